"""The Ray runtime: start a local cluster or join one, and check that the workers fit before placing them.

    cluster = connect(cfg.cluster)          # ray.init, bounded by cluster.connect_timeout_s
    specs = worker_specs(cfg.cluster, cluster.nodes)
    placement = place(specs, cluster.nodes) # ClusterError naming what is missing, never a hang
    ...
    cluster.shutdown()                      # stops the local cluster sleuth started

Only cluster/ imports Ray, and only when `cluster.uses_ray`: the one-process default never pays
for it. Checking the request against the nodes' resources first matters because Ray itself waits
forever for an actor whose resources no node has (it calls it "pending", not an error).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sleuth.cluster_config import ClusterConfig
from sleuth.errors import UserError

GiB = 1024**3


class ClusterError(UserError):
    """The Ray cluster cannot be reached, or it lacks the resources the workers ask for."""


@dataclass(frozen=True)
class Node:
    """One alive Ray node and what it offers to sleuth's workers."""

    node_id: str
    ip: str
    cpus: float
    gpus: float
    memory_gb: float
    """RAM Ray may hand to tasks and actors on this node."""
    gpu_memory_gb: float | None = None
    """Memory of one of its GPUs where known (queried on this machine only), else None."""


@dataclass(frozen=True)
class WorkerSpec:
    """What one trainer rank or rollout worker asks Ray for."""

    kind: str  # "trainer" or "rollout"
    index: int
    cpus: float
    gpus: float

    @property
    def name(self) -> str:
        return f"{self.kind} {'rank' if self.kind == 'trainer' else 'worker'} {self.index}"


@dataclass(frozen=True)
class Assignment:
    spec: WorkerSpec
    node: Node
    gpu_slots: tuple[int, ...] = ()
    """Which of the node's GPUs (0-based counting within the node) this worker is planned on."""


@dataclass
class Cluster:
    """A connected Ray cluster: its alive nodes, and whether sleuth started it (and must stop it)."""

    address: str
    started_here: bool
    nodes: list[Node] = field(default_factory=list)
    watch: Any = None
    """The RayletWatch of this node's raylet (watch_raylet), closed by shutdown."""

    def watch_raylet(self, run_dir: Path) -> None:
        """Print one line with a resume hint should this node's raylet die and take the driver with
        it (cluster/raylet_watch.py); nothing when the raylet's process is not found."""
        import ray

        from sleuth.cluster.raylet_watch import RayletWatch, raylet_pid

        node = getattr(ray._private.worker.global_worker, "node", None)
        pid = raylet_pid(node.raylet_socket_name) if node is not None else None
        if pid is not None:
            self.watch = RayletWatch(pid, run_dir)

    def shutdown(self) -> None:
        import ray

        if self.watch is not None:
            self.watch.close()
            self.watch = None
        if ray.is_initialized():
            ray.shutdown()


# ---------------------------------------------------------------- connecting


def start_cluster(cfg: ClusterConfig) -> tuple[Cluster, list[Assignment]]:
    """Connect (or start) and check that the configured workers fit; the cluster and the plan."""
    cluster = connect(cfg)
    try:
        return cluster, place(worker_specs(cfg, cluster.nodes), cluster.nodes)
    except BaseException:
        cluster.shutdown()
        raise


HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
"""HTTP/2's client preface and an empty SETTINGS frame: a gRPC server (Ray's GCS, the Ray Client
server) answers with a SETTINGS frame of its own."""


def probe(address: str, timeout_s: float) -> None:
    """Fail fast, within timeout_s, on a HOST:PORT that nothing answers on or that does not speak
    gRPC (HTTP/2) as Ray does: ray.init would retry for minutes there, deaf to SIGTERM. The wait is
    in short slices, so signals are handled meanwhile."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    deadline = time.monotonic() + timeout_s
    limit = f"within {timeout_s:g} s (cluster.connect_timeout_s)"
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    except OSError as e:
        reason = "timed out" if isinstance(e, TimeoutError) else (e.strerror or type(e).__name__)
        raise ClusterError(f"cannot reach the Ray cluster at cluster.address={address} {limit}: {reason}") from None
    with sock:
        reply = b""
        try:
            sock.sendall(HTTP2_PREFACE)
            while len(reply) < 9 and time.monotonic() < deadline:
                sock.settimeout(min(0.2, max(deadline - time.monotonic(), 0.001)))
                try:
                    chunk = sock.recv(9 - len(reply))
                except TimeoutError:
                    continue
                if not chunk:
                    break
                reply += chunk
        except OSError:
            pass
    if len(reply) < 9 or reply[3] != 4:  # frame type 4: SETTINGS
        raise ClusterError(f"cluster.address={address} accepts connections but did not answer as a Ray cluster "
                           f"(a gRPC server) {limit}; is it the Ray head's GCS port (6379 by default)?")


def connect(cfg: ClusterConfig) -> Cluster:
    """Join cfg.address, or start a local Ray cluster sized to this machine."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if ray.is_initialized():  # e.g. a test or notebook that started Ray itself
        return Cluster(address="(already connected)", started_here=False, nodes=alive_nodes())
    common: dict[str, Any] = dict(logging_level="warning", log_to_driver=False, include_dashboard=False)
    if cfg.address is None:
        store = None if cfg.object_store_gb is None else int(cfg.object_store_gb * GiB)
        # "local": a new cluster even when `ray start` made one on this machine (e.g. another user's)
        for attempt in (1, 2):
            try:
                ray.init(address="local", num_cpus=os.cpu_count(), object_store_memory=store, **common)
                break
            except Exception as e:  # Ray gives its raylet 30 s to register, too little on a busy machine
                ray.shutdown()
                if attempt == 2 or "timed out during startup" not in str(e):
                    raise ClusterError(f"could not start a local Ray cluster: {str(e).splitlines()[0]}") from None
        return Cluster(address="local", started_here=True, nodes=alive_nodes())
    if cfg.address != "auto":
        probe(cfg.address, cfg.connect_timeout_s)
    try:
        ray.init(address=cfg.address, **common)
    except ConnectionError as e:
        raise ClusterError(f"cannot join the Ray cluster at cluster.address={cfg.address}: "
                           f"{str(e).splitlines()[0]}") from None
    return Cluster(address=cfg.address, started_here=False, nodes=alive_nodes())


