import pytest
import torch

from sleuth.train.kernels.completion_attention import CompletionAttention, length_buckets


def dense_reference(q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, ko: torch.Tensor, vo: torch.Tensor,
                    sizes: list[int], scale: float) -> torch.Tensor:
    """Plain masked attention: each completion token sees the whole prompt and its own earlier tokens."""
    n, p = q.shape[2], kp.shape[2]
    owner = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    idx = torch.arange(n)
    own = (owner[:, None] == owner[None, :]) & (idx[None, :] <= idx[:, None])
    mask = torch.cat([torch.ones(n, p, dtype=torch.bool), own], dim=1)
    k, v = torch.cat([kp, ko], 2), torch.cat([vp, vo], 2)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_equals_masked_attention_forward_and_backward(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    sizes = [7, 3, 9, 1, 6, 9]  # unequal: stacked in length buckets, padded, reordered
    n, p, heads, d = sum(sizes), 11, 3, 8
    leaves = [torch.randn(1, heads, length, d, dtype=dtype, requires_grad=True) for length in (n, p, p, n, n)]
    upstream = torch.randn(1, heads, n, d, dtype=dtype)
    results = []
    for fn in (CompletionAttention.apply, dense_reference):
        out = fn(*leaves, sizes, 0.3)
        (out * upstream).sum().backward()
        results.append((out.detach(), [t.grad.clone() for t in leaves]))
        for t in leaves:
            t.grad = None
    (out, grads), (want, want_grads) = results
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


def test_bf16_stays_close_to_float32() -> None:
    torch.manual_seed(1)
    sizes = [20, 17, 20]
    n, p = sum(sizes), 30
    leaves = [torch.randn(1, 4, length, 16) for length in (n, p, p, n, n)]
    want = dense_reference(*leaves, sizes, 0.25)
    got = CompletionAttention.apply(*(t.to(torch.bfloat16) for t in leaves), sizes, 0.25)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0.02, atol=0.02)


def test_length_buckets_bound_the_padding() -> None:
    assert length_buckets([4, 5, 5, 3, 1]) == [[1, 2, 0, 3], [4]]
    assert length_buckets([]) == []
