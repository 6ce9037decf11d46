"""One query row against a cache (decoding): ``causal`` is a no-op there, and with GQA the
query heads of each kv head are folded into rows of one attention. Both are held to the
float64 reference, under every transform, on the torch path and the Triton interpreter."""

import pytest
import torch
from torch.func import grad, jvp, vmap

from torchfn.kernels import _autograd, attention, reference_attention

BACKENDS = ["torch", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("padding", [False, True])
def test_one_query_row_equals_the_reference(backend, heads, padding, data):
    h, hkv = heads
    d = data(h * 10 + hkv + padding)
    dtype = torch.float64 if backend == "torch" else torch.float32  # triton: no float64
    tol = dict(rtol=1e-9, atol=1e-11) if backend == "torch" else dict(rtol=1e-5, atol=1e-5)
    q, k, v = d.qkv(2, h, hkv, 1, 37, 16, dtype=dtype)
    kp = d.bools(2, 37) if padding else None
    kw = dict(causal=True, key_padding_mask=kp)
    o, lse = attention(q, k, v, backend=backend, return_lse=True, **kw)
    exact = tuple(x.double() for x in (q, k, v))
    want, want_lse = reference_attention(*exact, return_lse=True, **kw)
    torch.testing.assert_close(o.double(), want, **tol)
    torch.testing.assert_close(lse.double(), want_lse, **tol)
    # gradients in q, k, v, and a jvp, through the fold
    loss = lambda f: lambda q, k, v: (f(q, k, v, **kw) * v.sum()).sum()  # noqa: E731
    ours = grad(loss(lambda *a, **x: attention(*a, backend=backend, **x)), argnums=(0, 1, 2))
    ref = grad(loss(reference_attention), argnums=(0, 1, 2))
    for a, b in zip(ours(q, k, v), ref(*exact)):
        torch.testing.assert_close(a.double(), b, **tol)
    t = d.qkv(2, h, hkv, 1, 37, 16, dtype=dtype)
    _, tan = jvp(lambda q, k, v: attention(q, k, v, backend=backend, **kw), (q, k, v), t)
    _, want_tan = jvp(lambda q, k, v: reference_attention(q, k, v, **kw), exact,
                      tuple(x.double() for x in t))
    torch.testing.assert_close(tan.double(), want_tan, **tol)


def test_per_example_decoding_under_vmap(data):
    d = data(3)
    q, k, v = d.qkv(5, 4, 2, 1, 20, 8)  # a batch of 5 examples, each (H, 1, D)
    per = vmap(lambda q, k, v: attention(q[None], k[None], v[None], causal=True)[0])(q, k, v)
    torch.testing.assert_close(per, reference_attention(q, k, v), rtol=1e-10, atol=1e-12)


def test_the_fold_runs_kv_heads_not_query_heads(data, monkeypatch):
    """With GQA and one row, the kernel sees (B, Hkv, G, D) queries: no K/V copies per
    query head. A mask that varies over heads keeps the plain layout."""
    seen = []
    forward = _autograd.attention
    monkeypatch.setattr(_autograd, "attention",
                        lambda q, *a, **kw: (seen.append(tuple(q.shape)), forward(q, *a, **kw))[1])
    d = data(4)
    q, k, v = d.qkv(2, 6, 2, 1, 11, 8)
    attention(q, k, v, causal=True)
    per_head = d.bools(2, 6, 1, 11)
    per_head[..., -1] = True
    o = attention(q, k, v, mask=per_head)
    assert seen == [(2, 2, 3, 8), (2, 6, 1, 8)]
    torch.testing.assert_close(o, reference_attention(q, k, v, mask=per_head), rtol=1e-10,
                               atol=1e-12)
