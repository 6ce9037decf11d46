"""LatentAttention (DeepSeek's MLA) on its own: the absorbed path equals the expanded one,
the latent cache (growing and static, windowed) equals the whole sequence, and
per-sample gradients and jvp go through both paths. test_deepseek_transformers.py
compares whole models with transformers."""

from __future__ import annotations

import pytest
import torch
from _cached import logits_through_cache
from _transforms import check_vmap_grad_and_jvp
from hypothesis import given
from hypothesis import strategies as st

import torchfn
from torchfn import random
from torchfn.models import (
    KVCache,
    LatentAttention,
    StaticKVCache,
    TransformerEncoder,
    generate,
)

DIMS = dict(kv_rank=12, rope_dim=6, nope_dim=4, v_dim=10)


def mla(seed=0, **kw):
    """A float64 LatentAttention Model and params, and its input x ``(2, 9, 24)``."""
    model = torchfn.Model(LatentAttention(24, 3, **dict(DIMS, **kw)).double())
    params = model.init(random.key(seed))
    x = random.normal(random.key(seed + 1), (2, 9, 24), dtype=torch.float64)
    return model, params, x


def lm(seed=0, depth=2, **kw):
    """A float64 decoder with latent attention in every block, its params and tokens."""
    net = TransformerEncoder(dim=24, heads=3, depth=depth, vocab_size=40, out_dim=40,
                             causal=True, position_embedding="rotary", norm="rms",
                             mlp="swiglu", bias=False,
                             latent_attention=dict(DIMS, q_rank=16), **kw).double()
    model = torchfn.Model(net)
    tokens = random.randint(random.key(seed + 1), (2, 14), 0, 40)
    return net, model, model.init(random.key(seed)), tokens


@given(n=st.integers(1, 9), window=st.sampled_from([None, 2, (3, None)]),
       softcap=st.sampled_from([None, 0.5]), padded=st.booleans(),
       q_rank=st.sampled_from([None, 8]))
def test_absorbed_equals_expanded(n, window, softcap, padded, q_rank):
    """Both ways of computing the same attention, in float64, over query counts, windows
    (an int is both sides: not causal-only), soft caps and key padding."""
    causal = not isinstance(window, int)
    outs = []
    for absorb in (True, False):
        model, params, x = mla(causal=causal, window=window, softcap=softcap, q_rank=q_rank,
                               absorb=absorb)
        mask = None
        if padded:
            mask = torch.ones(2, n, dtype=torch.bool)
            mask[1, : n // 2] = False
        outs.append(model.apply(params, x[:, :n], mask))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-12)


def test_a_fully_masked_row_gives_zero_on_both_paths():
    """A query with no key to see (every key padded) gives 0, never NaN, either way (the
    output projection has no bias, so the layer's output is 0 too)."""
    outs = []
    for absorb in (True, False):
        model, params, x = mla(absorb=absorb)
        mask = torch.zeros(2, 9, dtype=torch.bool)
        mask[0] = True
        out = model.apply(params, x, mask)
        assert torch.isfinite(out).all()
        outs.append(out)
    torch.testing.assert_close(outs[1][1], torch.zeros(9, 24, dtype=torch.float64))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("absorb", [None, True, False])
@pytest.mark.parametrize("window", [None, (3, None)])
def test_the_latent_cache_equals_the_whole_sequence(absorb, window):
    """Prefill then one token at a time, through a growing KVCache and a StaticKVCache
    (a ring buffer of window + 1 slots for the windowed model): the logits of the whole
    sequence at once. The cache holds kv_rank + rope_dim numbers a token and layer."""
    net, model, params, tokens = lm(window=window)
    for block in net.blocks:
        block.attn.absorb = absorb
    model = torchfn.Model(net)
    want = model.apply(params, tokens)
    torch.testing.assert_close(logits_through_cache(model, params, tokens, 5), want,
                               rtol=1e-10, atol=1e-10)
    _, cache = model.apply(params, tokens[:, :5], cache=KVCache())
    assert [tuple(k.shape) for k in cache.keys] == [(2, 1, 5, DIMS["kv_rank"])] * 2
    assert [tuple(v.shape) for v in cache.values] == [(2, 1, 5, DIMS["rope_dim"])] * 2
    capacity = 16 if window is None else 4 + 5  # the window's keys and a call's tokens
    static = StaticKVCache.allocate(net, 2, capacity, dtype=torch.float64)
    out, static = model.apply(params, tokens[:, :5], cache=static)
    outs = [out]
    for i in range(5, tokens.shape[1]):
        out, static = model.apply(params, tokens[:, i:i + 1], cache=static)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, 1), want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("absorb", [True, False])
