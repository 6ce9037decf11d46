"""What ``models.GatedDeltaNet``, ``models.KimiDeltaAttention``, ``models.Mamba2``,
``models.Mamba``, ``models.ShortConv``, ``models.LightningAttention``, ``models.RGLRU`` and
``models.MLSTM`` all promise, and
an encoder of Falcon-H1's parallel blocks (attention and Mamba-2 side by side): both caches
(a prefill, then a token a call; the static one with room for nothing but the layers'
windows and states, or the tokens too where there is attention) equal the whole sequence;
a left-padded row and each packed document come out as they do alone; per-sample
gradients under ``vmap`` equal the loop; bad arguments are named. Each layer's own file
compares it with transformers."""

from __future__ import annotations

import pytest
import torch
from _cached import logits_through_cache

import torchfn
from torchfn import random
from torchfn.models import (
    MLSTM,
    RGLRU,
    GatedDeltaNet,
    KimiDeltaAttention,
    KVCache,
    LatentAttention,
    LightningAttention,
    Mamba,
    Mamba2,
    MultiHeadAttention,
    ShortConv,
    StaticKVCache,
    TransformerEncoder,
)

LAYERS = {
    "gated_deltanet": lambda: GatedDeltaNet(32, 4, key_heads=2, key_dim=8, value_dim=6),
    # conv and projection biases, 2 groups, chunks of 8
    "mamba2": lambda: Mamba2(32, 4, head_dim=16, state_dim=8, groups=2, bias=True, chunk=8),
    "mamba": lambda: Mamba(32, 48, state_dim=4, dt_rank=3, bias=True, chunk=8),
    # a decay per key channel; chunks of 24: a 16-token sub-chunk and the pairs across
    "kda": lambda: KimiDeltaAttention(32, 4, head_dim=6, chunk=24),
    # Ling 3's: full-rank gates, the decay bounded below
    "kda_full_rank": lambda: KimiDeltaAttention(32, 4, head_dim=6, chunk=24,
                                                low_rank_gates=False, lower_bound=-5.0),
    # LFM2's gated short convolution: no state, the window alone; biases
    "short_conv": lambda: ShortConv(32, kernel=4, bias=True),
    # MiniMax's lightning attention: a fixed decay per head, no convolution
    "lightning": lambda: LightningAttention(32, 4, slopes=(0.5, 0.2, 0.05, 0.0), chunk=8),
    # Griffin's recurrent block: the RG-LRU, narrower than the model, 4 gate blocks
    "rg_lru": lambda: RGLRU(32, 4, width=24),
    # xLSTM's mLSTM: exponential input gates and a normaliser, biases, chunks of 8
    "mlstm": lambda: MLSTM(32, 4, qk_dim=16, v_dim=24, bias=True, chunk=8),
    # two Falcon-H1 blocks: rotary attention beside Mamba-2 (norm before the gate), every
    # multiplier away from 1
    "parallel": lambda: TransformerEncoder(
        32, 4, 2, in_dim=32, causal=True, position_embedding="rotary", norm="rms",
        mlp="swiglu", bias=False, kv_heads=2, mlp_scales=(0.75, 1.4),
        linear_attention=dict(kind="mamba2", heads=4, head_dim=16, state_dim=8, groups=2,
                              chunk=8, norm="before_gate", in_scales=(0.5, 1.5, 0.8, 1.2, 2.0)),
        parallel_linear=dict(attn_in=0.8, attn_out=1.3, linear_in=1.2, linear_out=0.9)),
}


def _room(net, tokens):
    """A static cache's capacity: the tokens if some layer attends, else 1."""
    return tokens if any(isinstance(m, MultiHeadAttention) for m in net.modules()) else 1


@pytest.fixture(params=list(LAYERS))
def layer(request):
    """``(net, model, params)`` in float64, every param moved off its initial value
    (norms at 1, D at 1, biases at 0 would hide a mistake)."""
    net = LAYERS[request.param]()
    model = torchfn.Model(net)
    params = {n: p.double() + 0.05 * random.normal(random.key(i + 10), p.shape, torch.float64)
              for i, (n, p) in enumerate(sorted(model.init(random.key(0)).items()))}
    return net, model, params


def test_caches_equal_the_whole_sequence(layer):
    net, model, params = layer
    x = random.normal(random.key(2), (2, 30, 32), torch.float64)
    want = model.apply(params, x)
    for cache in (KVCache(), StaticKVCache.allocate(net, 2, _room(net, 30),
                                                    dtype=torch.float64)):
        torch.testing.assert_close(logits_through_cache(model.apply, params, x, 11, cache),
                                   want, rtol=0, atol=1e-12)


