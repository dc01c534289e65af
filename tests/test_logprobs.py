import pytest
import torch

from sleuth.errors import UserError
from sleuth.train import logprobs
from sleuth.train.logprobs import token_logprobs


def reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Autograd through a full float32 log-softmax: what the chunked function must equal."""
    full = torch.log_softmax(hidden.float() @ weight.float().T, -1)
    return full.gather(-1, targets[:, None])[:, 0], -(full.exp() * full).sum(-1)


@pytest.mark.parametrize("frozen_head,budget", [(True, None), (False, 1 << 30), (False, 0), (False, 1000)],
                         ids=["basis", "keep", "recompute", "keep_then_recompute"])
def test_chunked_logprobs_and_gradients_match_full_log_softmax(frozen_head: bool, budget: int | None,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    if budget is not None:  # 1000 bytes: the first 3 x 50 x 4-byte chunk is kept, later ones recomputed
        monkeypatch.setattr(logprobs, "KEEP_BUDGET_BYTES", budget)
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False).requires_grad_(not frozen_head)
    hidden = torch.randn(11, 16, requires_grad=True)
    targets = torch.randint(0, 50, (11,))
    upstream = torch.randn(11)  # a non-uniform incoming gradient, as the loss gives
    logp, entropy = token_logprobs(hidden, head, targets, chunk=3)
    want_logp, want_entropy = reference(hidden, head.weight, targets)
    torch.testing.assert_close(logp, want_logp)
    torch.testing.assert_close(entropy, want_entropy)
    assert not entropy.requires_grad
    (logp * upstream).sum().backward()
    got = [hidden.grad.clone()] + ([] if frozen_head else [head.weight.grad.clone()])
    hidden.grad = None
    head.weight.grad = None
    (want_logp * upstream).sum().backward()
    want = [hidden.grad] + ([] if frozen_head else [head.weight.grad])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert frozen_head == (head.weight.grad is None)


def test_bf16_head_keeps_float32_logits() -> None:
    """bf16 hidden states and head: logprobs equal the float32 computation on the same values (the
    logits are float32), gradients to bf16 precision."""
    torch.manual_seed(1)
    head = torch.nn.Linear(32, 300, bias=False).to(torch.bfloat16).requires_grad_(False)
    hidden = torch.randn(40, 32).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, 300, (40,))
    logp, _ = token_logprobs(hidden, head, targets, chunk=16)
    want, _ = reference(hidden, head.weight, targets)
    torch.testing.assert_close(logp, want, rtol=1e-5, atol=1e-5)
    logp.sum().backward()
    grad = hidden.grad.float().clone()
    hidden.grad = None
    want.sum().backward()
    assert hidden.grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad, hidden.grad.float(), rtol=2e-2, atol=2e-2)


def test_no_grad_path_equals_grad_path() -> None:
    torch.manual_seed(2)
    head = torch.nn.Linear(8, 20, bias=False)
    hidden = torch.randn(5, 8)
    targets = torch.randint(0, 20, (5,))
    with torch.no_grad():
        plain = token_logprobs(hidden, head, targets)
    tracked = token_logprobs(hidden.requires_grad_(True), head, targets)
    for a, b in zip(plain, tracked, strict=True):
        torch.testing.assert_close(a, b.detach())


def test_head_with_bias_is_refused() -> None:
    with pytest.raises(UserError, match="bias"):
        token_logprobs(torch.randn(2, 4), torch.nn.Linear(4, 6), torch.tensor([0, 1]))
