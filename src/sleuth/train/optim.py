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


class CompensatedAdamW(torch.optim.AdamW):
    """AdamW that loses no update to a low-precision (bfloat16) parameter's rounding.

    A bf16 weight w moves only when its update reaches half its spacing, about |w| / 512: with
    plain AdamW (whose step is about lr for every weight) at lr 3e-5 every weight above ~0.015 in
    magnitude stays exactly where it is, so a full fine-tune in bf16 silently trains only its small
    weights. Here a bf16 parameter's update is computed in float32 and added with compensated
    (Kahan) summation: what the rounding drops is kept in a bf16 buffer (`compensation`, in the
    optimizer state, so it is checkpointed) and added to the next update. Its moments stay in the
    parameter's dtype, as torch's AdamW keeps them, so the cost is one bf16 copy of the weights,
    not the two float32 copies of master weights. Float32 parameters take torch's own AdamW step
    unchanged."""

    @torch.no_grad()
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        low = [p for group in self.param_groups for p in group["params"]
               if p.grad is not None and p.dtype != torch.float32]
        grads = {p: p.grad for p in low}
        for p in low:  # torch's AdamW skips a parameter without a gradient
            p.grad = None
        super().step()
        for p in low:
            p.grad = grads[p]
        for group in self.param_groups:
            for p in group["params"]:
                if p in grads:
                    self._compensated_step(p, grads[p], group)

    def _compensated_step(self, p: torch.Tensor, grad: torch.Tensor, group: dict) -> None:
        beta1, beta2 = group["betas"]
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state.setdefault("compensation", torch.zeros_like(p))  # absent in a checkpoint of torch's AdamW
        state["step"] += 1
        step = float(state["step"])
        g = grad.float()
        m = state["exp_avg"].float().mul_(beta1).add_(g, alpha=1 - beta1)
        v = state["exp_avg_sq"].float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
        state["exp_avg"].copy_(m)
        state["exp_avg_sq"].copy_(v)
        denom = (v.sqrt_() / math.sqrt(1 - beta2 ** step)).add_(group["eps"])
        weight = p.float()
        update = m.div_(denom).mul_(-group["lr"] / (1 - beta1 ** step))
        if group["weight_decay"]:
            update.add_(weight, alpha=-group["lr"] * group["weight_decay"])
        wanted = update.add_(state["compensation"].float())
        rounded = (weight + wanted).to(p.dtype)
        state["compensation"].copy_(wanted.sub_(rounded.float() - weight))
        p.copy_(rounded)


def build_optimizer(
    params: list[torch.nn.Parameter], cfg: TrainerConfig, total_steps: int | None
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    if not params:
        raise ConfigError("the policy has no trainable parameters")
    if cfg.schedule == "cosine" and total_steps is None:
        raise ConfigError("trainer.schedule=cosine needs the total number of steps")
    # foreach=False keeps AdamW's per-parameter temporaries small on CPU.
    optimizer = CompensatedAdamW(
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
