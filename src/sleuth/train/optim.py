"""AdamW, learning-rate schedules, and the matmul peak rate used for the MFU estimate."""

from __future__ import annotations

import math
import time

import torch

from sleuth.config import TrainerConfig
from sleuth.errors import ConfigError


def lr_factor(step: int, schedule: str, warmup_steps: int, total_steps: int | None) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based).

    constant: 1. warmup: linear from 1/(warmup+1) to 1 over warmup_steps, then 1.
    cosine: the same warm-up, then cosine decay to 10% of the peak at total_steps.
    """
    if schedule == "constant":
        return 1.0
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "warmup":
        return 1.0
    if schedule == "cosine":
        if total_steps is None:
            raise ConfigError("trainer.schedule=cosine needs the total number of steps")
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ConfigError(f"trainer.schedule: unknown schedule '{schedule}'")


def build_optimizer(
    params: list[torch.nn.Parameter], cfg: TrainerConfig, total_steps: int | None
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    if not params:
        raise ConfigError("the policy has no trainable parameters")
    if cfg.schedule == "cosine" and total_steps is None:
        raise ConfigError("trainer.schedule=cosine needs the total number of steps")
    # foreach=False keeps AdamW's per-parameter temporaries small on CPU.
    optimizer = torch.optim.AdamW(
        params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, foreach=False
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg.schedule, cfg.warmup_steps, total_steps)
    )
    return optimizer, scheduler


def measure_matmul_flops(dtype: torch.dtype, device: torch.device | str, n: int = 1024, reps: int = 4) -> float:
    """Achieved FLOP/s of an n x n x n matmul in this dtype on this device (best of reps)."""
    dev = torch.device(device)
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    best = float("inf")
    for _ in range(reps + 1):  # the first run warms up kernels and caches
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        _ = a @ b
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        best = min(best, time.perf_counter() - t)
    return 2.0 * n**3 / max(best, 1e-9)
