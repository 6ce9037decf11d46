"""``attention``'s values, gradients and tangents vs the float64 reference, and its semantics.

Numerics contract: fp32 relative error <= 1e-5 against float64; fp16 / bf16 error
<= 2x ``F.scaled_dot_product_attention``'s in the same dtype. The reference itself is
checked against SDPA in float64 where their semantics coincide.
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given
from hypothesis import strategies as st

from torchfn.kernels import _dispatch, _torch_ops, attention, reference_attention

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
MASKS = ["none", "bool", "additive", "padding", "dead", "bool+padding"]
# sliding windows (None: none); (left, right), None = unbounded side
WINDOWS = [None, None, 0, 2, (3, None), (None, 1), (0, 5), (20, 0)]
# broadcast shapes of a mask, as a function of (B, H, Nq, Nk)
BROADCASTS = {
    "full": lambda B, H, Nq, Nk: (B, H, Nq, Nk),
    "2d": lambda B, H, Nq, Nk: (Nq, Nk),
    "heads": lambda B, H, Nq, Nk: (1, H, 1, Nk),
    "batch": lambda B, H, Nq, Nk: (B, 1, Nq, 1),
}


@contextlib.contextmanager
def torch_path(budget, sdpa=False):
    """Pick the torch backend's path: SDPA's fused CPU kernels where they apply, or the
    blockwise path with query blocks of ~``budget`` scores (small: many blocks)."""
    old = _torch_ops._SCORE_BUDGET, _torch_ops._USE_SDPA
    _torch_ops._SCORE_BUDGET, _torch_ops._USE_SDPA = budget, sdpa
    try:
        yield
    finally:
        _torch_ops._SCORE_BUDGET, _torch_ops._USE_SDPA = old


@st.composite
def cases(draw, dtypes=(torch.float32, torch.float64), masks=MASKS, max_n=33):
    hkv, groups = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 3]))
    return dict(
        B=draw(st.integers(1, 2)),
        H=hkv * groups,
        Hkv=hkv,
        Nq=draw(st.integers(1, max_n)),
        Nk=draw(st.integers(1, max_n)),
        D=draw(st.sampled_from([1, 3, 8, 16, 24, 33, 64])),
        causal=draw(st.booleans()),
        mask=draw(st.sampled_from(masks)),
        broadcast=draw(st.sampled_from(sorted(BROADCASTS))),
        dtype=draw(st.sampled_from(dtypes)),
        seed=draw(st.integers(0, 2**16)),
        path=draw(st.sampled_from(["sdpa", "blockwise", "blocks of 40"])),
        window=draw(st.sampled_from(WINDOWS)),
    )


def make(case, data):
    """(q, k, v, mask kwargs) for a drawn case; masks in the case's broadcast shape."""
    d = data(case["seed"])
    B, H, Nq, Nk = case["B"], case["H"], case["Nq"], case["Nk"]
    q, k, v = d.qkv(B, H, case["Hkv"], Nq, Nk, case["D"], case["dtype"])
    shape = BROADCASTS[case["broadcast"]](B, H, Nq, Nk)
    kind, kw = case["mask"], {}
    if kind in ("bool", "bool+padding"):
        kw["mask"] = d.bools(*shape)
    if kind == "additive":
        bias = d.normal(*shape, dtype=case["dtype"])
        kw["mask"] = bias.masked_fill(~d.bools(*shape, p=0.8), float("-inf"))
    if kind == "dead":  # whole rows without any allowed key
        kw["mask"] = d.bools(B, H, Nq, Nk) & d.bools(B, H, Nq, 1, p=0.6)
    if kind in ("padding", "bool+padding"):
        kw["key_padding_mask"] = d.bools(B, Nk)
    return q, k, v, kw


def reference(q, k, v, causal, kw, **extra):
    """The float64 reference on the same (upcast) inputs."""
    kw = {n: m.double() if isinstance(m, torch.Tensor) and m.is_floating_point() else m
          for n, m in kw.items()}
    return reference_attention(q.double(), k.double(), v.double(), causal=causal, **kw, **extra)


