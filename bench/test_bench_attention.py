"""CPU attention: torchfn's PyTorch path vs ``F.scaled_dot_product_attention``.

Run (about a minute):
    .venv/bin/pytest bench/test_bench_attention.py --benchmark-only -q -p no:randomly \\
        --benchmark-columns=min,median,mean

Groups, each torchfn next to its peer:
- ``forward`` / ``forward+backward``: B=4, H=8, D=64, fp32, N in {256, 1024}, causal on/off.
  ``torchfn`` is the default CPU path (SDPA's fused CPU kernels behind torchfn's custom
  ops); at N=256 ``torchfn-blockwise`` is its own blockwise path (CUDA without Triton,
  causal with Nq != Nk, fp32 bias on fp16 inputs, and every jvp run it).
- ``sliding window``: B=1, H=8, D=64, N=4096, causal with a window of 256 keys
  (Mistral-style): torchfn's ``window=(255, None)``, which skips the key blocks outside
  the band, vs SDPA with the band as a dense bool mask (it scores every key), and SDPA
  plain causal for scale.
- ``packed documents``: the same shapes, causal, 16 documents of 256 tokens packed
  into one sequence: torchfn's ``segment_ids`` vs SDPA with the block-diagonal causal
  mask as a dense bool tensor.
- ``softcap``: the same shapes at N=2048, causal, logits soft-capped at 30: torchfn's
  ``softcap`` vs the materialised attention one writes without a kernel (SDPA has none).
- ``dropout``: the same shapes at N=2048, causal, attention dropout 0.1: torchfn's keyed
  ``dropout`` (mask recomputed blockwise from the key, never stored) vs the materialised
  attention with the same keyed mask (``reference_attention``) and SDPA's ``dropout_p``
  (torch's global RNG: a different mask, so it is timed, not compared).
- ``alibi``: the same shapes at N=2048, causal, ALiBi slopes 2^-1..2^-8: torchfn's
  ``alibi_slopes`` (the bias made per block) vs SDPA given the bias as an additive float
  mask (H x N x N fp32, built once outside the timing, as SDPA users pass it).
- ``per-sample grads``: ``vmap(grad)`` of a 2-layer pre-LN Transformer (d=64, 4 heads,
  N=64, causal, batch 32) with its attention from torchfn vs from SDPA. SDPA's CPU
  kernels have no batching rule, so functorch runs them in a per-sample loop (it warns
  "There is a performance drop because we have not yet implemented the batching rule
  for aten::_scaled_dot_product_flash_attention_for_cpu[_backward]"); a plain Python
  loop of ``grad`` over the batch is the third entry.
- ``hvp``: a Hessian-vector product ``jvp(grad(loss))`` in q (B=1, H=8, D=64, N=2048,
  causal): torchfn (second order a block of query rows at a time) vs the materialised
  ``reference_attention`` under the same transforms (SDPA has no forward-mode AD), and
  vs torchfn with the whole formula as one block, as before the row blocks; and the
  same product as grad-of-grad (reverse over reverse). Peak memory is printed for each.
- ``jvp``: forward-mode AD through attention, ``jvp`` in (q, k, v) at the same shapes:
  torchfn's fused JVP (blockwise, the tangent's softmax terms carried with the
  output's) vs the materialised ``reference_attention`` under ``jvp``. SDPA has no
  forward-mode AD at all.
"""

import contextlib
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, jvp, vmap

from torchfn import random
from torchfn.kernels import _torch_ops, attention, reference_attention
from torchfn.kernels._reference import alibi_bias

B, H, D = 4, 8, 64


def torchfn_attention(q, k, v, causal):
    return attention(q, k, v, causal=causal, backend="torch")


def sdpa_attention(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def blockwise_attention(q, k, v, causal):
    old, _torch_ops._USE_SDPA = _torch_ops._USE_SDPA, False
    try:
        return attention(q, k, v, causal=causal, backend="torch")
    finally:
        _torch_ops._USE_SDPA = old


IMPLS = {"torchfn": torchfn_attention, "sdpa": sdpa_attention}
SHAPES = [(256, False), (256, True), (1024, False), (1024, True)]
CASES = [(impl, n, causal) for n, causal in SHAPES for impl in IMPLS] + [
    ("torchfn-blockwise", 256, causal) for causal in (False, True)
]
IMPLS["torchfn-blockwise"] = blockwise_attention


def _qkv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, n, D, generator=g) for _ in range(3))


