"""``models.Mamba2`` and ``models.Mamba``: transformers' ``Mamba2Mixer`` and ``MambaMixer``
with the same weights give the same outputs; a hybrid encoder of Mamba-2 and attention
blocks decodes through both caches as it runs whole. (Caches, padding, packing and
``vmap(grad)``: test_recurrent_layers.py.)"""

from __future__ import annotations

import pytest
import torch

import torchfn
from torchfn import random
from torchfn.models import (
    Mamba,
    Mamba2,
    StaticKVCache,
    SwiGLU,
    TransformerBlock,
    TransformerEncoder,
    generate,
)

HF_NAMES = {"in_proj.weight": "in_proj.weight", "in_proj.bias": "in_proj.bias",
            "conv1d.weight": "conv.weight", "conv1d.bias": "conv.bias", "dt_bias": "dt_bias",
            "A_log": "A_log", "D": "D", "norm.weight": "norm.weight",
            "out_proj.weight": "out.weight", "out_proj.bias": "out.bias"}


def test_equals_transformers_mamba2_mixer():
    transformers = pytest.importorskip("transformers", reason="the peer of this test")
    from transformers.models.mamba2 import modeling_mamba2

    config = transformers.Mamba2Config(
        hidden_size=32, num_heads=4, head_dim=16, state_size=8, n_groups=2, conv_kernel=4,
        expand=2, use_bias=True, use_conv_bias=True, num_hidden_layers=1, chunk_size=8,
        time_step_limit=(0.0, 0.05))  # a limit that bites
    torch.manual_seed(0)
    hf = modeling_mamba2.Mamba2Mixer(config, 0).double()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    params = {HF_NAMES[n]: t for n, t in hf.state_dict().items()}
    model = torchfn.Model(Mamba2(32, 4, head_dim=16, state_dim=8, groups=2, bias=True,
                                 dt_limit=(0.0, 0.05)))
    x = random.normal(random.key(1), (2, 30, 32), torch.float64)
    with torch.no_grad():
        want = hf(x)
    # transformers runs the scan in float32
    torch.testing.assert_close(model.apply(params, x), want, rtol=0, atol=2e-6)


def test_mamba_equals_transformers_mamba_mixer():
    transformers = pytest.importorskip("transformers", reason="the peer of this test")
    from transformers.models.mamba import modeling_mamba

    config = transformers.MambaConfig(hidden_size=16, intermediate_size=32, state_size=4,
                                      time_step_rank=3, use_bias=True, num_hidden_layers=1)
    torch.manual_seed(0)
    hf = modeling_mamba.MambaMixer(config, 0).double()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    names = {"conv1d.weight": "conv.weight", "conv1d.bias": "conv.bias",
             "out_proj.weight": "out.weight", "out_proj.bias": "out.bias"}
    params = {names.get(n, n): t for n, t in hf.state_dict().items()}
    model = torchfn.Model(Mamba(16, 32, state_dim=4, dt_rank=3, bias=True, chunk=8))
    x = random.normal(random.key(1), (2, 30, 16), torch.float64)
    with torch.no_grad():
        want = hf(x)
    torch.testing.assert_close(model.apply(params, x), want, rtol=0, atol=1e-6)


def test_a_hybrid_encoder_decodes_as_it_runs_whole():
    """Mamba-2 blocks then an attention block (Bamba's / Granite 4.0-H's pattern): greedy
    tokens from both caches equal those of the whole sequence re-run each step."""
    net = TransformerEncoder(
        dim=32, heads=4, depth=3, vocab_size=40, out_dim=40, causal=True,
        position_embedding="rotary", norm="rms", mlp="swiglu", bias=False,
        layer_linear=[True, True, False],
        linear_attention=dict(kind="mamba2", heads=4, head_dim=16, state_dim=8, chunk=8))
    model = torchfn.Model(net)
    params = {n: p.double() for n, p in model.init(random.key(5)).items()}
    prompt = random.randint(random.key(6), (2, 9), 0, 40)
    seq = prompt
    for _ in range(6):  # no cache: the whole sequence each step
        seq = torch.cat((seq, model.apply(params, seq)[:, -1:].argmax(-1)), 1)
    assert torch.equal(generate(model, params, prompt, 6), seq)
    static = StaticKVCache.allocate(net, 2, 15, dtype=torch.float64)
    assert torch.equal(generate(model, params, prompt, 6, cache=static), seq)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="bcdt_norm_eps must be a number > 0 or None, got 0"):
        Mamba(16, bcdt_norm_eps=0)
    with pytest.raises(ValueError, match="bcdt_norm_weight must be a bool, and True only with a "
                                         "bcdt_norm_eps; got bcdt_norm_weight=True, "
                                         "bcdt_norm_eps=None"):
        Mamba(16, bcdt_norm_weight=True)
    with pytest.raises(ValueError, match="groups must divide heads = 4, got groups=3"):
        Mamba2(32, 4, groups=3)
    with pytest.raises(ValueError, match="norm must be 'gated', 'before_gate' or 'none', got "
                                         "'after'"):
        Mamba2(32, 4, norm="after")
    with pytest.raises(ValueError, match=r"in_scales must be 5 numbers \(z, x, B, C, dt\) or "
                                         r"None, got \(1.0, 2.0\)"):
        Mamba2(32, 4, in_scales=(1.0, 2.0))
    with pytest.raises(ValueError, match=r"scales must be two numbers \(gate, out\) or None, "
                                         r"got \(1.0,\)"):
        SwiGLU(8, 16, scales=(1.0,))
    hybrid = dict(linear_attention=dict(kind="mamba2", heads=4), causal=True)
    with pytest.raises(ValueError, match=r"parallel_linear must be a bool or a dict of numbers "
                                         r"for \['attn_in', 'attn_out', 'linear_in', "
                                         r"'linear_out'\], got \{'ssm_in': 2.0\}"):
        TransformerEncoder(32, 4, 1, parallel_linear={"ssm_in": 2.0}, **hybrid)
    with pytest.raises(ValueError, match="parallel_linear needs linear_attention"):
        TransformerBlock(32, 4, parallel_linear=True)
    with pytest.raises(ValueError, match=r"mlp_scales are a dense SwiGLU / GeGLU's \(gate, "
                                         r"out\); got mlp='gelu', experts=None"):
        TransformerEncoder(32, 4, 1, mlp_scales=(1.0, 2.0))
    with pytest.raises(ValueError, match="linear_attention must be a dict of"):
        TransformerEncoder(32, 4, 1, linear_attention=dict(kind="rwkv", heads=4))
