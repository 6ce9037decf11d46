"""``attention`` on CUDA: both backends vs the float64 reference, under the transforms.

Marked ``gpu`` (skipped without CUDA, deselected by default). The GPU machine may have
only torch + triton, so this module also runs as a script:
``PYTHONPATH=src python tests/kernels/test_attention_gpu.py``.
"""

from functools import partial

import torch
import torch.nn.functional as F
from torch.func import grad, hessian, jvp, vmap

from torchfn.kernels import _dispatch, attention, reference_attention

try:
    import pytest

    pytestmark = [
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ]
except ImportError:  # run as a script on a machine without pytest
    pytest = None

if pytest is not None:

    @pytest.fixture(autouse=True)
    def _first_configs(monkeypatch):
        # correctness, not speed: one config per kernel (the tuner would compile them all,
        # minutes for fp32); bench/gpu_attention.py --sweep checks every config's result
        monkeypatch.setenv("TORCHFN_TRITON_AUTOTUNE", "0")

DEV = "cuda"
# (B, H, Hkv, Nq, Nk, D): GQA, Nq != Nk, a non-power-of-two head dim, a multi-block N
SHAPES = [(2, 4, 2, 300, 257, 64), (1, 2, 1, 129, 200, 80), (1, 4, 4, 128, 128, 128)]


def _data(seed, B, H, Hkv, Nq, Nk, D, dtype):
    g = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(DEV, dtype)

    q, k, v = normal(B, H, Nq, D), normal(B, Hkv, Nk, D), normal(B, Hkv, Nk, D)
    masks = {
        "none": {},
        "bool": dict(mask=(torch.rand(B, 1, Nq, Nk, generator=g) < 0.8).to(DEV)),
        "additive": dict(mask=normal(1, H, 1, Nk).float()),
        "padding": dict(key_padding_mask=(torch.rand(B, Nk, generator=g) < 0.7).to(DEV)),
    }
    masks["bool"]["mask"][..., 3, :] = False  # a fully masked row
    return q, k, v, masks, normal


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item()


def _ref(kw):
    kw = {n: m.double() if m.is_floating_point() else m for n, m in kw.items()}
    return lambda q, k, v, causal: reference_attention(
        q.double(), k.double(), v.double(), causal=causal, **kw
    )


def test_default_backend_on_cuda_is_triton():
    q = torch.ones(1, 1, 4, 16, device=DEV)
    assert _dispatch._resolve_backend(None, q) == "triton"
    assert _dispatch._resolve_backend(None, q.double()) == "torch"


def test_fp32_matches_reference_fwd_vjp_jvp():
    """fp32, both backends: o, vjp and jvp within 1e-5 of float64 (fp32 dots pinned to ieee)."""
    for backend in ("triton", "torch"):
        for i, shape in enumerate(SHAPES):
            q, k, v, masks, normal = _data(i, *shape, torch.float32)
            do, tangents = normal(*q.shape), (normal(*q.shape), normal(*k.shape), normal(*v.shape))
            for j, (name, kw) in enumerate(masks.items()):
                causal = (i + j) % 2 == 0  # each mask kind with and without causal over shapes

                def ours(q, k, v, causal=causal, kw=kw, backend=backend):
                    return attention(q, k, v, causal=causal, backend=backend, **kw)

                def ref(q, k, v, causal=causal, kw=kw):
                    return _ref(kw)(q, k, v, causal)

                o, pull = torch.func.vjp(ours, q, k, v)
                o_ref, pull_ref = torch.func.vjp(ref, q, k, v)
                errs = [_rel(o, o_ref)] + [_rel(a, b) for a, b in zip(pull(do), pull_ref(do))]
                _, t = jvp(ours, (q, k, v), tangents)
                _, t_ref = jvp(ref, (q, k, v), tangents)
                errs.append(_rel(t, t_ref))
                where = f"{backend} {shape} {name} causal={causal}: {errs}"
                assert max(errs) <= 1e-5, where
                assert not o.isnan().any(), where


def _sdpa_gqa(q, k, v, groups, mask):
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_low_precision_within_twice_sdpa():
    """bf16 / fp16 forward and vjp error <= 2x SDPA's (explicit equivalent mask), Triton."""
    for dtype in (torch.bfloat16, torch.float16):
        for i, (B, H, Hkv, Nq, Nk, D) in enumerate(SHAPES[:2]):
            q, k, v, masks, normal = _data(10 + i, B, H, Hkv, Nq, Nk, D, dtype)
            do = normal(*q.shape)
            g = H // Hkv
            for causal in (False, True):
                if causal and Nq > Nk:  # rows without keys: SDPA gives NaN there
                    continue
                allowed = torch.ones(Nq, Nk, dtype=torch.bool, device=DEV).tril(Nk - Nq)
                if not causal:
                    allowed[:] = True
                ours, pull = torch.func.vjp(
                    partial(attention, causal=causal, backend="triton"), q, k, v
                )
                sdpa = partial(_sdpa_gqa, groups=g, mask=allowed)
                sd, sd_pull = torch.func.vjp(sdpa, q, k, v)
                ref, ref_pull = torch.func.vjp(
                    partial(reference_attention, causal=causal), q.double(), k.double(), v.double()
                )
                eps = torch.finfo(dtype).eps
                pairs = [(ours, sd, ref), *zip(pull(do), sd_pull(do), ref_pull(do.double()))]
                for a, s, r in pairs:
                    err = (a.double() - r).abs().max().item()
                    err_sdpa = (s.double() - r).abs().max().item()
                    floor = 0.5 * eps * r.abs().max().item()
                    assert err <= 2 * err_sdpa + floor, (dtype, causal, err, err_sdpa)


