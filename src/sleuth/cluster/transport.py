"""Weights through Ray's object store: named tensors packed into flat byte buckets.

    buckets = pack_buckets(policy.sync_state(), bucket_mb=256)   # list[Bucket], CPU bytes
    refs = [ray.put(b) for b in buckets]                          # once; every worker reads them
    ... on a worker:  for name, tensor in unpack(ray.get(ref)): ...

One bucket is one numpy uint8 array plus a table of (name, dtype, shape, offset): Ray stores numpy
arrays out of band, so a worker on the same node reads the bytes from shared memory without a copy
(torch tensors would be pickled, i.e. copied, unless Ray's experimental zero-copy flag is set), and
any dtype (bfloat16 included) travels as raw bytes.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

ALIGN = 64
"""Byte alignment of each tensor in a bucket (a view as int64/float64 needs at least 8)."""

DEFAULT_BUCKET_MB = 256
"""Bucket size: large enough that per-object overhead vanishes, small enough to pipeline."""


@dataclass
class Bucket:
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
    flat = None
    if bucket.nbytes:
        with warnings.catch_warnings():  # "buffer is not writable": we only read it
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(memoryview(bucket.data), dtype=torch.uint8)
    for name, dtype, shape, offset, n in bucket.entries:
        raw = flat[offset:offset + n] if flat is not None else torch.empty(0, dtype=torch.uint8)
        yield name, raw.view(getattr(torch, dtype)).reshape(shape)
