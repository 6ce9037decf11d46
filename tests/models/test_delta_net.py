"""``models.GatedDeltaNet``: transformers' Qwen3.5 linear-attention layer with the same
weights gives the same output; both caches (prefill, then a token a call) equal the
whole sequence; left padding leaves each row as it is alone, and packed documents each
document; ``vmap(grad)`` equals the loop."""

from __future__ import annotations

import pytest
import torch
from _cached import logits_through_cache

import torchfn
from torchfn import random
from torchfn.models import GatedDeltaNet, KVCache, StaticKVCache

HF_NAMES = {"in_proj_qkv.weight": "qkv.weight", "in_proj_z.weight": "gate.weight",
            "in_proj_b.weight": "beta.weight", "in_proj_a.weight": "dt.weight",
            "conv1d.weight": "conv.weight", "dt_bias": "dt_bias", "A_log": "A_log",
            "norm.weight": "norm.weight", "out_proj.weight": "out.weight"}


def layer(seed=0, **kw):
    options = dict(key_heads=2, key_dim=8, value_dim=6) | kw
    net = GatedDeltaNet(32, 4, **options)
    model = torchfn.Model(net)
    params = {n: p.double() for n, p in model.init(random.key(seed)).items()}
    params["norm.weight"] = params["norm.weight"] + 0.1 * random.normal(random.key(seed + 9),
                                                                         (6,), torch.float64)
    return net, model, params


def test_equals_transformers_qwen3_5_layer():
    transformers = pytest.importorskip("transformers", reason="the peer of this test")
    from transformers.models.qwen3_5 import modeling_qwen3_5

    config = transformers.Qwen3_5TextConfig(
        hidden_size=32, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
        num_hidden_layers=1, layer_types=["linear_attention"])
    torch.manual_seed(0)
    hf = modeling_qwen3_5.Qwen3_5GatedDeltaNet(config, 0).double()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    params = {HF_NAMES[n]: t for n, t in hf.state_dict().items()}
    model = torchfn.Model(GatedDeltaNet(32, 4, key_heads=2, key_dim=8, value_dim=6))
    x = random.normal(random.key(1), (2, 70, 32), torch.float64)
    with torch.no_grad():
        want = hf(x)
    # transformers runs the rule in float32
    torch.testing.assert_close(model.apply(params, x), want, rtol=0, atol=2e-5)


def test_caches_equal_the_whole_sequence():
    net, model, params = layer()
    x = random.normal(random.key(2), (2, 30, 32), torch.float64)
    want = model.apply(params, x)
    for cache in (KVCache(), StaticKVCache.allocate(net, 2, 1, dtype=torch.float64)):
        torch.testing.assert_close(logits_through_cache(model.apply, params, x, 11, cache),
                                   want, rtol=0, atol=1e-12)


def test_left_padding_leaves_each_row_as_alone():
    net, model, params = layer(seed=1)
    x = random.normal(random.key(3), (2, 12, 32), torch.float64)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :5] = False
    got = model.apply(params, x, key_padding_mask=mask)
    alone = model.apply(params, x[1:, 5:])
    torch.testing.assert_close(got[1:, 5:], alone, rtol=0, atol=1e-12)
    static = StaticKVCache.allocate(net, 2, 16, dtype=torch.float64)
    slots = torch.cat((mask, torch.ones(2, 4, dtype=torch.bool)), 1)  # (B, capacity)
    got, _ = model.apply(params, x, key_padding_mask=slots, cache=static)
    torch.testing.assert_close(got[1:, 5:], alone, rtol=0, atol=1e-12)