@given(case=cases())
def test_torch_backend_matches_float64_reference(case, data, rel_err):
    """Forward, lse, vjp and jvp of the torch backend == float64 reference (fp32: 1e-5)."""
    q, k, v, kw = make(case, data)
    causal, tol = case["causal"], TOL[case["dtype"]]
    kw["window"] = case["window"]
    d = data(case["seed"] + 1)
    do = d.normal(*q.shape, dtype=q.dtype)
    tangents = tuple(d.normal(*x.shape, dtype=q.dtype) for x in (q, k, v))

    def ours(q, k, v):
        return attention(q, k, v, causal=causal, backend="torch", **kw)

    def ref(q, k, v):
        return reference(q, k, v, causal, kw)

    path = case["path"]
    with torch_path(40 if path == "blocks of 40" else 1 << 22, sdpa=path == "sdpa"):
        o, vjp_fn = torch.func.vjp(ours, q, k, v)
        grads = vjp_fn(do)
        _, tangent = torch.func.jvp(ours, (q, k, v), tangents)
        args = _dispatch._prepare(q, k, v, kw.get("mask"), kw.get("key_padding_mask"),
                                  causal, None, "torch", kw["window"])
        _, lse = torch.ops.torchfn.attention_fwd(q, k, v, args.mask, causal, args.scale, "torch",
                                                 *args.window)
    up = lambda xs: tuple(x.double() for x in xs)  # noqa: E731
    o_ref, vjp_ref = torch.func.vjp(ref, *up((q, k, v)))
    _, lse_ref = reference(q, k, v, causal, kw, return_lse=True)
    _, tangent_ref = torch.func.jvp(ref, up((q, k, v)), up(tangents))

    assert not o.isnan().any()
    assert o.dtype == q.dtype and o.shape == q.shape
    assert rel_err(o, o_ref) <= tol
    assert torch.equal(lse.isinf(), lse_ref.isinf())  # -inf exactly on fully masked rows
    live = lse_ref.isfinite()
    if live.any():
        assert rel_err(lse[live], lse_ref[live]) <= tol
    for g, g_ref in zip(grads, vjp_ref(do.double())):
        assert g.dtype == q.dtype and rel_err(g, g_ref) <= tol
    assert rel_err(tangent, tangent_ref) <= tol


def _sdpa_inputs(q, k, v, causal, kw):
    """SDPA arguments with exactly our semantics: explicit mask, repeated kv heads."""
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    mask = kw.get("mask")
    allowed = torch.ones(B, H, Nq, Nk, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(Nq, Nk, dtype=torch.bool).tril(Nk - Nq)
    if mask is not None:
        mask = mask.expand(B, H, Nq, Nk)
    g = H // k.shape[1]
    return q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), mask, allowed


@given(
    case=cases(dtypes=(torch.float16, torch.bfloat16), masks=["none", "additive"], max_n=64),
    N=st.integers(16, 64),
)
@example(case={"B": 2, "H": 3, "Hkv": 1, "Nq": 1, "Nk": 5, "D": 1, "causal": True,
               "mask": "none", "broadcast": "2d", "dtype": torch.float16, "seed": 8433,
               "path": "sdpa", "window": None}, N=38)
