"""``falcon_h1_from_hf`` / ``falcon_h1_to_hf`` against ``transformers``' Falcon-H1: small
random models saved with ``save_pretrained``, compared on logits, both caches, greedy
generation (left-padded too) and the round trip. Every block runs attention and Mamba-2
side by side; the muP multipliers are set away from 1 so that each one counts."""

from __future__ import annotations

import pytest
import torch
from _hf_checks import (
    assert_left_padded_generation_matches,
    assert_round_trip_and_reload,
    assert_same_logits_caches_and_tokens,
    hf_checkpoint,
)

import torchfn
from torchfn.models import KVCache, StaticKVCache, falcon_h1_from_hf, falcon_h1_to_hf

transformers = pytest.importorskip(
    "transformers", reason="transformers (a dev dependency) is the peer these tests compare "
    "against")

BASE = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=64, mamba_n_heads=4,
            mamba_d_state=8, mamba_n_groups=2, pad_token_id=0)
MULTIPLIERS = dict(embedding_multiplier=1.5, lm_head_multiplier=0.7, key_multiplier=0.6,
                   attention_in_multiplier=0.8, attention_out_multiplier=1.3,
                   ssm_in_multiplier=1.2, ssm_out_multiplier=0.9,
                   ssm_multipliers=[0.5, 1.5, 0.8, 1.25, 2.0], mlp_multipliers=[0.75, 1.4])
CASES = {
    # every multiplier away from 1; the gated norm applied before the gate
    "norm-before-gate": dict(MULTIPLIERS, mamba_rms_norm=True, mamba_norm_before_gate=True),
    # Mamba-2's own order (gate, then norm), biases on the projections
    "gated-norm": dict(MULTIPLIERS, mamba_rms_norm=True, mamba_norm_before_gate=False,
                       attention_bias=True, projectors_bias=True),
    # no norm in the mixer (the config's default); a step-size limit that bites
    "no-norm": dict(mamba_rms_norm=False, time_step_limit=(0.0, 0.05)),
}
ATOL = 5e-6  # transformers runs the scan in float32, even in a float64 model


def checkpoint(case, tmp_path):
    return hf_checkpoint("falcon_h1", dict(BASE, **CASES[case]), tmp_path)


@pytest.mark.parametrize("case", list(CASES))
def test_a_transformers_checkpoint_gives_the_same_logits_caches_and_tokens(case, tmp_path):
    """transformers' Mamba-2 decode step ignores time_step_limit (as its Mamba-2's): there
    its uncached greedy tokens are the reference."""
    hf, config, sd = checkpoint(case, tmp_path)
    module, params = falcon_h1_from_hf(config, sd)
    assert_same_logits_caches_and_tokens(hf, module, params, ATOL,
                                         use_cache="time_step_limit" not in CASES[case])


def test_greedy_generation_from_left_padded_prompts_equals_transformers(tmp_path):
    hf, config, sd = checkpoint("norm-before-gate", tmp_path)
    module, params = falcon_h1_from_hf(config, sd)
    assert_left_padded_generation_matches(hf, torchfn.Model(module), params)


@pytest.mark.parametrize("case", list(CASES))
def test_falcon_h1_to_hf_gives_back_the_checkpoint_and_loads_in_transformers(case, tmp_path):
    hf, config, sd = checkpoint(case, tmp_path)
    module, params = falcon_h1_from_hf(config, sd)
    assert_round_trip_and_reload(module, params, falcon_h1_to_hf(config, params), sd, tmp_path,
                                 config, ATOL)


def test_a_parallel_block_caches_attention_then_the_mixer():
    """Two entries a block, in the order StaticKVCache.allocate finds the layers; the
    static cache's logits equal the growing cache's."""
    config = dict(BASE, model_type="falcon_h1", **MULTIPLIERS)
    module, _ = falcon_h1_from_hf(config)
    model = torchfn.Model(module)
    params = model.init(torchfn.random.key(0))
    tokens = torchfn.random.randint(torchfn.random.key(1), (2, 7), 0, 50)
    out, cache = model.apply(params, tokens, cache=KVCache())
    assert len(cache.keys) == 2 * BASE["num_hidden_layers"]
    assert [k.dim() for k in cache.keys[:2]] == [4, 3]  # attention's keys, the conv window
    static = StaticKVCache.allocate(module, 2, 7)
    assert [tuple(k.shape) for k in static.keys[:2]] == [(2, 2, 7, 8), (2, 96, 3)]
    got, static = model.apply(params, tokens, cache=static)
    torch.testing.assert_close(got, out)
    torch.testing.assert_close(got, model.apply(params, tokens))


def test_falcon_h1_errors_are_named():
    config = dict(BASE, model_type="falcon_h1")
    with pytest.raises(ValueError, match=r"model_type'\] must be 'falcon_h1', got 'bamba'"):
        falcon_h1_from_hf(dict(config, model_type="bamba"))
    with pytest.raises(ValueError, match=r"lacks \['mamba_n_heads'\]: not a falcon_h1"):
        falcon_h1_from_hf({k: v for k, v in config.items() if k != "mamba_n_heads"})
    with pytest.raises(ValueError, match=r"mamba_n_heads \* mamba_d_head = 60 must be the "
                                         r"Mamba width .* = 64"):
        falcon_h1_from_hf(dict(config, mamba_d_head=15))
    with pytest.raises(ValueError, match=r"config\['ssm_multipliers'\] must be 5 numbers, "
                                         r"got \[1.0, 2.0\]"):
        falcon_h1_from_hf(dict(config, ssm_multipliers=[1.0, 2.0]))
    module, _ = falcon_h1_from_hf(config)
    sd = falcon_h1_to_hf(config, torchfn.Model(module).init(torchfn.random.key(0)))
    with pytest.raises(ValueError, match=r"has tensors a falcon_h1 does not: \['model.x'\]"):
        falcon_h1_from_hf(config, {**sd, "model.x": torch.zeros(1)})
    sd.pop("model.layers.0.mamba.D")
    with pytest.raises(ValueError, match=r"missing \['blocks.0.linear.D'\]"):
        falcon_h1_from_hf(config, sd)
