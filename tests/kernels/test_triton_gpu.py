"""Raw Triton attention kernels on CUDA vs a float64 reference (the contract on a GPU).

fp32 relative error <= 1e-5 (fp32 dots run as 3xTF32); fp16 / bf16 within 2x the
error of ``F.scaled_dot_product_attention`` in the same dtype; a deterministic
backward, and the same bounds for the atomic-dQ backward (``deterministic=False``);
the ordered-dQ backward repeatable to the bit and equal to the 7-matmul one;
the overlap variants (forward ``PIPELINE``, dK/dV ``EARLY_DP``) and the warp-specialized
ones (``WARP_SPEC``) give the plain kernels' results.
Compiled kernels (``TRITON_INTERPRET`` switched off for these tests) with
the default block configs (no autotuning), so the file stays under a minute.
Run: ``pytest -m gpu tests/kernels/test_triton_gpu.py``.
"""

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
FP32_TOL = 1e-5


@pytest.fixture(autouse=True)
def _compiled_kernels(monkeypatch):
    pytest.importorskip("triton", reason="triton is not installed")
    # another test module may have switched the interpreter on for the whole process;
    # _triton_ops re-defines its kernels when the variable changes between calls
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("TORCHFN_TRITON_AUTOTUNE", "0")


def _causal(Nq, Nk, device):
    return torch.arange(Nk, device=device)[None, :] <= (
        torch.arange(Nq, device=device)[:, None] + (Nk - Nq))


def reference(q, k, v, mask, causal, scale, softcap=None):
    """Materialised float64 attention -> (o, lse); fully masked rows: o = 0, lse = -inf."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = scale * q @ k.transpose(-1, -2)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    allowed = torch.ones_like(s, dtype=torch.bool)
    if mask is not None:
        if mask.dtype == torch.bool:
            allowed = allowed & mask
        else:
            s = s + mask.double()
            allowed = allowed & (mask > float("-inf"))
    if causal:
        allowed = allowed & _causal(s.shape[-2], s.shape[-1], s.device)
    row_ok = allowed.any(-1, keepdim=True)
    s = torch.where(row_ok, torch.where(allowed, s, float("-inf")), 0.0)
    o = (torch.softmax(s, -1) * row_ok) @ v
    return o, torch.where(row_ok[..., 0], torch.logsumexp(s, -1), float("-inf"))


def low_precision_peers(q, k, v, mask, causal, scale, sdpa=True):
    """(SDPA in the inputs' dtype, naive materialised attention in the inputs' dtype).

    ``sdpa=False`` skips SDPA (None in its place): under ``jvp``, since SDPA's CUDA
    backends have no forward-mode AD."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    attn = mask
    if causal:
        c = _causal(q.shape[2], k.shape[2], q.device)
        attn = c if attn is None else (attn & c if attn.dtype == torch.bool
                                       else attn.masked_fill(~c, float("-inf")))
    if attn is not None and attn.dtype != torch.bool:
        attn = attn.to(q.dtype)
    o = (torch.nan_to_num(F.scaled_dot_product_attention(q, k, v, attn_mask=attn, scale=scale))
         if sdpa else None)
    s = (q @ k.transpose(-1, -2)) * scale
    if attn is not None:
        s = s.masked_fill(~attn, float("-inf")) if attn.dtype == torch.bool else s + attn
    return o, torch.nan_to_num(torch.softmax(s, -1)) @ v


def rel_err(x, ref):
    """max |x - ref| / max(max |ref|, 1) (unit-normal data)."""
    return ((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1.0)).item()


