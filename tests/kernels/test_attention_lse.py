"""``attention(..., return_lse=True)``: the row logsumexp as a differentiable output.

Equivalences: (o, lse) and every derivative of a loss of both (grad, vmap(grad), jvp,
hessian) equal the float64 ``reference_attention``; and attention over the keys split
in two and merged by lse (ring attention, KV-cache chunks) equals attention over all of
them, values, gradients and tangents.
"""

import importlib.util

import pytest
import torch
from torch.func import grad, hessian, jvp, vmap

from torchfn import random
from torchfn.kernels import attention, reference_attention

HAS_TRITON = all(importlib.util.find_spec(m) for m in ("triton", "torchfn.kernels._triton_ops"))
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not HAS_TRITON, reason="triton or _triton_ops is missing"))]
B, H, HKV, NQ, NK, D = 1, 2, 1, 6, 9, 8


def _data(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, w = (torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)
                  for s in ((B, H, NQ, D), (B, HKV, NK, D), (B, HKV, NK, D), (B, H, NQ, D)))
    u = torch.randn(B, H, NQ, generator=g, dtype=torch.float64)
    mask = torch.rand(B, 1, NQ, NK, generator=g) < 0.8
    mask[..., 2, :] = False  # a row that sees no key: lse = -inf
    return q, k, v, w, u, mask


def _tol(backend):
    return 1e-10 if backend == "torch" else 1e-5


def _dtype(backend):
    return torch.float64 if backend == "torch" else torch.float32


def _loss(fn, w, u):
    """A scalar of o and of the finite lse entries (a -inf lse gets no cotangent)."""
    def loss(q, k, v):
        o, lse = fn(q, k, v)
        fin = torch.where(lse.isfinite(), lse, 0.0)
        return (o * w.to(o.dtype)).sum() + (fin * u.to(fin.dtype)).square().sum()
    return loss