def test_value_head_dim_on_cuda():
    """v with its own head dim (zero-padded to the wider of D and Dv): o and the vjp in
    fp32 within 1e-5 of float64, both ways round, causal with GQA."""
    for D, Dv in ((128, 64), (64, 128)):
        q, k, _, _, normal = _data(20 + D, 1, 4, 2, 129, 200, D, torch.float32)
        v, do = normal(1, 2, 200, Dv), normal(1, 4, 129, Dv)
        ours = partial(attention, causal=True, backend="triton")
        o, pull = torch.func.vjp(ours, q, k, v)
        o_ref, pull_ref = torch.func.vjp(lambda q, k, v: _ref({})(q, k, v, True), q, k, v)
        assert o.shape == (1, 4, 129, Dv)
        errs = [_rel(o, o_ref)] + [_rel(a, b) for a, b in zip(pull(do), pull_ref(do))]
        assert max(errs) <= 1e-5, (D, Dv, errs)


def test_transforms_triton():
    """vmap(grad) == loop, hessian and grad-of-grad == reference, compile fwd+bwd == eager."""
    q, k, v, masks, normal = _data(20, 1, 2, 1, 40, 50, 32, torch.float32)
    kw = masks["bool"]
    w = normal(*q.shape)

    def loss(fn):
        return lambda q, k, v: (fn(q, k, v) * w).sum()

    ours = lambda q, k, v: attention(q, k, v, causal=True, backend="triton", **kw)  # noqa: E731
    ref = lambda q, k, v: _ref(kw)(q, k, v, True)  # noqa: E731
    qs = normal(3, *q.shape)
    per_sample = vmap(grad(loss(ours)), in_dims=(0, None, None))(qs, k, v)
    for i in range(3):
        assert _rel(per_sample[i], grad(loss(ours))(qs[i], k, v)) <= 1e-6
        assert _rel(per_sample[i], grad(loss(ref))(qs[i], k, v)) <= 1e-5
    dirs = normal(2, *q.shape)

    def along(fn, x):
        return loss(fn)(q.to(x.dtype) + torch.einsum("i,i...->...", x, dirs.to(x.dtype)), k, v)

    x0 = torch.full((2,), 0.1, device=DEV)
    h = hessian(lambda x: along(ours, x))(x0)
    h_ref = hessian(lambda x: along(ref, x))(x0.double())
    assert _rel(h, h_ref) <= 1e-4
    gg = grad(lambda q: (grad(loss(ours))(q, k, v) * w).sum())(q)
    gg_ref = grad(lambda q: (grad(loss(ref))(q, k, v) * w.double()).sum())(q.double())
    assert _rel(gg, gg_ref) <= 1e-4
    qq = q.detach().clone().requires_grad_()
    compiled = torch.compile(loss(ours), fullgraph=True)
    value = compiled(qq, k, v)
    (gq,) = torch.autograd.grad(value, qq)
    assert _rel(gq, grad(loss(ours))(q, k, v)) <= 1e-6


def test_grad_of_jvp_triton():
    """Reverse mode over forward mode on the GPU kernels (MeanFlow's loss): grad of a
    function of attention's jvp equals the float64 reference's."""
    q, k, v, masks, normal = _data(21, 1, 2, 1, 40, 50, 32, torch.float32)
    kw = masks["bool"]
    tq, tv, w = normal(*q.shape), normal(*v.shape), normal(*q.shape)
    ours = lambda q, k, v: attention(q, k, v, causal=True, backend="triton", **kw)  # noqa: E731
    ref = lambda q, k, v: _ref(kw)(q, k, v, True)  # noqa: E731

    def readout(fn, dtype):
        def scalar(q, k, v):
            o, to = jvp(fn, (q, k, v), (tq.to(dtype), torch.cos(k), tv.to(dtype)))
            return (to * w.to(dtype)).sum() + (torch.tanh(o) * to).sum()
        return scalar

    got = grad(readout(ours, torch.float32), argnums=(0, 1, 2))(q, k, v)
    want = grad(readout(ref, torch.float64), argnums=(0, 1, 2))(q.double(), k.double(),
                                                                 v.double())
    for a, b in zip(got, want):
        assert _rel(a, b) <= 1e-4


if __name__ == "__main__":
    import os
    import sys
    import time
    import traceback

    os.environ["TORCHFN_TRITON_AUTOTUNE"] = "0"

    failed = 0
    for name, fn in list(globals().items()):
        if name.startswith("test_") and callable(fn):
            t0 = time.perf_counter()
            try:
                fn()
                print(f"PASS {name} ({time.perf_counter() - t0:.1f}s)", flush=True)
            except Exception:  # noqa: BLE001 - report every test
                failed += 1
                print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
    sys.exit(1 if failed else 0)
