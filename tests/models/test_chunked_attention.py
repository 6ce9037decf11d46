"""Chunked attention (``MultiHeadAttention(chunk=...)``, Llama 4) and query temperature
tuning (``temperature=...``): the layer equals softmax attention under the mask written
out from the positions; the growing and the static (ring-buffer) KV caches and
left-padded decoding equal the whole sequence; ``vmap(grad)`` equals the loop."""

from __future__ import annotations

import math

import pytest
import torch
from _cached import logits_through_cache
from hypothesis import given
from hypothesis import strategies as st

import torchfn
from torchfn import random
from torchfn.models import (
    KVCache,
    MultiHeadAttention,
    StaticKVCache,
    TransformerEncoder,
    generate,
)


def masked_attend(allowed, q_scale=None):
    """Softmax attention over ``allowed`` ``(B, N, N)`` bool, written out in float64; the
    queries times ``q_scale`` ``(N, 1)`` first where given."""
    def attend(q, k, v, *, key_padding_mask, causal, **extra):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        if q_scale is not None:
            q = q * q_scale
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, N, N)
        s = s.masked_fill(~allowed[:, None], float("-inf"))
        return s.softmax(-1) @ v
    return attend


def chunk_mask(positions, chunk, docs):
    """Query i sees key j iff j <= i, both in one document and in one chunk of their
    document's positions: ``(B, N, N)``."""
    n = positions.shape[-1]
    same = (positions[:, :, None] // chunk) == (positions[:, None, :] // chunk)
    same = same & (docs[:, :, None] == docs[:, None, :])
    return same & torch.ones(n, n, dtype=torch.bool).tril()


@given(n=st.integers(1, 40), chunk=st.integers(1, 12), docs=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_a_chunked_layer_equals_attention_under_the_written_out_mask(n, chunk, docs, seed):
    """Packed documents (``segment_ids``) too: positions restart at each document, and a
    chunk never spans two."""
    cuts = torch.randperm(max(n - 1, 1), generator=torch.Generator().manual_seed(seed))
    ids = torch.zeros(2, n, dtype=torch.long)
    for b in range(2):
        for c in sorted((cuts[:docs - 1] + 1).tolist()):
            ids[b, c:] += 1
    layer = MultiHeadAttention(24, 4, kv_heads=2, causal=True, rotary=True, chunk=chunk)
    model = torchfn.Model(layer)
    params = {k: p.double() for k, p in model.init(random.key(seed)).items()}
    x = random.normal(random.key(seed + 1), (2, n, 24), torch.float64)
    got = model.apply(params, x, segment_ids=ids)
    starts = torch.stack([torch.searchsorted(r, r, right=False) for r in ids])
    positions = torch.arange(n) - starts  # each document from 0
    plain = torchfn.Model(MultiHeadAttention(24, 4, kv_heads=2, causal=True, rotary=True,
                                             attend=masked_attend(chunk_mask(positions, chunk,
                                                                             ids))))
    want = plain.apply(params, x, segment_ids=ids)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_temperature_scales_the_queries_by_the_formula():
    """``1 + s log(1 + floor((p + 1) / f))`` per position, here f = 3 so it grows within
    the sequence; and from a cache's offset on."""
    f, s, n = 3.0, 0.5, 16
    layer = MultiHeadAttention(16, 2, causal=True, temperature=(f, s))
    model = torchfn.Model(layer)
    params = {k: p.double() for k, p in model.init(random.key(0)).items()}
    x = random.normal(random.key(1), (1, n, 16), torch.float64)
    p = torch.arange(n, dtype=torch.float64)
    scale = (1 + s * torch.log1p(torch.floor((p + 1) / f)))[:, None]  # (N, 1)
    allowed = torch.ones(1, n, n, dtype=torch.bool).tril()
    want = torchfn.Model(MultiHeadAttention(16, 2, causal=True, attend=masked_attend(
        allowed, scale))).apply(params, x)
    torch.testing.assert_close(model.apply(params, x), want, rtol=0, atol=1e-6)
    out, cache = model.apply(params, x[:, :9], cache=KVCache())
    last, _ = model.apply(params, x[:, 9:], cache=cache)
    torch.testing.assert_close(torch.cat((out, last), 1), want, rtol=0, atol=1e-6)


def llama4_like(seed=0, all_chunked=False):
    """A small encoder with Llama 4's layer pattern: three chunked rotary layers with
    weightless q/k norms, then a NoPE layer with temperature tuning (``all_chunked``: a
    fourth chunked layer instead)."""
    chunked = {"chunk": 5, "qk_norm": "rms_plain"}
    net = TransformerEncoder(
        dim=32, heads=4, kv_heads=2, depth=4, vocab_size=40, out_dim=40, causal=True,
        position_embedding="rotary", norm="rms", mlp="swiglu", bias=False,
        rotary_interleaved=True, layer_rotary=[None] * 3 + [None if all_chunked else False],
        layer_attention=[chunked] * 3 + [chunked if all_chunked else
                                         {"temperature": (4.0, 0.3)}])
    model = torchfn.Model(net)
    params = {k: p.double() for k, p in model.init(random.key(seed)).items()}
    return net, model, params


def test_caches_equal_the_whole_sequence_across_chunk_boundaries():
    """The growing cache; a static cache; and, where every layer is chunked, a static
    ring buffer of the chunk's 4 keys plus a call's tokens (capacity 4 + 7 for the
    prompt, then one token a call)."""
    tokens = torch.randint(0, 40, (2, 23), generator=torch.Generator().manual_seed(3))
    for all_chunked, capacity in ((False, 23), (True, 11)):
        net, model, params = llama4_like(all_chunked=all_chunked)
        want = model.apply(params, tokens)
        torch.testing.assert_close(logits_through_cache(model.apply, params, tokens, 7), want,
                                   rtol=0, atol=1e-10)
        cache = StaticKVCache.allocate(net, 2, capacity, dtype=torch.float64)
        outs, start = [], 0
        for stop in [7, *range(8, 24)]:
            out, cache = model.apply(params, tokens[:, start:stop], cache=cache)
            outs.append(out)
            start = stop
        torch.testing.assert_close(torch.cat(outs, 1), want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("static", [False, True])
def test_left_padded_decoding_equals_each_row_alone(static):
    """Chunks count each row's real tokens, in the growing and in the static cache."""
    net, model, params = llama4_like(seed=1)
    prompt = torch.randint(1, 40, (3, 8), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(3, 8, dtype=torch.bool)
    mask[1, :3] = mask[2, :6] = False
    prompt = prompt.masked_fill(~mask, 0)
    cache = StaticKVCache.allocate(net, 3, 8 + 12, dtype=torch.float64) if static else None
    got = generate(model, params, prompt, 12, prompt_mask=mask, cache=cache)
    for row in range(3):
        alone = generate(model, params, prompt[row:row + 1, mask[row]], 12)
        assert torch.equal(got[row, -12:], alone[0, -12:])


def test_per_sample_gradients_through_chunks_equal_the_loop():
    net, model, params = llama4_like(seed=2)
    tokens = torch.randint(0, 40, (3, 12), generator=torch.Generator().manual_seed(5))

    def loss(p, t):
        logits = model.apply(p, t[:-1])
        return torch.nn.functional.cross_entropy(logits, t[1:])

    batched = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, tokens)
    for i in range(3):
        one = torch.func.grad(loss)(params, tokens[i])
        for name in params:
            torch.testing.assert_close(batched[name][i], one[name], rtol=0, atol=1e-10)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="chunk must be"):
        MultiHeadAttention(16, 2, chunk=0)
    for bad in (3, (4.0, 0.1, 2.0), (4.0, -0.1)):
        with pytest.raises(ValueError, match=r"temperature must be a pair \(floor_scale, "
                                             r"attn_scale\) of numbers > 0 \(and an offset in "
                                             r"\[0, 1\]\), or None; got"):
            MultiHeadAttention(16, 2, temperature=bad)
    with pytest.raises(ValueError, match="qk_norm_scope must be 'head', 'all' or 'rotated'"):
        MultiHeadAttention(16, 2, qk_norm=True, qk_norm_scope="after")
    with pytest.raises(ValueError, match="qk_norm must be a bool, 'rms', 'rms\\+1' or "
                                         "'rms_plain', got 'l2'"):
        MultiHeadAttention(16, 2, qk_norm="l2")
    with pytest.raises(ValueError, match=r"attn_options must be a dict of \['chunk', "):
        TransformerEncoder(16, 2, 2, layer_attention=[{"window": 3}, None])
    with pytest.raises(ValueError, match="layer_attention must be a list of depth = 2"):
        TransformerEncoder(16, 2, 2, layer_attention=[None])
    layer = MultiHeadAttention(16, 2, causal=True, rotary=True, chunk=4)
    model = torchfn.Model(layer)
    params = model.init(random.key(0))
    table = layer.rotary_table(torch.arange(3), torch.float32)
    with pytest.raises(ValueError, match="chunk and temperature need the tokens' positions"):
        model.apply(params, torch.zeros(1, 3, 16), positions=table)
