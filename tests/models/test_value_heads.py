"""``MultiHeadAttention(v_dim=, value_scale=)``: value heads narrower than the query/key
heads, scaled (MiMo-V2-Flash's), equal attention written out by hand in float64, through
both caches and under ``vmap(grad)``; per-block overrides of the heads through
``TransformerEncoder(layer_attention=)``. test_routed_moe_transformers.py compares
MiMo-V2-Flash with transformers."""

from __future__ import annotations

import pytest
import torch
from _cached import logits_through_cache

import torchfn
from torchfn import random
from torchfn.models import MultiHeadAttention, StaticKVCache, TransformerEncoder


def attention_by_hand(params, x, heads, kv_heads, hd, vd, scale, window=None):
    """Causal grouped-query attention over ``x`` ``(B, N, dim)`` with q/k heads ``hd`` and
    value heads ``vd`` wide, values times ``scale``, written out in float64."""
    b, n, _ = x.shape
    q, k, v = (x @ params["qkv.weight"].T + params["qkv.bias"]).split(
        [heads * hd, kv_heads * hd, kv_heads * vd], -1)
    q = q.unflatten(-1, (heads, hd)).transpose(1, 2)  # (B, H, N, hd)
    k = k.unflatten(-1, (kv_heads, hd)).transpose(1, 2).repeat_interleave(heads // kv_heads, 1)
    v = scale * v.unflatten(-1, (kv_heads, vd)).transpose(1, 2).repeat_interleave(
        heads // kv_heads, 1)  # (B, H, N, vd)
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    if window is not None:
        allowed &= ~torch.ones(n, n, dtype=torch.bool).tril(-window - 1)
    p = (q @ k.transpose(-1, -2) * hd ** -0.5).masked_fill(~allowed, float("-inf")).softmax(-1)
    o = (p @ v).transpose(1, 2).flatten(2)  # (B, N, H vd)
    return o @ params["out.weight"].T + params["out.bias"]


@pytest.mark.parametrize("window", [None, 3])
def test_narrow_scaled_values_equal_attention_by_hand_and_through_both_caches(window):
    attn = MultiHeadAttention(24, 4, kv_heads=2, head_dim=8, v_dim=5, value_scale=0.7,
                              causal=True, window=(window, None) if window else None).double()
    model = torchfn.Model(attn)
    params = model.init(random.key(0))
    assert params["qkv.weight"].shape == (4 * 8 + 2 * 8 + 2 * 5, 24)
    assert params["out.weight"].shape == (24, 4 * 5)
    x = random.normal(random.key(1), (2, 9, 24), dtype=torch.float64)
    want = attention_by_hand(params, x, 4, 2, 8, 5, 0.7, window)
    torch.testing.assert_close(model.apply(params, x), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logits_through_cache(model, params, x, 4), want, rtol=1e-12,
                               atol=1e-12)
    static = StaticKVCache.allocate(attn, 2, 12, dtype=torch.float64)
    assert static.keys[0].shape == (2, 2, 12, 8) and static.values[0].shape == (2, 2, 12, 5)
    torch.testing.assert_close(logits_through_cache(model, params, x, 4, static), want,
                               rtol=1e-12, atol=1e-12)


def test_per_block_heads_and_per_sample_gradients():
    """``layer_attention`` gives one block twice the key/value heads, sinks, narrower
    scaled values and its own rotated width; ``vmap(grad)`` of the LM equals the loop."""
    net = TransformerEncoder(dim=24, heads=4, depth=2, vocab_size=30, out_dim=30, causal=True,
                             position_embedding="rotary", kv_heads=1, head_dim=8,
                             layer_attention=[None, dict(kv_heads=2, sinks=True, v_dim=6,
                                                         value_scale=0.5, rotary_dim=4)])
    a, b = net.blocks[0].attn, net.blocks[1].attn
    assert (a.kv_heads, a.v_dim, a.rotary_dim, a.sinks) == (1, 8, 8, None)
    assert (b.kv_heads, b.v_dim, b.rotary_dim, b.sinks.shape) == (2, 6, 4, (4,))
    model = torchfn.Model(net.double())
    params = model.init(random.key(0))
    tokens = random.randint(random.key(1), (3, 7), 0, 30)
    torch.testing.assert_close(logits_through_cache(model, params, tokens, 3),
                               model.apply(params, tokens), rtol=1e-12, atol=1e-12)

    def loss(p, seq):
        return torch.nn.functional.cross_entropy(model.apply(p, seq[:-1]), seq[1:])

    per = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, tokens)
    for i in range(3):
        one = torch.func.grad(loss)(params, tokens[i])
        for name in params:
            torch.testing.assert_close(per[name][i], one[name], rtol=1e-10, atol=1e-12)


def test_bad_value_heads_are_named():
    with pytest.raises(ValueError, match="v_dim must be an int >= 1, got 0"):
        MultiHeadAttention(24, 4, v_dim=0)
    with pytest.raises(ValueError, match="value_scale must be a number > 0 or None, got -1"):
        MultiHeadAttention(24, 4, value_scale=-1)
    with pytest.raises(ValueError, match="kv_heads must divide heads = 4, got kv_heads=3"):
        TransformerEncoder(dim=24, heads=4, depth=1, layer_attention=[dict(kv_heads=3)])
