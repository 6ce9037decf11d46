"""Attention sinks (gpt-oss; FlashAttention-3's ``learnable_sink``): a logit per head that
joins each row's softmax as a key without a value. Both backends and every transform,
the sinks' own gradient and tangent included, must equal the float64 formula: softmax
over the scores with the sink appended, the sink's column dropped."""

import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import grad, jvp, vmap

from torchfn.kernels import attention

HAS_TRITON = all(importlib.util.find_spec(m) for m in ("triton", "torchfn.kernels._triton_ops"))
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not HAS_TRITON, reason="triton or _triton_ops is missing"))]


def formula(q, k, v, sinks, causal=False, mask=None):
    """``(o, lse)`` in float64: the softmax over ``[scores, sink]`` (GQA by repeating kv
    heads), the sink's weight dropped; lse over the scores and the sink."""
    q, k, v, sinks = (x.double() for x in (q, k, v, sinks))
    groups = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # (B, H, Nq, Nk)
    nq, nk = s.shape[-2:]
    if causal:
        s = s.masked_fill(~torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    sink = sinks[:, None, None].expand(*s.shape[:-1], 1)  # (B, H, Nq, 1)
    full = torch.cat((s, sink), -1)  # (B, H, Nq, Nk + 1)
    p = torch.softmax(full, -1)[..., :-1]
    return p @ v, torch.logsumexp(full, -1)


def data(dtype, seed, B=2, H=4, Hkv=2, Nq=7, Nk=11, D=8):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)
               for s in ((B, H, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, D)))
    sinks = torch.randn(H, generator=g, dtype=torch.float64).to(dtype)
    mask = torch.rand(B, 1, Nq, Nk, generator=g) < 0.8
    if Nq > 1:
        mask[:, :, 1] = False  # a row that sees no key: all its weight on the sink, o = 0
    return q, k, v, sinks, mask


@settings(max_examples=15)
@given(nq=st.integers(1, 10), nk=st.integers(1, 10), causal=st.booleans(),
       groups=st.sampled_from([1, 2]), masked=st.booleans(), seed=st.integers(0, 2**16))
def test_torch_path_is_the_formula(nq, nk, causal, groups, masked, seed, rel_err):
    q, k, v, sinks, mask = data(torch.float64, seed, H=2 * groups, Nq=nq, Nk=nk)
    mask = mask[:, :, :nq, :nk] if masked and nq > 1 else None
    o, lse = attention(q, k, v, sinks=sinks, causal=causal, mask=mask, return_lse=True)
    o64, lse64 = formula(q, k, v, sinks, causal, mask)
    assert rel_err(o, o64) <= 1e-12 and rel_err(lse, lse64) <= 1e-12
    assert rel_err(attention(q, k, v, sinks=sinks, causal=causal, mask=mask), o64) <= 1e-12


