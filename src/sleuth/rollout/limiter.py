"""How many sequences may be in flight so the engine's KV cache never overflows (no preemption).

vLLM preempts (evicts and later recomputes) running sequences when their KV blocks no longer fit;
for RL rollouts that wastes work and distorts timings. Instead of guessing a concurrency, admit a
sample only while the blocks it is expected to need still fit:

    blocks(sample) = prompt blocks (paid once per group while any of its samples is in flight,
                     since prefix caching shares the prompt's full blocks)
                   + ceil((prompt tail + expected completion) / block_size)   (its own blocks)

The expected completion is max_tokens until a few samples have finished, then the running mean
completion length times a safety margin (capped at max_tokens). The mean is over the recent window
so it follows the policy as its completions grow or shrink during training.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass
class _Group:
    prompt_blocks: int
    in_flight: int = 0


class KVLimiter:
    """Admission control over a KV cache of `total_blocks` blocks of `block_size` tokens.

    Not thread-safe: one driver thread owns it. Keys identify samples; group keys their prompts.
    """

    def __init__(self, total_blocks: int, block_size: int, max_sequences: int | None = None,
                 margin: float = 1.25, warmup: int = 8, window: int = 256) -> None:
        if total_blocks < 1 or block_size < 1:
            raise ValueError(f"KV cache of {total_blocks} blocks x {block_size} tokens is empty")
        self.total_blocks = total_blocks
        self.block_size = block_size
        self.max_sequences = max_sequences
        self.margin = margin
        self.warmup = warmup
        self._recent: deque[int] = deque(maxlen=window)
        self._groups: dict[str, _Group] = {}
        self._samples: dict[str, tuple[str, int]] = {}  # key -> (group, own blocks)
        self.used_blocks = 0
        self.peak_in_flight = 0

    # ------------------------------------------------------------------ estimates

    @property
    def mean_completion(self) -> float | None:
        """Running mean completion length over the recent window (None before any finished)."""
        return sum(self._recent) / len(self._recent) if self._recent else None

    def expected_completion(self, max_tokens: int) -> int:
        if len(self._recent) < self.warmup:
            return max_tokens
        mean = self.mean_completion or 0.0
        return max(1, min(max_tokens, math.ceil(mean * self.margin)))

    def sample_blocks(self, prompt_len: int, max_tokens: int) -> int:
        """Blocks a sample needs beyond its prompt's shared full blocks."""
        tail = prompt_len % self.block_size
        return math.ceil((tail + self.expected_completion(max_tokens)) / self.block_size)

    def capacity(self, prompt_len: int, max_tokens: int, group_size: int) -> int:
        """Sequences of this shape that fit at once (for reporting and sizing batches)."""
        prompt = prompt_len // self.block_size
        per_group = prompt + group_size * self.sample_blocks(prompt_len, max_tokens)
        seqs = max(1, self.total_blocks // per_group * group_size)
        return min(seqs, self.max_sequences) if self.max_sequences else seqs

    @property
    def in_flight(self) -> int:
        return len(self._samples)

    # ------------------------------------------------------------------ admission

    def try_acquire(self, key: str, group: str, prompt_len: int, max_tokens: int) -> bool:
        """Admit the sample if its blocks fit (always when nothing is in flight, so a sample larger
        than the whole cache still runs alone rather than waiting forever)."""
        if key in self._samples:
            raise ValueError(f"sample {key} is already in flight")
        if self.max_sequences is not None and self.in_flight >= self.max_sequences:
            return False
        g = self._groups.get(group)
        prompt = 0 if g is not None and g.in_flight > 0 else prompt_len // self.block_size
        own = self.sample_blocks(prompt_len, max_tokens)
        if self.in_flight > 0 and self.used_blocks + prompt + own > self.total_blocks:
            return False
        if g is None:
            g = self._groups[group] = _Group(prompt_blocks=prompt_len // self.block_size)
        g.in_flight += 1
        self._samples[key] = (group, own)
        self.used_blocks += prompt + own
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        return True

    def release(self, key: str, completion_len: int | None) -> None:
        """The sample finished (completion_len tokens; None when aborted, which teaches nothing
        about lengths); free its blocks and, with its group's last sample, the prompt's."""
        group, own = self._samples.pop(key)
        self.used_blocks -= own
        g = self._groups[group]
        g.in_flight -= 1
        if g.in_flight == 0:
            self.used_blocks -= g.prompt_blocks
            del self._groups[group]
        if completion_len is not None:
            self._recent.append(completion_len)