@pytest.mark.parametrize("impl, n, causal", CASES)
def test_forward(benchmark, impl, n, causal):
    benchmark.group = f"forward N={n} causal={causal}"
    q, k, v = _qkv(n)
    with torch.no_grad():
        out = benchmark.pedantic(
            IMPLS[impl], args=(q, k, v, causal), rounds=8 if n <= 256 else 3, warmup_rounds=1
        )
        assert torch.allclose(out, sdpa_attention(q, k, v, causal), atol=1e-5)


@pytest.mark.parametrize("impl, n, causal", CASES)
def test_forward_backward(benchmark, impl, n, causal):
    benchmark.group = f"forward+backward N={n} causal={causal}"
    q, k, v = (x.requires_grad_() for x in _qkv(n))
    do = _qkv(n, seed=1)[0]

    def step():
        return torch.autograd.grad(IMPLS[impl](q, k, v, causal), (q, k, v), do)

    grads = benchmark.pedantic(
        step, rounds=5 if n <= 256 else 2, warmup_rounds=1 if n <= 256 else 0
    )
    ref = torch.autograd.grad(sdpa_attention(q, k, v, causal), (q, k, v), do)
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(grads, ref))


# ---------------------------------------------------------------- sliding window

WN, WW = 4096, 256  # sequence length, window (keys per query, itself included)


def _time_against(benchmark, fn, ref_fn, mode, n, seed, atol, scale=1.0, nk=None):
    """Time ``fn`` on (1, H, n, D) inputs (keys and values: ``nk`` rows, default n), forward
    or forward+backward, and check it equals ``ref_fn`` (skipped when ``ref_fn`` is None:
    a peer that computes something else)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(1, H, m, D, generator=g) * scale
                   for m in (n, nk or n, nk or n, n))
    if mode == "forward":
        with torch.no_grad():
            out = benchmark.pedantic(fn, args=(q, k, v), rounds=3, warmup_rounds=1)
            assert ref_fn is None or torch.allclose(out, ref_fn(q, k, v), atol=atol)
        return
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    grads = benchmark.pedantic(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do),
                               rounds=2, warmup_rounds=1)
    if ref_fn is not None:
        ref = torch.autograd.grad(ref_fn(q, k, v), (q, k, v), do)
        assert all(torch.allclose(a, b, atol=10 * atol) for a, b in zip(grads, ref))


def _band():
    i = torch.arange(WN)
    return (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - WW)  # (N, N)


WINDOW_IMPLS = {
    "torchfn window": lambda q, k, v: attention(q, k, v, causal=True, window=(WW - 1, None),
                                                backend="torch"),
    "sdpa band mask": lambda q, k, v: F.scaled_dot_product_attention(q, k, v,
                                                                     attn_mask=_band()),
    "sdpa causal (no window)": lambda q, k, v: F.scaled_dot_product_attention(q, k, v,
                                                                              is_causal=True),
}


@pytest.mark.parametrize("mode", ["forward", "forward+backward"])
@pytest.mark.parametrize("impl", list(WINDOW_IMPLS))
def test_sliding_window(benchmark, impl, mode):
    benchmark.group = f"sliding window N={WN} W={WW} {mode}"
    ref = None if impl.endswith("(no window)") else WINDOW_IMPLS["sdpa band mask"]
    _time_against(benchmark, WINDOW_IMPLS[impl], ref, mode, WN, seed=3, atol=1e-5)


# ---------------------------------------------------------------- packed documents

DOC = 256  # tokens per document; WN / DOC documents per sequence
DOC_IDS = (torch.arange(WN) // DOC)[None]  # (1, N)

PACKED_IMPLS = {
    "torchfn segment_ids": lambda q, k, v: attention(q, k, v, causal=True,
                                                     segment_ids=DOC_IDS, backend="torch"),
    "sdpa document mask": lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, attn_mask=(DOC_IDS[0, :, None] == DOC_IDS[0, None, :]) & _causal_mask()),
}


def _causal_mask():
    i = torch.arange(WN)
    return i[None, :] <= i[:, None]


@pytest.mark.parametrize("mode", ["forward", "forward+backward"])
@pytest.mark.parametrize("impl", list(PACKED_IMPLS))
def test_packed_documents(benchmark, impl, mode):
    benchmark.group = f"packed documents N={WN} doc={DOC} {mode}"
    _time_against(benchmark, PACKED_IMPLS[impl], PACKED_IMPLS["sdpa document mask"], mode, WN,
                  seed=4, atol=1e-5)


# ---------------------------------------------------------------- softcap

SN, CAP = 2048, 30.0


def _eager_softcap(q, k, v):
    s = (q @ k.transpose(-1, -2)) * D**-0.5
    s = (CAP * torch.tanh(s / CAP)).masked_fill(~torch.ones(SN, SN, dtype=torch.bool).tril(),
                                                float("-inf"))
    return torch.softmax(s, -1) @ v


SOFTCAP_IMPLS = {
    "torchfn softcap": lambda q, k, v: attention(q, k, v, causal=True, softcap=CAP,
                                                 backend="torch"),
    "eager softcap": _eager_softcap,
}


@pytest.mark.parametrize("mode", ["forward", "forward+backward"])
@pytest.mark.parametrize("impl", list(SOFTCAP_IMPLS))
def test_softcap(benchmark, impl, mode):
    benchmark.group = f"softcap N={SN} {mode}"
    _time_against(benchmark, SOFTCAP_IMPLS[impl], _eager_softcap, mode, SN, seed=5, atol=1e-4,
                  scale=4.0)


# ---------------------------------------------------------------- attention sinks

SINKS = torch.linspace(-1.0, 2.0, H)  # (H,): gpt-oss's learned logit per head


def _eager_sinks(q, k, v):
    """transformers' gpt-oss eager attention: the sink appended to each row's scores, a
    softmax over both, the sink's column dropped (SDPA has no sinks)."""
    s = (q @ k.transpose(-1, -2)) * D**-0.5
    s = s.masked_fill(~torch.ones(SN, SN, dtype=torch.bool).tril(), float("-inf"))
    s = torch.cat((s, SINKS[:, None, None].expand(*s.shape[:-1], 1)), -1)
    return torch.softmax(s, -1)[..., :-1] @ v


