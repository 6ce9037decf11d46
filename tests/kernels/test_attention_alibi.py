"""``attention(..., alibi_slopes=s)``: the in-kernel ALiBi bias equals the same bias passed
as an additive mask (values, gradients, tangents), on both backends; errors name the
argument."""

import importlib.util

import pytest
import torch
from torch.func import grad, jvp, vmap

from torchfn.kernels import attention
from torchfn.kernels._reference import alibi_bias

HAS_TRITON = all(importlib.util.find_spec(m) for m in ("triton", "torchfn.kernels._triton_ops"))
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not HAS_TRITON, reason="triton or _triton_ops is missing"))]


def _data(B, H, Hkv, Nq, Nk, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)
                 for s in ((B, H, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, D), (B, H, Nq, D)))


@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window": (6, 2), "softcap": 3.0}],
                         ids=["plain", "causal", "window-softcap"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_alibi_equals_its_bias_as_an_additive_mask(backend, kw, rel_err):
    """GQA, Nq != Nk (the distance is from the bottom-right diagonal), per-batch slopes."""
    dtype = torch.float64 if backend == "torch" else torch.float32
    B, H, Nq, Nk = 2, 4, 21, 35
    q, k, v, w = _data(B, H, 2, Nq, Nk, 16, dtype)
    slopes = 2.0 ** -torch.arange(1, B * H + 1, dtype=dtype).reshape(B, H)  # (B, H)
    bias = alibi_bias(slopes, Nq, Nk)  # (B, H, Nq, Nk)
    ours = lambda q, k, v: attention(q, k, v, alibi_slopes=slopes, backend=backend,  # noqa: E731
                                     **kw)
    masked = lambda q, k, v: attention(q, k, v, mask=bias, backend=backend, **kw)  # noqa: E731
    tol = 1e-12 if backend == "torch" else 2e-6
    assert rel_err(ours(q, k, v), masked(q, k, v)) <= tol
    g = grad(lambda *a: (ours(*a) * w).sum(), argnums=(0, 1, 2))(q, k, v)
    rg = grad(lambda *a: (masked(*a) * w).sum(), argnums=(0, 1, 2))(q, k, v)
    ts = tuple(torch.randn_like(x) for x in (q, k, v))
    for a, b in zip((*g, jvp(ours, (q, k, v), ts)[1]), (*rg, jvp(masked, (q, k, v), ts)[1])):
        assert rel_err(a, b) <= tol
    assert not torch.allclose(ours(q, k, v), attention(q, k, v, backend=backend, **kw))


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_over_slopes_equals_a_loop(backend, rel_err):
    q, k, v, _ = _data(1, 2, 1, 9, 12, 8, torch.float32, seed=1)
    many = torch.tensor([[0.5, 0.25], [1.0, 0.0], [0.1, 2.0]])  # 3 sets of (H,) slopes

    def f(s):
        return attention(q, k, v, causal=True, alibi_slopes=s, backend=backend)

    out = vmap(f)(many)
    for i in range(3):
        assert rel_err(out[i], f(many[i])) <= 1e-6
    h_one = f(torch.zeros(2))  # slope 0: plain attention
    assert rel_err(h_one, attention(q, k, v, causal=True, backend=backend)) <= 1e-6


@pytest.mark.parametrize("slopes, err, msg", [
    (torch.ones(3), ValueError, r"alibi_slopes must have shape \(H,\) = \(2,\) or \(B, H\)"),
    (torch.ones(2, dtype=torch.int64), TypeError, "alibi_slopes must be a float tensor"),
    ([0.5, 0.25], TypeError, "alibi_slopes must be a float tensor of shape"),
    (torch.ones(2, requires_grad=True), ValueError, "alibi_slopes must not require grad"),
])
def test_bad_slopes_are_errors(slopes, err, msg):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(err, match=msg):
        attention(q, q, q, alibi_slopes=slopes)