def test_low_precision_within_twice_sdpa_error(case, N, data):
    """fp16 / bf16: error vs float64 <= 2x SDPA's error on the same inputs, fwd and bwd.

    Masks here never empty a row (SDPA's math path gives NaN there); a half-ulp floor
    at the output's magnitude allows for the rounding of an exact result. The example:
    D = 1, where the backward's ``delta`` taken from the fp16 output (rather than summed
    from P and dP) made dk 2.5 ulp off at |dk| ~ 1.6 (the blockwise path, causal Nq < Nk).
    """
    case = dict(case, Nq=N, Nk=N + case["Nk"] % 8, broadcast="full")
    q, k, v, kw = make(case, data)
    if "mask" in kw:  # finite additive bias: no row is emptied
        kw["mask"] = kw["mask"].nan_to_num(neginf=-5.0)
    causal = case["causal"]
    do = data(case["seed"] + 1).normal(*q.shape, dtype=q.dtype)
    qs, ks, vs, bias, allowed = _sdpa_inputs(q, k, v, causal, kw)
    sdpa_mask = allowed if bias is None else bias.masked_fill(~allowed, float("-inf"))

    with torch_path(1 << 22, sdpa=case["path"] == "sdpa"):
        ours_o, ours_vjp = torch.func.vjp(
            lambda q, k, v: attention(q, k, v, causal=causal, backend="torch", **kw), q, k, v
        )
        ours_grads = ours_vjp(do)
    sdpa_o, sdpa_vjp = torch.func.vjp(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask), qs, ks, vs
    )
    ref_o, ref_vjp = torch.func.vjp(
        lambda q, k, v: reference(q, k, v, causal, kw), q.double(), k.double(), v.double()
    )
    g = q.shape[1] // k.shape[1]
    sdpa_grads = list(sdpa_vjp(do))
    sdpa_grads[1:] = [x.double().unflatten(1, (k.shape[1], g)).sum(2) for x in sdpa_grads[1:]]
    eps = torch.finfo(q.dtype).eps
    for ours, sdpa, ref in [(ours_o, sdpa_o, ref_o), *zip(ours_grads, sdpa_grads,
                                                          ref_vjp(do.double()))]:
        err = (ours.double() - ref).abs().max().item()
        err_sdpa = (sdpa.double() - ref).abs().max().item()
        assert err <= 2 * err_sdpa + 0.5 * eps * ref.abs().max().item()


@given(case=cases(dtypes=(torch.float64,), masks=["none", "bool", "additive"]))
def test_reference_matches_sdpa_float64(case, data, rel_err):
    """The oracle agrees with SDPA (float64) where their semantics coincide."""
    case = dict(case, Nk=case["Nq"] if case["causal"] else case["Nk"])
    q, k, v, kw = make(case, data)
    if case["mask"] == "bool":  # SDPA's math path gives NaN on rows without a key
        kw["mask"] = kw["mask"] | torch.eye(case["Nq"], case["Nk"], dtype=torch.bool)
    if case["mask"] == "additive":
        kw["mask"] = kw["mask"].nan_to_num(neginf=-7.0)
    ours = reference_attention(q, k, v, causal=case["causal"], **kw)
    sdpa = F.scaled_dot_product_attention(
        q, k, v, attn_mask=kw.get("mask"), is_causal=case["causal"], enable_gqa=True
    )
    assert rel_err(ours, sdpa) <= 1e-12


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_fully_masked_rows_give_zero_and_zero_grads(backend, data):
    q, k, v = data(3).qkv(2, 2, 1, 6, 5, 8)
    mask = data(4).bools(2, 1, 6, 5, p=0.9)
    mask[0, :, 2] = False  # row 2 of batch 0 sees nothing
    kp = torch.ones(2, 5, dtype=torch.bool)
    kp[1] = False  # batch 1 sees nothing at all
    fn = attention if backend == "torch" else reference_attention

    def loss(q, k, v):
        return (fn(q, k, v, mask=mask, key_padding_mask=kp) ** 2).sum()

    o = fn(q, k, v, mask=mask, key_padding_mask=kp)
    dq, dk, dv = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert o[0, :, 2].eq(0).all() and o[1].eq(0).all()
    assert o[0, :, 3].ne(0).all()
    assert dq[0, :, 2].eq(0).all() and dq[1].eq(0).all() and dk[1].eq(0).all()
    assert all(x.isfinite().all() for x in (o, dq, dk, dv))
    # causal with Nq > Nk: the first Nq - Nk queries precede every key
    o = fn(q, k[:, :, :3], v[:, :, :3], causal=True)
    assert o[:, :, :3].eq(0).all() and o[:, :, 3:].ne(0).all()


