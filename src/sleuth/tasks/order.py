"""Deterministic data order for tasks backed by a finite list of problems.

Training index i maps to an item through epoch-wise permutations: epoch e = i // n visits every
item once, in an order seeded by (seed, e). A pure function of (n, seed, i), so a resumed run that
stored only its data position sees the same problems, and different seeds see different orders.
"""

from __future__ import annotations

import random
from functools import lru_cache

from sleuth.system.seeds import derive_seed


@lru_cache(maxsize=8)
def epoch_permutation(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    """The order in which epoch `epoch` visits items 0..n-1."""
    order = list(range(n))
    random.Random(derive_seed("epoch", seed, epoch, bits=63)).shuffle(order)
    return tuple(order)


def stream_index(n: int, seed: int, index: int) -> int:
    """Which of n items the index-th training problem is (index >= 0)."""
    if n <= 0:
        raise ValueError("stream_index needs at least one item")
    if index < 0:
        raise ValueError(f"training index must be >= 0, got {index}")
    epoch, position = divmod(index, n)
    return epoch_permutation(n, seed, epoch)[position]
