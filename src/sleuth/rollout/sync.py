"""Weight sync: the trainer's weights into the rollout engine after each update, in one place.

    sync = WeightSync(policy, engine)      # decides adapter-only vs full weights once
    stats = sync.push()                    # SyncStats(mode="adapter", bytes=..., seconds=...)
    run.writer.log(it, stats.metrics())    # {"time/sync_s": ..., "sync/bytes": ..., "sync/adapter": ...}

Two paths:
- adapter: the policy trains a LoRA adapter and the engine serves adapters (`engine.native_lora`:
  vLLM started with rollout.native_lora, the transformers engine always). Only the adapter's
  tensors move (r x (in + out) per adapted module), the engine applies them.
- full: the policy's full weights with any LoRA merged in (Policy.sync_state, HF names).

How tensors reach the engine is a Transport. A sync is two moves: `stage` reads the weights (a
copy when the trainer goes on changing them before the send: overlapped rollouts), and the function
it returns sends them. InProcessTransport calls the engine's methods in this process; RayTransport
puts the weights into Ray's object store once, as flat byte buckets, for every rollout worker of a
RolloutPool (cluster/rollout_pool.py) to read; cluster/collective.py's CollectiveTransport has the
process holding the weights (the driver, or FSDP2 trainer rank 0) broadcast them to the workers over
a torch.distributed group (NCCL on GPUs, gloo on CPU), so they never pass through the driver. The
pool bounds each sync by cluster.sync_timeout_s.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

import numpy as np
import torch

from sleuth.errors import UserError
from sleuth.records import LoraAdapter
from sleuth.rollout.base import RolloutEngine
from sleuth.rollout.sync_check import Reference, SyncCheck

SyncMode = Literal["adapter", "full"]

ALIGN = 64
"""Byte alignment of each tensor in a bucket (a view as int64/float64 needs at least 8)."""

DEFAULT_BUCKET_MB = 256
"""Bucket size: large enough that per-object overhead vanishes, small enough to pipeline."""


class WeightSource(Protocol):
    """What a sync reads: train/policy.py's Policy in one process, or the FSDP2 ranks behind
    cluster/trainer_group.py's TrainerGroup (weights gathered on rank 0)."""

    @property
    def is_lora(self) -> bool: ...
    @property
    def adapter_is_portable(self) -> bool: ...
    def sync_state(self) -> Iterable[tuple[str, torch.Tensor]]: ...
    def lora_adapter(self) -> LoraAdapter: ...


Send = Callable[[RolloutEngine], int]
"""Sends staged weights to an engine; returns the bytes it moved."""


class Transport(Protocol):
    """Moves weights into an engine."""

    def stage(self, source: WeightSource, mode: SyncMode, copy: bool) -> Send:
        """Read the source's weights now (copy=True: a copy the trainer's next steps leave alone);
        the function returned sends what was read."""
        ...


def read_weights(source: WeightSource, mode: SyncMode, copy: bool) -> LoraAdapter | Iterable[tuple[str, torch.Tensor]]:
    """The adapter (mode "adapter") or the full merged weights of `source`, as of now.

    copy=False: the full weights come as source.sync_state()'s stream, read (and, with LoRA, merged
    one tensor at a time) as the send consumes it under torch.no_grad, so no second copy of the
    model is held. copy=True reads them all now and copies only trained tensors: a LoRA policy's
    frozen base weights stay shared, and its merged weights are new tensors anyway; a full
    fine-tune's are its parameters, changed in place."""
    with torch.no_grad():
        if mode == "adapter":
            adapter = source.lora_adapter()
            return replace(adapter, tensors={n: t.clone() for n, t in adapter.tensors.items()}) if copy else adapter
        if not copy:
            return source.sync_state()
        clone = not source.is_lora
        return [(n, t.clone() if clone else t) for n, t in source.sync_state()]