SINK_IMPLS = {
    "torchfn sinks": lambda q, k, v: attention(q, k, v, causal=True, sinks=SINKS,
                                               backend="torch"),
    "torchfn no sinks": lambda q, k, v: attention(q, k, v, causal=True, backend="torch"),
    "eager sinks": _eager_sinks,
}


@pytest.mark.parametrize("mode", ["forward", "forward+backward"])
@pytest.mark.parametrize("impl", list(SINK_IMPLS))
def test_sinks(benchmark, impl, mode):
    benchmark.group = f"sinks N={SN} {mode}"
    ref = None if impl == "torchfn no sinks" else _eager_sinks
    _time_against(benchmark, SINK_IMPLS[impl], ref, mode, SN, seed=8, atol=1e-4)


# ---------------------------------------------------------------- dropout

P_DROP, DROP_KEY = 0.1, random.key(0)
DROPOUT_IMPLS = {
    "torchfn dropout": lambda q, k, v: attention(q, k, v, causal=True, dropout=P_DROP,
                                                 key=DROP_KEY, backend="torch"),
    "eager keyed dropout": lambda q, k, v: reference_attention(q, k, v, causal=True,
                                                               dropout=P_DROP, key=DROP_KEY),
    "sdpa dropout_p": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                     dropout_p=P_DROP),
}


@pytest.mark.parametrize("mode", ["forward", "forward+backward"])
@pytest.mark.parametrize("impl", list(DROPOUT_IMPLS))
def test_dropout(benchmark, impl, mode):
    benchmark.group = f"dropout N={SN} {mode}"
    ref = DROPOUT_IMPLS["eager keyed dropout"] if impl != "sdpa dropout_p" else None
    _time_against(benchmark, DROPOUT_IMPLS[impl], ref, mode, SN, seed=6, atol=1e-4)


# ---------------------------------------------------------------- ALiBi

SLOPES = 2.0 ** -torch.arange(1, H + 1, dtype=torch.float32)  # (H,)


