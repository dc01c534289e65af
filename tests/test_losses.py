import pytest
import torch

from sleuth.errors import UserError
from sleuth.train.losses import aggregation_weights, get_loss, gspo, k3_kl, ppo_clip, tis_weights


def test_ppo_clip_values_and_clip_flags() -> None:
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([0.5, 1.5, 0.5, 1.5])).requires_grad_()
    adv = torch.tensor([-1.0, 1.0, 1.0, -1.0])
    out = ppo_clip(logp, old, adv, torch.zeros(4, dtype=torch.long), clip_low=0.2, clip_high=0.28)
    # ratio 0.5 with A<0: clipped to 0.8 (pessimistic -> -0.8 objective); ratio 1.5 with A>0: 1.28.
    assert out.token_loss.tolist() == pytest.approx([0.8, -1.28, -0.5, 1.5])
    assert out.clipped_low.tolist() == [True, False, False, False]
    assert out.clipped_high.tolist() == [False, True, False, False]
    out.token_loss.sum().backward()
    # Clipped tokens pass no gradient; the others get -A * ratio.
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, -0.5, 1.5])


def test_gspo_uses_the_sequence_ratio() -> None:
    old = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0])
    logp = torch.tensor([0.1, -0.1, 0.3, 0.05, 0.05], requires_grad=True)
    seq = torch.tensor([0, 0, 1, 1, 1])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0])
    out = gspo(logp, old, adv, seq, clip_low=10.0, clip_high=10.0)
    s0, s1 = 1.0, float(torch.exp(torch.tensor(0.4 / 3)))
    assert out.token_loss.tolist() == pytest.approx([-s0, -s0, s1, s1, s1], rel=1e-6)
    # Mean over each sequence's tokens gives GSPO's gradient: A * s * mean of token scores.
    (out.token_loss[:2].mean() + out.token_loss[2:].mean()).backward()
    assert logp.grad.tolist() == pytest.approx([-s0 / 2, -s0 / 2, s1 / 3, s1 / 3, s1 / 3], rel=1e-6)
    # A ratio above 1 + clip_high binds only for a positive advantage.
    tight = gspo(logp, old, adv, seq, clip_low=0.05, clip_high=0.05)
    assert not bool(tight.clipped_high.any() | tight.clipped_low.any())
    tight = gspo(logp, old, torch.ones(5), seq, clip_low=0.05, clip_high=0.05)
    assert tight.clipped_high.tolist() == [False, False, True, True, True]


def test_k3_kl_is_nonnegative_and_zero_at_equality() -> None:
    logp = torch.randn(100)
    ref = torch.randn(100)
    kl = k3_kl(logp, ref)
    assert bool((kl >= 0).all())
    assert float(k3_kl(logp, logp).abs().max()) == 0.0


def test_tis_weights_are_bounded() -> None:
    old = torch.randn(1000) * 3
    engine = torch.randn(1000) * 3
    w = tis_weights(old, engine, cap=2.0)
    assert float(w.max()) <= 2.0 and float(w.min()) > 0
    assert torch.allclose(w[w < 2.0], torch.exp(old - engine)[w < 2.0])
    assert torch.equal(tis_weights(old, engine, None), torch.ones(1000))
    with pytest.raises(UserError, match="tis_cap"):
        tis_weights(old, engine, 0.0)


def test_aggregation_weights() -> None:
    lengths = torch.tensor([2, 4])
    tm = aggregation_weights(lengths, "token_mean", 8)
    assert tm.tolist() == pytest.approx([1 / 6, 1 / 6])
    sm = aggregation_weights(lengths, "seq_mean_token_mean", 8)
    assert sm.tolist() == pytest.approx([1 / 4, 1 / 8])
    assert float((sm * lengths).sum()) == pytest.approx(1.0)
    assert aggregation_weights(lengths, "constant", 8).tolist() == pytest.approx([1 / 16, 1 / 16])
    with pytest.raises(UserError, match="unknown aggregation"):
        aggregation_weights(lengths, "sum", 8)


def test_loss_registry() -> None:
    assert get_loss("ppo_clip") is ppo_clip and get_loss("gspo") is gspo
    with pytest.raises(UserError, match="unknown policy loss 'dpo'"):
        get_loss("dpo")
