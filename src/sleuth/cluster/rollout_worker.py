"""One rollout worker: a Ray actor owning one engine (cluster/rollout_pool.py drives a pool of them).

Every call carries the weights version the pool last synced; a worker that is new (restarted by
Ray) or missed a sync refuses with StaleWeights, and the pool re-syncs it."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from sleuth.config import RolloutConfig
from sleuth.records import LoraAdapter
from sleuth.rollout.base import GenerationRequest, GenerationResult, RolloutEngine
from sleuth.rollout.sync import Bucket, unpack


class StaleWeights(RuntimeError):
    """A worker holds other weights than the pool last synced (it was restarted)."""


class RolloutWorker:
    """A Ray actor (async: the engine's futures resolve on the actor's event loop) owning one engine."""

    def __init__(self, rollout_cfg: dict[str, Any], model_path: str, dtype: str, seed: int, threads: int,
                 gpus: int = 0) -> None:
        import torch

        from sleuth.system.logs import configure_logging

        configure_logging()  # as the driver was told (SLEUTH_LOG reaches the actor's environment)
        torch.set_num_threads(threads)
        self._args = (RolloutConfig(**rollout_cfg), model_path, dtype, seed)
        self._tensor_parallel_size = max(1, gpus)
        """cluster.gpus_per_rollout_worker: vLLM's tensor_parallel_size over this actor's GPUs."""
        self.engine: RolloutEngine | None = None
        self.version = 0
        """Weights version: 0 = the model folder's weights; the pool's sync counter after a sync."""
        self.channel: Any = None
        """This worker's end of the weight broadcast group (cluster/collective.py), once joined."""

    def info(self) -> dict[str, Any]:
        import ray

        return {"pid": os.getpid(), "ip": ray.util.get_node_ip_address(), "version": self.version,
                "gpus": ray.get_gpu_ids(), "context_len": getattr(self.engine, "context_len", 0),
                "native_lora": bool(self.engine is not None and self.engine.native_lora),
                "in_flight": bool(self.engine is not None and self.engine.supports_in_flight_updates)}

    async def start(self, settings: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.engine is None:
            from sleuth.rollout.factory import make_engine

            self.engine = await asyncio.to_thread(make_engine, *self._args,
                                                  tensor_parallel_size=self._tensor_parallel_size)
        if settings:
            self.configure(settings)
        return self.info()

    def configure(self, settings: dict[str, Any]) -> None:
        """The pool's engine settings (loop.streaming): in_flight_updates, policy_version."""
        if self.engine is not None:
            self.engine.in_flight_updates = bool(settings["in_flight"]) and self.engine.supports_in_flight_updates
            self.engine.policy_version = int(settings["policy_version"])

    def _check(self, version: int) -> RolloutEngine:
        if self.engine is None or self.version != version:
            raise StaleWeights(f"worker holds weights version {self.version}, the pool {version}")
        return self.engine

    async def stream(self, requests: list[GenerationRequest], version: int) -> Any:
        engine = self._check(version)
        async for result in engine.stream(requests):
            yield result

    async def probe(self, request: GenerationRequest) -> GenerationResult:
        """One request on this worker's engine, whatever its weights (the weight-sync check)."""
        if self.engine is None:
            raise StaleWeights("worker engine not started")
        return await self.engine.generate(request)

    async def load_weights(self, bucket_refs: list[Any], version: int) -> int:
        """Fetch the buckets and load them into the engine; returns the bytes read."""
        import ray

        engine = self.engine
        if engine is None:
            raise StaleWeights("worker engine not started")
        buckets: list[Bucket] = [ray.get(ref) for ref in bucket_refs]
        await asyncio.to_thread(engine.sync_weights, [nt for b in buckets for nt in unpack(b)])
        self.version = version
        return sum(b.nbytes for b in buckets)

    async def join_weight_group(self, address: tuple[str, int], rank: int, world: int, backend: str,
                                timeout_s: float) -> None:
        from sleuth.cluster.collective import Channel

        self.channel = Channel(backend)
        await asyncio.to_thread(self.channel.join, rank, world, timeout_s, tuple(address))

    async def receive_weights(self, version: int) -> int:
        """Receive one broadcast from the group's rank 0 and load it; returns the bytes received."""
        from sleuth.cluster.collective import received

        engine, channel = self.engine, self.channel
        if engine is None or channel is None or not channel.joined:
            raise StaleWeights("worker is not in the weight-sync group")
        header, flats = await asyncio.to_thread(channel.receive)
        weights = received(header, flats)
        if isinstance(weights, LoraAdapter):
            await asyncio.to_thread(engine.sync_lora, weights)
        else:
            await asyncio.to_thread(engine.sync_weights, weights)
        self.version = version
        return sum(int(f.numel()) for f in flats)

    async def load_lora(self, adapter: LoraAdapter, version: int) -> None:
        if self.engine is None:
            raise StaleWeights("worker engine not started")
        await asyncio.to_thread(self.engine.sync_lora, adapter)
        self.version = version

    def stats(self) -> dict[str, float]:
        return self.engine.stats() if self.engine is not None else {}

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
