"""LoRA adapters: a fresh adapter changes nothing, the layer equals its formula in
float64, merging folds it into plain params for the original module, and per-example
adapter gradients under vmap equal a loop (through torchfn attention)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import torchfn
from torchfn import models, random


def _encoder():
    return models.TransformerEncoder(dim=16, heads=2, depth=2, vocab_size=11, out_dim=3,
                                     causal=True, max_len=12)


@given(rank=st.integers(1, 6), alpha=st.floats(0.5, 32.0), rslora=st.booleans(),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_lora_linear_equals_its_formula_in_float64(rank, alpha, rslora, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    base = nn.Linear(7, 5, bias=bias).double()
    layer = models.LoRALinear(base, rank, alpha, rslora=rslora)
    with torch.no_grad():
        layer.lora_B.copy_(torch.randn(5, rank, generator=gen, dtype=torch.float64))
    x = torch.randn(4, 3, 7, generator=gen, dtype=torch.float64)  # (..., in)
    scale = alpha / (rank**0.5 if rslora else rank)
    expected = x @ base.weight.T + scale * (x @ layer.lora_A.T) @ layer.lora_B.T
    if bias:
        expected = expected + base.bias
    torch.testing.assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)
    assert layer.scale == pytest.approx(scale)


def test_fresh_adapters_change_nothing_and_pretrained_params_load_by_name():
    net = _encoder()
    lora_net = models.with_lora(net, rank=4, targets=["qkv", "out"])
    base, lora = torchfn.Model(net), torchfn.Model(lora_net)
    pretrained, _ = base.extract(net)
    params = lora.init(random.key(0))
    assert set(pretrained) < set(params)  # the base names are unchanged
    adapters = models.split_lora(params)[1]
    assert sorted(adapters) == sorted(
        f"blocks.{i}.attn.{n}.lora_{ab}" for i in range(2) for n in ("qkv", "out")
        for ab in "AB")
    assert all(float(v.abs().max()) == 0 for k, v in adapters.items() if k.endswith("_B"))
    assert all(float(v.abs().max()) > 0 for k, v in adapters.items() if k.endswith("_A"))
    tokens = random.randint(random.key(1), (2, 12), 0, 11)
    torch.testing.assert_close(lora.apply({**params, **pretrained}, tokens),
                               base.apply(pretrained, tokens), rtol=0, atol=0)
    assert isinstance(net.blocks[0].attn.qkv, nn.Linear)  # the original is untouched
    assert not isinstance(net.blocks[0].attn.qkv, models.LoRALinear)


def test_merged_params_give_the_adapted_outputs_in_the_original_module():
    net = _encoder()
    lora_net = models.with_lora(net, rank=3, alpha=6.0)
    lora = torchfn.Model(lora_net)
    params = lora.init(random.key(2))
    params = {k: (torch.randn_like(v) * 0.1 if k.endswith("lora_B") else v)
              for k, v in params.items()}
    merged = models.merge_lora(lora_net, params)
    assert set(merged) == set(torchfn.Model(net).init(random.key(0)))
    tokens = random.randint(random.key(3), (2, 12), 0, 11)
    torch.testing.assert_close(torchfn.Model(net).apply(merged, tokens),
                               lora.apply(params, tokens), rtol=1e-5, atol=1e-5)


def test_per_example_adapter_grads_under_vmap_equal_a_loop():
    lora_net = models.with_lora(_encoder(), rank=2, targets=lambda name, m: "attn" in name)
    lora = torchfn.Model(lora_net)
    params = lora.init(random.key(4))
    params = {k: (torch.randn_like(v) * 0.1 if k.endswith("lora_B") else v)
              for k, v in params.items()}
    frozen, adapters = models.split_lora(params)
    tokens = random.randint(random.key(5), (6, 12), 0, 11)
    labels = random.randint(random.key(6), (6,), 0, 3)

    def loss(adapters, tokens, label):  # one sequence
        logits = lora.apply({**frozen, **adapters}, tokens[None])[0, -1]  # (3,)
        return torch.nn.functional.cross_entropy(logits, label)

    batched = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(
        adapters, tokens, labels)
    for i in range(6):
        one = torch.func.grad(loss)(adapters, tokens[i], labels[i])
        for k in adapters:
            torch.testing.assert_close(batched[k][i], one[k], rtol=1e-5, atol=1e-6)
    assert all(batched[k].shape == (6, *adapters[k].shape) for k in adapters)
    assert float(batched["blocks.0.attn.qkv.lora_A"].abs().max()) > 0


def test_a_module_that_is_one_linear():
    lora_net = models.with_lora(nn.Linear(3, 2), rank=1)
    assert isinstance(lora_net, models.LoRALinear)
    assert sorted(torchfn.Model(lora_net).init(random.key(0))) == [
        "bias", "lora_A", "lora_B", "weight"]


def test_bad_input():
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"targets=\['qkv'\] matched no nn.Linear; .*'0', '2'"):
        models.with_lora(net, targets=["qkv"])
    with pytest.raises(TypeError, match="targets must be None"):
        models.with_lora(net, targets="0")
    with pytest.raises(ValueError, match="rank must be an int >= 1, got 0"):
        models.with_lora(net, rank=0)
    with pytest.raises(ValueError, match="alpha must be a number > 0, got -1"):
        models.with_lora(net, alpha=-1.0)
    with pytest.raises(TypeError, match="module must be a torch.nn.Module, got int"):
        models.with_lora(3)
    params = torchfn.Model(net).init(random.key(0))
    with pytest.raises(ValueError, match="params hold no adapters"):
        models.split_lora(params)
    with pytest.raises(ValueError, match="module has no LoRA layers"):
        models.merge_lora(net, params)
    lora_net = models.with_lora(net, targets=["2"])
    with pytest.raises(ValueError, match="params lack '2.lora_A'"):
        models.merge_lora(lora_net, params)


def test_the_layer_keeps_the_base_weights_and_init_draws_them_as_nn_linear():
    base = nn.Linear(6, 4)
    layer = models.LoRALinear(base, rank=2)
    assert torch.equal(layer.weight, base.weight) and torch.equal(layer.bias, base.bias)
    # Model.init draws W and b as it would for the plain Linear, from the same key
    plain = torchfn.Model(nn.Linear(6, 4)).init(random.key(7))
    lora = torchfn.Model(models.with_lora(nn.Linear(6, 4), rank=2)).init(random.key(7))
    assert torch.equal(plain["weight"], lora["weight"])
    assert torch.equal(plain["bias"], lora["bias"])