def test_per_sample_gradients_and_jvp_through_either_path(absorb):
    """``vmap(grad)`` equals a loop of ``grad``; ``jvp`` equals a central difference."""
    model, params, x = mla(absorb=absorb)
    check_vmap_grad_and_jvp(model, params, x)


def test_per_sample_gradients_of_a_deepseek_style_lm_equal_the_loop():
    """Latent attention and a sigmoid-routed, grouped mixture with a shared expert (the
    DeepSeek-V3 block) under ``vmap(grad)``: each example's gradient of the next-token
    loss equals ``grad`` on that example alone."""
    net, model, params, tokens = lm(
        experts=4, top_k=2, expert_hidden=8, layer_experts=[False, True],
        moe_options=dict(scoring="sigmoid", groups=2, topk_groups=1, routed_scale=2.0,
                         shared_hidden=8, router_bias=True))
    state = model.init_state()

    def loss(p, seq):
        logits = model.apply(p, seq[:-1], state=state)  # (N - 1, V)
        return torch.nn.functional.cross_entropy(logits, seq[1:])

    per = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, tokens)
    for i in range(tokens.shape[0]):
        one = torch.func.grad(loss)(params, tokens[i])
        for name in params:
            torch.testing.assert_close(per[name][i], one[name], rtol=1e-9, atol=1e-12)


def test_cost_rule_absorbs_when_decoding_and_expands_for_a_prompt():
    attn = LatentAttention(64, 8, kv_rank=32, rope_dim=8, nope_dim=16, v_dim=16)
    assert attn._absorb_cheaper(1, 100)  # one query against a long cache
    assert not attn._absorb_cheaper(100, 100)  # a prompt: expand once


def test_bad_latent_attention_options_are_named():
    base = dict(dim=24, heads=3, depth=1, vocab_size=40, causal=True,
                position_embedding="rotary")
    with pytest.raises(ValueError, match="latent_attention must be a dict with kv_rank"):
        TransformerEncoder(**base, latent_attention={"rope_dim": 4})
    with pytest.raises(ValueError, match=r"sets the heads' shapes itself; got \{'kv_heads': 1"):
        TransformerEncoder(**base, latent_attention=DIMS, kv_heads=1)
    with pytest.raises(ValueError, match=r"got \{'attn_sinks': True\} too"):
        TransformerEncoder(**base, latent_attention=DIMS, attn_sinks=True)
    with pytest.raises(ValueError, match="rotary must be a bool, got 'yes'"):
        LatentAttention(24, 3, **DIMS, rotary="yes")
    with pytest.raises(ValueError, match="rope_dim must be even, got 5"):
        LatentAttention(24, 3, **dict(DIMS, rope_dim=5))
    with pytest.raises(ValueError, match="kv_rank must be an int >= 1, got 0"):
        LatentAttention(24, 3, **dict(DIMS, kv_rank=0))
    with pytest.raises(ValueError, match="absorb must be None, True or False, got 'yes'"):
        LatentAttention(24, 3, **DIMS, absorb="yes")
    model, params, x = mla(absorb=True)
    with pytest.raises(ValueError, match="absorb=True takes neither attention dropout nor "
                                         "segment_ids"):
        model.apply(params, x, segment_ids=torch.zeros(2, 9, dtype=torch.long))
    model, params, x = mla()
    wrong = KVCache((torch.zeros(2, 1, 3, 8, dtype=torch.float64),),
                    (torch.zeros(2, 1, 3, 6, dtype=torch.float64),))
    with pytest.raises(ValueError, match=r"cache must hold latents \(B, 1, L, 12\) and rotary "
                                         r"keys \(B, 1, L, 6\), got \(2, 1, 3, 8\)"):
        model.apply(params, x, cache=wrong)
    with pytest.raises(ValueError, match="cache needs causal=True"):
        mla(causal=False)[0].apply(params, x, cache=KVCache())


@pytest.mark.slow  # a cold compile of the prefill and the step: ~40 s on 2 cores; the
# eager StaticKVCache test above covers the values, this one that the graph compiles
def test_compiled_static_decoding_equals_eager():
    """``generate`` through ``torch.compile(model, fullgraph=True)`` with a StaticKVCache
    (absorbed steps over fixed-shape latent buffers) gives the eager tokens."""
    net, model, params, tokens = lm()
    net, model = net.float(), torchfn.Model(net.float())
    params = {n: t.float() for n, t in params.items()}
    want = generate(model, params, tokens[:, :5], 8)
    cache = StaticKVCache.allocate(net, 2, 16)
    got = generate(torch.compile(model, fullgraph=True), params, tokens[:, :5], 8, cache=cache)
    assert torch.equal(got, want)
