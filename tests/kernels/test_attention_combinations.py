"""Every option of ``attention`` at once: hypothesis draws a shape (GQA, Nq != Nk, padded
head dims) and any combination of mask, key padding, causal, window, segment ids, softcap,
ALiBi and keyed dropout, and the fused backends must equal the float64 reference in
o, lse, the vjp (with cotangents for o *and* lse) and the jvp tangents of both.

The single-option tests elsewhere pin each option down; this one catches the options
that break each other (a band and a segment range that leave a block empty, ALiBi on a
GQA row stack, dropout under a window whose blocks are skipped...).
"""

import importlib.util

import pytest
import torch
from _budget import interpreter_examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.func import jvp, vjp

from torchfn import random
from torchfn.kernels import _torch_ops, attention, reference_attention

HAS_TRITON = all(importlib.util.find_spec(m) for m in ("triton", "torchfn.kernels._triton_ops"))


@st.composite
def cases(draw, max_n: int):
    """(shape, options): a shape and the keyword arguments of one call."""
    B, Hkv, G = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    Nq, Nk = draw(st.integers(1, max_n)), draw(st.integers(1, max_n))
    D = draw(st.sampled_from([16, 20, 32]))
    H = Hkv * G
    kw = {"causal": draw(st.booleans())}
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    mask = draw(st.sampled_from(["none", "bool", "additive", "bool-2d"]))
    if mask == "bool":  # (B, 1, Nq, Nk): broadcast over heads
        kw["mask"] = torch.rand(B, 1, Nq, Nk, generator=g) < 0.75
    elif mask == "bool-2d":
        kw["mask"] = torch.rand(Nq, Nk, generator=g) < 0.75
    elif mask == "additive":
        kw["mask"] = torch.randn(1, H, Nq, Nk, generator=g, dtype=torch.float64)
    if draw(st.booleans()):
        kw["key_padding_mask"] = torch.rand(B, Nk, generator=g) < 0.8
    if draw(st.booleans()):
        side = st.one_of(st.none(), st.integers(0, max_n // 2))
        kw["window"] = (draw(side), draw(side))
    if draw(st.booleans()):  # packed documents: non-decreasing ids, aligned bottom-right
        ids = torch.cumsum(torch.rand(B, max(Nq, Nk), generator=g) < 0.1, 1)
        kw["segment_ids"] = (ids[:, -Nq:], ids[:, -Nk:])
    if draw(st.booleans()):
        kw["softcap"] = draw(st.sampled_from([2.0, 10.0]))
    if draw(st.booleans()):
        shape = draw(st.sampled_from([(H,), (B, H)]))
        kw["alibi_slopes"] = torch.rand(*shape, generator=g, dtype=torch.float64)
    if draw(st.booleans()):
        kw["dropout"] = draw(st.sampled_from([0.1, 0.5]))
        kw["key"] = random.key(seed)
    return (B, H, Hkv, Nq, Nk, D, seed), kw


def _cast(kw, dtype):
    """The float options in ``dtype`` (an fp32 mask on fp32 inputs, fp64 for the oracle)."""
    out = dict(kw)
    for name in ("mask", "alibi_slopes"):
        if name in out and out[name].is_floating_point():
            out[name] = out[name].to(dtype)
    return out


def _finite(lse):
    """lse with the -inf of fully masked rows set to 0 (their cotangent is then harmless)."""
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


def _everything(fn, q, k, v, do, dlse, tangents):
    """(o, lse, dq, dk, dv, to, tlse) of ``fn(q, k, v) -> (o, lse)``."""
    (o, lse), pull = vjp(lambda *a: (lambda r: (r[0], _finite(r[1])))(fn(*a)), q, k, v)
    grads = pull((do, dlse))
    _, (to, tlse) = jvp(lambda *a: (lambda r: (r[0], _finite(r[1])))(fn(*a)), (q, k, v),
                        tangents)
    return (o, lse, *grads, to, tlse)


def _check(backend, case, dtype, tol, rel_err, blocks=None):
    """``blocks``: None (the defaults) or small block shapes, so the options also meet
    at block edges: torch, the query rows per block and whether SDPA may serve; Triton,
    the interpreter's (BLOCK_M, BLOCK_N) of each kernel, the key splits of the forward
    and dQ, and whether dQ is the ordered one."""
    (B, H, Hkv, Nq, Nk, D, seed), kw = case
    with pytest.MonkeyPatch.context() as mp:
        if backend == "torch" and blocks is not None:
            rows, sdpa = blocks
            mp.setattr(_torch_ops, "_SCORE_BUDGET", rows * B * H * Nk)
            mp.setattr(_torch_ops, "_USE_SDPA", sdpa)
        elif blocks is not None:
            from torchfn.kernels import _triton_configs

            blocks, splits, ordered = blocks
            mp.setattr(_triton_configs, "_INTERP_CONFIGS", blocks)
            mp.setenv("TORCHFN_TRITON_SPLIT_KV", str(splits))
            mp.setenv("TORCHFN_TRITON_ORDERED_DQ", "1" if ordered else "0")
        _compare(backend, (B, H, Hkv, Nq, Nk, D, seed), kw, dtype, tol, rel_err)


def _compare(backend, shape, kw, dtype, tol, rel_err):
    """``tol``: a bound on each relative error, or "peer": fp16 / bf16 within 2x the error
    of the materialised reference run in that dtype (SDPA takes none of these options),
    or within one ulp of 1 in that dtype: on a tiny shape both are rounded to the dtype,
    and the peer's error may be that rounding alone, or zero."""
    B, H, Hkv, Nq, Nk, D, seed = shape
    g = torch.Generator().manual_seed(seed + 1)

    def normal(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q, k, v, do = normal(B, H, Nq, D), normal(B, Hkv, Nk, D), normal(B, Hkv, Nk, D), \
        normal(B, H, Nq, D)
    dlse, tangents = normal(B, H, Nq), (normal(*q.shape), normal(*k.shape), normal(*v.shape))
    low = [x.to(dtype) for x in (q, k, v, do, dlse, *tangents)]
    kw_low = _cast(kw, dtype)
    ours = _everything(lambda *a: attention(*a, backend=backend, return_lse=True, **kw_low),
                       *low[:5], tuple(low[5:]))
    kw64 = _cast(kw, torch.float64)
    ref = _everything(lambda *a: reference_attention(*a, return_lse=True, **kw64),
                      q, k, v, do, dlse, tangents)
    names = ("o", "lse", "dq", "dk", "dv", "to", "tlse")
    errs = {n: rel_err(a, b) for n, a, b in zip(names, ours, ref)}
    options = sorted(k for k in kw if kw[k] is not False)
    assert all(torch.isfinite(x).all() for x in ours), (errs, options)
    if tol == "peer":
        peer = _everything(lambda *a: reference_attention(*a, return_lse=True, **kw_low),
                           *low[:5], tuple(low[5:]))
        ulp = torch.finfo(dtype).eps
        bound = {n: max(2 * rel_err(a, b), ulp) for n, a, b in zip(names, peer, ref)}
        assert all(errs[n] <= bound[n] for n in names), (errs, bound, options)
    else:
        assert max(errs.values()) <= tol, (errs, options)


SETTINGS = dict(deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@settings(max_examples=60, **SETTINGS)
@given(case=cases(max_n=48))
def test_torch_backend_with_every_option_matches_float64_reference(case, rel_err):
    """float64 in, so the blockwise path must agree with the oracle to rounding."""
    _check("torch", case, torch.float64, 1e-10, rel_err)


@settings(max_examples=60, **SETTINGS)
@given(case=cases(max_n=48), rows=st.sampled_from([1, 5, 16]), sdpa=st.booleans())
def test_torch_backend_in_small_blocks_matches_float64_reference(case, rows, sdpa, rel_err):
    """Query blocks of 1, 5 or 16 rows: the key ranges a band or a segment leaves each
    block (possibly none) are cut per block."""
    _check("torch", case, torch.float64, 1e-10, rel_err, blocks=(rows, sdpa))


@settings(max_examples=30, **SETTINGS)
@given(case=cases(max_n=48))
def test_torch_backend_fp32_with_every_option(case, rel_err):
    _check("torch", case, torch.float32, 1e-5, rel_err)


@pytest.mark.skipif(not HAS_TRITON, reason="triton or _triton_ops is missing")
@settings(max_examples=interpreter_examples(25), **SETTINGS)
@given(case=cases(max_n=40))
def test_triton_with_every_option_matches_float64_reference(case, rel_err):
    """The Triton forward, dK/dV, dQ and fused JVP kernels (the interpreter on CPU)."""
    _check("triton", case, torch.float32, 1e-5, rel_err)


# (BLOCK_M, BLOCK_N, warps, stages) per kernel: tiles smaller than the sequences, and
# dK/dV's tile transposed to the forward's, so every edge and diagonal case comes up
SMALL_BLOCKS = [
    {"fwd": (16, 16, 4, 1), "jvp": (16, 32, 4, 1), "dkdv": (16, 32, 4, 1),
     "dkdv_atomic": (16, 32, 4, 1), "dkdv_ordered": (16, 32, 4, 1), "dq": (32, 16, 4, 1)},
    {"fwd": (32, 16, 4, 1), "jvp": (16, 16, 4, 1), "dkdv": (32, 16, 4, 1),
     "dkdv_atomic": (32, 16, 4, 1), "dkdv_ordered": (32, 16, 4, 1), "dq": (16, 16, 4, 1)},
]


@pytest.mark.skipif(not HAS_TRITON, reason="triton or _triton_ops is missing")
@settings(max_examples=interpreter_examples(25), **SETTINGS)
@given(case=cases(max_n=56), blocks=st.sampled_from(SMALL_BLOCKS),
       splits=st.sampled_from([0, 2, 3]), ordered=st.booleans())
def test_triton_in_small_blocks_matches_float64_reference(case, blocks, splits, ordered,
                                                          rel_err):
    """Also with the keys of the forward and of dQ split in 2 or 3 runs (split-KV): every
    option must survive a run boundary, and a run that sees no key of a row; and with
    dQ added in turn by the dK/dV kernel (the ordered dQ, where it applies)."""
    _check("triton", case, torch.float32, 1e-5, rel_err, blocks=(blocks, splits, ordered))


@pytest.mark.skipif(not HAS_TRITON, reason="triton or _triton_ops is missing")
@settings(max_examples=interpreter_examples(16), **SETTINGS)
@given(case=cases(max_n=40), dtype=st.sampled_from([torch.float16, torch.bfloat16]))
def test_triton_half_precision_with_every_option(case, dtype, rel_err):
    _check("triton", case, dtype, "peer", rel_err)


@settings(max_examples=25, **SETTINGS)
@given(case=cases(max_n=48), dtype=st.sampled_from([torch.float16, torch.bfloat16]))
def test_torch_backend_half_precision_with_every_option(case, dtype, rel_err):
    """The blockwise path in fp32 for fp16 / bf16 inputs: within 2x the materialised
    reference's error in that dtype."""
    _check("torch", case, dtype, "peer", rel_err)