@functools.cache
def _alibi_mask():
    """(1, H, N, N) fp32: the ALiBi bias with the causal mask in it (128 MiB; made once)."""
    causal = torch.ones(SN, SN, dtype=torch.bool).tril()
    return alibi_bias(SLOPES[None], SN, SN).masked_fill(~causal, float("-inf"))


ALIBI_IMPLS = {
    "torchfn alibi_slopes": lambda q, k, v: attention(q, k, v, causal=True, alibi_slopes=SLOPES,
                                                      backend="torch"),
    "sdpa bias mask": lambda q, k, v: F.scaled_dot_product_attention(q, k, v,
                                                                     attn_mask=_alibi_mask()),
}


@pytest.mark.parametrize("mode", ["forward", "forward+backward"])
@pytest.mark.parametrize("impl", list(ALIBI_IMPLS))
def test_alibi(benchmark, impl, mode):
    benchmark.group = f"alibi N={SN} {mode}"
    _time_against(benchmark, ALIBI_IMPLS[impl], ALIBI_IMPLS["sdpa bias mask"], mode, SN,
                  seed=7, atol=1e-4)


# ---------------------------------------------------------------- causal, Nq != Nk

CQ, CK = 1024, 2048  # queries (the last CQ positions) and keys


@functools.cache
def _bottom_right():
    """(CQ, CK) bool: query i (at position i + CK - CQ) sees keys up to its position."""
    return torch.arange(CK)[None, :] <= torch.arange(CQ)[:, None] + (CK - CQ)


RECT_IMPLS = {
    "torchfn causal": lambda q, k, v: attention(q, k, v, causal=True, backend="torch"),
    "sdpa bottom-right mask": lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, attn_mask=_bottom_right()),
}


@pytest.mark.parametrize("mode", ["forward", "forward+backward"])
@pytest.mark.parametrize("impl", list(RECT_IMPLS))
def test_causal_fewer_queries_than_keys(benchmark, impl, mode):
    """Bottom-right causal with Nq != Nk (a chunk of queries after a prefix), which SDPA's
    ``is_causal`` (top-left) cannot say: its users pass the mask."""
    benchmark.group = f"causal Nq={CQ} Nk={CK} {mode}"
    _time_against(benchmark, RECT_IMPLS[impl], RECT_IMPLS["sdpa bottom-right mask"], mode, CQ,
                  seed=8, atol=1e-5, nk=CK)


# ---------------------------------------------------------------- values with their own head dim

MLA_N, MLA_D, MLA_DV = 1024, 192, 128  # DeepSeek's MLA: 192-dim queries/keys, 128-dim values


def _mla_qkv(requires_grad: bool, seed=10):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(1, H, MLA_N, d, generator=g)
                   for d in (MLA_D, MLA_D, MLA_DV, MLA_DV))
    return tuple(x.requires_grad_(requires_grad) for x in (q, k, v)), do


MLA_IMPLS = {
    "torchfn Dv != D": lambda q, k, v: attention(q, k, v, causal=True, backend="torch"),
    "sdpa Dv != D": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
}


@pytest.mark.parametrize("mode", ["forward", "forward+backward"])
@pytest.mark.parametrize("impl", list(MLA_IMPLS))
def test_value_head_dim(benchmark, impl, mode):
    """D = 192, Dv = 128: torchfn zero-pads v to 192 and runs its usual path; SDPA's CPU
    kernels take Dv != D too (no padding)."""
    benchmark.group = f"Dv != D (MLA 192/128) N={MLA_N} {mode}"
    fn, ref = MLA_IMPLS[impl], MLA_IMPLS["sdpa Dv != D"]
    (q, k, v), do = _mla_qkv(mode != "forward")
    if mode == "forward":
        with torch.no_grad():
            out = benchmark.pedantic(fn, args=(q, k, v), rounds=3, warmup_rounds=1)
            assert out.shape[-1] == MLA_DV and torch.allclose(out, ref(q, k, v), atol=1e-5)
        return
    grads = benchmark.pedantic(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do),
                               rounds=2, warmup_rounds=1)
    want = torch.autograd.grad(ref(q, k, v), (q, k, v), do)
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(grads, want))


# ---------------------------------------------------------------- per-sample gradients

