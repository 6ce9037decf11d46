"""``dbrx_from_hf`` / ``dbrx_to_hf`` against ``transformers``' DBRX: small random models
saved with ``save_pretrained`` (q/k/v clamped at a bound small enough to bite), compared
on logits, both caches, greedy generation (left-padded too) and the round trip."""

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
from torchfn.models import dbrx_from_hf, dbrx_to_hf

transformers = pytest.importorskip(
    "transformers", reason="transformers (a dev dependency) is the peer these tests compare "
    "against")

# transformers rotates by rope_parameters (not attn_config's rope_theta) and needs clip_qkv
CONFIG = dict(d_model=32, n_heads=4, n_layers=2, vocab_size=50, max_seq_len=64,
              attn_config=dict(kv_n_heads=2, clip_qkv=0.5, rope_theta=500.0),
              ffn_config=dict(ffn_hidden_size=12, moe_num_experts=4, moe_top_k=2),
              rope_parameters=dict(rope_type="default", rope_theta=500.0), pad_token_id=0,
              eos_token_id=1)
ATOL = 5e-6  # transformers routes its softmax in float32, even in float64


def checkpoint(tmp_path):
    return hf_checkpoint("dbrx", CONFIG, tmp_path, experts_implementation="eager")


def test_a_transformers_checkpoint_gives_the_same_logits_caches_and_tokens(tmp_path):
    hf, config, sd = checkpoint(tmp_path)
    module, params = dbrx_from_hf(config, sd)
    assert_same_logits_caches_and_tokens(hf, module, params, ATOL)


def test_greedy_generation_from_left_padded_prompts_equals_transformers(tmp_path):
    hf, config, sd = checkpoint(tmp_path)
    module, params = dbrx_from_hf(config, sd)
    assert_left_padded_generation_matches(hf, torchfn.Model(module), params)


def test_dbrx_to_hf_gives_back_the_checkpoint_and_loads_in_transformers(tmp_path):
    hf, config, sd = checkpoint(tmp_path)
    module, params = dbrx_from_hf(config, sd)
    assert_round_trip_and_reload(module, params, dbrx_to_hf(config, params), sd, tmp_path,
                                 config, ATOL, experts_implementation="eager")


def test_the_clamp_binds_and_errors_are_named(tmp_path):
    """Without the clamp the logits move: the test above holds it to transformers'."""
    hf, config, sd = checkpoint(tmp_path)
    module, params = dbrx_from_hf(config, sd)
    unclamped, _ = dbrx_from_hf(dict(config, attn_config=dict(config["attn_config"],
                                                              clip_qkv=None)), sd)
    tokens = torch.randint(3, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    assert not torch.allclose(torchfn.Model(module).apply(params, tokens),
                              torchfn.Model(unclamped).apply(params, tokens), atol=1e-3)
    with pytest.raises(ValueError, match=r"model_type'\] must be 'dbrx', got 'mixtral'"):
        dbrx_from_hf(dict(config, model_type="mixtral"))
    with pytest.raises(ValueError, match=r"moe_normalize_expert_weights'\] = 2.0 is not "
                                         r"supported"):
        dbrx_from_hf(dict(config, ffn_config=dict(config["ffn_config"],
                                                  moe_normalize_expert_weights=2.0)))
    with pytest.raises(ValueError, match="qkv_clip must be a number > 0 or None, got -1"):
        dbrx_from_hf(dict(config, attn_config=dict(config["attn_config"], clip_qkv=-1)))
    with pytest.raises(ValueError, match=r"has tensors a dbrx does not: \['transformer.x'\]"):
        dbrx_from_hf(config, {**sd, "transformer.x": torch.zeros(1)})
