"""Values with their own head dim: v (B, Hkv, Nk, Dv), Dv != D (SDPA and FlexAttention
allow it; MLA uses D = 192, Dv = 128). ``attention`` zero-pads the narrower dim, so both
backends and every transform must equal the float64 math written from the formula."""

import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import grad, jvp, vmap

from torchfn.kernels import attention, reference_attention

HAS_TRITON = all(importlib.util.find_spec(m) for m in ("triton", "torchfn.kernels._triton_ops"))
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not HAS_TRITON, reason="triton or _triton_ops is missing"))]
DIMS = [(16, 8), (8, 24), (20, 13)]  # (D, Dv): narrower values, wider values, neither a power of 2


def formula(q, k, v, causal, mask=None):
    """softmax(q k^T / sqrt(D) [masked]) v in float64, GQA by repeating kv heads; rows
    that see no key give 0."""
    q, k, v = (x.double() for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # (B, H, Nq, Nk)
    nq, nk = s.shape[-2:]
    if causal:
        s = s.masked_fill(~torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0) @ v  # (B, H, Nq, Dv)


def _data(D, Dv, dtype, seed, B=2, H=4, Hkv=2, Nq=9, Nk=13):
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, Dv), (B, H, Nq, Dv))
    q, k, v, w = (torch.randn(*s, generator=g, dtype=torch.float64).to(dtype) for s in shapes)
    mask = torch.rand(B, 1, Nq, Nk, generator=g) < 0.8
    if Nq > 1:
        mask[:, :, 1] = False  # a row that sees no key
    return q, k, v, w, mask


@settings(max_examples=15)
@given(d=st.integers(1, 40), dv=st.integers(1, 40), nq=st.integers(1, 12),
       nk=st.integers(1, 12), causal=st.booleans(), groups=st.sampled_from([1, 2]),
       seed=st.integers(0, 2**16))
def test_torch_path_is_the_formula(d, dv, nq, nk, causal, groups, seed, rel_err):
    q, k, v, _, _ = _data(d, dv, torch.float64, seed, B=1, H=2 * groups, Hkv=2, Nq=nq, Nk=nk)
    want = formula(q, k, v, causal)
    assert rel_err(reference_attention(q, k, v, causal=causal), want) <= 1e-12
    assert rel_err(attention(q, k, v, causal=causal, backend="torch"), want) <= 1e-12


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dims", DIMS, ids=[f"D{d}-Dv{dv}" for d, dv in DIMS])
def test_output_lse_gradients_and_tangents_match_float64(backend, dims, rel_err):
    """o, lse, the vjp (cotangents for o and lse) and the jvp of both, with GQA, causal
    and a bool mask with an empty row, against the float64 reference."""
    D, Dv = dims
    dtype = torch.float64 if backend == "torch" else torch.float32
    tol = 1e-10 if backend == "torch" else 1e-5
    q, k, v, w, mask = _data(D, Dv, dtype, seed=D + Dv)
    u = torch.randn(q.shape[:3], generator=torch.Generator().manual_seed(1), dtype=dtype)
    kw = dict(mask=mask, causal=True, return_lse=True)
    run = lambda q, k, v: attention(q, k, v, backend=backend, **kw)  # noqa: E731
    ref = lambda q, k, v: reference_attention(q, k, v, **kw)  # noqa: E731
    xs = tuple(x.clone().requires_grad_() for x in (q, k, v))
    xs64 = tuple(x.detach().double().requires_grad_() for x in (q, k, v))
    (o, lse), (o64, lse64) = run(*xs), ref(*xs64)
    assert o.shape == (*q.shape[:3], Dv)
    assert rel_err(o64, formula(q, k, v, True, mask)) <= 1e-12 and rel_err(o, o64) <= tol
    finite = lse64.isfinite()
    assert torch.equal(lse.isfinite(), finite) and rel_err(lse[finite], lse64[finite]) <= tol
    loss = lambda o, lse: (o * w).sum() + (lse.nan_to_num(0.0, 0.0, 0.0) * u).sum()  # noqa: E731
    got = torch.autograd.grad(loss(o, lse), xs)
    want = torch.autograd.grad(loss(o64, lse64), xs64)
    for a, b in zip(got, want):
        assert rel_err(a, b) <= tol
    tangents = tuple(torch.randn_like(x) for x in (q, k, v))
    _, (to, tlse) = jvp(run, (q, k, v), tangents)
    _, (to64, tlse64) = jvp(ref, tuple(x.double() for x in (q, k, v)),
                            tuple(t.double() for t in tangents))
    assert rel_err(to, to64) <= tol and rel_err(tlse[finite], tlse64[finite]) <= tol


@pytest.mark.parametrize("dims", DIMS, ids=[f"D{d}-Dv{dv}" for d, dv in DIMS])
def test_per_sample_gradients_and_hvp(dims, rel_err):
    """vmap(grad) equals the loop of grads, and the Hessian-vector product jvp(grad)
    (second order, in blocks of query rows) equals the reference's."""
    D, Dv = dims
    q, k, v, w, _ = _data(D, Dv, torch.float64, seed=7, B=3)

    def loss(fn, q, k, v, w):  # one example: q (H, Nq, D), w (H, Nq, Dv)
        return (fn(q[None], k[None], v[None], causal=True)[0] * w).sum()

    per_sample = vmap(grad(lambda *x: loss(attention, *x), argnums=(0, 1, 2)))(q, k, v, w)
    for i in range(3):
        looped = grad(lambda *x: loss(attention, *x), argnums=(0, 1, 2))(q[i], k[i], v[i], w[i])
        for a, b in zip(per_sample, looped):
            assert rel_err(a[i], b) <= 1e-12
    tangents = tuple(torch.randn_like(x) for x in (q, k, v))

    def hvp(fn):
        g = grad(lambda q, k, v: loss(fn, q[0], k[0], v[0], w[0]), argnums=(0, 1, 2))
        return jvp(g, (q[:1], k[:1], v[:1]), tuple(t[:1] for t in tangents))[1]

    for a, b in zip(hvp(attention), hvp(reference_attention)):
        assert rel_err(a, b) <= 1e-10


def test_compile_with_value_head_dim(rel_err):
    """torch.compile(fullgraph) of a loss through the padding: value and grads == eager
    (dynamo, the fake kernels, AOT autograd; test_attention_transforms runs inductor)."""
    torch._dynamo.reset()
    q, k, v, w, mask = _data(16, 8, torch.float32, seed=3)
    loss = lambda q, k, v: (attention(q, k, v, mask=mask, backend="torch") * w).sum()  # noqa: E731
    xs = tuple(x.clone().requires_grad_() for x in (q, k, v))
    value = torch.compile(loss, fullgraph=True, backend="aot_eager")(*xs)
    assert rel_err(value, loss(*xs)) <= 1e-6
    for a, b in zip(torch.autograd.grad(value, xs), torch.autograd.grad(loss(*xs), xs)):
        assert rel_err(a, b) <= 1e-5
