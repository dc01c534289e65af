"""cluster/runtime.py: joining or starting Ray, and checking that the workers fit before placing them."""

import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from sleuth.cluster.runtime import ClusterError, Node, WorkerSpec, place, worker_specs
from sleuth.cluster_config import ClusterConfig
from sleuth.config import load_config
from sleuth.errors import ConfigError


def node(name: str, cpus: float, gpus: float = 0) -> Node:
    return Node(node_id=name, ip=name, cpus=cpus, gpus=gpus, memory_gb=64)


def test_one_process_default_needs_no_ray():
    assert not ClusterConfig().uses_ray
    assert ClusterConfig(rollout_workers=2).uses_ray
    assert ClusterConfig(trainer_workers=2).uses_ray
    assert ClusterConfig(address="auto").uses_ray


def test_address_must_be_auto_or_host_port():
    assert load_config(None, ["cluster.address=10.1.2.3:6379"]).cluster.address == "10.1.2.3:6379"
    for bad in ("somewhere", "host:", "host:70000", ":6379"):
        with pytest.raises(ConfigError, match=r"cluster\.address"):
            load_config(None, [f"cluster.address={bad}"])


def test_worker_specs_default_to_one_gpu_each_only_where_there_are_gpus():
    cfg = ClusterConfig(trainer_workers=4, rollout_workers=2)
    on_gpus = worker_specs(cfg, [node("a", 64, 8)])
    assert [(s.kind, s.gpus) for s in on_gpus] == [("trainer", 1.0)] * 4 + [("rollout", 1.0)] * 2
    assert {s.gpus for s in worker_specs(cfg, [node("a", 64)])} == {0.0}
    # one trainer rank stays in the driver: no actor for it
    assert [s.kind for s in worker_specs(ClusterConfig(rollout_workers=3), [node("a", 4)])] == ["rollout"] * 3


def test_place_fills_nodes_gpu_workers_first():
    specs = [WorkerSpec("trainer", i, 1, 1) for i in range(4)] + [WorkerSpec("rollout", i, 1, 2) for i in range(2)]
    plan = place(specs, [node("a", 16, 4), node("b", 16, 4)])
    assert [a.spec for a in plan] == specs  # returned in the order asked
    by = {(a.spec.kind, a.spec.index): (a.node.node_id, a.gpu_slots) for a in plan}
    # the 2-GPU rollout workers are placed first, then the 1-GPU trainer ranks fill the rest
    assert by[("rollout", 0)] == ("a", (0, 1)) and by[("rollout", 1)] == ("a", (2, 3))
    assert [by[("trainer", i)] for i in range(4)] == [("b", (0,)), ("b", (1,)), ("b", (2,)), ("b", (3,))]


