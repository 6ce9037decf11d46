"""``attention`` under every transform, for each backend, equals the float64 reference.

The torch backend runs in float64 (tight tolerances, plus ``gradcheck``), once with
Nq != Nk (its blockwise path) and once with Nq == Nk (SDPA's fused CPU kernels); the
Triton backend runs in float32 (in the Triton interpreter on CPU, so sizes are tiny)
and is held to the fp32 contract, 1e-5 (second order, computed by fp32 torch math: 1e-4).
"""

import importlib.util

import pytest
import torch
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vmap

from torchfn import random
from torchfn.kernels import _dropout, _second_order, attention, reference_attention

# B=1, H=2 query heads on Hkv=1 kv head (GQA), Nq <= Nk=7, odd D, causal + bool mask
# (and, in the window variants, a sliding window of 2 keys left of the diagonal)
B, H, HKV, NK, D = 1, 2, 1, 7, 6
HAS_TRITON = all(importlib.util.find_spec(m) for m in ("triton", "torchfn.kernels._triton_ops"))
NEEDS_TRITON = pytest.mark.skipif(not HAS_TRITON, reason="triton or _triton_ops is missing")
VARIANTS = [
    # (backend, Nq, deterministic, window, packed segment ids, softcap, dropout, ALiBi)
    # Nq != Nk: the blockwise path; Nq == Nk: SDPA's kernels
    pytest.param(("torch", 5, True, None, False, None, 0.0, False), id="torch-blockwise"),
    pytest.param(("torch", NK, True, None, False, None, 0.0, False), id="torch-sdpa"),
    pytest.param(("torch", 5, True, (2, None), False, None, 0.0, False), id="torch-window"),
    pytest.param(("torch", 5, True, None, True, None, 0.0, False), id="torch-segments"),
    pytest.param(("torch", 5, True, None, False, 1.5, 0.0, False), id="torch-softcap"),
    pytest.param(("torch", NK, True, None, False, None, 0.3, False), id="torch-dropout"),
    pytest.param(("torch", 5, True, None, False, None, 0.0, True), id="torch-alibi"),
    pytest.param(("triton", 5, True, None, False, None, 0.0, False), id="triton",
                 marks=NEEDS_TRITON),
    # dQ added with atomics inside the dK/dV kernel
    pytest.param(("triton", 5, False, None, False, None, 0.0, False), id="triton-atomic-dq",
                 marks=NEEDS_TRITON),
    pytest.param(("triton", 5, True, (2, None), False, None, 0.0, False), id="triton-window",
                 marks=NEEDS_TRITON),
    pytest.param(("triton", 5, True, None, True, None, 0.0, False), id="triton-segments",
                 marks=NEEDS_TRITON),
    pytest.param(("triton", 5, True, None, False, 1.5, 0.0, False), id="triton-softcap",
                 marks=NEEDS_TRITON),
    pytest.param(("triton", 5, True, None, False, None, 0.3, False), id="triton-dropout",
                 marks=NEEDS_TRITON),
    pytest.param(("triton", 5, True, None, False, None, 0.0, True), id="triton-alibi",
                 marks=NEEDS_TRITON),
]
KEY = random.key(7)  # the dropout variants' key
KV_IDS = torch.tensor([[0, 0, 0, 1, 1, 1, 1]])  # two packed documents of the Nk = 7 keys