def test_packed_documents_equal_each_document_alone():
    """``segment_ids``: documents of 5, 2, 1, 19 and 3 tokens (shorter than the
    convolution too), in the layer and in a hybrid encoder (whose attention restarts
    positions at each document)."""
    from torchfn.models import TransformerEncoder

    lengths = [5, 2, 1, 19, 3]
    ids = torch.repeat_interleave(torch.arange(5), torch.tensor(lengths))[None]
    runs = ids % 2  # 0 1 0 1 0: for the layer, a document is a run of one id
    net = TransformerEncoder(
        dim=32, heads=4, kv_heads=2, head_dim=8, depth=2, vocab_size=40, out_dim=40,
        causal=True, position_embedding="rotary", norm="rms+1", mlp="swiglu", bias=False,
        qk_norm=True, attn_gate=True, layer_linear=[True, False],
        linear_attention=dict(heads=4, key_heads=2, key_dim=8, value_dim=6))
    encoder = torchfn.Model(net)
    eparams = {n: p.double() for n, p in encoder.init(random.key(5)).items()}
    _, model, params = layer(seed=3)
    x = random.normal(random.key(6), (1, 30, 32), torch.float64)
    tokens = random.randint(random.key(7), (1, 30), 0, 40)
    got = model.apply(params, x, segment_ids=runs)
    got_tokens = encoder.apply(eparams, tokens, segment_ids=ids)
    start = 0
    for length in lengths:
        part = slice(start, start + length)
        torch.testing.assert_close(got[:, part], model.apply(params, x[:, part]), rtol=0,
                                   atol=1e-12)
        torch.testing.assert_close(got_tokens[:, part], encoder.apply(eparams, tokens[:, part]),
                                   rtol=0, atol=1e-12)
        start += length


def test_per_sample_gradients_equal_the_loop():
    _, model, params = layer(seed=2)
    x = random.normal(random.key(4), (3, 9, 32), torch.float64)

    def loss(p, one):
        return model.apply(p, one[None]).square().mean()

    batched = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    for i in range(3):
        one = torch.func.grad(loss)(params, x[i])
        for name in params:
            torch.testing.assert_close(batched[name][i], one[name], rtol=0, atol=1e-12)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="key_heads must divide heads = 4, got key_heads=3"):
        GatedDeltaNet(32, 4, key_heads=3)
    with pytest.raises(ValueError, match="conv_kernel must be"):
        GatedDeltaNet(32, 4, conv_kernel=0)
    _, model, params = layer()
    x = torch.zeros(1, 3, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match="cache does not take segment_ids"):
        model.apply(params, x, segment_ids=torch.zeros(1, 3, dtype=torch.long), cache=KVCache())
    with pytest.raises(ValueError, match=r"segment_ids must be \(B, N\) = \(1, 3\)"):
        model.apply(params, x, segment_ids=torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="cache must hold 0 or 1 layers"):
        model.apply(params, x, cache=KVCache((x, x), (x, x)))


@pytest.mark.slow  # its cold compile takes ~40 s; the static cache's eager path is tested above
def test_compiled_static_decoding_of_a_hybrid_stack_equals_eager():
    """Three Gated DeltaNet blocks and one gated attention (Qwen3.5's pattern) decode with
    a static cache under ``torch.compile(fullgraph=True)`` to the eager tokens."""
    from torchfn.models import TransformerEncoder, generate

    net = TransformerEncoder(
        dim=32, heads=4, kv_heads=2, head_dim=8, depth=4, vocab_size=40, out_dim=40,
        causal=True, position_embedding="rotary", norm="rms+1", mlp="swiglu", bias=False,
        qk_norm=True, attn_gate=True, rotary_dim=4, layer_linear=[True, True, True, False],
        linear_attention=dict(heads=4, key_heads=2, key_dim=8, value_dim=6))
    model = torchfn.Model(net)
    params = model.init(random.key(0))
    prompt = random.randint(random.key(1), (2, 9), 0, 40)
    want = generate(model, params, prompt, 12, cache=StaticKVCache.allocate(net, 2, 21))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    got = generate(compiled, params, prompt, 12, cache=StaticKVCache.allocate(net, 2, 21))
    assert torch.equal(got, want)