D_MODEL, HEADS, N_TOK, BATCH, LAYERS = 64, 4, 64, 32, 2


def init_transformer(seed=0):
    """Parameters of a pre-LN Transformer: LAYERS x (attention + MLP), then a readout."""
    g = torch.Generator().manual_seed(seed)
    d = D_MODEL

    def w(*shape):
        return torch.randn(*shape, generator=g) / shape[0] ** 0.5

    layers = [
        dict(
            ln1=torch.ones(d),
            wqkv=w(d, 3 * d),
            wo=w(d, d),
            ln2=torch.ones(d),
            w1=w(d, 4 * d),
            w2=w(4 * d, d),
        )
        for _ in range(LAYERS)
    ]
    return dict(layers=layers, readout=w(d, 1))


def transformer(params, x, attn):
    """x: (N, d) one sequence -> (N,) predictions; causal self-attention via ``attn``."""
    n, d = x.shape
    for p in params["layers"]:
        h = F.layer_norm(x, (d,), p["ln1"])
        q, k, v = (h @ p["wqkv"]).view(n, 3, HEADS, d // HEADS).permute(1, 2, 0, 3).unsqueeze(1)
        o = attn(q, k, v, True)  # (1, HEADS, N, d / HEADS)
        x = x + o.squeeze(0).transpose(0, 1).reshape(n, d) @ p["wo"]
        h = F.layer_norm(x, (d,), p["ln2"])
        x = x + F.gelu(h @ p["w1"]) @ p["w2"]
    return (x @ params["readout"]).squeeze(-1)


def make_loss(attn):
    def loss(params, x, y):
        return (transformer(params, x, attn) - y).square().mean()

    return loss


def _batch(seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, N_TOK, D_MODEL, generator=g), torch.randn(BATCH, N_TOK, generator=g)


def per_sample_vmap(attn):
    fn = vmap(grad(make_loss(attn)), in_dims=(None, 0, 0))
    return lambda params, x, y: fn(params, x, y)


def per_sample_loop(attn):
    g = grad(make_loss(attn))

    def fn(params, x, y):
        grads = [g(params, x[i], y[i]) for i in range(x.shape[0])]
        return torch.utils._pytree.tree_map(lambda *xs: torch.stack(xs), *grads)

    return fn


PER_SAMPLE = {
    "torchfn vmap(grad)": lambda: per_sample_vmap(torchfn_attention),
    "sdpa vmap(grad)": lambda: per_sample_vmap(sdpa_attention),
    "sdpa loop of grad": lambda: per_sample_loop(sdpa_attention),
}


@pytest.mark.parametrize("impl", list(PER_SAMPLE))
def test_per_sample_grads_transformer(benchmark, impl):
    benchmark.group = "per-sample grads: 2-layer Transformer, batch 32"
    params, (x, y) = init_transformer(), _batch()
    fn = PER_SAMPLE[impl]()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="There is a performance drop")
        grads = benchmark.pedantic(fn, args=(params, x, y), rounds=10, warmup_rounds=2)
        ref = per_sample_loop(sdpa_attention)(params, x[:2], y[:2])
    for a, b in zip(torch.utils._pytree.tree_leaves(grads), torch.utils._pytree.tree_leaves(ref)):
        assert a.shape[0] == BATCH and torch.allclose(a[:2], b, atol=1e-4)


# ---------------------------------------------------------------- Hessian-vector product

HN = 2048


def _hvp_of(attn, mode="hvp"):
    g = torch.Generator().manual_seed(9)
    q, k, v, w, t = (torch.randn(1, H, HN, D, generator=g) for _ in range(5))

    def loss(q):
        return (attn(q, k, v) * w).sum()

    if mode == "grad-of-grad":  # the same product, reverse over reverse
        return lambda: grad(lambda q: (grad(loss)(q) * t).sum())(q)
    return lambda: jvp(grad(loss), (q,), (t,))[1]


def _torchfn_causal(q, k, v):
    return attention(q, k, v, causal=True, backend="torch")


HVP_IMPLS = {
    "torchfn row blocks": lambda mode: _hvp_of(_torchfn_causal, mode),
    "torchfn whole formula": lambda mode: _hvp_of(_torchfn_causal, mode),
    "materialised reference": lambda mode: _hvp_of(
        lambda q, k, v: reference_attention(q, k, v, causal=True), mode),
}