def test_place_names_what_is_missing():
    with pytest.raises(ClusterError, match=r"need 4 GPUs but the cluster has 0"):
        place([WorkerSpec("rollout", i, 1, 2) for i in range(2)], [node("a", 8)])
    with pytest.raises(ClusterError, match=r"need 6 CPUs \(cluster.cpus_per_worker=3 x 2 workers\) but the "
                                           r"cluster has 4"):
        place([WorkerSpec("rollout", i, 3, 0) for i in range(2)], [node("a", 2), node("b", 2)])
    # enough in total, but no single node holds a 4-GPU worker
    with pytest.raises(ClusterError, match="rollout worker 0 needs 1 CPUs and 4 GPUs on one node"):
        place([WorkerSpec("rollout", 0, 1, 4)], [node("a", 8, 2), node("b", 8, 2)])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sleuth(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sleuth", "train", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_weight_transport_is_one_of_its_names():
    assert load_config(None, []).cluster.weight_transport == "auto"
    assert load_config(None, ["cluster.weight_transport=collective"]).cluster.weight_transport == "collective"
    with pytest.raises(ConfigError, match=r"cluster\.weight_transport.*unknown value 'nccl'; choose from auto, "
                                          r"collective, object_store"):
        load_config(None, ["cluster.weight_transport=nccl"])


def test_unreachable_address_is_one_line_and_exit_2(tmp_path):
    port = _free_port()  # nothing listens there
    t = time.monotonic()
    proc = _sleuth(f"cluster.address=127.0.0.1:{port}", "cluster.connect_timeout_s=5", "--out", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("sleuth: error")]
    assert lines == [f"sleuth: error: cannot reach the Ray cluster at cluster.address=127.0.0.1:{port} within "
                     "5 s (cluster.connect_timeout_s): Connection refused"]
    assert time.monotonic() - t < 60  # (the Python start-up, not a retry loop)


@pytest.mark.slow
def test_more_gpus_than_the_local_cluster_has_is_a_clear_error(tmp_path):
    # sleuth starts a local Ray cluster (no GPUs here), sees the workers cannot fit, stops it, exits 2.
    proc = _sleuth("cluster.rollout_workers=2", "cluster.gpus_per_rollout_worker=1", "cluster.object_store_gb=0.1",
                   "--out", str(tmp_path / "r"))
    assert "the workers need 2 GPUs but the cluster has 0" in _one_error(proc)


def _one_error(proc: subprocess.CompletedProcess) -> str:
    """The one `sleuth: error` line of a command that exited 2."""
    assert proc.returncode == 2, proc.stderr
    error = [ln for ln in proc.stderr.splitlines() if ln.startswith("sleuth: error")]
    assert len(error) == 1, proc.stderr
    return error[0]


def test_quantized_base_with_fsdp2_ranks_is_refused_before_ray_starts(tmp_path):
    proc = _sleuth("cluster.trainer_workers=2", "model.quantization=nf4", "--out", str(tmp_path / "r"))
    assert "model.quantization=nf4 with cluster.trainer_workers > 1" in _one_error(proc)
    assert "Ray" not in proc.stderr


def test_tensor_parallel_rollout_workers_need_vllm(tmp_path):
    proc = _sleuth("cluster.rollout_workers=2", "cluster.gpus_per_rollout_worker=2", "rollout.engine=hf",
                   "--out", str(tmp_path / "r"))
    assert "use rollout.engine=vllm" in _one_error(proc)


def test_transformers_engine_refuses_a_tensor_parallel_size(tiny_model_dir):
    from sleuth.config import RolloutConfig
    from sleuth.rollout.factory import make_engine

    with pytest.raises(ConfigError, match="transformers engine runs on one GPU"):
        make_engine(RolloutConfig(engine="hf"), str(tiny_model_dir), "float32", 0, tensor_parallel_size=2)


def _listener(reply: bytes | None):
    """A TCP server on a free port that accepts and then answers `reply` to anything (None: never)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held = []

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)
            if reply is not None:
                with contextlib.suppress(OSError):
                    conn.recv(1024)
                    conn.sendall(reply)

    threading.Thread(target=serve, daemon=True).start()
    return server, held


@pytest.mark.parametrize("reply", [None, b"HTTP/1.1 400 Bad Request\r\n\r\n", b"SSH-2.0-OpenSSH_9.6\r\n", b""])
def test_a_port_that_is_not_ray_fails_within_connect_timeout(reply):
    from sleuth.cluster.runtime import probe

    server, _held = _listener(reply)
    address = f"127.0.0.1:{server.getsockname()[1]}"
    t = time.monotonic()
    with pytest.raises(ClusterError, match=r"did not answer as a Ray cluster .*within 1\.5 s"):
        probe(address, 1.5)
    assert time.monotonic() - t < 3
    server.close()


def test_a_grpc_server_passes_the_probe():
    from sleuth.cluster.runtime import probe

    settings = bytes([0, 0, 6, 4, 0, 0, 0, 0, 0]) + bytes([0, 3, 0, 0, 0, 100])  # SETTINGS, as gRPC sends
    server, _held = _listener(settings)
    probe(f"127.0.0.1:{server.getsockname()[1]}", 5)
    server.close()


def test_dry_run_against_a_silent_port_ends_within_the_timeout_and_on_sigterm(tmp_path):
    server, _held = _listener(None)
    port = server.getsockname()[1]
    t = time.monotonic()
    proc = _sleuth(f"cluster.address=127.0.0.1:{port}", "cluster.connect_timeout_s=3", "--dry-run")
    assert proc.returncode == 2, proc.stderr
    assert [ln for ln in proc.stderr.splitlines() if ln.startswith("sleuth: error")] == [
        f"sleuth: error: cluster.address=127.0.0.1:{port} accepts connections but did not answer as a Ray cluster "
        "(a gRPC server) within 3 s (cluster.connect_timeout_s); is it the Ray head's GCS port (6379 by default)?"]
    assert time.monotonic() - t < 60
    # SIGTERM while it waits (a long timeout): the process ends at once
    proc = subprocess.Popen([sys.executable, "-m", "sleuth", "train", f"cluster.address=127.0.0.1:{port}",
                             "cluster.connect_timeout_s=600", "--dry-run"], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(_held) < 2 and time.monotonic() < deadline:  # until the second run is connected and waiting
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    t = time.monotonic()
    proc.wait(timeout=20)
    assert proc.returncode != 0 and time.monotonic() - t < 5
    server.close()


def test_raylet_watch_speaks_only_when_the_raylet_died_under_the_driver(tmp_path):
    import io
    import os

    from sleuth.cluster.raylet_watch import DONE, alive, watch

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    while alive(child.pid):  # exited but not reaped: a zombie counts as dead
        time.sleep(0.05)
    assert os.path.exists(f"/proc/{child.pid}")
    dead = child.pid
    err = io.StringIO()
    assert not watch(dead, tmp_path, io.BytesIO(DONE), err)  # the driver ended normally
    assert not watch(os.getpid(), tmp_path, io.BytesIO(b""), err)  # the raylet is alive: not its doing
    assert err.getvalue() == ""
    assert watch(dead, tmp_path, io.BytesIO(b""), err)
    assert err.getvalue() == (f"sleuth: error: Ray's raylet on this machine (pid {dead}) died, which ended the run; "
                              f"continue with `sleuth train --resume {tmp_path}` (from its newest valid checkpoint)\n")
    child.wait()
