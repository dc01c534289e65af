"""Weight sync as a torch.distributed broadcast from the process that holds the weights to the workers.

    transport = CollectiveTransport(pool, LocalSender(policy, "gloo"), "gloo")   # one trainer: the driver
    transport = CollectiveTransport(pool, trainer_group, "nccl")                 # FSDP2: trainer rank 0
    WeightSync(policy, pool, transport).push()

The group's rank 0 is the sender (the driver when it trains, else FSDP2 trainer rank 0), ranks 1..N
are the rollout workers. It is a group of its own (a TCPStore hosted by the sender, a gloo or NCCL
backend object), apart from the trainer ranks' FSDP2 group, so adding it changes nothing there.
On GPUs (NCCL) the weights go from GPU to GPU without the object store or the driver; on CPU gloo
runs the same code, which is how it is tested here.

One sync: the sender stages the weights (the adapter, or the full merged weights gathered on rank 0)
as byte buckets (sync.pack_buckets); every worker is asked to receive; the sender broadcasts a JSON
header (names, dtypes, shapes, offsets: no pickle crosses the wire), then each bucket; each worker
loads what it received into its engine. The staged buckets stay in the sender's memory (CPU) until
the next sync: a rollout worker that Ray restarts (it has left the group) gets them through the
object store, and the group is built again, with the new process, before the next broadcast. A
broadcast that fails (a worker died during it) falls back to the object store for that sync.
"""

from __future__ import annotations

import datetime
import json
import socket
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from sleuth.records import LoraAdapter
from sleuth.rollout.sync import (
    Bucket,
    Send,
    SyncMode,
    WeightSource,
    pack_buckets,
    read_weights,
    unpack,
    views,
)

Backend = str  # "gloo" (CPU tensors) or "nccl" (CUDA tensors)


class CollectiveError(RuntimeError):
    """The broadcast group could not be built or a broadcast failed."""


