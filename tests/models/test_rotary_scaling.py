"""``rotary_frequencies``' context-extension scalings: each against its definition written
out another way (Hugging Face's branch-by-branch form for Llama 3.1 and YaRN)."""

from __future__ import annotations

import math

import pytest
import torch

import torchfn
from torchfn import random
from torchfn.models import (
    KVCache,
    TransformerEncoder,
    rotary_embedding,
    rotary_frequencies,
)

LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}


def plain(d, base):
    return 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)


def test_linear_is_position_interpolation_and_ntk_a_larger_base():
    x = random.normal(random.key(0), (1, 2, 9, 16), torch.float64)
    pos = torch.arange(9) * 1000
    lin = rotary_embedding(x, pos, scaling={"rope_type": "linear", "factor": 4.0})
    torch.testing.assert_close(lin, rotary_embedding(x, pos / 4.0), rtol=0, atol=1e-12)
    f, scale = rotary_frequencies(16, 1e4, {"type": "ntk", "factor": 4.0})  # old key name
    torch.testing.assert_close(f, plain(16, 1e4 * 4.0 ** (16 / 14)))
    assert f[0] == 1.0 and scale == 1.0  # the fastest turn is kept ...
    torch.testing.assert_close(f[-1], plain(16, 1e4)[-1] / 4)  # ... the slowest interpolated


def test_llama3_matches_the_branchwise_definition():
    d, base = 128, 500000.0
    inv = plain(d, base)
    wavelen = 2 * math.pi / inv
    low_wl, high_wl = 8192 / 1.0, 8192 / 4.0
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    want = torch.where(wavelen > low_wl, inv / 8, inv)
    medium = (wavelen >= high_wl) & (wavelen <= low_wl)
    want = torch.where(medium, (1 - smooth) * want / 8 + smooth * want, want)
    got, scale = rotary_frequencies(d, base, LLAMA31)
    torch.testing.assert_close(got, want, rtol=1e-15, atol=0)
    assert scale == 1.0
    kept, divided = wavelen < high_wl, wavelen > low_wl
    assert kept.any() and divided.any() and medium.any()  # all three bands occur
    torch.testing.assert_close(got[kept], inv[kept], rtol=1e-15, atol=0)
    torch.testing.assert_close(got[divided], inv[divided] / 8, rtol=1e-15, atol=0)