@pytest.mark.parametrize("mode", ["hvp", "grad-of-grad"])
@pytest.mark.parametrize("impl", list(HVP_IMPLS))
def test_hvp(benchmark, impl, mode, monkeypatch):
    from torchfn.kernels import _second_order
    from torchfn.train import PeakMemory

    benchmark.group = f"{mode} N={HN}"
    if impl == "torchfn whole formula":
        monkeypatch.setattr(_second_order, "_BUDGET", 1 << 40)
    fn = HVP_IMPLS[impl](mode)
    with PeakMemory() as mem:
        out = fn()
    print(f"\n{impl} {mode}: peak {mem.peak / 2**20:.0f} MiB")
    timed = benchmark.pedantic(fn, rounds=3, warmup_rounds=0)
    ref = HVP_IMPLS["materialised reference"](mode)()
    assert torch.allclose(out, ref, rtol=1e-3, atol=1e-3) and torch.equal(out, timed)


# ---------------------------------------------------------------- forward-mode AD


def _jvp_of(attn):
    g = torch.Generator().manual_seed(10)
    primals = tuple(torch.randn(1, H, HN, D, generator=g) for _ in range(3))
    tangents = tuple(torch.randn(1, H, HN, D, generator=g) for _ in range(3))
    return lambda: jvp(attn, primals, tangents)


JVP_IMPLS = {
    "torchfn fused jvp": lambda: _jvp_of(_torchfn_causal),
    "materialised reference": lambda: _jvp_of(
        lambda q, k, v: reference_attention(q, k, v, causal=True)),
}


@pytest.mark.parametrize("impl", list(JVP_IMPLS))
def test_jvp(benchmark, impl):
    from torchfn.train import PeakMemory

    benchmark.group = f"jvp N={HN}"
    fn = JVP_IMPLS[impl]()
    with PeakMemory() as mem:
        out = fn()
    print(f"\n{impl}: peak {mem.peak / 2**20:.0f} MiB")
    benchmark.pedantic(fn, rounds=3, warmup_rounds=0)
    ref = JVP_IMPLS["materialised reference"]()()
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(out, ref))


# ---------------------------------------------------------------- small attentions: overhead

TINY = (1, 4, 64, 16)  # B, H, N, D: a small model's attention, where Python overhead is the cost


def _tiny(requires_grad: bool, batch: int = 1, seed=11):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch * TINY[0], *TINY[1:], generator=g).requires_grad_(
        requires_grad) for _ in range(3))


def _tiny_step(attn, mode):
    if mode == "forward (no grad)":
        q, k, v = _tiny(False)
        return lambda: attn(q, k, v, True), lambda out, ref: torch.allclose(out, ref, atol=1e-5)
    if mode == "forward+backward":
        q, k, v = _tiny(True)
        return (lambda: torch.autograd.grad(attn(q, k, v, True).sum(), (q, k, v)),
                lambda out, ref: all(torch.allclose(a, b, atol=1e-5) for a, b in zip(out, ref)))
    q, k, v = _tiny(False, batch=8)  # per-sample gradients of 8 examples
    loss = lambda q, k, v: attn(q[None], k[None], v[None], True).sum()  # noqa: E731
    fn = vmap(grad(loss, argnums=(0, 1, 2)))
    return (lambda: fn(q, k, v),
            lambda out, ref: all(torch.allclose(a, b, atol=1e-5) for a, b in zip(out, ref)))


@pytest.mark.parametrize("mode", ["forward (no grad)", "forward+backward", "vmap(grad) x8"])
@pytest.mark.parametrize("impl", ["torchfn", "sdpa"])
def test_small_attention_overhead(benchmark, impl, mode):
    benchmark.group = f"small attention {TINY} {mode}"
    step, same = _tiny_step(IMPLS[impl], mode)
    with torch.no_grad() if mode.startswith("forward (") else contextlib.nullcontext():
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="There is a performance drop")
            out = benchmark.pedantic(step, rounds=300, warmup_rounds=20)
            ref = _tiny_step(IMPLS["sdpa"], mode)[0]()
    assert same(out, ref)
