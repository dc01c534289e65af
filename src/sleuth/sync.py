"""Weight sync: the trainer's weights into the rollout engine after each update, in one place.

    sync = WeightSync(policy, engine)      # decides adapter-only vs full weights once
    stats = sync.push()                    # SyncStats(mode="adapter", bytes=..., seconds=...)
    run.writer.log(it, stats.metrics())    # {"time/sync_s": ..., "sync/bytes": ..., "sync/adapter": ...}

Two paths:
- adapter: the policy trains a LoRA adapter and the engine serves adapters (`engine.native_lora`:
  vLLM started with rollout.native_lora, the transformers engine always). Only the adapter's
  tensors move (r x (in + out) per adapted module), the engine applies them.
- full: the policy's full weights with any LoRA merged in (Policy.sync_state, HF names).

How tensors reach the engine is a Transport. InProcessTransport calls the engine's methods in this
process; a transport to engines elsewhere (Ray actors, another GPU) implements the same two methods
and is passed to WeightSync; nothing else changes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

import torch

from sleuth.records import LoraAdapter
from sleuth.rollout.base import RolloutEngine
from sleuth.train.policy import Policy

SyncMode = Literal["adapter", "full"]


class Transport(Protocol):
    """Moves weights into an engine. Returns the bytes it moved."""

    def send_full(self, engine: RolloutEngine, tensors: Iterable[tuple[str, torch.Tensor]]) -> int: ...

    def send_adapter(self, engine: RolloutEngine, adapter: LoraAdapter) -> int: ...


class InProcessTransport:
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


@dataclass(frozen=True)
class SyncStats:
    mode: SyncMode
    bytes: int
    seconds: float

    def metrics(self) -> dict[str, float]:
        """The sync's metrics under their namespaced keys (see README, metrics)."""
        return {"time/sync_s": self.seconds, "sync/bytes": float(self.bytes),
                "sync/adapter": float(self.mode == "adapter")}


def choose_mode(policy: Policy, engine: RolloutEngine) -> SyncMode:
    """adapter whenever the policy is LoRA and the engine serves adapters, else full weights. An
    adapter that does not reproduce the policy on the engine's base checkpoint (quantized base,
    fused-expert adapters) goes as full merged weights (Policy.adapter_is_portable)."""
    return "adapter" if policy.is_lora and engine.native_lora and policy.adapter_is_portable else "full"


def lora_adapter(policy: Policy) -> LoraAdapter:
    """The policy's LoRA adapter as tensors (no copy, no disk): PEFT names without the adapter name."""
    from peft import get_peft_model_state_dict

    lora = policy.model_cfg.lora
    tensors = {name: t.detach() for name, t in get_peft_model_state_dict(policy.model).items()}
    targets = tuple(lora.target_modules) if isinstance(lora.target_modules, list) else ()
    return LoraAdapter(tensors, rank=lora.rank, alpha=lora.alpha, target_modules=targets)


class WeightSync:
    """Keeps one engine's weights equal to the policy's. `push()` after every update."""

    def __init__(self, policy: Policy, engine: RolloutEngine, transport: Transport | None = None,
                 mode: SyncMode | None = None) -> None:
        self.policy = policy
        self.engine = engine
        self.transport: Transport = transport or InProcessTransport()
        self.mode: SyncMode = mode or choose_mode(policy, engine)
        if self.mode == "adapter" and not policy.is_lora:
            raise ValueError("adapter sync needs a LoRA policy")

    def push(self) -> SyncStats:
        """Send the policy's current weights (the adapter, or the full merged weights)."""
        start = time.perf_counter()
        with torch.no_grad():
            if self.mode == "adapter":
                moved = self.transport.send_adapter(self.engine, lora_adapter(self.policy))
            else:
                moved = self.transport.send_full(self.engine, self.policy.sync_state())
        return SyncStats(self.mode, moved, time.perf_counter() - start)

    def snapshot(self) -> Callable[[], SyncStats]:
        """A copy of the policy's current weights now, and a function that pushes that copy later.

        For rollouts overlapped with training: the trainer changes its tensors in place while the
        engine finishes generating, so what is pushed must be copied first. Only trained tensors are
        copied (a LoRA policy's frozen base weights stay shared; merged ones are new tensors anyway).
        """
        with torch.no_grad():
            if self.mode == "adapter":
                adapter = lora_adapter(self.policy)
                adapter = replace(adapter, tensors={n: t.clone() for n, t in adapter.tensors.items()})

                def send() -> int:
                    return self.transport.send_adapter(self.engine, adapter)
            else:
                copy = not self.policy.is_lora
                tensors = [(n, t.clone() if copy else t) for n, t in self.policy.sync_state()]

                def send() -> int:
                    return self.transport.send_full(self.engine, tensors)

        def push() -> SyncStats:
            start = time.perf_counter()
            with torch.no_grad():
                moved = send()
            return SyncStats(self.mode, moved, time.perf_counter() - start)

        return push

    def describe(self) -> dict[str, Any]:
        return {"mode": self.mode, "engine": type(self.engine).__name__,
                "transport": type(self.transport).__name__}