class TensorTransport:
    """A transport whose weights are read in this process and handed over as tensors: subclasses
    define send_full and send_adapter (each returns the bytes it moved)."""

    def send_full(self, engine: Any, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        raise NotImplementedError

    def send_adapter(self, engine: Any, adapter: LoraAdapter) -> int:
        raise NotImplementedError

    def stage(self, source: WeightSource, mode: SyncMode, copy: bool) -> Send:
        weights = read_weights(source, mode, copy)
        if isinstance(weights, LoraAdapter):
            return lambda engine: self.send_adapter(engine, weights)
        return lambda engine: self.send_full(engine, weights)


class InProcessTransport(TensorTransport):
    """The engine lives in this process: hand it the tensors (its worker thread copies them)."""

    def send_full(self, engine: RolloutEngine, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        moved = 0

        def counted() -> Iterable[tuple[str, torch.Tensor]]:
            nonlocal moved
            for name, t in tensors:
                moved += t.numel() * t.element_size()
                yield name, t

        engine.sync_weights(counted())
        return moved

    def send_adapter(self, engine: RolloutEngine, adapter: LoraAdapter) -> int:
        engine.sync_lora(adapter)
        return adapter.nbytes


class RayTransport(TensorTransport):
    """The engine is a RolloutPool of Ray actors: full weights go into the object store once, packed
    in buckets, and every worker reads them from there; an adapter goes in as one object."""

    def __init__(self, bucket_mb: float = DEFAULT_BUCKET_MB) -> None:
        self.bucket_mb = bucket_mb

    def send_full(self, engine: Any, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        import ray

        buckets = pack_buckets(tensors, self.bucket_mb)
        engine.load_buckets([ray.put(b) for b in buckets])
        return sum(b.nbytes for b in buckets)

    def send_adapter(self, engine: Any, adapter: LoraAdapter) -> int:
        import ray

        on_cpu = LoraAdapter({k: v.detach().to("cpu").contiguous() for k, v in adapter.tensors.items()},
                             adapter.rank, adapter.alpha, adapter.target_modules)
        engine.load_adapter(ray.put(on_cpu))
        return adapter.nbytes


@dataclass(frozen=True)
class SyncStats:
    mode: SyncMode
    bytes: int
    seconds: float
    check_s: float | None = None
    """The weight-sync check's seconds (sync_check.py); None: not checked."""

    def metrics(self) -> dict[str, float]:
        """The sync's metrics under their namespaced keys (see README, metrics)."""
        out = {"time/sync_s": self.seconds, "sync/bytes": float(self.bytes),
               "sync/adapter": float(self.mode == "adapter")}
        if self.check_s is not None:
            out["time/sync_check_s"] = self.check_s
        return out


def choose_mode(policy: WeightSource, engine: RolloutEngine) -> SyncMode:
    """adapter whenever the policy is LoRA and the engine serves adapters, else full weights. An
    adapter that does not reproduce the policy on the engine's base checkpoint (quantized base,
    fused-expert adapters) goes as full merged weights (Policy.adapter_is_portable)."""
    return "adapter" if policy.is_lora and engine.native_lora and policy.adapter_is_portable else "full"


class WeightSync:
    """Keeps one engine's weights equal to the policy's. `push()` after every update."""

    def __init__(self, policy: WeightSource, engine: RolloutEngine, transport: Transport | None = None,
                 mode: SyncMode | None = None, check: SyncCheck | None = None) -> None:
        self.policy = policy
        self.engine = engine
        self.check = check
        """After every push: the engine's probe logprobs must match the trainer's (sync_check.py)."""
        self.count = 0
        """Syncs staged so far (names the sync in a failed check)."""
        self.transport: Transport = transport or InProcessTransport()
        self.mode: SyncMode = mode or choose_mode(policy, engine)
        if self.mode == "adapter" and not policy.is_lora:
            raise ValueError("adapter sync needs a LoRA policy")
        if self.mode == "full" and not getattr(engine, "full_sync_supported", True):
            # Refused at start-up rather than after the first training step.
            raise UserError(f"{type(engine).__name__} cannot take full weight syncs of this model "
                            "(mixture-of-experts); use rollout.engine=hf")

    def push(self) -> SyncStats:
        """Send the policy's current weights (the adapter, or the full merged weights), then check
        that they arrived (when a check is set)."""
        reference, what = self._reference()
        start = time.perf_counter()
        with torch.no_grad():  # merged weights are computed as the send reads them
            moved = self.transport.stage(self.policy, self.mode, copy=False)(self.engine)
        seconds = time.perf_counter() - start
        return SyncStats(self.mode, moved, seconds, self._verify(reference, what))

    def _reference(self) -> tuple[Reference | None, str]:
        self.count += 1
        what = f"weight sync {self.count} ({self.mode}, {type(self.transport).__name__})"
        return (self.check.reference() if self.check is not None else None), what

    def _verify(self, reference: Reference | None, what: str) -> float | None:
        if self.check is None or reference is None:
            return None
        return self.check.verify(reference, what)

    def snapshot(self, version: int | None = None) -> Callable[[], SyncStats]:
        """A copy of the policy's current weights now, and a function that pushes that copy later.

        For rollouts overlapped with training: the trainer changes its tensors in place while the
        engine finishes generating, so what is pushed must be copied first (read_weights, copy=True).
        `version`: set as the engine's policy_version as soon as the weights are sent (before the
        check), so tokens sampled after it are labelled with it.
        """
        reference, what = self._reference()  # the trainer's probe, of the weights copied now
        with torch.no_grad():
            send = self.transport.stage(self.policy, self.mode, copy=True)

        def push() -> SyncStats:
            start = time.perf_counter()
            with torch.no_grad():
                moved = send(self.engine)
            seconds = time.perf_counter() - start
            if version is not None:  # sent: tokens sampled from now on are this version's (loop.streaming)
                self.engine.policy_version = version
            return SyncStats(self.mode, moved, seconds, self._verify(reference, what))

        return push

    def describe(self) -> dict[str, Any]:
        return {"mode": self.mode, "engine": type(self.engine).__name__,
                "transport": type(self.transport).__name__}


# ---------------------------------------------------------------- buckets (the Ray transport's format)

@dataclass
class Bucket:
    """Named tensors as one numpy uint8 array plus a table: Ray keeps numpy arrays out of band, so a
    worker on the same node reads the bytes from shared memory without a copy (a torch tensor would
    be pickled, i.e. copied), and any dtype, bfloat16 included, travels as raw bytes."""

    data: np.ndarray
    """All tensors' bytes back to back (uint8), each starting at a multiple of ALIGN."""
    entries: list[tuple[str, str, tuple[int, ...], int, int]]
    """(name, torch dtype name, shape, byte offset, byte length) per tensor."""

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def pack_buckets(named_tensors: Iterable[tuple[str, Any]], bucket_mb: float = DEFAULT_BUCKET_MB) -> list[Bucket]:
    """Group tensors (in order) into buckets of about bucket_mb; a larger tensor gets its own."""
    limit = int(bucket_mb * 1024**2)
    buckets: list[Bucket] = []
    parts: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named_tensors:
        t = t.detach().to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        if parts and size + nbytes > limit:
            buckets.append(_bucket(parts))
            parts, size = [], 0
        parts.append((name, t))
        size += nbytes
    if parts:
        buckets.append(_bucket(parts))
    return buckets


def _bucket(parts: list[tuple[str, torch.Tensor]]) -> Bucket:
    entries, offset = [], 0
    for name, t in parts:
        n = t.numel() * t.element_size()
        entries.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, n))
        offset += -(-n // ALIGN) * ALIGN  # each tensor starts aligned, so it can be viewed in place
    data = np.empty(offset, dtype=np.uint8)
    flat = torch.from_numpy(data)
    for (_, t), (_, _, _, start, n) in zip(parts, entries):
        flat[start:start + n].copy_(t.reshape(-1).view(torch.uint8))
    return Bucket(data, entries)


def unpack(bucket: Bucket) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) views into the bucket's bytes (read-only when they come from the object
    store: the reader copies them into its own weights)."""
    flat = torch.empty(0, dtype=torch.uint8)
    if bucket.nbytes:
        with warnings.catch_warnings():  # "buffer is not writable": we only read it
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(memoryview(bucket.data), dtype=torch.uint8)
    return views(flat, bucket.entries)


def views(flat: torch.Tensor, entries: list[tuple[str, str, tuple[int, ...], int, int]]
          ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) views into a bucket's bytes held as a flat uint8 tensor (on any device)."""
    for name, dtype, shape, offset, n in entries:
        yield name, flat[offset:offset + n].view(getattr(torch, dtype)).reshape(tuple(shape))