@pytest.fixture(scope="module", params=VARIANTS)
def case(request):
    """Inputs, mask (one fully masked row), and the attention of each backend + reference."""
    attn_backend, nq, deterministic, window, packed, softcap, dropout, alibi = request.param
    key = KEY if dropout else None
    slopes = torch.tensor([0.5, 0.125]) if alibi else None  # (H,)
    ids = (KV_IDS[:, NK - nq:], KV_IDS) if packed else None  # the queries: the last nq
    g = torch.Generator().manual_seed(11)
    dtype = torch.float64 if attn_backend == "torch" else torch.float32

    def normal(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    mask = torch.rand(B, 1, nq, NK, generator=g) < 0.8
    mask[..., 1, :] = False  # query 1 sees no key
    mask[..., 2, :4] = True  # query 2 keeps its causally visible keys

    def ours(q, k, v):
        return attention(q, k, v, mask=mask, causal=True, window=window, segment_ids=ids,
                         softcap=softcap, dropout=dropout, key=key, alibi_slopes=slopes,
                         backend=attn_backend, deterministic=deterministic)

    def ref(q, k, v):
        return reference_attention(q.double(), k.double(), v.double(), mask=mask, causal=True,
                                   window=window, segment_ids=ids, softcap=softcap,
                                   dropout=dropout, key=key, alibi_slopes=slopes)

    tol = 1e-10 if attn_backend == "torch" else 1e-5
    return dict(
        qkv=(normal(B, H, nq, D), normal(B, HKV, NK, D), normal(B, HKV, NK, D)),
        w=normal(B, H, nq, D),  # a random readout, so no gradient is trivially 0
        normal=normal,
        ours=ours,
        ref=ref,
        tol=tol,
        tol2=1e-10 if attn_backend == "torch" else 1e-4,
        backend=attn_backend,
        deterministic=deterministic,
        nq=nq,
        window=window,
        # the raw ops' normalised (left, right) (see _dispatch._normalize_window)
        window_args=(-1, -1) if window is None else (window[0], -1),
        ids=ids,
        softcap=softcap,
        dropout=dropout,
        key=key,
        slopes=slopes,
    )


def loss_of(fn, w):
    return lambda q, k, v: (fn(q, k, v) * w).sum()


def test_grad(case, rel_err):
    q, k, v = case["qkv"]
    ours = grad(loss_of(case["ours"], case["w"]), argnums=(0, 1, 2))(q, k, v)
    ref = grad(loss_of(case["ref"], case["w"].double()), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(ours, ref):
        assert a.dtype == q.dtype and rel_err(a, b) <= case["tol"]
    assert ours[0][..., 1, :].eq(0).all()  # the fully masked row gets no gradient


def test_vmap_grad_per_sample_equals_loop(case, rel_err):
    """Per-sample gradients of a projection through attention: vmap(grad) == a loop."""
    normal, w = case["normal"], case["w"]
    params = {n: normal(D, D) for n in ("wq", "wk", "wv")}
    xs = normal(3, B, H, NK, D)  # 3 samples

    def loss(params, x):
        q = x[:, :, NK - case["nq"] :] @ params["wq"]
        k, v = x[:, :HKV] @ params["wk"], x[:, :HKV] @ params["wv"]
        return (case["ours"](q, k, v) * w).sum()

    batched = vmap(grad(loss), in_dims=(None, 0))(params, xs)
    for i in range(xs.shape[0]):
        single = grad(loss)(params, xs[i])
        for n in params:
            assert rel_err(batched[n][i], single[n]) <= case["tol"]
    assert batched["wq"].abs().amax() > 0


def test_vmap_forward_in_dims_and_batched_mask(case, rel_err):
    """vmap over k only, and over a per-sample key-padding mask, == a loop."""
    q, k, v = case["qkv"]
    ks = case["normal"](2, B, HKV, NK, D)
    out = vmap(case["ours"], in_dims=(None, 0, None))(q, ks, v)
    for i in range(2):
        assert rel_err(out[i], case["ref"](q, ks[i], v)) <= case["tol"]
    kps = torch.tensor([[True] * NK, [True, False] * 3 + [True]]).unsqueeze(1)  # (2, B, Nk)
    fn = lambda kp: attention(q, k, v, key_padding_mask=kp, backend=case["backend"])  # noqa: E731
    out = vmap(fn)(kps)
    for i in range(2):
        ref = reference_attention(q.double(), k.double(), v.double(), key_padding_mask=kps[i])
        assert rel_err(out[i], ref) <= case["tol"]


def test_grad_of_vmap_and_vmap_of_vmap(case, rel_err):
    """vmap inside grad (the vmap rule applies the Functions again under grad) and vmap of
    vmap (it folds twice) == loops."""
    q, k, v = case["qkv"]
    normal, w, ours, ref = case["normal"], case["w"], case["ours"], case["ref"]
    ks = normal(2, B, HKV, NK, D)

    def batched(q, ks):
        return (vmap(ours, in_dims=(None, 0, None))(q, ks, v) * w).sum()

    def looped(q, ks):
        return sum((ref(q, ks[i], v) * w.double()).sum() for i in range(ks.shape[0]))

    got = grad(batched, argnums=(0, 1))(q, ks)
    want = grad(looped, argnums=(0, 1))(q.double(), ks.double())
    for a, b in zip(got, want):
        assert rel_err(a, b) <= case["tol"]
    assert got[1][1].abs().amax() > 0  # the second sample's keys get a gradient

    qs = normal(2, 3, *q.shape)
    out = vmap(vmap(ours, in_dims=(0, None, None)), in_dims=(0, None, None))(qs, k, v)
    assert out.shape == (2, 3, *q.shape)
    for i in range(2):
        for j in range(3):
            assert rel_err(out[i, j], ref(qs[i, j], k, v)) <= case["tol"]


def test_jacrev(case, rel_err):
    q, k, v = case["qkv"]
    # a small output (B, H, Nq) keeps the number of vmapped cotangents down
    ours = jacrev(lambda q: case["ours"](q, k, v).sum(-1))(q)
    ref = jacrev(lambda q: case["ref"](q, k, v).sum(-1))(q.double())
    assert ours.shape == (B, H, case["nq"], B, H, case["nq"], D)
    assert rel_err(ours, ref) <= case["tol"]


def test_jacfwd(case, rel_err):
    """jacfwd in 3 directions moving q, k and v at once (all tangents batched)."""
    q, k, v = case["qkv"]
    normal = case["normal"]
    qkv, dirs = (q, k, v), (normal(*q.shape), normal(*k.shape), normal(*v.shape))

    def along(fn, x):
        moved = (p.to(x.dtype) + x[i] * d.to(x.dtype) for i, (p, d) in enumerate(zip(qkv, dirs)))
        return fn(*moved).sum(-1)

    x0 = torch.zeros(3, dtype=q.dtype)
    ours = jacfwd(lambda x: along(case["ours"], x))(x0)
    ref = jacfwd(lambda x: along(case["ref"], x))(x0.double())
    assert ours.shape == (B, H, case["nq"], 3)
    assert rel_err(ours, ref) <= case["tol"]
    if case["backend"] == "torch":  # the full Jacobian wrt v too (cheap here)
        ours = jacfwd(lambda v: case["ours"](q, k, v))(v)
        ref = jacfwd(lambda v: case["ref"](q, k, v))(v)
        assert rel_err(ours, ref) <= case["tol"]


def test_jvp_is_right_not_zero(case, rel_err):
    q, k, v = case["qkv"]
    normal = case["normal"]
    tangents = (normal(*q.shape), normal(*k.shape), normal(*v.shape))
    o, t = jvp(case["ours"], (q, k, v), tangents)
    o_ref, t_ref = jvp(case["ref"], (q.double(), k.double(), v.double()),
                       tuple(x.double() for x in tangents))
    assert rel_err(o, o_ref) <= case["tol"]
    assert rel_err(t, t_ref) <= case["tol"]
    assert t_ref.abs().amax() > 0.1 and t.abs().amax() > 0.1
    # one tangent at a time (the others None inside the fused jvp)
    for i in range(3):
        only = tuple(x if j == i else torch.zeros_like(x) for j, x in enumerate(tangents))
        _, t_i = jvp(case["ours"], (q, k, v), only)
        _, t_i_ref = jvp(case["ref"], (q.double(), k.double(), v.double()),
                         tuple(x.double() for x in only))
        assert rel_err(t_i, t_i_ref) <= case["tol"]


def test_hessian(case, rel_err):
    """Hessian of a scalar in a few directions of q and k (forward-over-reverse)."""
    q, k, v = case["qkv"]
    normal, w = case["normal"], case["w"]
    dq, dk = normal(2, *q.shape), normal(2, *k.shape)

    def scalar(fn, x):
        qx = q.to(x.dtype) + torch.einsum("i,i...->...", x[:2], dq.to(x.dtype))
        kx = k.to(x.dtype) + torch.einsum("i,i...->...", x[2:], dk.to(x.dtype))
        return (fn(qx, kx, v.to(x.dtype)) * w.to(x.dtype)).sum()

    x0 = torch.zeros(4, dtype=q.dtype) + 0.1
    ours = hessian(lambda x: scalar(case["ours"], x))(x0)
    ref = hessian(lambda x: scalar(case["ref"], x))(x0.double())
    assert rel_err(ours, ref) <= case["tol2"]
    assert torch.allclose(ours, ours.T, atol=10 * case["tol2"])


def gradient_dot(fn, w, dirs):
    """(q, k, v) -> the gradient of ``loss_of(fn, w)`` dotted with ``dirs(q, k, v)``:
    a scalar whose gradient is a second derivative (grad-of-grad)."""
    inner = grad(loss_of(fn, w), argnums=(0, 1, 2))
    return lambda q, k, v: sum((g * c).sum() for g, c in zip(inner(q, k, v), dirs(q, k, v)))


def test_grad_of_grad(case, rel_err):
    q, k, v = case["qkv"]
    u = case["normal"](*q.shape)
    ours = grad(gradient_dot(case["ours"], case["w"], lambda q, k, v: (u, k, v)),
                argnums=(0, 1, 2))(q, k, v)
    ref = grad(gradient_dot(case["ref"], case["w"].double(), lambda q, k, v: (u.double(), k, v)),
               argnums=(0, 1, 2))(q.double(), k.double(), v.double())
    for a, b in zip(ours, ref):
        assert rel_err(a, b) <= case["tol2"]


def tangent_readout(fn, w, tq, tv):
    """(q, k, v) -> a scalar of attention's output and of its jvp along (tq, cos k, tv):
    its gradient runs reverse mode over forward mode (MeanFlow's loss does this)."""

    def scalar(q, k, v):
        o, to = jvp(fn, (q, k, v), (tq.to(q.dtype), torch.cos(k), tv.to(q.dtype)))
        return (to * w.to(q.dtype)).sum() + (torch.tanh(o) * to).sum()

    return scalar


def test_grad_of_jvp(case, rel_err):
    """grad of a function of the jvp's tangent: the tangent's own derivatives in q, k, v
    (the Hessian of <g, attention> along the tangents) and its pullback to them."""
    q, k, v = case["qkv"]
    tq, tv = case["normal"](*q.shape), case["normal"](*v.shape)
    ours = grad(tangent_readout(case["ours"], case["w"], tq, tv), argnums=(0, 1, 2))(q, k, v)
    ref = grad(tangent_readout(case["ref"], case["w"].double(), tq.double(), tv.double()),
               argnums=(0, 1, 2))(q.double(), k.double(), v.double())
    for a, b in zip(ours, ref):
        assert rel_err(a, b) <= case["tol2"]


def test_vmap_of_grad_of_jvp_equals_loop(case, rel_err):
    if case["backend"] == "triton":
        pytest.skip("the torch backends cover the vmap rule of the jvp Function; the "
                    "interpreter is slow")
    q, k, v = case["qkv"]
    tq, tv = case["normal"](*q.shape), case["normal"](*v.shape)
    qs = torch.stack([q, q.flip(-1), 0.5 * q])  # 3 examples of q, shared k, v

    def one(qi):
        return grad(tangent_readout(case["ours"], case["w"], tq, tv))(qi, k, v)

    assert rel_err(vmap(one)(qs), torch.stack([one(x) for x in qs])) <= case["tol"]


def test_backward_through_a_forward_mode_tangent(case, rel_err):
    """torch.autograd.forward_ad's dual tensors, then loss.backward() on the tangent (of
    a sum: an expanded cotangent). The reference is torch.func's grad-of-jvp of the
    materialised attention: its own dual-tensor backward fails in torch (softmax's
    forward AD leaves a tensor modified in place that the backward needs)."""
    import torch.autograd.forward_ad as fwAD

    q, k, v = (x.clone().requires_grad_(True) for x in case["qkv"])
    tq = case["normal"](*q.shape)
    with fwAD.dual_level():  # (the backward after the level: torch nests no dual levels)
        to = fwAD.unpack_dual(case["ours"](fwAD.make_dual(q, tq), k, v)).tangent
    to.sum().backward()

    def tangent_sum(q, k, v):
        return jvp(lambda q: case["ref"](q, k, v), (q,), (tq.double(),))[1].sum()

    want = grad(tangent_sum, argnums=(0, 1, 2))(*(x.detach().double() for x in case["qkv"]))
    for a, b in zip((q.grad, k.grad, v.grad), want):
        assert rel_err(a, b) <= case["tol2"]


def test_hvp_and_grad_of_grad_one_query_row_at_a_time(case, rel_err, monkeypatch):
    """With the second-order formula run one query row per block (``_second_order``),
    a Hessian-vector product (forward-over-reverse) and grad-of-grad == the reference's:
    row offsets of the causal band, window, ALiBi, dropout and segments all carried."""
    monkeypatch.setattr(_second_order, "_BUDGET", 1)
    q, k, v = case["qkv"]
    normal, w = case["normal"], case["w"]
    tangents = (normal(*q.shape), normal(*k.shape), normal(*v.shape))

    def hvp(fn, w, primals, tangents):
        return jvp(grad(loss_of(fn, w), argnums=(0, 1, 2)), primals, tangents)[1]

    ours = hvp(case["ours"], w, (q, k, v), tangents)
    ref = hvp(case["ref"], w.double(), (q.double(), k.double(), v.double()),
              tuple(t.double() for t in tangents))
    for a, b in zip(ours, ref):
        assert rel_err(a, b) <= case["tol2"]
    assert ref[1].abs().amax() > 0  # k's second derivative is not trivially zero

    ours = grad(gradient_dot(case["ours"], w, lambda *_: tangents), argnums=(0, 1, 2))(q, k, v)
    doubles = tuple(t.double() for t in tangents)
    ref = grad(gradient_dot(case["ref"], w.double(), lambda *_: doubles),
               argnums=(0, 1, 2))(q.double(), k.double(), v.double())
    for a, b in zip(ours, ref):
        assert rel_err(a, b) <= case["tol2"]


def test_raw_ops_vmap_rules_equal_loops():
    """The custom ops' own vmap rules (what ``_AttentionCompiled`` and the fused jvp
    under ``jacfwd`` reach), called with their optional arguments left out, a mask
    batched and k shared: == a loop of the ops."""
    from torchfn.kernels._autograd import attention_bwd, attention_fwd, attention_jvp

    g = torch.Generator().manual_seed(5)
    q, do, tq = (torch.randn(3, 2, 2, 4, 5, generator=g, dtype=torch.float64) for _ in "abc")
    k, v = (torch.randn(2, 1, 6, 5, generator=g, dtype=torch.float64) for _ in "kv")
    mask = torch.rand(3, 1, 1, 4, 6, generator=g) < 0.7  # (V, b = 1 of B = 2, h, Nq, Nk)
    scale = 0.4

    def fwd(q, mask):
        return attention_fwd(q, k, v, mask, True, scale, "torch")

    def bwd(q, mask, do):
        o, lse = fwd(q, mask)
        return attention_bwd(q, k, v, o, lse, do, mask, True, scale, "torch")

    def tangent(q, mask, tq):
        return attention_jvp(q, k, v, tq, None, None, mask, True, scale, "torch")

    for fn, args in ((fwd, (q, mask)), (bwd, (q, mask, do)), (tangent, (q, mask, tq))):
        mapped = torch.func.vmap(fn)(*args)
        for i in range(q.shape[0]):
            for a, b in zip(mapped, fn(*(x[i] for x in args))):
                torch.testing.assert_close(a[i], b, rtol=1e-12, atol=1e-12)


def test_opcheck(case):
    """The raw custom ops pass torch.library.opcheck (schema, fake tensors, aot dispatch)."""
    q, k, v = case["qkv"]
    normal, be = case["normal"], case["backend"]
    mask = torch.rand(B, 1, case["nq"], NK, generator=torch.Generator().manual_seed(1)) < 0.7
    seeds = _dropout.seeds(KEY, B, H) if case["dropout"] else None
    slopes = None if case["slopes"] is None else case["slopes"].to(q.dtype).expand(B, H)
    win = (*case["window_args"], *(case["ids"] or (None, None)), case["softcap"] or 0.0,
           case["dropout"], seeds)
    o, lse = torch.ops.torchfn.attention_fwd(q, k, v, mask, True, 0.4, be, *win, slopes)
    ops = torch.ops.torchfn
    torch.library.opcheck(ops.attention_fwd.default,
                          (q, k, v, mask, True, 0.4, be, *win, slopes))
    torch.library.opcheck(
        ops.attention_bwd.default,
        (q, k, v, o, lse, normal(*q.shape), mask, True, 0.4, be, case["deterministic"], *win,
         None, slopes),
    )
    tq, tv = normal(*q.shape), normal(*v.shape)
    torch.library.opcheck(ops.attention_jvp.default,
                          (q, k, v, tq, None, tv, None, False, 0.4, be, *win, slopes))


def test_torch_compile_forward_backward(case, rel_err):
    """torch.compile(f) forward + backward == eager (the jvp-free twin Function).

    Inductor builds the torch backend's graphs (its C++ for the blockwise loop and the
    Philox hash is what could go wrong) and the plain Triton case's (custom ops in an
    inductor graph). To inductor the other Triton variants are the same opaque ops with
    other arguments, so they run under aot_eager: dynamo, fake kernels and AOT autograd,
    without another C++ build each (the dropout one took 16-20 s on 2 cores)."""
    torch._dynamo.reset()
    q, k, v = (x.detach().clone().requires_grad_() for x in case["qkv"])
    loss = loss_of(case["ours"], case["w"])
    plain = case["window"] is None and case["ids"] is None and case["softcap"] is None \
        and not case["dropout"] and case["slopes"] is None and case["deterministic"]
    backend = "inductor" if case["backend"] == "torch" or plain else "aot_eager"
    compiled = torch.compile(loss, fullgraph=True, backend=backend)
    value = compiled(q, k, v)
    grads = torch.autograd.grad(value, (q, k, v))
    ref_value = loss(q, k, v)
    ref_grads = torch.autograd.grad(ref_value, (q, k, v))
    assert rel_err(value, ref_value) <= case["tol"]
    for a, b in zip(grads, ref_grads):
        assert rel_err(a, b) <= case["tol"]


def test_torch_compile_of_func_grad(case, rel_err):
    """compile(grad(f)): dynamo cannot trace the Function inside torch.func, so attention
    runs eagerly inside the compiled step, and the result is right."""
    if case["backend"] != "torch":
        pytest.skip("the torch backend covers the compile(grad) wiring; the interpreter is slow")
    torch._dynamo.reset()
    q, k, v = case["qkv"]
    f = grad(loss_of(case["ours"], case["w"]))
    assert rel_err(torch.compile(f)(q, k, v), f(q, k, v)) <= case["tol"]


def test_gradcheck_and_gradgradcheck_float64(case):
    if case["backend"] != "torch":
        pytest.skip("gradcheck needs float64, which only the torch backend supports")
    q, k, v = (x[:, :, :4, :3].detach().clone().requires_grad_() for x in case["qkv"])
    mask = torch.tensor([[True, False, True, True]] * 3 + [[False] * 4])  # last row fully masked

    def fn(q, k, v):
        ids = None if case["ids"] is None else tuple(x[:, :4] for x in case["ids"])
        return attention(q, k, v, mask=mask, scale=0.7, window=case["window"], segment_ids=ids,
                         softcap=case["softcap"], dropout=case["dropout"], key=case["key"],
                         alibi_slopes=case["slopes"], backend="torch")

    assert torch.autograd.gradcheck(fn, (q, k, v))
    assert torch.autograd.gradgradcheck(fn, (q, k, v))
    assert torch.autograd.gradcheck(
        fn, (q, k, v), check_forward_ad=True, check_backward_ad=False, check_undefined_grad=False,
        check_batched_grad=False,
    )