def _new_group(backend: Backend, store: Any, rank: int, world: int, timeout_s: float) -> Any:
    """A process group of its own over `store` (not torch.distributed's default group)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, options)
    raise ValueError(f"unknown collective backend {backend!r} (gloo or nccl)")


class Channel:
    """One member's end of the group: rank 0 hosts the store and broadcasts, the others receive."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self._store: Any = None
        self._group: Any = None
        self.timeout_s = 600.0

    def host(self, world: int, timeout_s: float) -> tuple[str, int]:
        """Rank 0: start the group's store on a free port; the address the others join."""
        import torch.distributed as dist

        self.close()
        self.timeout_s = timeout_s
        self._store = dist.TCPStore("0.0.0.0", 0, world, True, datetime.timedelta(seconds=timeout_s),
                                    wait_for_workers=False)
        return _node_ip(), int(self._store.port)

    def join(self, rank: int, world: int, timeout_s: float, address: tuple[str, int] | None = None) -> None:
        """Join the group (blocks until every member has): rank 0 after host(), others at `address`."""
        import torch.distributed as dist

        if rank > 0:
            assert address is not None
            self.close()
            self._store = dist.TCPStore(address[0], address[1], world, False, datetime.timedelta(seconds=timeout_s))
        self.timeout_s = timeout_s
        try:
            self._group = _new_group(self.backend, self._store, rank, world, timeout_s)
        except RuntimeError as e:
            raise CollectiveError(f"joining the weight-sync group as rank {rank} of {world}: {e}") from None

    @property
    def joined(self) -> bool:
        return self._group is not None

    def _broadcast(self, tensor: torch.Tensor) -> None:
        try:
            self._group.broadcast([tensor], _root0()).wait()
        except RuntimeError as e:
            self._group = None  # a member is gone: the group is built again before the next sync
            raise CollectiveError(f"weight broadcast failed: {str(e).strip().splitlines()[0]}") from None

    def send(self, header: dict[str, Any], buckets: list[Bucket]) -> int:
        """Rank 0: the header, then every bucket; returns the bytes broadcast."""
        raw = json.dumps(header).encode()
        self._broadcast(torch.tensor([len(raw)], dtype=torch.int64, device=self.device))
        self._broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.device))
        moved = 0
        for b in buckets:
            flat = torch.from_numpy(b.data).to(self.device)  # a view on CPU, one upload on a GPU
            self._broadcast(flat)
            moved += b.nbytes
        return moved

    def receive(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """Ranks > 0: the header and the buckets' bytes (flat uint8 tensors on this member's device)."""
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(size)
        raw = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._broadcast(raw)
        header = json.loads(bytes(raw.cpu().numpy()))
        flats = []
        for b in header["buckets"]:
            flat = torch.empty(int(b["size"]), dtype=torch.uint8, device=self.device)
            self._broadcast(flat)
            flats.append(flat)
        return header, flats

    def close(self) -> None:
        self._group = None
        self._store = None


def _root0() -> Any:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return opts


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:  # pragma: no cover - ray is a dependency of every cluster run
        pass
    return socket.gethostbyname(socket.gethostname())


# ---------------------------------------------------------------- staging (the sender's side)

class Staged:
    """What rank 0 broadcasts next: the header and the buckets (kept for restarted workers)."""

    def __init__(self, weights: LoraAdapter | Iterable[tuple[str, torch.Tensor]]) -> None:
        if isinstance(weights, LoraAdapter):
            self.kind = "lora"
            named: Iterable[tuple[str, torch.Tensor]] = list(weights.tensors.items())
            self.lora = {"rank": weights.rank, "alpha": weights.alpha,
                         "target_modules": list(weights.target_modules)}
        else:
            self.kind, named, self.lora = "full", weights, {}
        self.buckets = pack_buckets(named)
        self.header = {"kind": self.kind, "lora": self.lora,
                       "buckets": [{"size": b.nbytes, "entries": b.entries} for b in self.buckets]}

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def object_payload(self) -> tuple[str, Any]:
        """The same weights for the object-store path (RolloutPool's payload format)."""
        import ray

        if self.kind == "full":
            return "full", [ray.put(b) for b in self.buckets]
        tensors = {n: t.clone() for b in self.buckets for n, t in unpack(b)}
        return "lora", ray.put(LoraAdapter(tensors, self.lora["rank"], self.lora["alpha"],
                                           tuple(self.lora["target_modules"])))


def received(header: dict[str, Any], flats: list[torch.Tensor]) -> LoraAdapter | list[tuple[str, torch.Tensor]]:
    """What a worker received, as the engine takes it: an adapter, or (name, tensor) weights."""
    named = [nt for b, flat in zip(header["buckets"], flats) for nt in views(flat, b["entries"])]
    if header["kind"] == "lora":
        L = header["lora"]
        return LoraAdapter(dict(named), int(L["rank"]), float(L["alpha"]), tuple(L["target_modules"]))
    return named


class Sender(Protocol):
    """The process holding the weights, as the driver sees it: LocalSender (the driver itself) or
    cluster/trainer_group.py's TrainerGroup (its rank 0)."""

    def host_weight_group(self, world: int, backend: Backend, timeout_s: float) -> tuple[str, int]: ...
    def join_weight_group(self) -> None: ...
    def stage_weights(self, mode: SyncMode, copy: bool) -> tuple[int, int]: ...
    def broadcast_weights(self, token: int) -> int: ...
    def staged_payload(self, token: int) -> tuple[str, Any]: ...


class WeightSender:
    """Rank 0's side, in the process that holds the weights: the channel and the staged weights.

    Each stage() gets a token: with overlapped rollouts the trainer may stage the next weights
    before the previous ones went out, so a broadcast names the staging it sends."""

    def __init__(self) -> None:
        self.channel: Channel | None = None
        self._staged: dict[int, Staged] = {}
        self._next = 0
        self._world = 0

    def host(self, world: int, backend: Backend, timeout_s: float) -> tuple[str, int]:
        self.channel = Channel(backend)
        self._world = world
        return self.channel.host(world, timeout_s)

    def join(self) -> None:
        assert self.channel is not None, "host() first"
        self.channel.join(0, self._world, self.channel.timeout_s)

    def stage(self, weights: LoraAdapter | Iterable[tuple[str, torch.Tensor]]) -> tuple[int, int]:
        """Copy the weights into buckets (the trainer may change its own at once): (token, bytes)."""
        self._next += 1
        self._staged[self._next] = staged = Staged(weights)
        return self._next, staged.nbytes

    def broadcast(self, token: int) -> int:
        """Send staging `token` to the group; older stagings are dropped (this one is kept for
        workers that restart before the next broadcast)."""
        assert self.channel is not None, "host() and join() first"
        for old in [t for t in self._staged if t < token]:
            del self._staged[old]
        staged = self._staged[token]
        return self.channel.send(staged.header, staged.buckets)

    def payload(self, token: int) -> tuple[str, Any]:
        return self._staged[token].object_payload()


class LocalSender:
    """The driver trains (cluster.trainer_workers = 1): it is rank 0 of the broadcast group."""

    def __init__(self, source: WeightSource) -> None:
        self.source = source
        self.sender = WeightSender()

    def host_weight_group(self, world: int, backend: Backend, timeout_s: float) -> tuple[str, int]:
        return self.sender.host(world, backend, timeout_s)

    def join_weight_group(self) -> None:
        self.sender.join()

    def stage_weights(self, mode: SyncMode, copy: bool) -> tuple[int, int]:
        return self.sender.stage(read_weights(self.source, mode, copy=False))  # staging copies anyway

    def broadcast_weights(self, token: int) -> int:
        return self.sender.broadcast(token)

    def staged_payload(self, token: int) -> tuple[str, Any]:
        return self.sender.payload(token)


def choose_backend(weight_transport: str, trainer_on_gpu: bool, workers_on_gpu: bool) -> Backend | None:
    """cluster.weight_transport resolved: the broadcast backend, or None for the object store."""
    on_gpus = trainer_on_gpu and workers_on_gpu
    if weight_transport == "object_store" or (weight_transport == "auto" and not on_gpus):
        return None
    return "nccl" if on_gpus else "gloo"


class CollectiveTransport:
    """sync.Transport over the broadcast group between a Sender and a RolloutPool's workers."""

    def __init__(self, pool: Any, sender: Sender, backend: Backend, timeout_s: float) -> None:
        self.pool = pool
        self.sender = sender
        self.backend = backend
        self.timeout_s = timeout_s
        self._restarts_seen: int | None = None
        """The pool's restart count when the group was built; None: no group yet (or it broke)."""

    def stage(self, source: WeightSource, mode: SyncMode, copy: bool) -> Send:
        """The sender reads (on rank 0: gathers) the weights now and keeps them as buckets."""
        token, nbytes = self.sender.stage_weights(mode, copy)

        def send(engine: Any) -> int:
            if self._restarts_seen != self.pool.restarts:
                self.connect()
            if not self.pool.broadcast_sync(lambda: self.sender.broadcast_weights(token),
                                            lambda: self.sender.staged_payload(token)):
                self._restarts_seen = None  # it fell back to the object store; a new group next time
            return nbytes

        return send

    def connect(self) -> None:
        """(Re)build the group: the sender hosts it, every rollout worker and then the sender join."""
        world = len(self.pool.workers) + 1
        address = self.sender.host_weight_group(world, self.backend, self.timeout_s)
        self.pool.join_weight_group(address, world, self.backend, self.timeout_s, self.sender.join_weight_group)
        self._restarts_seen = self.pool.restarts