def test_causal_is_bottom_right_aligned(data, rel_err):
    """Query i sees key j iff j <= i + Nk - Nq; equals SDPA's top-left is_causal iff Nq == Nk."""
    q, k, v = data(5).qkv(1, 2, 2, 4, 7, 8)
    explicit = torch.ones(4, 7, dtype=torch.bool).tril(diagonal=3)
    o = attention(q, k, v, causal=True)
    assert rel_err(o, attention(q, k, v, mask=explicit)) <= 1e-12
    assert rel_err(o, F.scaled_dot_product_attention(q, k, v, attn_mask=explicit)) <= 1e-12
    assert rel_err(o, F.scaled_dot_product_attention(q, k, v, is_causal=True)) > 1e-3
    q = data(6).normal(1, 2, 7, 8)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert rel_err(attention(q, k, v, causal=True), sdpa) <= 1e-12


def test_key_padding_mask_drops_keys(data, rel_err):
    """Padding keys out == attending over the real keys only (per batch element)."""
    q, k, v = data(7).qkv(2, 4, 2, 5, 9, 16)
    lengths = [9, 4]
    kp = torch.arange(9) < torch.tensor(lengths)[:, None]  # (B, Nk)
    o = attention(q, k, v, key_padding_mask=kp)
    for b, n in enumerate(lengths):
        alone = attention(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n])
        assert rel_err(o[b : b + 1], alone) <= 1e-12
    bool_mask = kp[:, None, None, :]
    assert rel_err(o, attention(q, k, v, mask=bool_mask)) <= 1e-12


def test_gqa_equals_repeated_kv_heads(data, rel_err):
    q, k, v = data(8).qkv(2, 6, 2, 5, 7, 8)
    kr, vr = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)
    assert rel_err(attention(q, k, v, causal=True), attention(q, kr, vr, causal=True)) <= 1e-12
    mqa_k, mqa_v = k[:, :1], v[:, :1]
    expanded = attention(q, mqa_k.expand(2, 6, 7, 8), mqa_v.expand(2, 6, 7, 8))
    assert rel_err(attention(q, mqa_k, mqa_v), expanded) <= 1e-12


def test_masks_stay_compact(data):
    """The dispatcher never materialises a (B, H, Nq, Nk) mask from a small one."""
    q, k, v = data(9).qkv(3, 4, 4, 50, 60, 8)
    kp = data(10).bools(3, 60)
    args = _dispatch._prepare(q, k, v, None, kp, False, None, "torch")
    assert args.mask.shape == (3, 1, 1, 60)
    args = _dispatch._prepare(q, k, v, data(11).bools(50, 60), kp, False, None, "torch")
    assert args.mask.shape == (3, 1, 50, 60)
    expanded = data(12).bools(1, 1, 1, 60).expand(3, 4, 50, 60)
    assert _torch_ops._compact(expanded).shape == (1, 1, 1, 60)


def test_noncontiguous_inputs(data, rel_err):
    q, k, v = data(13).qkv(2, 3, 3, 6, 7, 8)
    qt = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # stride(-1) != 1
    kt = k.transpose(1, 2).contiguous().transpose(1, 2)
    assert rel_err(attention(qt, kt, v), attention(q, k, v)) <= 1e-12


