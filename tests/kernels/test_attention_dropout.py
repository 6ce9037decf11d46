"""Keyed attention dropout: the mask is the spec's on both backends, the rate and the
mean are right, and the fused forward / backward / JVP equal the float64 reference.

The spec (``torchfn.kernels._dropout``): head ``(b, h)`` uses ``fold_in(key, b * H + h)``;
score ``(i, j)`` is kept iff 16-bit draw ``j % 8`` of Philox-4x32-10(``(j // 8, i, 0, 0)``)
is at least ``round(p * 2**16)``; kept probabilities are scaled by 1 / (the exact keep
rate).
"""

import importlib.util
import math

import pytest
import torch
from torch.func import grad, jvp, vmap

from torchfn import random
from torchfn.kernels import _dropout, attention, reference_attention

HAS_TRITON = all(importlib.util.find_spec(m) for m in ("triton", "torchfn.kernels._triton_ops"))
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not HAS_TRITON, reason="triton or _triton_ops is missing"))]
KEY = random.key(2026)


def _inputs(B, H, Hkv, Nq, Nk, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)
                 for s in ((B, H, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, D), (B, H, Nq, D)))


def _spec_keep(key, B, H, Nq, Nk, p):
    """The keep mask (B, H, Nq, Nk), written from the spec with ``random.fold_in``."""
    out = torch.empty(B, H, Nq, Nk, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            kh = random.fold_in(key, b * H + h)
            out[b, h] = _dropout.keep(kh, torch.arange(Nq)[:, None], 0, Nk,
                                      _dropout.threshold(p))
    return out


def test_seeds_are_fold_in_of_batch_and_head():
    s = _dropout.seeds(KEY, 3, 5)
    assert s.shape == (3, 5, 2) and s.dtype == torch.int32
    for b in range(3):
        for h in range(5):
            assert torch.equal(s[b, h], random.fold_in(KEY, b * 5 + h))


def _philox_py(k0, k1, c0, c1, c2=0, c3=0):
    """Philox-4x32-10 on Python ints, written from Salmon et al. (2011)."""
    m = 0xFFFFFFFF
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & m, (p0 >> 32) ^ c3 ^ k1, p0 & m
        k0, k1 = (k0 + 0x9E3779B9) & m, (k1 + 0xBB67AE85) & m
    return c0, c1, c2, c3


def test_philox_is_random123s_and_keep_uses_its_eight_half_words():
    """The Python Philox gives Random123's known answers; the tensor one equals it on
    random words; column j of row i uses half j % 2 of word (j % 8) // 2 of the hash of
    (j // 8, i), and a range starting mid-group gives the same draws."""
    assert _philox_py(0, 0, 0, 0) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert _philox_py(0xA4093822, 0x299F31D0, 0x243F6A88, 0x85A308D3, 0x13198A2E,
                      0x03707344) == (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)
    g = torch.Generator().manual_seed(0)
    words = torch.randint(-2**31, 2**31, (64, 4), generator=g, dtype=torch.int64).to(torch.int32)
    got = torch.stack(_dropout.philox4x32(*words.unbind(1)), 1)
    want = [_philox_py(*(w & 0xFFFFFFFF for w in row)) for row in words.tolist()]
    assert got.tolist() == [list(w) for w in want]
    k = random.key(5)
    hashed = _philox_py(int(k[0]) & 0xFFFFFFFF, int(k[1]) & 0xFFFFFFFF, 2, 3)  # row 3, 16..23
    halves = [h for w in hashed for h in (w & 0xFFFF, w >> 16)]
    for t in (0, 20000, 40000, 65535):
        assert _dropout.keep(k, torch.tensor([[3]]), 16, 24, t)[0].tolist() == [
            h >= t for h in halves]
    full = _dropout.keep(k, torch.arange(4)[:, None], 0, 43, 30000)
    assert torch.equal(_dropout.keep(k, torch.arange(4)[:, None], 5, 37, 30000), full[:, 5:37])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropped_probabilities_are_the_spec_mask(backend, p):
    """With scale 0 (uniform P = 1 / Nk) and v = I, the output is the dropped P itself:
    each entry is 0 or keep_scale / Nk exactly where the spec keeps it."""
    B, H, Hkv, Nq, Nk = 2, 4, 2, 19, 45  # GQA, Nk not a multiple of 4 or of a block
    q = torch.randn(B, H, Nq, Nk)
    v = torch.eye(Nk).expand(B, Hkv, Nk, Nk).contiguous()
    o = attention(q, v, v, scale=0.0, dropout=p, key=KEY, backend=backend)
    keep = _spec_keep(KEY, B, H, Nq, Nk, p)
    want = keep.double() * _dropout.keep_scale(p) / Nk
    assert torch.allclose(o.double(), want, rtol=1e-6, atol=0)
    assert 0 < keep.double().mean() < 1


def test_keep_rate_and_independence():
    """Kept fraction within 5 sigma of the exact rate; neighbouring columns (the words of
    one hash), rows and heads uncorrelated within 5 sigma."""
    for p in (0.05, 0.3, 0.9):
        keep = _spec_keep(random.key(1), 2, 2, 256, 256, p).double()
        rate = 1 - _dropout.threshold(p) / 2**16
        n = keep.numel()
        assert abs(keep.mean().item() - rate) <= 5 * math.sqrt(rate * (1 - rate) / n)
        z = (keep - keep.mean()) / keep.std()
        for a, b in ((z[..., :-1], z[..., 1:]), (z[..., :-1, :], z[..., 1:, :]),
                     (z[:, 0], z[:, 1]), (z[0], z[1])):
            assert abs((a * b).mean().item()) <= 5 / math.sqrt(a.numel())
    assert abs(_dropout.threshold(0.1) / 2**16 - 0.1) <= 2**-17


def test_output_is_unbiased():
    """The mean over many keys of the dropped attention is the attention without dropout
    (within 5 standard errors of the sample mean)."""
    q, k, v, _ = _inputs(1, 2, 2, 6, 9, 4, torch.float64, seed=3)
    keys = random.split(random.key(9), 4000)
    outs = vmap(lambda key: attention(q, k, v, dropout=0.4, key=key, backend="torch"))(keys)
    mean, se = outs.mean(0), outs.std(0) / math.sqrt(len(keys))
    exact = attention(q, k, v, backend="torch")
    assert ((mean - exact).abs() <= 5 * se + 1e-12).all()
    assert (outs.std(0) > 0.01).all()  # it does drop


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_over_keys_equals_a_loop_and_keys_differ(backend):
    q, k, v, w = _inputs(1, 2, 1, 7, 11, 8, torch.float32, seed=1)
    keys = random.split(KEY, 3)

    def f(key):
        return attention(q, k, v, causal=True, dropout=0.25, key=key, backend=backend)

    def g(q, key):
        return (attention(q, k, v, causal=True, dropout=0.25, key=key, backend=backend) * w).sum()

    out, gq = vmap(f)(keys), vmap(grad(g), in_dims=(None, 0))(q, keys)
    for i, key in enumerate(keys):
        assert torch.equal(out[i], f(key))
        assert torch.allclose(gq[i], grad(g)(q, key), rtol=1e-6, atol=1e-6)
    assert not torch.equal(out[0], out[1])
    assert torch.equal(f(keys[0]), f(keys[0]))  # pure: the same key, the same output
    assert torch.equal(keys, random.split(KEY, 3))  # and the key is not touched


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_rate_is_no_dropout(backend):
    q, k, v, _ = _inputs(1, 2, 2, 5, 8, 8, torch.float32)
    plain = attention(q, k, v, backend=backend)
    assert torch.equal(attention(q, k, v, dropout=0.0, key=KEY, backend=backend), plain)
    assert torch.equal(attention(q, k, v, dropout=0.0, backend=backend), plain)
    # a rate that rounds to 0 / 2**16 drops nothing (and needs no key)
    assert torch.equal(attention(q, k, v, dropout=1e-6, backend=backend), plain)


def test_reference_is_the_written_out_formula():
    """reference_attention's dropout == softmax, then the spec mask times keep_scale."""
    q, k, v, _ = _inputs(2, 2, 1, 5, 10, 4, torch.float64)
    p = 0.35
    s = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) / 2.0
    probs = torch.softmax(s, -1) * _spec_keep(KEY, 2, 2, 5, 10, p) * _dropout.keep_scale(p)
    want = probs @ v.repeat_interleave(2, 1)
    got = reference_attention(q, k, v, dropout=p, key=KEY)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------- fused == float64 reference