@pytest.mark.parametrize("extra", [{}, {"softcap": 2.0}, {"dropout": 0.3}],
                         ids=["plain", "softcap", "dropout"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_lse_and_its_gradients_equal_the_reference(backend, extra, rel_err):
    q, k, v, w, u, mask = _data(_dtype(backend))
    kw = dict(mask=mask, causal=True, **extra)
    if "dropout" in extra:
        kw["key"] = random.key(1)
    ours = lambda q, k, v: attention(q, k, v, backend=backend, return_lse=True, **kw)  # noqa: E731
    ref = lambda q, k, v: reference_attention(q, k, v, return_lse=True, **kw)  # noqa: E731
    o, lse = ours(q, k, v)
    ro, rlse = ref(q.double(), k.double(), v.double())
    assert lse.shape == (B, H, NQ) and lse.dtype == _dtype(backend)
    assert torch.equal(lse.isfinite(), rlse.isfinite()) and (lse[..., 2] == -torch.inf).all()
    fin = rlse.isfinite()
    assert rel_err(o, ro) <= _tol(backend) and rel_err(lse[fin], rlse[fin]) <= _tol(backend)
    g = grad(_loss(ours, w, u), argnums=(0, 1, 2))(q, k, v)
    rg = grad(_loss(ref, w, u), argnums=(0, 1, 2))(q.double(), k.double(), v.double())
    for a, b in zip(g, rg):
        assert rel_err(a, b) <= _tol(backend)
    # without o in the loss, dq comes from lse alone; it differs from o's share
    g_lse = grad(lambda q: _loss(ours, 0 * w, u)(q, k, v))(q)
    assert rel_err(g_lse, grad(lambda q: _loss(ref, 0 * w, u)(q, k.double(), v.double()))(
        q.double())) <= _tol(backend)
    assert g_lse.abs().amax() > 0.01


@pytest.mark.parametrize("backend", BACKENDS)
def test_lse_tangent_and_second_order(backend, rel_err):
    q, k, v, w, u, mask = _data(_dtype(backend), seed=1)
    ours = lambda q, k, v: attention(q, k, v, mask=mask, backend=backend,  # noqa: E731
                                     return_lse=True)
    ref = lambda q, k, v: reference_attention(q, k, v, mask=mask, return_lse=True)  # noqa: E731
    ts = tuple(torch.randn_like(x) for x in (q, k, v))
    (o, lse), (to, tlse) = jvp(ours, (q, k, v), ts)
    (_, rlse), (rto, rtlse) = jvp(ref, tuple(x.double() for x in (q, k, v)),
                                  tuple(t.double() for t in ts))
    assert rel_err(to, rto) <= _tol(backend) and rel_err(tlse, rtlse) <= _tol(backend)
    assert (tlse[..., 2] == 0).all() and tlse.abs().amax() > 0.01
    # grad-of-grad and hessian go through the cotangent of lse too
    d = torch.randn(2, *q.shape, dtype=q.dtype)

    def along(fn, x):
        return _loss(fn, w, u)(q.to(x.dtype) + torch.einsum("i,i...->...", x, d.to(x.dtype)),
                               k.to(x.dtype), v.to(x.dtype))

    x0 = torch.full((2,), 0.1, dtype=q.dtype)
    h = hessian(lambda x: along(ours, x))(x0)
    rh = hessian(lambda x: along(ref, x))(x0.double())
    assert rel_err(h, rh) <= (1e-10 if backend == "torch" else 1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_merging_two_key_chunks_by_lse_is_attention_over_all_keys(backend, rel_err):
    """Ring attention's identity: o = sum_c exp(lse_c - lse) o_c, lse = logaddexp(lse_c),
    with gradients, per-sample gradients (vmap) and tangents through the merge."""
    q, k, v, w, u, _ = _data(_dtype(backend), seed=2)

    def full(q, k, v):
        return attention(q, k, v, causal=True, backend=backend, return_lse=True)

    def merged(q, k, v):
        split = 4  # the queries are the last NQ of NK positions (causal, bottom-right)
        o1, l1 = attention(q, k[:, :, :split], v[:, :, :split], backend=backend,
                           return_lse=True)
        # the second chunk holds keys split.. NK: causal on it is bottom-right aligned too
        o2, l2 = attention(q, k[:, :, split:], v[:, :, split:], causal=True, backend=backend,
                           return_lse=True)
        lse = torch.logaddexp(l1, l2)
        o = (l1 - lse).exp()[..., None] * o1 + (l2 - lse).exp()[..., None] * o2
        return o, lse

    tol = _tol(backend)
    for a, b in zip(merged(q, k, v), full(q, k, v)):
        assert rel_err(a, b) <= tol
    g = grad(_loss(merged, w, u), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g, grad(_loss(full, w, u), argnums=(0, 1, 2))(q, k, v)):
        assert rel_err(a, b) <= tol
    ts = tuple(torch.randn_like(x) for x in (q, k, v))
    for a, b in zip(jvp(merged, (q, k, v), ts)[1], jvp(full, (q, k, v), ts)[1]):
        assert rel_err(a, b) <= tol
    ks = torch.stack([k, 2 * k, -k])  # per-sample keys
    per = vmap(grad(lambda k: _loss(merged, w, u)(q, k, v)))(ks)
    for i in range(3):
        assert rel_err(per[i], grad(lambda k: _loss(full, w, u)(q, k, v))(ks[i])) <= tol


def test_compile_with_lse(rel_err):
    """torch.compile(fullgraph) of a loss of (o, lse): forward and backward == eager
    (dynamo, the fake kernels, AOT autograd; test_attention_transforms runs inductor)."""
    torch._dynamo.reset()
    q, k, v, w, u, mask = _data(torch.float32, seed=3)
    fn = lambda q, k, v: attention(q, k, v, mask=mask, backend="torch",  # noqa: E731
                                   return_lse=True)
    loss = _loss(fn, w, u)
    xs = tuple(x.clone().requires_grad_() for x in (q, k, v))
    value = torch.compile(loss, fullgraph=True, backend="aot_eager")(*xs)
    grads = torch.autograd.grad(value, xs)
    ref = torch.autograd.grad(loss(*xs), xs)
    for a, b in zip(grads, ref):
        assert rel_err(a, b) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck_backward_with_an_lse_cotangent(backend):
    q, k, v, w, u, mask = _data(torch.float32 if backend == "triton" else torch.float64)
    ops = torch.ops.torchfn
    o, lse = ops.attention_fwd(q, k, v, mask, True, 0.4, backend)
    dlse = torch.randn_like(lse)
    torch.library.opcheck(ops.attention_bwd.default,
                          (q, k, v, o, lse, w, mask, True, 0.4, backend, True, -1, -1, None,
                           None, 0.0, 0.0, None, dlse))


def test_return_lse_must_be_a_bool():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(TypeError, match="return_lse must be a bool, got int"):
        attention(q, q, q, return_lse=1)
    assert isinstance(attention(q, q, q), torch.Tensor)


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_sinks_from_lse_equal_a_sink_column(backend, rel_err):
    """Per-head sink logits (gpt-oss): softmax over [scores, sink] then v, with the sink
    adding no value. With the differentiable lse it is ``o * sigmoid(lse - sink)``; values
    and gradients (the sink logits' included) equal the materialised definition."""
    q, k, v, w, _, mask = _data(_dtype(backend), seed=4)
    sink = torch.randn(H, dtype=q.dtype)

    def ours(q, k, v, sink):
        o, lse = attention(q, k, v, mask=mask, causal=True, backend=backend, return_lse=True)
        return o * torch.sigmoid(lse - sink[:, None]).to(o.dtype)[..., None]

    def materialised(q, k, v, sink):
        allowed = mask & torch.ones(NQ, NK, dtype=torch.bool).tril(NK - NQ)
        s = (q @ k.repeat_interleave(H // HKV, 1).transpose(-1, -2)) * D**-0.5
        s = s.masked_fill(~allowed, float("-inf"))
        s = torch.cat([s, sink[:, None, None].expand(B, H, NQ, 1)], -1)  # the sink column
        return torch.softmax(s, -1)[..., :NK] @ v.repeat_interleave(H // HKV, 1)

    args = (q, k, v, sink)
    assert rel_err(ours(*args), materialised(*(x.double() for x in args))) <= _tol(backend)
    g = grad(lambda *a: (ours(*a) * w).sum(), argnums=(0, 1, 2, 3))(*args)
    rg = grad(lambda *a: (materialised(*a) * w.double()).sum(), argnums=(0, 1, 2, 3))(
        *(x.double() for x in args))
    for a, b in zip(g, rg):
        assert rel_err(a, b) <= _tol(backend)
    assert g[3].abs().amax() > 1e-3  # the sinks get a gradient