def test_sdpa_kernels_serve_the_torch_backend_where_they_apply(data, monkeypatch):
    calls = []
    sdpa = _torch_ops._SDPA_FWD
    monkeypatch.setattr(_torch_ops, "_SDPA_FWD", lambda *a, **kw: calls.append(1) or sdpa(*a, **kw))
    q, k, v = data(16).qkv(1, 4, 2, 6, 6, 8)
    attention(q, k, v, causal=True, mask=data(17).bools(6, 6))
    assert calls == [1]
    # bottom-right causal with Nq != Nk, ALiBi: the blockwise path, each (here one) query
    # block through SDPA with its bias
    attention(q[:, :, :5], k, v, causal=True)
    attention(q, k, v, mask=data(17).bools(6, 6), alibi_slopes=torch.ones(4, dtype=q.dtype))
    assert calls == [1, 1, 1]
    # what SDPA cannot take, or a window / segments: the plain blockwise path
    attention(q.half(), k.half(), v.half(), mask=torch.zeros(6, 6))  # fp32 bias on fp16
    attention(q, k, v, softcap=5.0)
    attention(q, k, v, dropout=0.5, key=torch.zeros(2, dtype=torch.int32))
    attention(q, k, v, window=2)
    assert calls == [1, 1, 1]


def test_default_backend_on_cpu_is_torch(data, monkeypatch):
    calls = []
    fwd = _torch_ops.fwd
    monkeypatch.setattr(_torch_ops, "fwd", lambda *a, **kw: calls.append(1) or fwd(*a, **kw))
    q, k, v = data(14).qkv(1, 2, 2, 3, 3, 4, torch.float32)
    attention(q, k, v)
    assert calls == [1]
    assert _dispatch._resolve_backend(None, q) == "torch"


def test_reference_lse(data, rel_err):
    q, k, v = data(15).qkv(1, 2, 1, 4, 6, 8)
    o, lse = reference_attention(q, k, v, scale=0.3, return_lse=True)
    s = 0.3 * q @ k.repeat_interleave(2, 1).transpose(-1, -2)
    assert rel_err(lse, torch.logsumexp(s, -1)) <= 1e-14
    assert rel_err(o, torch.softmax(s, -1) @ v.repeat_interleave(2, 1)) <= 1e-14


def band_mask(Nq, Nk, causal, window):
    """The allowed (query, key) pairs of ``causal`` and ``window``, built independently of
    the library: query i sits at position i + Nk - Nq."""
    left, right = (window, window) if isinstance(window, int) else window
    allowed = torch.ones(Nq, Nk, dtype=torch.bool)
    for i in range(Nq):
        pos = i + Nk - Nq
        for j in range(Nk):
            if (causal and j > pos) or (left is not None and j < pos - left) or (
                    right is not None and j > pos + right):
                allowed[i, j] = False
    return allowed


@given(Nq=st.integers(1, 40), Nk=st.integers(1, 40), causal=st.booleans(),
       window=st.sampled_from(WINDOWS[2:] + [(0, 0), (None, None), 39, (1, 100)]),
       seed=st.integers(0, 2**16))
def test_window_is_the_band_mask(Nq, Nk, causal, window, seed, data, rel_err):
    """window=(left, right) == the explicit (Nq, Nk) band as a bool mask, in the reference
    and in the torch path (values and gradients), including rows the band leaves empty."""
    q, k, v = data(seed).qkv(1, 2, 1, Nq, Nk, 8)
    mask = band_mask(Nq, Nk, causal, window)
    ref = lambda q, k, v: reference_attention(q, k, v, mask=mask)  # noqa: E731
    for fn in (lambda q, k, v: reference_attention(q, k, v, causal=causal, window=window),
               lambda q, k, v: attention(q, k, v, causal=causal, window=window,
                                         backend="torch")):
        with torch_path(50):  # several query blocks
            o, vjp_fn = torch.func.vjp(fn, q, k, v)
            grads = vjp_fn(torch.ones_like(o))
        o_ref, vjp_ref = torch.func.vjp(ref, q, k, v)
        assert not o.isnan().any() and rel_err(o, o_ref) <= 1e-12
        for g, g_ref in zip(grads, vjp_ref(torch.ones_like(o))):
            assert rel_err(g, g_ref) <= 1e-12