CASES = [
    # B, H, Hkv, Nq, Nk, D, dtype, kwargs
    pytest.param(1, 2, 2, 64, 64, 32, torch.float32, {}, id="fp32-basic"),
    pytest.param(1, 4, 2, 40, 75, 24, torch.float32, {"causal": True}, id="fp32-causal-gqa"),
    pytest.param(2, 2, 2, 75, 40, 40, torch.float32, {"causal": True}, id="fp32-causal-Nq>Nk"),
    pytest.param(2, 2, 1, 48, 81, 16, torch.float32, {"mask": "bool"}, id="fp32-bool-empty-row"),
    pytest.param(1, 2, 2, 70, 70, 32, torch.float32, {"window": (9, 4), "softcap": 3.0},
                 id="fp32-window-softcap"),
    pytest.param(2, 2, 2, 66, 66, 16, torch.float32, {"segments": True, "causal": True},
                 id="fp32-segments"),
    pytest.param(1, 2, 1, 70, 90, 64, torch.float16, {"causal": True}, id="fp16-causal"),
    pytest.param(1, 2, 2, 50, 60, 32, torch.bfloat16, {"mask": "bool"}, id="bf16-bool"),
]


def _kwargs(kw, B, H, Nq, Nk):
    kw = dict(kw)
    g = torch.Generator().manual_seed(5)
    if kw.pop("mask", None) == "bool":
        m = torch.rand(B, H, Nq, Nk, generator=g) < 0.7
        m[:, :, 3] = False  # a fully masked row
        kw["mask"] = m
    if kw.pop("segments", False):
        kw["segment_ids"] = torch.cumsum(torch.rand(B, Nq, generator=g) < 0.08, 1)
    return kw


