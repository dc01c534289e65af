import pytest
import torch

from sleuth.errors import UserError
from sleuth.train import logprobs
from sleuth.train.logprobs import token_logprobs, unpack_bitmask


def reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Autograd through a full float32 log-softmax: what the chunked function must equal."""
    full = torch.log_softmax(hidden.float() @ weight.float().T, -1)
    return full.gather(-1, targets[:, None])[:, 0], -(full.exp() * full).sum(-1)


def assert_same_gradients(logp: torch.Tensor, want_logp: torch.Tensor, upstream: torch.Tensor,
                          hidden: torch.Tensor, head: torch.nn.Module) -> list[torch.Tensor]:
    """Backward through both with the same incoming gradient; the hidden (and trained head)
    gradients must match. Returns the first one's."""
    trained = head.weight.requires_grad
    (logp * upstream).sum().backward()
    got = [hidden.grad.clone()] + ([head.weight.grad.clone()] if trained else [])
    hidden.grad = None
    head.weight.grad = None
    (want_logp * upstream).sum().backward()
    want = [hidden.grad] + ([head.weight.grad] if trained else [])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    return got


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
    assert_same_gradients(logp, want_logp, upstream, hidden, head)
    assert frozen_head == (head.weight.grad is None)


@pytest.mark.parametrize("frozen_head,budget,masked", [(True, None, False), (False, 1 << 30, False),
                                                      (False, 0, False), (True, None, True), (False, 0, True)],
                         ids=["basis", "keep", "recompute", "basis_masked", "recompute_masked"])
def test_entropy_gradient_matches_autograd(frozen_head: bool, budget: int | None, masked: bool,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """entropy_grad=True: the entropy is differentiable, and the hidden (and trained head)
    gradients of a loss mixing logprobs and entropies equal autograd's through a full log-softmax
    (over the allowed tokens when masked); the values are those of entropy_grad=False."""
    if budget is not None:
        monkeypatch.setattr(logprobs, "KEEP_BUDGET_BYTES", budget)
    torch.manual_seed(3)
    n, v = 11, 70
    head = torch.nn.Linear(16, v, bias=False).requires_grad_(not frozen_head)
    hidden = torch.randn(n, 16, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    allowed = torch.rand(n, v) < 0.4
    allowed[torch.arange(n), targets] = True
    bitmask = pack_bits(allowed) if masked else None
    up_logp, up_entropy = torch.randn(n), torch.randn(n)
    logp, entropy = token_logprobs(hidden, head, targets, chunk=4, token_bitmask=bitmask, entropy_grad=True)
    assert entropy.requires_grad
    plain = token_logprobs(hidden, head, targets, chunk=4, token_bitmask=bitmask)
    torch.testing.assert_close(logp, plain[0])
    torch.testing.assert_close(entropy, plain[1])
    logits = hidden @ head.weight.T
    full = torch.log_softmax(logits.masked_fill(~allowed, float("-inf")) if masked else logits, -1)
    want_logp = full.gather(-1, targets[:, None])[:, 0]
    want_entropy = -(full.exp() * full.nan_to_num(neginf=0.0)).sum(-1)
    torch.testing.assert_close(entropy, want_entropy)
    ((logp * up_logp).sum() + (entropy * up_entropy).sum()).backward()
    got = [hidden.grad.clone()] + ([] if frozen_head else [head.weight.grad.clone()])
    hidden.grad = head.weight.grad = None
    ((want_logp * up_logp).sum() + (want_entropy * up_entropy).sum()).backward(retain_graph=True)
    want = [hidden.grad] + ([] if frozen_head else [head.weight.grad])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    # The entropy's share of the gradient is not negligible: without it the gradient differs.
    hidden.grad = head.weight.grad = None
    (want_logp * up_logp).sum().backward()
    assert (got[0] - hidden.grad).norm() > 0.01 * got[0].norm()


def pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """[N, V] bool -> [N, ceil(V/32)] int32 in xgrammar's layout (bit j of word w: token 32w + j)."""
    n, v = allowed.shape
    padded = torch.nn.functional.pad(allowed, (0, -v % 32)).reshape(n, -1, 32).long()
    words = (padded << torch.arange(32)).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


@pytest.mark.parametrize("frozen_head,budget", [(True, None), (False, 1 << 30), (False, 0)],
                         ids=["basis", "keep", "recompute"])
def test_constrained_logprobs_are_the_renormalized_distribution(frozen_head: bool, budget: int | None,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """With a token bitmask: logprobs, entropies and gradients of the softmax over the allowed
    tokens only; a forced token has logprob 0 and no gradient."""
    if budget is not None:
        monkeypatch.setattr(logprobs, "KEEP_BUDGET_BYTES", budget)
    torch.manual_seed(2)
    n, v = 9, 70  # 70 tokens: the last word of the bitmask is partly used
    head = torch.nn.Linear(16, v, bias=False).requires_grad_(not frozen_head)
    hidden = torch.randn(n, 16, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    allowed = torch.rand(n, v) < 0.3
    allowed[:, 31] = allowed[:, 63] = True  # the sign bit of a word
    allowed[torch.arange(n), targets] = True
    allowed[4] = False
    allowed[4, targets[4]] = True  # forced
    bitmask = pack_bits(allowed)
    assert torch.equal(unpack_bitmask(bitmask, v, targets), allowed)
    upstream = torch.randn(n)
    logp, entropy = token_logprobs(hidden, head, targets, chunk=4, token_bitmask=bitmask)
    full = torch.log_softmax((hidden @ head.weight.T).masked_fill(~allowed, float("-inf")), -1)
    want_logp = full.gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(logp, want_logp)
    torch.testing.assert_close(entropy, -(full.exp() * full.nan_to_num(neginf=0.0)).sum(-1))
    assert logp[4].item() == 0.0 and entropy[4].item() == 0.0
    got = assert_same_gradients(logp, want_logp, upstream, hidden, head)
    assert got[0][4].abs().max().item() == 0.0  # the forced token moves nothing
    # The unconstrained logprobs differ: the mask is what makes them equal the engine's.
    raw, _ = token_logprobs(hidden.detach(), head, targets)
    assert (raw - logp.detach()).max().item() < -0.1


def test_bitmask_narrower_than_the_vocabulary_disallows_the_rest() -> None:
    """A tokenizer smaller than the model's embedding: ids past the bitmask are never allowed,
    and a sampled target always is."""
    targets = torch.tensor([3, 40])
    bitmask = torch.tensor([[1 << 3], [1 << 5]], dtype=torch.int32)  # one word: tokens 0-31
    allowed = unpack_bitmask(bitmask, 48, targets)
    assert allowed.shape == (2, 48)
    assert allowed[0].nonzero().flatten().tolist() == [3]
    assert allowed[1].nonzero().flatten().tolist() == [5, 40]


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