def test_window_skips_the_keys_outside_the_band():
    """The blockwise path visits only key ranges the band reaches: O(Nq * width) scores."""
    q, k = torch.zeros(1, 1, 4096, 8), torch.zeros(1, 1, 4096, 8)
    for causal, window, width in [(True, (63, -1), 64), (False, (10, 20), 31)]:
        layout = _torch_ops._Layout(q, k, None, causal, 1.0, window)
        spans = [(i1 - i0, k1 - k0) for i0, i1, k0, k1 in layout.blocks()]
        assert sum(n for n, _ in spans) == 4096
        assert all(nk <= n + width - 1 for n, nk in spans)
        assert sum(n * nk for n, nk in spans) < 4096 * 4096 // 16


def _ids(kind, B, N, g):
    """(B, N) segment ids: "packed" contiguous documents, or "random" ids in {0, 1, 2}."""
    if kind == "packed":
        cuts = torch.sort(torch.randint(0, N + 1, (B, 3), generator=g), -1).values
        return (torch.arange(N)[None, :, None] >= cuts[:, None, :]).sum(-1)
    return torch.randint(0, 3, (B, N), generator=g)


@given(Nq=st.integers(1, 40), Nk=st.integers(1, 40), causal=st.booleans(),
       kind=st.sampled_from(["packed", "random"]), window=st.sampled_from([None, 3, (5, None)]),
       seed=st.integers(0, 2**16))
def test_segment_ids_are_the_mask_of_equal_ids(Nq, Nk, causal, kind, window, seed, data,
                                                rel_err):
    """segment_ids == the (B, 1, Nq, Nk) mask ``q_ids[i] == kv_ids[j]``, in the reference and
    in the torch path (values, vjp and jvp), combined with causal and a window."""
    q, k, v = data(seed).qkv(2, 2, 1, Nq, Nk, 8)
    g = torch.Generator().manual_seed(seed)
    q_ids = _ids(kind, 2, Nq, g)
    kv_ids = q_ids if Nq == Nk and kind == "packed" else _ids(kind, 2, Nk, g)
    ids = q_ids if kv_ids is q_ids else (q_ids, kv_ids)
    same = (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]
    ref = lambda q, k, v: reference_attention(q, k, v, mask=same, causal=causal,  # noqa: E731
                                              window=window)
    tangents = tuple(torch.ones_like(x) for x in (q, k, v))
    o_ref, vjp_ref = torch.func.vjp(ref, q, k, v)
    _, t_ref = torch.func.jvp(ref, (q, k, v), tangents)
    for fn in (lambda q, k, v: reference_attention(q, k, v, causal=causal, window=window,
                                                   segment_ids=ids),
               lambda q, k, v: attention(q, k, v, causal=causal, window=window, segment_ids=ids,
                                         backend="torch")):
        with torch_path(50):  # several query blocks
            o, vjp_fn = torch.func.vjp(fn, q, k, v)
            grads = vjp_fn(torch.ones_like(o))
            _, t = torch.func.jvp(fn, (q, k, v), tangents)
        assert not o.isnan().any() and rel_err(o, o_ref) <= 1e-12
        assert rel_err(t, t_ref) <= 1e-12
        for a, b in zip(grads, vjp_ref(torch.ones_like(o))):
            assert rel_err(a, b) <= 1e-12