def _run(fn, q, k, v, do, tangents):
    o, vjp_fn = torch.func.vjp(fn, q, k, v)
    return (o, *vjp_fn(do.to(o.dtype)), jvp(fn, (q, k, v), tangents)[1])


def _runs():
    """Every case on the torch backend and on Triton's deterministic backward; the atomic
    dQ backward on the cases that stress dK/dV's recomputed mask (GQA, empty rows,
    segments: the transposed keep tile over every block shape)."""
    atomic = {"fp32-causal-gqa", "fp32-bool-empty-row", "fp32-segments"}
    triton = BACKENDS[1].marks
    for case in CASES:
        name = case.id
        yield pytest.param("torch", True, *case.values, id=f"{name}-torch")
        yield pytest.param("triton", True, *case.values, id=f"{name}-triton", marks=triton)
        if name in atomic:
            yield pytest.param("triton", False, *case.values, id=f"{name}-triton-atomic-dq",
                               marks=triton)


@pytest.mark.parametrize("backend, deterministic, B, H, Hkv, Nq, Nk, D, dtype, kw", list(_runs()))
def test_fused_dropout_matches_reference(backend, deterministic, B, H, Hkv, Nq, Nk, D, dtype,
                                         kw, rel_err):
    """o, dq, dk, dv and the JVP tangent with dropout: fp32 within 1e-5 of the float64
    reference; fp16 / bf16 within 2x the error of the materialised reference in that dtype
    (SDPA cannot draw this mask). The torch backend is always deterministic."""
    q, k, v, do = _inputs(B, H, Hkv, Nq, Nk, D, dtype)
    tangents = tuple(torch.randn_like(x) for x in (q, k, v))
    kw = _kwargs(kw, B, H, Nq, Nk)
    ours = _run(lambda q, k, v: attention(q, k, v, dropout=0.2, key=KEY, backend=backend,
                                          deterministic=deterministic, **kw),
                q, k, v, do, tangents)
    ref = _run(lambda q, k, v: reference_attention(q, k, v, dropout=0.2, key=KEY, **kw),
               *(x.double() for x in (q, k, v, do)), tuple(t.double() for t in tangents))
    errs = [rel_err(a, b) for a, b in zip(ours, ref)]
    if dtype == torch.float32:
        assert max(errs) <= 1e-5, errs
        return
    peer = _run(lambda q, k, v: reference_attention(q, k, v, dropout=0.2, key=KEY, **kw),
                q, k, v, do, tangents)
    bound = [rel_err(a, b) for a, b in zip(peer, ref)]
    assert all(e <= 2 * b + 1e-6 for e, b in zip(errs, bound)), (errs, bound)


