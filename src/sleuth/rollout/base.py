"""The rollout interface: token ids in, sampled token ids + logprobs out, streamed per group."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sleuth.records import Sample, SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    """n samples of one prompt (one group)."""

    prompt_ids: list[int]
    n: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""


@dataclass
class GenerationResult:
    request: GenerationRequest
    samples: list[Sample]
    time_s: float = 0.0


class RolloutEngine(ABC):
    """An inference engine behind one small async interface."""

    @abstractmethod
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """All n samples of one request."""

    async def stream(self, requests: Sequence[GenerationRequest]) -> AsyncIterator[GenerationResult]:
        """Results per group in the order they finish, so scoring can start early."""
        tasks = [asyncio.ensure_future(self.generate(r)) for r in requests]
        try:
            for fut in asyncio.as_completed(tasks):
                yield await fut
        finally:
            for t in tasks:
                t.cancel()

    def generate_all(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Synchronous convenience: every request, results in request order."""

        async def run() -> list[GenerationResult]:
            return list(await asyncio.gather(*(self.generate(r) for r in requests)))

        return asyncio.run(run())

    @abstractmethod
    def sync_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Replace the engine's weights in place with the trainer's (full, HF parameter names)."""

    def stats(self) -> dict[str, float]:
        """Counters since start (preemptions, aborted samples, tokens, ...)."""
        return {}

    def close(self) -> None:
        """Release the engine's resources."""