def test_left_padding_and_packed_documents_equal_each_alone(layer):
    """Padding in both caches' forms of the mask; documents of 5, 2, 1, 19 and 3 tokens
    (shorter than the convolution too), a document being a run of one id (0 1 0 1 0)."""
    net, model, params = layer
    x = random.normal(random.key(3), (2, 30, 32), torch.float64)
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[1, :5] = False
    alone = model.apply(params, x[1:, 5:])
    torch.testing.assert_close(model.apply(params, x, key_padding_mask=mask)[1:, 5:], alone,
                               rtol=0, atol=1e-12)
    static = StaticKVCache.allocate(net, 2, 34, dtype=torch.float64)
    slots = torch.cat((mask, torch.ones(2, 4, dtype=torch.bool)), 1)  # (B, capacity)
    got, _ = model.apply(params, x, key_padding_mask=slots, cache=static)
    torch.testing.assert_close(got[1:, 5:], alone, rtol=0, atol=1e-12)
    lengths = [5, 2, 1, 19, 3]
    ids = torch.arange(5)  # attention reads equal ids as one document: each its own there
    ids = ids if _room(net, 2) == 2 else ids % 2
    runs = torch.repeat_interleave(ids, torch.tensor(lengths))[None]
    got = model.apply(params, x, segment_ids=runs.expand(2, -1))
    start = 0
    for length in lengths:
        part = slice(start, start + length)
        torch.testing.assert_close(got[:, part], model.apply(params, x[:, part]), rtol=0,
                                   atol=1e-12)
        start += length


def test_per_sample_gradients_equal_the_loop(layer):
    _, model, params = layer
    x = random.normal(random.key(4), (3, 9, 32), torch.float64)

    def loss(p, one):
        return model.apply(p, one[None]).square().mean()

    batched = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    for i in range(3):
        one = torch.func.grad(loss)(params, x[i])
        for name in params:
            torch.testing.assert_close(batched[name][i], one[name], rtol=0, atol=1e-12)


def test_bad_input_is_named(layer):
    net, model, params = layer
    x = torch.zeros(1, 3, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match="cache does not take segment_ids"):
        model.apply(params, x, segment_ids=torch.zeros(1, 3, dtype=torch.long), cache=KVCache())
    with pytest.raises(ValueError, match=r"segment_ids must (have shape|be) \(B, N\) = "
                                         r"\(1, 3\)"):
        model.apply(params, x, segment_ids=torch.zeros(1, 2, dtype=torch.long))
    entries = getattr(net, "_entries", 1)  # the encoder: 2 a parallel block
    with pytest.raises(ValueError, match=f"cache must hold 0 or {entries} layers"):
        model.apply(params, x, cache=KVCache((x, x), (x, x)))


def test_bad_gate_options_are_named():
    with pytest.raises(ValueError, match="lower_bound must be a number < 0 or None, got 1"):
        KimiDeltaAttention(32, 4, head_dim=6, lower_bound=1)
    with pytest.raises(ValueError, match="low_rank_gates must be a bool, got 'no'"):
        KimiDeltaAttention(32, 4, head_dim=6, low_rank_gates="no")
    with pytest.raises(ValueError, match="head_gate must be a bool, got 1"):
        LatentAttention(32, 4, kv_rank=8, rope_dim=4, nope_dim=4, v_dim=4, head_gate=1)


def test_left_padded_static_decoding_of_a_model_without_attention():
    """A static cache of recurrent layers alone has no slots (``capacity`` None): the
    prompt mask is sized by the prompt and the steps, not by a layer's channel count
    (8 here, under the 13 positions decoded)."""
    from torchfn.models import generate

    net = TransformerEncoder(8, 2, 2, vocab_size=20, out_dim=20, causal=True,
                             position_embedding="none", norm="rms", mlp="swiglu",
                             linear_attention=dict(kind="short_conv", bias=True))
    model = torchfn.Model(net)
    params = model.init(random.key(0))
    prompt = random.randint(random.key(1), (2, 6), 1, 20)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, :2] = False
    static = StaticKVCache.allocate(net, 2, 1)
    assert static.capacity is None
    want = generate(model, params, prompt, 8, prompt_mask=mask)
    assert torch.equal(generate(model, params, prompt, 8, prompt_mask=mask, cache=static), want)