def alive_nodes() -> list[Node]:
    import ray

    nodes = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = n.get("Resources", {})
        nodes.append(Node(node_id=n["NodeID"], ip=n.get("NodeManagerAddress", "?"),
                          cpus=float(res.get("CPU", 0)), gpus=float(res.get("GPU", 0)),
                          memory_gb=float(res.get("memory", 0)) / GiB,
                          gpu_memory_gb=local_gpu_memory_gb() if res.get("GPU") else None))
    return nodes


def local_gpu_memory_gb() -> float | None:
    """Memory of GPU 0 of this machine (None without CUDA). Other nodes' GPUs are assumed alike."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / GiB


# ---------------------------------------------------------------- placement


def worker_specs(cfg: ClusterConfig, nodes: list[Node]) -> list[WorkerSpec]:
    """The trainer ranks and rollout workers cfg asks for (trainer_workers=1: the trainer stays in
    the driver and needs no actor). GPUs default to 1 per worker when the cluster has any."""
    has_gpus = any(n.gpus > 0 for n in nodes)
    t_gpus = cfg.gpus_per_trainer_worker if cfg.gpus_per_trainer_worker is not None else float(has_gpus)
    r_gpus = cfg.gpus_per_rollout_worker if cfg.gpus_per_rollout_worker is not None else int(has_gpus)
    specs = []
    if cfg.trainer_workers > 1:
        specs += [WorkerSpec("trainer", i, cfg.cpus_per_worker, t_gpus) for i in range(cfg.trainer_workers)]
    specs += [WorkerSpec("rollout", i, cfg.cpus_per_worker, float(r_gpus)) for i in range(cfg.rollout_workers)]
    return specs


def place(specs: list[WorkerSpec], nodes: list[Node]) -> list[Assignment]:
    """First fit, GPU-hungry workers first, each worker within one node; ClusterError naming what is
    missing when they do not fit (the totals, or which worker fits on no single node)."""
    need_cpu, need_gpu = sum(s.cpus for s in specs), sum(s.gpus for s in specs)
    have_cpu, have_gpu = sum(n.cpus for n in nodes), sum(n.gpus for n in nodes)
    missing = []
    if need_cpu > have_cpu + 1e-9:
        missing.append(f"{need_cpu:g} CPUs (cluster.cpus_per_worker={specs[0].cpus:g} x {len(specs)} "
                       f"workers) but the cluster has {have_cpu:g}")
    if need_gpu > have_gpu + 1e-9:
        missing.append(f"{need_gpu:g} GPUs but the cluster has {have_gpu:g}")
    if missing:
        raise ClusterError(f"the workers need {'; and '.join(missing)}: lower cluster.trainer_workers, "
                           "cluster.rollout_workers or the per-worker CPUs/GPUs, or add nodes")
    free_cpu = {n.node_id: n.cpus for n in nodes}
    next_gpu = {n.node_id: 0 for n in nodes}
    out: dict[tuple[str, int], Assignment] = {}
    for spec in sorted(specs, key=lambda s: -s.gpus):
        node = next((n for n in nodes if free_cpu[n.node_id] + 1e-9 >= spec.cpus
                     and n.gpus - next_gpu[n.node_id] + 1e-9 >= spec.gpus), None)
        if node is None:
            raise ClusterError(f"{spec.name} needs {spec.cpus:g} CPUs and {spec.gpus:g} GPUs on one node, "
                               "and no node has that much left; use fewer GPUs per worker or bigger nodes")
        free_cpu[node.node_id] -= spec.cpus
        first = next_gpu[node.node_id]
        whole = int(spec.gpus + 0.999)
        next_gpu[node.node_id] += spec.gpus
        out[(spec.kind, spec.index)] = Assignment(spec, node, tuple(range(int(first), int(first) + whole)))
    return [out[(s.kind, s.index)] for s in specs]