def test_yarn_matches_the_ramp_definition_and_scales_the_attention():
    d, base, s, orig = 128, 10000.0, 4.0, 4096

    def dim_of(turns):
        return d * math.log(orig / (turns * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = max(math.floor(dim_of(32)), 0), min(math.ceil(dim_of(1)), d - 1)
    extrapolate = 1 - ((torch.arange(d // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
    inv = plain(d, base)
    want = inv / s * (1 - extrapolate) + inv * extrapolate
    got, scale = rotary_frequencies(d, base, YARN)
    torch.testing.assert_close(got, want, rtol=1e-15, atol=0)
    assert scale == pytest.approx(0.1 * math.log(4.0) + 1)
    x = random.normal(random.key(1), (1, 1, 5, d), torch.float64)
    out = rotary_embedding(x, torch.arange(5), scaling=YARN)
    torch.testing.assert_close(out.norm(dim=-1), scale * x.norm(dim=-1))  # cos, sin x scale
    assert rotary_frequencies(d, base, dict(YARN, attention_factor=1.0))[1] == 1.0


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0},
                                     {"rope_type": "ntk", "factor": 3.0}, LLAMA31, YARN])
def test_scores_stay_relative_and_a_scaled_model_decodes_from_its_cache(scaling):
    q = random.normal(random.key(2), (1, 2, 6, 16), torch.float64)
    k = random.normal(random.key(3), (1, 2, 6, 16), torch.float64)
    pos = torch.arange(6) + 20000  # past every original context above

    def scores(p):
        return rotary_embedding(q, p, scaling=scaling) @ rotary_embedding(
            k, p, scaling=scaling).mT

    torch.testing.assert_close(scores(pos + 777), scores(pos), rtol=0, atol=1e-9)
    model = torchfn.Model(TransformerEncoder(dim=16, heads=2, depth=1, vocab_size=7,
                                             out_dim=7, causal=True,
                                             position_embedding="rotary",
                                             rotary_scaling=scaling))
    params = {n: t.double() for n, t in model.init(random.key(4)).items()}
    tokens = random.randint(random.key(5), (2, 8), 0, 7)
    out, cache = model.apply(params, tokens[:, :5], cache=KVCache())
    last, _ = model.apply(params, tokens[:, 5:], cache=cache)
    torch.testing.assert_close(torch.cat((out, last), 1), model.apply(params, tokens),
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("scaling, err, match", [
    ({"rope_type": "dynamic", "factor": 2.0}, ValueError, r"rope_type'\] must be one of"),
    ({"rope_type": "linear"}, ValueError, r"missing \['factor'\]"),
    ({"rope_type": "linear", "factor": 2.0, "beta_fast": 3}, ValueError,
     r"unknown \['beta_fast'\]"),
    ({"rope_type": "linear", "factor": 0.5}, ValueError, "factor'\\] must be a number >= 1"),
    (dict(LLAMA31, low_freq_factor=5.0), ValueError, "low_freq_factor < high_freq_factor"),
    ("llama3", TypeError, "scaling must be a dict"),
])
def test_bad_scaling_is_named(scaling, err, match):
    with pytest.raises(err, match=match):
        rotary_frequencies(16, 1e4, scaling)
    with pytest.raises(err, match=match):  # at construction, not at the first forward
        TransformerEncoder(dim=16, heads=2, depth=1, vocab_size=7,
                           position_embedding="rotary", rotary_scaling=scaling)


def test_longrope_divides_each_frequency_by_its_factor_and_checks_their_count():
    """LongRoPE: short factors by default, long ones with ``long=True``, the attention
    factor sqrt(1 + ln(factor) / ln(original)); a factor list of the wrong length is named."""


    scaling = {"rope_type": "longrope", "short_factor": [1.0, 2.0, 4.0],
               "long_factor": [3.0, 5.0, 7.0], "original_max_position_embeddings": 16,
               "factor": 8.0}
    plain, _ = rotary_frequencies(6, 100.0)
    short, scale = rotary_frequencies(6, 100.0, scaling)
    long, _ = rotary_frequencies(6, 100.0, scaling, long=True)
    torch.testing.assert_close(short, plain / torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64))
    torch.testing.assert_close(long, plain / torch.tensor([3.0, 5.0, 7.0], dtype=torch.float64))
    assert scale == pytest.approx(math.sqrt(1 + math.log(8) / math.log(16)))
    with pytest.raises(ValueError, match=r"short_factor'\] must hold rotary_dim / 2 = 2 "
                                         r"factors, got 3"):
        rotary_frequencies(4, 100.0, scaling)


def test_longrope_mscales_go_with_their_factors():
    """Phi-3.5-MoE's ``short_mscale`` / ``long_mscale`` scale cos and sin with the short
    factors for a call within the original context and with the long ones past it."""
    from torchfn.models._rotary import rotary_table

    scaling = {"rope_type": "longrope", "short_factor": [1.0, 2.0], "long_factor": [3.0, 5.0],
               "original_max_position_embeddings": 16, "factor": 8.0,
               "short_mscale": 1.25, "long_mscale": 1.5}
    for n, factors, mscale in ((10, [1.0, 2.0], 1.25), (20, [3.0, 5.0], 1.5)):
        pos = torch.arange(n, dtype=torch.float64)
        angles = pos[:, None] * plain(4, 100.0) / torch.tensor(factors, dtype=torch.float64)
        table = rotary_table(torch.arange(n), 4, base=100.0, scaling=scaling,
                             dtype=torch.float64)
        torch.testing.assert_close(table.cos, mscale * angles.cos(), rtol=0, atol=1e-14)
        torch.testing.assert_close(table.sin, mscale * angles.sin(), rtol=0, atol=1e-14)
