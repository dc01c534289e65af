"""The one seed function: every seed in sleuth is derived from its parts by `derive_seed`.

    derive_seed("request", run_seed, iteration, index)      # a rollout request's sampling seed

A hash of the printed parts (SHA-256), so it is stable across processes, machines and Python
versions (unlike hash()), never collides by arithmetic accident (seed 1 / iteration 0 and seed 0 /
iteration 1_000_003 were the same seed under the old linear formulas), and a tag as the first part
keeps the streams of different purposes apart.
"""

from __future__ import annotations

import hashlib


def derive_seed(*parts: object, bits: int = 31) -> int:
    """A stable integer in [0, 2**bits) from any printable parts (bits <= 64)."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") % (1 << bits)


def seed_everything(seed: int, iteration: int, deterministic: bool) -> None:
    """Seed python, numpy and torch from (seed, iteration): each iteration starts from a known state."""
    import random

    import numpy as np
    import torch

    mixed = derive_seed("iteration", seed, iteration)
    random.seed(mixed)
    np.random.seed(mixed)
    torch.manual_seed(mixed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