@pytest.mark.parametrize("backend", BACKENDS)
def test_values_gradients_and_tangents_match_float64(backend, rel_err):
    """o, lse, the gradients in q, k, v and the sinks, and the jvp with a tangent for
    each, with GQA, causal and a mask with an empty row (which must give 0, not NaN)."""
    dtype = torch.float64 if backend == "torch" else torch.float32
    tol = 1e-10 if backend == "torch" else 1e-5
    q, k, v, sinks, mask = data(dtype, seed=3)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    run = lambda q, k, v, s: attention(q, k, v, sinks=s, mask=mask, causal=True,  # noqa: E731
                                       backend=backend, return_lse=True)
    ref = lambda q, k, v, s: formula(q, k, v, s, True, mask)  # noqa: E731
    xs = tuple(x.clone().requires_grad_() for x in (q, k, v, sinks))
    xs64 = tuple(x.detach().double().requires_grad_() for x in (q, k, v, sinks))
    (o, lse), (o64, lse64) = run(*xs), ref(*xs64)
    assert rel_err(o, o64) <= tol and rel_err(lse, lse64) <= tol
    assert torch.equal(o[:, :, 1], torch.zeros_like(o[:, :, 1]))
    got = torch.autograd.grad(((o * w).sum() + lse.sum()), xs)
    want = torch.autograd.grad(((o64 * w.double()).sum() + lse64.sum()), xs64)
    for a, b in zip(got, want):
        assert torch.isfinite(a).all() and rel_err(a, b) <= tol
    tangents = tuple(torch.randn_like(x) for x in (q, k, v, sinks))
    _, (to, tlse) = jvp(run, (q, k, v, sinks), tangents)
    _, (to64, tlse64) = jvp(ref, tuple(x.double() for x in (q, k, v, sinks)),
                            tuple(t.double() for t in tangents))
    assert rel_err(to, to64) <= tol and rel_err(tlse, tlse64) <= tol


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_lse_cotangent_folded_into_sdpas_fused_backward(dtype, monkeypatch, rel_err):
    """On the CPU, where SDPA's fused backward applies (Nq == Nk, no window), lse's
    cotangent rides on one more feature of O and dO (``_fold_dlse``): the gradients in
    q, k, v and the sinks still equal the float64 formula's, and the fold ran."""
    from torchfn.kernels import _torch_ops

    calls = []
    fold = _torch_ops._fold_dlse
    monkeypatch.setattr(_torch_ops, "_fold_dlse", lambda *a: calls.append(1) or fold(*a))
    q, k, v, sinks, mask = data(dtype, seed=4, Nq=9, Nk=9, D=12)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(2), dtype=dtype)
    xs = tuple(x.clone().requires_grad_() for x in (q, k, v, sinks))
    xs64 = tuple(x.detach().double().requires_grad_() for x in (q, k, v, sinks))
    o = attention(*xs[:3], sinks=xs[3], causal=True, mask=mask, backend="torch")
    o64 = formula(*xs64, True, mask)[0]
    got = torch.autograd.grad((o * w).sum(), xs)
    want = torch.autograd.grad((o64 * w.double()).sum(), xs64)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    for a, b in zip(got, want):
        assert rel_err(a, b) <= tol
    assert calls, "the fused backward with the folded lse cotangent did not run"


def test_per_sample_gradients_in_the_sinks_equal_the_loop(rel_err):
    """vmap(grad) over examples, the sinks shared (a parameter): each example's gradient
    in q and in the sinks equals grad on that example alone."""
    q, k, v, sinks, _ = data(torch.float64, seed=5, B=3)

    def loss(sinks, q, k, v):  # one example (H, N, D)
        return attention(q[None], k[None], v[None], sinks=sinks, causal=True).square().sum()

    per = vmap(grad(loss, argnums=(0, 1)), in_dims=(None, 0, 0, 0))(sinks, q, k, v)
    for i in range(3):
        one = grad(loss, argnums=(0, 1))(sinks, q[i], k[i], v[i])
        assert rel_err(per[0][i], one[0]) <= 1e-12 and rel_err(per[1][i], one[1]) <= 1e-12


def test_decoding_one_query_with_grouped_heads(rel_err):
    """One query row with GQA (the kernels fold the heads into rows there): still the
    formula."""
    q, k, v, sinks, _ = data(torch.float64, seed=8, Nq=1, Nk=9, H=8, Hkv=2)
    assert rel_err(attention(q, k, v, sinks=sinks), formula(q, k, v, sinks)[0]) <= 1e-12


def test_bad_sinks_are_named():
    q, k, v, sinks, _ = data(torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"sinks must be a floating-point tensor \(H,\) = "
                                         r"\(4,\) on cpu, got torch.float32 \(2, 4\)"):
        attention(q, k, v, sinks=sinks.expand(2, 4))
    with pytest.raises(ValueError, match=r"got torch.int64 \(4,\)"):
        attention(q, k, v, sinks=torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="got list"):
        attention(q, k, v, sinks=[0.0] * 4)
