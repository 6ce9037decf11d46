"""LoRA on Conv1d/2d/3d (grouped, any padding mode) and Embedding: each layer equals its
formula in float64 (the adapter as a change of weight, ``W + s delta``), a fresh adapter
changes nothing, merged params reproduce the adapted model in the original module, and
per-example adapter gradients under vmap equal a loop."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call, grad, vmap

import torchfn
from torchfn import models, random

F64 = torch.float64


def normal(seed, *shape):
    return random.normal(random.key(seed), shape, dtype=F64)


CONVS = {1: (nn.Conv1d, models.LoRAConv1d, nn.functional.conv1d),
         2: (nn.Conv2d, models.LoRAConv2d, nn.functional.conv2d),
         3: (nn.Conv3d, models.LoRAConv3d, nn.functional.conv3d)}


def grouped_delta(b, a, groups):
    """B A group by group, written out as a loop over the groups."""
    out, r = b.shape[0], a.shape[0]
    blocks = [torch.tensordot(b[j * out // groups:(j + 1) * out // groups],
                              a[j * r // groups:(j + 1) * r // groups], dims=1)
              for j in range(groups)]
    return torch.cat(blocks)  # (out, in / groups, *k)


@given(dims=st.sampled_from([1, 2, 3]), groups=st.sampled_from([1, 2]),
       rank_per_group=st.integers(1, 2), stride=st.integers(1, 2), padding=st.integers(0, 2),
       dilation=st.integers(1, 2), mode=st.sampled_from(["zeros", "reflect", "circular"]),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_conv_equals_the_merged_weight(dims, groups, rank_per_group, stride, padding,
                                       dilation, mode, bias, seed):
    conv_type, lora_type, conv = CONVS[dims]
    base = conv_type(4, 6, 3, stride=stride, padding=padding, dilation=dilation,
                     groups=groups, bias=bias, padding_mode=mode).double()
    rank = rank_per_group * groups
    layer = lora_type(base, rank, alpha=2.0)
    with torch.no_grad():
        layer.lora_B.copy_(normal(seed, 6, rank_per_group))
    x = normal(seed + 1, 2, 4, *(7,) * dims)
    # a conv is linear in its weight: the adapter equals the base conv with W + s B A
    merged = base.weight + layer.scale * grouped_delta(layer.lora_B, layer.lora_A, groups)
    torch.testing.assert_close(layer.delta(layer.lora_A, layer.lora_B),
                               grouped_delta(layer.lora_B, layer.lora_A, groups))
    want = base._conv_forward(x, merged, base.bias)  # the base layer's own padding mode
    torch.testing.assert_close(layer(x), want, rtol=1e-11, atol=1e-11)
    if dims == 2 and groups == 1:  # PEFT's layout, written as PEFT merges it
        peft = torch.einsum("or,rikl->oikl", layer.lora_B, layer.lora_A)
        torch.testing.assert_close(layer.delta(layer.lora_A, layer.lora_B), peft)


@given(rank=st.integers(1, 4), padding_idx=st.sampled_from([None, 0]),
       seed=st.integers(0, 2**16))
def test_embedding_equals_the_merged_table(rank, padding_idx, seed):
    base = nn.Embedding(9, 6, padding_idx=padding_idx).double()
    layer = models.LoRAEmbedding(base, rank, alpha=4.0)
    with torch.no_grad():
        layer.lora_A.copy_(normal(seed, rank, 9))
    ids = random.randint(random.key(seed + 1), (3, 5), 0, 9).long()
    table = base.weight + layer.scale * (layer.lora_B @ layer.lora_A).T  # (9, 6)
    torch.testing.assert_close(layer(ids), table[ids], rtol=1e-12, atol=1e-12)


class Net(nn.Module):  # tokens -> embedding -> a 1-d "image" conv -> logits
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(12, 4)
        self.conv = nn.Conv2d(4, 6, 3, padding=1)
        self.head = nn.Linear(6, 3)

    def forward(self, ids):  # ids: (B, 5) or (5,) under vmap
        h = self.emb(ids).transpose(-1, -2).unsqueeze(-2)  # (..., 4, 1, 5)
        h = torch.relu(self.conv(h if h.dim() == 4 else h[None]))  # (N, 6, 1, 5)
        return self.head(h.mean((-1, -2)))  # (N, 3)


def test_fresh_adapters_change_nothing_and_merge_folds_them_in():
    net = Net().double()
    lora_net = models.with_lora(net, rank=2, layers=(nn.Linear, nn.Conv2d, nn.Embedding))
    assert isinstance(lora_net.emb, models.LoRAEmbedding)
    assert isinstance(lora_net.conv, models.LoRAConv2d)
    assert isinstance(lora_net.head, models.LoRALinear)
    base_params = dict(net.named_parameters())
    params = {k: v.detach() for k, v in lora_net.named_parameters()}
    ids = random.randint(random.key(0), (4, 5), 0, 12).long()
    torch.testing.assert_close(functional_call(lora_net, params, (ids,)),
                               functional_call(net, base_params, (ids,)))
    trained = {k: v + 0.1 * normal(i, *v.shape) for i, (k, v) in enumerate(params.items())}
    merged = models.merge_lora(lora_net, trained)
    assert sorted(merged) == sorted(base_params)
    torch.testing.assert_close(functional_call(net, merged, (ids,)),
                               functional_call(lora_net, trained, (ids,)), rtol=1e-10,
                               atol=1e-10)


def test_per_example_adapter_gradients_equal_a_loop():
    lora_net = models.with_lora(Net().double(), rank=2,
                                layers=(nn.Conv2d, nn.Embedding), targets=["emb", "conv"])
    model = torchfn.Model(lora_net)
    frozen, adapters = models.split_lora(
        {k: v.double() for k, v in model.init(random.key(1)).items()})
    adapters = {k: v + 0.1 * normal(i, *v.shape) for i, (k, v) in enumerate(adapters.items())}
    ids = random.randint(random.key(2), (6, 5), 0, 12).long()
    y = random.randint(random.key(3), (6,), 0, 3).long()

    def loss(adapters, ids, y):  # ONE example
        logits = functional_call(lora_net, {**frozen, **adapters}, (ids,))[0]
        return nn.functional.cross_entropy(logits, y)

    batched = vmap(grad(loss), in_dims=(None, 0, 0))(adapters, ids, y)
    for i in range(6):
        one = grad(loss)(adapters, ids[i], y[i])
        for k in adapters:
            torch.testing.assert_close(batched[k][i], one[k])


def test_merge_folds_grouped_1d_and_3d_adapters_into_the_original_module():
    net = nn.Sequential(nn.Conv1d(4, 8, 3, groups=4, padding=1, padding_mode="circular"),
                        nn.Tanh(), nn.Conv1d(8, 2, 1)).double()
    lora_net = models.with_lora(net, rank=4, layers=(nn.Conv1d,))
    assert isinstance(lora_net[0], models.LoRAConv1d) and lora_net[0].lora_B.shape == (8, 1)
    params = {k: v.detach() + 0.1 * normal(i, *v.shape)
              for i, (k, v) in enumerate(lora_net.named_parameters())}
    x = normal(9, 3, 4, 10)
    torch.testing.assert_close(functional_call(net, models.merge_lora(lora_net, params), (x,)),
                               functional_call(lora_net, params, (x,)), rtol=1e-10, atol=1e-10)
    frozen, adapters = models.split_lora(params)

    def loss(adapters, xi):  # ONE example (4, 10)
        return functional_call(lora_net, {**frozen, **adapters}, (xi[None],)).square().sum()

    batched = vmap(grad(loss), in_dims=(None, 0))(adapters, x)
    for i in range(3):
        for k, g in grad(loss)(adapters, x[i]).items():
            torch.testing.assert_close(batched[k][i], g)
    vol = nn.Conv3d(2, 4, 3, padding=1).double()
    lora_vol = models.with_lora(vol, rank=2, layers=(nn.Conv3d,))
    p3 = {k: v.detach() + 0.1 * normal(i, *v.shape)
          for i, (k, v) in enumerate(lora_vol.named_parameters())}
    x3 = normal(3, 1, 2, 5, 5, 5)
    torch.testing.assert_close(functional_call(vol, models.merge_lora(lora_vol, p3), (x3,)),
                               functional_call(lora_vol, p3, (x3,)), rtol=1e-10, atol=1e-10)


def test_bad_input():
    with pytest.raises(ValueError, match="rank must be divisible by the Conv2d's groups "
                                         r"\(each group gets rank / groups\), got rank=3, "
                                         "groups=2"):
        models.LoRAConv2d(nn.Conv2d(4, 4, 3, groups=2), rank=3)
    with pytest.raises(TypeError, match="base must be an nn.Conv1d, got Conv2d"):
        models.LoRAConv1d(nn.Conv2d(4, 4, 3), rank=2)
    with pytest.raises(ValueError, match="needs max_norm=None"):
        models.LoRAEmbedding(nn.Embedding(5, 3, max_norm=1.0), rank=2)
    with pytest.raises(ValueError, match=r"layers must be some of \['Linear', 'Conv1d', "
                                         r"'Conv2d', 'Conv3d', 'Embedding'\], got \['LSTM'\]"):
        models.with_lora(Net(), layers=(nn.LSTM,))
    with pytest.raises(ValueError, match=r"matched no nn.Embedding; the module's "
                                         r"nn.Embedding layers are \['emb'\]"):
        models.with_lora(Net(), layers=(nn.Embedding,), targets=["conv"])
