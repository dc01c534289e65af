import itertools
import math

import pytest
import torch

from sleuth.config import TrainerConfig
from sleuth.errors import ConfigError
from sleuth.train.optim import build_optimizer, lr_factor, measure_matmul_flops


def test_schedules() -> None:
    assert [lr_factor(s, "constant", 3, None) for s in range(5)] == [1.0] * 5
    assert [lr_factor(s, "warmup", 3, None) for s in range(5)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])
    cos = [lr_factor(s, "cosine", 2, 12) for s in range(14)]
    assert cos[:2] == pytest.approx([1 / 3, 2 / 3])
    assert cos[2] == pytest.approx(1.0) and cos[7] == pytest.approx(0.55) and cos[12] == pytest.approx(0.1)
    assert cos[13] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(cos[2:]))
    with pytest.raises(ConfigError, match="cosine needs the total"):
        lr_factor(5, "cosine", 0, None)


def test_build_optimizer_follows_the_schedule() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    cfg = TrainerConfig(lr=0.1, schedule="warmup", warmup_steps=1, weight_decay=0.01, betas=(0.8, 0.9))
    opt, sched = build_optimizer([p], cfg, total_steps=None)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    assert opt.param_groups[0]["betas"] == (0.8, 0.9) and opt.param_groups[0]["weight_decay"] == 0.01
    p.grad = torch.ones(3)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    assert float(p.detach()[0]) == pytest.approx(-0.05, rel=1e-3)  # Adam's first step moves by lr
    with pytest.raises(ConfigError, match="no trainable parameters"):
        build_optimizer([], cfg, None)
    with pytest.raises(ConfigError, match="cosine"):
        build_optimizer([p], TrainerConfig(schedule="cosine"), None)


def test_matmul_rate_is_positive_and_finite() -> None:
    rate = measure_matmul_flops(torch.float32, "cpu", n=64, reps=2)
    assert math.isfinite(rate) and rate > 1e6
