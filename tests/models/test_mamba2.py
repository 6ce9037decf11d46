"""``models.Mamba2``: transformers' ``Mamba2Mixer`` with the same weights gives the same
output; both caches (prefill, then a token a call) equal the whole sequence; left
padding and packed documents leave each row and document as it is alone; ``vmap(grad)``
equals the loop; a hybrid encoder of Mamba-2 and attention blocks caches both."""

from __future__ import annotations

import pytest
import torch
from _cached import logits_through_cache

import torchfn
from torchfn import random
from torchfn.models import KVCache, Mamba2, StaticKVCache, TransformerEncoder, generate

HF_NAMES = {"in_proj.weight": "in_proj.weight", "in_proj.bias": "in_proj.bias",
            "conv1d.weight": "conv.weight", "conv1d.bias": "conv.bias", "dt_bias": "dt_bias",
            "A_log": "A_log", "D": "D", "norm.weight": "norm.weight",
            "out_proj.weight": "out.weight", "out_proj.bias": "out.bias"}


def layer(seed=0, **kw):
    net = Mamba2(32, 4, head_dim=16, state_dim=8, groups=2, bias=True, chunk=8, **kw)
    model = torchfn.Model(net)
    params = {n: p.double() for n, p in model.init(random.key(seed)).items()}
    params = {n: p + 0.05 * random.normal(random.key(seed + i + 10), p.shape, torch.float64)
              for i, (n, p) in enumerate(sorted(params.items()))}  # norm, D, biases off 1 / 0
    return net, model, params


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


def test_caches_equal_the_whole_sequence():
    net, model, params = layer()
    x = random.normal(random.key(2), (2, 30, 32), torch.float64)
    want = model.apply(params, x)
    for cache in (KVCache(), StaticKVCache.allocate(net, 2, 1, dtype=torch.float64)):
        torch.testing.assert_close(logits_through_cache(model.apply, params, x, 11, cache),
                                   want, rtol=0, atol=1e-12)


def test_left_padding_and_packed_documents_equal_each_alone():
    _, model, params = layer(seed=1)
    x = random.normal(random.key(3), (2, 12, 32), torch.float64)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :5] = False
    got = model.apply(params, x, key_padding_mask=mask)
    torch.testing.assert_close(got[1:, 5:], model.apply(params, x[1:, 5:]), rtol=0,
                               atol=1e-12)
    lengths = [3, 1, 6, 2]
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))[None].expand(2, 12)
    got = model.apply(params, x, segment_ids=ids)
    start = 0
    for length in lengths:
        part = slice(start, start + length)
        torch.testing.assert_close(got[:, part], model.apply(params, x[:, part]), rtol=0,
                                   atol=1e-12)
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
    with pytest.raises(ValueError, match="groups must divide heads = 4, got groups=3"):
        Mamba2(32, 4, groups=3)
    with pytest.raises(ValueError, match="linear_attention must be a dict of"):
        TransformerEncoder(32, 4, 1, linear_attention=dict(kind="rwkv", heads=4))
    _, model, params = layer()
    x = torch.zeros(1, 3, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match="cache does not take segment_ids"):
        model.apply(params, x, segment_ids=torch.zeros(1, 3, dtype=torch.long), cache=KVCache())
    with pytest.raises(ValueError, match=r"segment_ids must be \(B, N\) = \(1, 3\)"):
        model.apply(params, x, segment_ids=torch.zeros(1, 2, dtype=torch.long))
