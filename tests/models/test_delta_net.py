"""``models.GatedDeltaNet``: transformers' Qwen3.5 linear-attention layer with the same
weights gives the same output; packed documents through a hybrid encoder; a compiled
hybrid decode. (Caches, padding, packing and ``vmap(grad)``: test_recurrent_layers.py.)"""

from __future__ import annotations

import pytest
import torch

import torchfn
from torchfn import random
from torchfn.models import GatedDeltaNet, StaticKVCache

HF_NAMES = {"in_proj_qkv.weight": "qkv.weight", "in_proj_z.weight": "gate.weight",
            "in_proj_b.weight": "beta.weight", "in_proj_a.weight": "dt.weight",
            "conv1d.weight": "conv.weight", "dt_bias": "dt_bias", "A_log": "A_log",
            "norm.weight": "norm.weight", "out_proj.weight": "out.weight"}


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


def test_packed_documents_in_a_hybrid_encoder_equal_each_document_alone():
    """``segment_ids`` through Gated DeltaNet and attention blocks (whose positions restart
    at each document): documents of 5, 2, 1, 19 and 3 tokens."""
    from torchfn.models import TransformerEncoder

    lengths = [5, 2, 1, 19, 3]
    ids = torch.repeat_interleave(torch.arange(5), torch.tensor(lengths))[None]
    net = TransformerEncoder(
        dim=32, heads=4, kv_heads=2, head_dim=8, depth=2, vocab_size=40, out_dim=40,
        causal=True, position_embedding="rotary", norm="rms+1", mlp="swiglu", bias=False,
        qk_norm=True, attn_gate=True, layer_linear=[True, False],
        linear_attention=dict(heads=4, key_heads=2, key_dim=8, value_dim=6))
    encoder = torchfn.Model(net)
    eparams = {n: p.double() for n, p in encoder.init(random.key(5)).items()}
    tokens = random.randint(random.key(7), (1, 30), 0, 40)
    got = encoder.apply(eparams, tokens, segment_ids=ids)
    start = 0
    for length in lengths:
        part = slice(start, start + length)
        torch.testing.assert_close(got[:, part], encoder.apply(eparams, tokens[:, part]),
                                   rtol=0, atol=1e-12)
        start += length


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="key_heads must divide heads = 4, got key_heads=3"):
        GatedDeltaNet(32, 4, key_heads=3)
    with pytest.raises(ValueError, match="conv_kernel must be"):
        GatedDeltaNet(32, 4, conv_kernel=0)


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