def make(B, H, Hkv, Nq, Nk, D, dtype, mask_kind, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(dtype)

    q, k, v, do = rnd(B, H, Nq, D), rnd(B, Hkv, Nk, D), rnd(B, Hkv, Nk, D), rnd(B, H, Nq, D)
    tangents = (rnd(B, H, Nq, D), rnd(B, Hkv, Nk, D), rnd(B, Hkv, Nk, D))
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(B, 1, Nq, Nk, generator=g, device="cuda") < 0.7
        mask[0, 0, Nq // 3] = False  # a fully masked row
        mask = mask.expand(B, H, Nq, Nk)
    elif mask_kind == "additive":
        mask = torch.randn(1, 1, Nq, Nk, generator=g, device="cuda").to(dtype)
        mask = mask.expand(B, H, Nq, Nk)
    elif mask_kind == "keypad":
        keep = torch.arange(Nk, device="cuda")[None, :] < torch.tensor([Nk, Nk // 2],
                                                                      device="cuda")[:B, None]
        mask = keep[:, None, None, :].expand(B, H, Nq, Nk)
    return q, k, v, do, tangents, mask


CASES = [
    # B, H, Hkv, Nq, Nk, D, dtype, causal, mask
    pytest.param(1, 4, 2, 150, 333, 72, torch.float32, True, "bool", id="fp32-d72-gqa-bool"),
    pytest.param(2, 2, 2, 300, 200, 128, torch.bfloat16, True, None, id="bf16-d128-causal-Nq>Nk"),
    pytest.param(1, 4, 1, 257, 257, 64, torch.float16, False, "additive", id="fp16-d64-mqa-add"),
    pytest.param(2, 2, 2, 190, 260, 64, torch.bfloat16, False, "keypad", id="bf16-d64-keypad"),
]


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic-dq"])
@pytest.mark.parametrize("B, H, Hkv, Nq, Nk, D, dtype, causal, mask_kind", CASES)
def test_gpu_kernels_match_reference(B, H, Hkv, Nq, Nk, D, dtype, causal, mask_kind,
                                     deterministic):
    check_gpu(B, H, Hkv, Nq, Nk, D, dtype, causal, mask_kind, deterministic)


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic-dq"])
@pytest.mark.parametrize("B, H, Hkv, Nq, Nk, D, dtype, causal, mask_kind", CASES[1:3])
def test_gpu_tma_kernels_match_reference(B, H, Hkv, Nq, Nk, D, dtype, causal, mask_kind,
                                         deterministic, monkeypatch):
    # TORCHFN_TRITON_TMA=1 (sm_90+): tiles through tensor descriptors, same contract
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor descriptors (TMA) need sm_90 or newer")
    monkeypatch.setenv("TORCHFN_TRITON_TMA", "1")
    check_gpu(B, H, Hkv, Nq, Nk, D, dtype, causal, mask_kind, deterministic)


def check_gpu(B, H, Hkv, Nq, Nk, D, dtype, causal, mask_kind, deterministic):
    """Triton fwd / bwd / jvp on CUDA vs float64; raises AssertionError with the errors."""
    from torchfn.kernels import _triton_ops as T

    q, k, v, do, (tq, tk, tv), mask = make(B, H, Hkv, Nq, Nk, D, dtype, mask_kind)
    scale = D**-0.5
    o, lse = T.fwd(q, k, v, mask, causal, scale)
    dq, dk, dv = T.bwd(q, k, v, o, lse, do, mask, causal, scale, deterministic)
    _, lse2, to, _ = T.jvp(q, k, v, tq, tk, tv, mask, causal, scale)
    assert not T.is_interpreted()

    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ro, rlse = reference(*leaves, mask, causal, scale)
    rdq, rdk, rdv = torch.autograd.grad(ro, leaves, do.double())
    _, rto = torch.func.jvp(lambda a, b, c: reference(a, b, c, mask, causal, scale)[0],
                            (q.double(), k.double(), v.double()),
                            (tq.double(), tk.double(), tv.double()))
    fin = rlse.isfinite()
    assert torch.equal(lse.isfinite(), fin) and torch.equal(lse2.isfinite(), fin)
    assert ((lse - rlse).abs() / (1 + rlse.abs()))[fin].max().item() <= FP32_TOL
    for t in (o, to, dq):
        assert (t[~fin] == 0).all()
    ours = {"o": rel_err(o, ro), "dq": rel_err(dq, rdq), "dk": rel_err(dk, rdk),
            "dv": rel_err(dv, rdv), "to": rel_err(to, rto)}
    if dtype == torch.float32:
        bound = dict.fromkeys(ours, FP32_TOL)
    else:
        lp = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        so, _ = low_precision_peers(*lp, mask, causal, scale)
        sdq, sdk, sdv = torch.autograd.grad(so, lp, do)
        _, nto = torch.func.jvp(lambda a, b, c: low_precision_peers(a, b, c, mask, causal,
                                                                    scale, sdpa=False)[1],
                                (q, k, v), (tq, tk, tv))
        base = {"o": rel_err(so, ro), "dq": rel_err(sdq, rdq), "dk": rel_err(sdk, rdk),
                "dv": rel_err(sdv, rdv)}
        base["to"] = max(rel_err(torch.nan_to_num(nto), rto), base["o"])  # SDPA: no fwd AD
        bound = {n: 2 * b + 1e-6 for n, b in base.items()}
    bad = {n: (e, bound[n]) for n, e in ours.items() if not e <= bound[n]}
    assert not bad, f"errors above the contract (error, bound): {bad}"


def test_gpu_backward_is_deterministic():
    from torchfn.kernels import _triton_ops as T

    q, k, v, do, _, _ = make(2, 2, 2, 300, 200, 128, torch.bfloat16, None, seed=1)
    o, lse = T.fwd(q, k, v, None, True, 0.1)
    first = T.bwd(q, k, v, o, lse, do, None, True, 0.1)
    second = T.bwd(q, k, v, o, lse, do, None, True, 0.1)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


# few configs: each compiles two kernels, and the GPU session's pytest has 300 s in all
@pytest.mark.parametrize("dtype, D, causal, Hkv, Nq, Nk", [
    (torch.bfloat16, 128, True, 8, 2048, 2048), (torch.bfloat16, 64, False, 8, 2048, 2048),
    (torch.float16, 128, False, 2, 1000, 700)],
    ids=["bf16-d128-causal", "bf16-d64", "fp16-d128-gqa-Nq>Nk"])
def test_gpu_ordered_dq_is_repeatable_and_right(dtype, D, causal, Hkv, Nq, Nk, monkeypatch):
    # the ordered dQ (sm_90+): TMA bulk reduces in turn, behind spin locks. The same bits
    # on every run, no wait timed out, every lock at its count, and the 7-matmul
    # backward's results to rounding (each within the usual bound of the reference);
    # deterministic=False's unlocked bulk reduces too.
    # Non-causal shapes rotate (wave > 1), which the interpreter cannot run.
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the ordered dQ needs TMA bulk reduces (sm_90+)")
    from torchfn.kernels import _triton_ops, _triton_ordered_bwd

    B, H = 2, 8
    q, k, v, do, _, _ = make(B, H, Hkv, Nq, Nk, D, dtype, None)
    scale = D ** -0.5
    o, lse = _triton_ops.fwd(q, k, v, None, causal, scale)
    monkeypatch.setenv("TORCHFN_TRITON_ORDERED_DQ", "1")
    runs = [_triton_ops.bwd(q, k, v, o, lse, do, None, causal, scale) for _ in range(4)]
    locks = _triton_ordered_bwd._LAST_LOCKS[0]
    assert locks[1].item() == 0
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run))
    monkeypatch.setenv("TORCHFN_TRITON_ORDERED_DQ", "0")
    plain = _triton_ops.bwd(q, k, v, o, lse, do, None, causal, scale)
    tol = FP32_TOL if dtype == torch.float32 else 2e-2
    for a, b in zip(runs[0], plain):
        assert rel_err(a, b.double()) <= tol  # (the plain one is held to the reference above)
    monkeypatch.setenv("TORCHFN_TRITON_ORDERED_DQ", "1")  # deterministic=False: no locks
    unordered = _triton_ops.bwd(q, k, v, o, lse, do, None, causal, scale, False)
    for a, b in zip(unordered, plain):
        assert rel_err(a, b.double()) <= tol
    (bm, bn, *_), = [c for key, c in _triton_ops.tuned_configs().items()
                     if key[0] == "dkdv_ordered" and key[2] == D and key[3] == causal]
    n_m, n_kb = -(-Nq // bm), -(-Nk // bn)
    assert locks[0].item() == B * Hkv * n_kb  # every ticket taken
    want = [sum(1 for kb in range(n_kb) if max(kb * bn - (Nk - Nq), 0) // bm <= mb)
            if causal else n_kb for mb in range(n_m)]
    assert locks[2:2 + B * H * n_m].view(B * H, n_m).tolist() == [want] * (B * H)


@pytest.mark.parametrize("D, cfg", [(128, (32, 64, 4, 3, False)), (128, (32, 128, 8, 3, True))],
                         ids=["d128-ptr", "d128-tma"])
def test_gpu_early_dp_gives_the_plain_order_gradients(D, cfg):
    # EARLY_DP (dK/dV's dP^T matmul before the exp) runs the same operations in another
    # issue order: the gradients of the plain order with the same tiles, to rounding
    from torchfn.kernels import _triton_configs as C
    from torchfn.kernels import _triton_ops as T

    if cfg[4] and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor descriptors (TMA) need sm_90 or newer")
    q, k, v, do, _, _ = make(2, 4, 2, 300, 430, D, torch.bfloat16, None, seed=2)
    o, lse = T.fwd(q, k, v, None, True, D**-0.5)
    dq_cfg = C._candidates("dq", torch.bfloat16, D)[0]
    late = T.bwd(q, k, v, o, lse, do, None, True, D**-0.5, config=((*cfg, False), dq_cfg))
    early = T.bwd(q, k, v, o, lse, do, None, True, D**-0.5, config=((*cfg, True), dq_cfg))
    for a, b in zip(late, early):
        assert rel_err(b, a.double()) <= 8e-3  # two bf16 ulps of the largest entry


@pytest.mark.parametrize("D, cfg", [(64, (128, 64, 8, 3, True)), (128, (128, 64, 8, 3, True))],
                         ids=["d64-tma", "d128-tma"])
def test_gpu_pipelined_forward_is_the_plain_forward(D, cfg):
    # PIPELINE (S_j issued with P_{j-1} V_{j-1}) adds the same products in the same order
    from torchfn.kernels import _triton_ops as T

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor descriptors (TMA) need sm_90 or newer")
    q, k, v, _, _, _ = make(2, 4, 2, 300, 700, D, torch.bfloat16, None, seed=3)
    # causal with Nk > Nq: full blocks in the pipelined loop, then the masked diagonal
    plain = T.fwd(q, k, v, None, True, D**-0.5, config=(*cfg, False))
    piped = T.fwd(q, k, v, None, True, D**-0.5, config=(*cfg, True))
    assert rel_err(piped[0], plain[0].double()) <= 8e-3  # two bf16 ulps of the largest
    assert ((piped[1] - plain[1]).abs() / (1 + plain[1].abs())).max().item() <= FP32_TOL


# causal: every block masked; D=64 with Nk a multiple of every BLOCK_N: no mask at all
# (WS_MASKED off), ragged query rows only
# (GQA in the second: dK/dV's loop runs over both query heads of a group)
@pytest.mark.parametrize("D, causal, Nq, Nk, Hkv", [(128, True, 300, 430, 4),
                                                    (64, False, 257, 768, 2)],
                         ids=["d128-causal", "d64-unmasked-gqa"])
def test_gpu_warp_specialized_kernels_are_the_plain_kernels(D, causal, Nq, Nk, Hkv):
    # WARP_SPEC: a TMA producer warpgroup and two consumers (Triton's Hopper pass), one
    # masked loop, descriptors made in the kernel (the launcher lends Triton a scratch
    # allocator). The same sums as the plain kernels, to rounding: a guard against the
    # pass miscompiling (the tuner also checks each candidate's results)
    from torchfn.kernels import _triton_configs as C
    from torchfn.kernels import _triton_ops as T

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("warp specialization with tensor descriptors needs sm_90 or newer")
    q, k, v, do, _, _ = make(2, 4, Hkv, Nq, Nk, D, torch.bfloat16, None, seed=4)
    scale = D**-0.5
    ws = {kind: (*C._GPU_WS_CONFIGS[kind][f"d{D}"][0], False, False, True)
          for kind in ("fwd", "dkdv", "dq")}
    plain = T.fwd(q, k, v, None, causal, scale, config=ws["fwd"][:4])
    fast = T.fwd(q, k, v, None, causal, scale, config=ws["fwd"])
    assert rel_err(fast[0], plain[0].double()) <= 8e-3  # two bf16 ulps of the largest
    assert ((fast[1] - plain[1]).abs() / (1 + plain[1].abs())).max().item() <= FP32_TOL
    o, lse = plain
    gplain = T.bwd(q, k, v, o, lse, do, None, causal, scale,
                   config=(ws["dkdv"][:4], ws["dq"][:4]))
    gws = T.bwd(q, k, v, o, lse, do, None, causal, scale, config=(ws["dkdv"], ws["dq"]))
    for a, b in zip(gplain, gws):
        assert rel_err(b, a.double()) <= 8e-3


# last in the file: gpu_session.sh gives these tests 300 s, and the band kernels' compiles
# must not push the warp-specialized tests (which decide the bench's --ws) out of it
@pytest.mark.parametrize("dtype, causal, window, packed, softcap",
                         [(torch.float32, True, (200, None), True, None),
                          (torch.bfloat16, False, (64, 31), False, None),
                          (torch.bfloat16, True, None, True, None),
                          (torch.float32, True, None, False, 2.0)],
                         ids=["fp32-causal-sliding-packed", "bf16-band", "bf16-causal-packed",
                              "fp32-causal-softcap"])
def test_gpu_window_and_segments_match_reference(dtype, causal, window, packed, softcap):
    # the band kernels (WINDOW, SEGMENTS) through the public API: values and gradients
    from torchfn.kernels import _dispatch, _reference, attention

    q, k, v, do, _, _ = make(2, 4, 2, 700, 900, 64, dtype, None)
    left, right = _dispatch._normalize_window(window, causal, 700, 900)
    band = _reference.band(700, 900, causal, (left, right), "cuda")
    band = torch.ones(700, 900, dtype=torch.bool, device="cuda") if band is None else band
    ids = None
    if packed:  # documents of 300 keys, the queries being the last 700 positions
        kv_ids = (torch.arange(900, device="cuda") // 300).expand(2, 900)
        ids = (kv_ids[:, 200:], kv_ids)
        band = band & _reference.segment_mask(ids)
    band = band.expand(2, 4, 700, 900)
    scale = 64 ** -0.5
    f = lambda q, k, v: attention(q, k, v, causal=causal, window=window,  # noqa: E731
                                  segment_ids=ids, softcap=softcap, backend="triton")
    o, vjp = torch.func.vjp(f, q, k, v)
    grads = vjp(do)
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ro, _ = reference(*leaves, band, False, scale, softcap)
    rgrads = torch.autograd.grad(ro, leaves, do.double())
    ours = [rel_err(o, ro)] + [rel_err(g, r) for g, r in zip(grads, rgrads)]
    if dtype == torch.float32:
        assert max(ours) <= FP32_TOL, ours
        return
    lp = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    so, _ = low_precision_peers(*lp, band, False, scale)
    sgrads = torch.autograd.grad(so, lp, do)
    base = [rel_err(so, ro)] + [rel_err(g, r) for g, r in zip(sgrads, rgrads)]
    assert all(e <= 2 * b + 1e-6 for e, b in zip(ours, base)), (ours, base)


@pytest.mark.parametrize("dtype, causal", [(torch.float32, True), (torch.bfloat16, False)],
                         ids=["fp32-causal", "bf16"])
def test_gpu_dropout_draws_the_spec_mask_and_matches_reference(dtype, causal):
    # keyed dropout on the compiled kernels: the exact mask (uniform P through v = I), then
    # o, the gradients and the JVP against the float64 reference with the same key
    from torchfn import random
    from torchfn.kernels import _dropout, attention, reference_attention

    key = random.key(3)
    B, H, Nq, Nk = 2, 2, 100, 130
    eye = torch.eye(Nk, device="cuda").expand(B, 1, Nk, Nk).contiguous()
    uniform = attention(torch.zeros(B, H, Nq, Nk, device="cuda"), eye, eye, scale=0.0,
                        dropout=0.3, key=key, backend="triton")
    seeds = _dropout.seeds(key.cuda(), B, H)[:, :, None, None, :]
    keep = _dropout.keep(seeds, torch.arange(Nq, device="cuda")[:, None], 0, Nk,
                         _dropout.threshold(0.3))
    assert torch.equal(uniform > 0, keep)
    q, k, v, do, _, _ = make(2, 4, 2, 500, 700, 64, dtype, None)
    tangents = tuple(torch.randn_like(x) for x in (q, k, v))
    f = lambda q, k, v: attention(q, k, v, causal=causal, dropout=0.2, key=key,  # noqa: E731
                                  backend="triton")
    r = lambda q, k, v: reference_attention(q, k, v, causal=causal, dropout=0.2,  # noqa: E731
                                            key=key)

    def run(fn, args, ts):
        o, vjp = torch.func.vjp(fn, *args)
        return (o, *vjp(do.to(o.dtype)), torch.func.jvp(fn, args, ts)[1])

    ours = run(f, (q, k, v), tangents)
    ref = run(r, tuple(x.double() for x in (q, k, v)), tuple(t.double() for t in tangents))
    errs = [rel_err(a, b) for a, b in zip(ours, ref)]
    if dtype == torch.float32:
        assert max(errs) <= FP32_TOL, errs
        return
    peer = run(r, (q, k, v), tangents)  # the materialised attention in bf16
    base = [rel_err(a, b) for a, b in zip(peer, ref)]
    assert all(e <= 2 * b + 1e-6 for e, b in zip(errs, base)), (errs, base)


def test_gpu_alibi_equals_its_bias_as_an_additive_mask():
    # the in-kernel ALiBi bias (compiled kernels) == the same bias as an fp32 additive mask
    from torchfn.kernels import attention
    from torchfn.kernels._reference import alibi_bias

    q, k, v, do, _, _ = make(2, 4, 2, 300, 500, 64, torch.bfloat16, None)
    slopes = 2.0 ** -torch.arange(1, 5, device="cuda", dtype=torch.float32)  # (H,)
    bias = alibi_bias(slopes.expand(2, 4), 300, 500)
    runs = []
    for kw in (dict(alibi_slopes=slopes), dict(mask=bias)):
        f = lambda q, k, v, kw=kw: attention(q, k, v, causal=True, backend="triton",  # noqa: E731
                                             **kw)
        o, vjp = torch.func.vjp(f, q, k, v)
        runs.append((o, *vjp(do)))
    for a, b in zip(*runs):
        assert rel_err(a, b.double()) <= 2e-2  # bf16 outputs: the same math, rounded


@pytest.mark.parametrize("dtype, D, Nq", [(torch.float32, 64, 1), (torch.bfloat16, 128, 1),
                                          (torch.bfloat16, 128, 37)],
                         ids=["fp32-decode", "bf16-decode", "bf16-37-queries"])
def test_gpu_split_kv_forward_matches_reference(dtype, D, Nq, monkeypatch):
    # decoding shapes (few query rows, a long context): the heuristic splits the keys on
    # any GPU of >= 20 SMs; the merged o and lse == the unsplit forward's and the float64
    # reference (fp32 <= 1e-5, bf16 within 2x SDPA's error); the split dQ (and dK/dV from
    # the merged lse) == the unsplit backward's
    from torchfn.kernels import _triton_ops

    monkeypatch.delenv("TORCHFN_TRITON_SPLIT_KV", raising=False)
    B, H, Hkv, Nk = 2, 4, 2, 20_000
    splits, _ = _triton_ops._splits(B * H, Nq, Nk, torch.device("cuda"), None)
    assert splits > 1
    q, k, v, do, _, _ = make(B, H, Hkv, Nq, Nk, D, dtype, None)
    scale = D ** -0.5
    o, lse = _triton_ops.fwd(q, k, v, None, True, scale)
    split_grads = _triton_ops.bwd(q, k, v, o, lse, do, None, True, scale)
    ro, rlse = reference(q, k, v, None, True, scale)
    monkeypatch.setenv("TORCHFN_TRITON_SPLIT_KV", "0")
    o1, lse1 = _triton_ops.fwd(q, k, v, None, True, scale)
    whole_grads = _triton_ops.bwd(q, k, v, o1, lse1, do, None, True, scale)
    assert rel_err(lse, rlse) <= FP32_TOL and rel_err(lse1, rlse) <= FP32_TOL
    if dtype == torch.float32:
        assert rel_err(o, ro) <= FP32_TOL
    else:
        sdpa, _ = low_precision_peers(q, k, v, None, True, scale)
        assert rel_err(o, ro) <= 2 * rel_err(sdpa, ro) + 1e-6
        assert rel_err(o, o1.double()) <= 1e-2  # the same sums, split and rounded
    for a, b in zip(split_grads, whole_grads):
        assert rel_err(a, b.double()) <= (FP32_TOL if dtype == torch.float32 else 2e-2)