@pytest.mark.skipif(not HAS_TRITON, reason="triton or _triton_ops is missing")
def test_triton_dropout_with_tma_descriptors(monkeypatch, rel_err):
    """The TMA (tensor-descriptor) kernels draw the same mask: o and grads == reference."""
    monkeypatch.setenv("TORCHFN_TRITON_TMA", "1")
    q, k, v, do = _inputs(1, 2, 1, 45, 83, 32, torch.float32)
    fn = lambda q, k, v: attention(q, k, v, causal=True, dropout=0.3, key=KEY,  # noqa: E731
                                   backend="triton")
    ref = lambda q, k, v: reference_attention(q, k, v, causal=True, dropout=0.3,  # noqa: E731
                                              key=KEY)
    ours = _run(fn, q, k, v, do, (q, k, v))
    want = _run(ref, *(x.double() for x in (q, k, v, do)), tuple(x.double() for x in (q, k, v)))
    assert max(rel_err(a, b) for a, b in zip(ours, want)) <= 1e-5


@pytest.mark.skipif(not HAS_TRITON, reason="triton or _triton_ops is missing")
@pytest.mark.parametrize(
    "fwd_cfg, bwd_cfg",
    [((16, 16, 4, 1), ((16, 16, 4, 1), (16, 16, 4, 1))),
     ((16, 64, 4, 1), ((64, 16, 4, 1), (16, 64, 4, 1))),
     ((64, 32, 4, 1), ((32, 128, 4, 1), (128, 32, 4, 1)))],
    ids=["16x16", "BM<BN", "BM>BN"],
)
def test_triton_mask_does_not_depend_on_the_block_shape(fwd_cfg, bwd_cfg, rel_err):
    """Raw Triton ops at other tile shapes than the interpreter's (the GPU tuner picks
    among many): the forward, dK/dV's transposed tile, dQ and the JVP all draw the spec's
    mask, so each equals the float64 reference."""
    from torchfn.kernels import _triton_ops as T
    from torchfn.kernels._reference import attention_vjp

    q, k, v, do = _inputs(1, 2, 1, 45, 83, 24, torch.float32, seed=4)
    tangents = tuple(torch.randn_like(x) for x in (q, k, v))
    seeds = _dropout.seeds(KEY, 1, 2)
    kw = dict(dropout=0.3, seeds=seeds)
    o, lse = T.fwd(q, k, v, None, True, 0.2, config=fwd_cfg, **kw)
    grads = T.bwd(q, k, v, o, lse, do, None, True, 0.2, config=bwd_cfg, **kw)
    _, _, to, _ = T.jvp(q, k, v, *tangents, None, True, 0.2, config=fwd_cfg, **kw)
    q64, k64, v64, do64 = (x.double() for x in (q, k, v, do))
    ref = lambda q, k, v: reference_attention(q, k, v, causal=True, scale=0.2,  # noqa: E731
                                              dropout=0.3, key=KEY)
    want = (ref(q64, k64, v64),
            *attention_vjp(q64, k64, v64, do64, None, True, 0.2, dropout=0.3, seeds=seeds),
            jvp(ref, (q64, k64, v64), tuple(t.double() for t in tangents))[1])
    for a, b in zip((o, *grads, to), want):
        assert rel_err(a, b) <= 1e-5


# ------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("fn", [attention, reference_attention])
def test_dropout_without_a_key_is_an_error(fn):
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match=r"key: dropout = 0.1 needs a torchfn.random key"):
        fn(q, q, q, dropout=0.1)


@pytest.mark.parametrize("fn", [attention, reference_attention])
@pytest.mark.parametrize("key", [torch.zeros(2), torch.zeros(3, dtype=torch.int32),
                                 torch.zeros(4, 2, dtype=torch.int32), 7],
                         ids=["float", "shape-3", "batched", "int"])
def test_bad_key_is_an_error(fn, key):
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(TypeError, match=r"key must be a torchfn.random key \(\(2,\) int32"):
        fn(q, q, q, dropout=0.1, key=key)


@pytest.mark.parametrize("p, err", [(-0.1, ValueError), (1.0, ValueError), (1.5, ValueError),
                                    (float("nan"), ValueError), (True, TypeError),
                                    ("0.1", TypeError)])
def test_bad_rate_is_an_error(p, err):
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(err, match=r"dropout must be"):
        attention(q, q, q, dropout=p, key=KEY)