def test_vmap_over_per_sample_segment_ids_equals_loop(data, rel_err):
    """Per-example packings (ids batched under vmap) == a loop over the examples."""
    q, k, v = data(5).qkv(3, 2, 2, 24, 24, 8)  # dim 0: the vmapped examples
    g = torch.Generator().manual_seed(5)
    ids = _ids("packed", 3, 24, g)  # (3, 24): one packing per example

    def per_example(q, k, v, ids):  # one example: (1, H, N, D), ids (1, N)
        return attention(q[None], k[None], v[None], causal=True, segment_ids=ids[None],
                         backend="torch")[0]

    out = torch.func.vmap(per_example)(q, k, v, ids)
    grads = torch.func.vmap(torch.func.grad(lambda *a: per_example(*a).sum(), argnums=(0, 1, 2)))(
        q, k, v, ids)
    for i in range(3):
        assert rel_err(out[i], per_example(q[i], k[i], v[i], ids[i])) <= 1e-12
        single = torch.func.grad(lambda *a: per_example(*a).sum(), argnums=(0, 1, 2))(
            q[i], k[i], v[i], ids[i])
        for a, b in zip(grads, single):
            assert rel_err(a[i], b) <= 1e-12


def test_segments_skip_the_other_documents():
    """Packed documents of 256: the blockwise path visits about one document per block."""
    ids = (torch.arange(4096) // 256)[None]  # (1, 4096), 16 documents
    q = torch.zeros(1, 1, 4096, 8)
    layout = _torch_ops._Layout(q, q, None, True, 1.0, (-1, -1), (ids, ids))
    scores = sum((i1 - i0) * (k1 - k0) for i0, i1, k0, k1 in layout.blocks())
    assert scores <= 4096 * 512  # vs 4096 * 4096 / 2 causal without segments


@given(Nq=st.integers(1, 40), Nk=st.integers(1, 40), causal=st.booleans(),
       softcap=st.sampled_from([0.3, 2.0, 50.0]), mask=st.sampled_from(["none", "additive"]),
       seed=st.integers(0, 2**16))
def test_softcap_is_tanh_of_the_scaled_scores(Nq, Nk, causal, softcap, mask, seed, data,
                                               rel_err):
    """softcap == ``softcap * tanh(scale q k^T / softcap)`` before the mask, written out with
    autograd: the torch path (values, vjp, jvp) and the reference's hand-written vjp
    (which second order differentiates)."""
    from torchfn.kernels._reference import attention_vjp

    q, k, v = (3 * x for x in data(seed).qkv(1, 2, 1, Nq, Nk, 8))  # large scores: the cap bites
    kw = {}
    if mask == "additive":
        kw["mask"] = data(seed + 1).normal(1, 1, Nq, Nk)
    scale = 8 ** -0.5

    def written_out(q, k, v):
        kr, vr = k.expand(-1, 2, -1, -1), v.expand(-1, 2, -1, -1)
        s = softcap * torch.tanh(scale * q @ kr.transpose(-1, -2) / softcap)
        if "mask" in kw:
            s = s + kw["mask"]
        if causal:
            i = torch.arange(Nq)[:, None] + Nk - Nq
            s = s.masked_fill(torch.arange(Nk) > i, float("-inf"))
        dead = (s == float("-inf")).all(-1, keepdim=True)  # a row with no key: output 0
        return (torch.softmax(s.masked_fill(dead, 0.0), -1) * ~dead) @ vr

    do = data(seed + 2).normal(1, 2, Nq, 8)
    tangents = tuple(torch.ones_like(x) for x in (q, k, v))
    o_ref, vjp_ref = torch.func.vjp(written_out, q, k, v)
    g_ref = vjp_ref(do)
    _, t_ref = torch.func.jvp(written_out, (q, k, v), tangents)
    ours = lambda q, k, v: attention(q, k, v, causal=causal, softcap=softcap,  # noqa: E731
                                     backend="torch", **kw)
    with torch_path(50):
        o, vjp_fn = torch.func.vjp(ours, q, k, v)
        g = vjp_fn(do)
        _, t = torch.func.jvp(ours, (q, k, v), tangents)
    assert rel_err(o, o_ref) <= 1e-12 and rel_err(t, t_ref) <= 1e-12
    hand = attention_vjp(q, k, v, do, kw.get("mask"), causal, scale, softcap=softcap)
    for a, b, c in zip(g, hand, g_ref):
        assert rel_err(a, c) <= 1e-12 and rel_err(b, c) <= 1e-12
