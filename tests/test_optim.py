import copy
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


def _adam_run(dtype: torch.dtype, steps: int, lr: float = 3e-5, resume_at: int | None = None):
    """A weight vector (|w| ~ 0.05) stepped with a constant gradient; with resume_at, the optimizer
    is rebuilt from its state_dict (a checkpoint) after that many steps."""
    from sleuth.config import TrainerConfig
    from sleuth.train.optim import build_optimizer

    torch.manual_seed(0)
    w0 = (torch.randn(1000) * 0.05).bfloat16().float()  # representable in both dtypes
    p = torch.nn.Parameter(w0.clone().to(dtype))
    cfg = TrainerConfig(lr=lr, weight_decay=0.01)
    opt, _ = build_optimizer([p], cfg, None)
    for k in range(steps):
        if k == resume_at:
            saved = copy.deepcopy(opt.state_dict())
            opt, _ = build_optimizer([p], cfg, None)
            opt.load_state_dict(saved)
        p.grad = torch.ones_like(p)
        opt.step()
        opt.zero_grad()
    return w0, p.detach().float()


def test_bf16_weights_take_every_update_and_float32_ones_torchs_exact_step():
    """Plain AdamW on bf16 weights of |w| ~ 0.05 at lr 3e-5 leaves ~88% of them unmoved (an
    update below half a bf16 spacing rounds away; SmolLM2-135M: 96% of its weights at that lr).
    The compensated step keeps what rounding drops and moves every weight by what the float32
    run moves it, to bf16 resolution and its bf16 moments; float32 weights take torch's own AdamW step, bit for bit;
    the compensation is in the optimizer state, so a resumed run continues exactly."""
    w0, bf16 = _adam_run(torch.bfloat16, 200)
    _, fp32 = _adam_run(torch.float32, 200)
    assert bool((bf16 != w0.bfloat16().float()).all())
    # to a bf16 spacing at that magnitude, plus 5% of the way (the moments are kept in bf16, as
    # torch keeps them for bf16 weights: the first moment of a constant gradient stops at 0.984)
    spacing = torch.pow(2.0, torch.floor(torch.log2(fp32.abs())) - 7)
    assert bool(((bf16 - fp32).abs() <= spacing + 0.05 * (fp32 - w0).abs()).all())
    plain = torch.nn.Parameter(w0.clone().bfloat16())
    reference = torch.optim.AdamW([plain], lr=3e-5, weight_decay=0.01, foreach=False)
    for _ in range(200):
        plain.grad = torch.ones_like(plain)
        reference.step()
    assert float((plain.float() != w0.bfloat16().float()).float().mean()) < 0.3  # what this fixes
    exact = torch.nn.Parameter(w0.clone())
    reference = torch.optim.AdamW([exact], lr=3e-5, weight_decay=0.01, foreach=False)
    for _ in range(200):
        exact.grad = torch.ones_like(exact)
        reference.step()
    assert torch.equal(fp32, exact.detach())
    _, resumed = _adam_run(torch.bfloat16, 200, resume_at=120)
    assert torch.equal(resumed, bf16)
