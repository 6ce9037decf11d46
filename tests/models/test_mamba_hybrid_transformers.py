"""``mamba_hybrid_from_hf`` / ``mamba_hybrid_to_hf`` against ``transformers``' Mamba,
Falcon-Mamba, Mamba-2, Bamba, Granite 4.0-H (``granitemoehybrid``) and Jamba: small random
models saved with ``save_pretrained``, compared on logits, both caches, greedy generation
(left-padded too) and the round trip. Mamba or Mamba-2 blocks, alone or with attention
blocks among them."""

from __future__ import annotations

import pytest
import torch
from _hf_checks import (
    assert_left_padded_generation_matches,
    assert_round_trip_and_reload,
    assert_same_logits_caches_and_tokens,
)
from _hf_checks import hf_checkpoint as _hf_checkpoint

import torchfn
from torchfn.models import (
    mamba_hybrid_from_hf,
    mamba_hybrid_to_hf,
)

transformers = pytest.importorskip(
    "transformers", reason="transformers (a dev dependency) is the peer these tests compare "
    "against")

BASE = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4, mamba_d_head=16,
            mamba_d_state=8, mamba_n_groups=2, pad_token_id=0)
CASES = {
    # a mixture beside the shared MLP, NoPE attention, Granite's four multipliers
    "granite-4.0-h": ("granitemoehybrid", dict(
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=40,
        layer_types=["mamba", "mamba", "attention", "mamba"], embedding_multiplier=2.0,
        attention_multiplier=0.3, residual_multiplier=0.5, logits_scaling=3.0,
        time_step_limit=(0.0, 0.05))),  # a step-size limit that bites
    # the shared MLP alone, rotary attention in layer 1
    "granite-dense-rope": ("granitemoehybrid", dict(
        num_local_experts=0, shared_intermediate_size=40, position_embedding_type="rope",
        layer_types=["mamba", "attention", "mamba", "mamba"])),
    # rotary on half of each head
    "bamba": ("bamba", dict(attn_layer_indices=[2])),
    # Mamba(-1): blocks of a norm and the mixer alone; tied embeddings, biased projections
    "mamba": ("mamba", dict(state_size=8, time_step_rank=3, use_bias=True)),
    # Mamba with its step sizes, B and C RMS-normalised
    "falcon-mamba": ("falcon_mamba", dict(state_size=8, time_step_rank=3, mixer_rms_eps=1e-3)),
    # Mamba blocks with weighted dt/B/C norms, NoPE attention in 1 and 3, a mixture of
    # unrenormalised top-2 in 0 and 2, SwiGLU in the others; biased projections
    "jamba": ("jamba", dict(num_experts=4, num_experts_per_tok=2, attn_layer_period=2,
                            attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=0,
                            mamba_dt_rank=3, mamba_proj_bias=True)),
    # blocks of a norm and the mixer alone; tied embeddings
    "mamba2": ("mamba2", dict(num_heads=4, head_dim=16, state_size=8, n_groups=2,
                              tie_word_embeddings=True, time_step_limit=(0.0, 0.1))),
}
ATOL = 5e-6  # transformers runs the scan in float32, even in a float64 model


def hf_checkpoint(kind, extra, tmp_path):
    return _hf_checkpoint(kind, dict(BASE, **extra), tmp_path, experts_implementation="eager")


@pytest.mark.parametrize("case", list(CASES))
def test_a_transformers_checkpoint_gives_the_same_logits_caches_and_tokens(case, tmp_path):
    """transformers' Mamba-2 decode step ignores time_step_limit (its cached tokens part
    from its own forward's): there its uncached greedy tokens are the reference."""
    hf, config, sd = hf_checkpoint(*CASES[case], tmp_path)
    module, params = mamba_hybrid_from_hf(config, sd)
    assert_same_logits_caches_and_tokens(hf, module, params, ATOL, use_cache=case != "mamba2")


@pytest.mark.parametrize("case", ["bamba", "jamba"])
def test_greedy_generation_from_left_padded_prompts_equals_transformers(case, tmp_path):
    """The padding stays out of the Mamba-2 (Bamba) and Mamba (Jamba) layers' windows and
    states."""
    hf, config, sd = hf_checkpoint(*CASES[case], tmp_path)
    module, params = mamba_hybrid_from_hf(config, sd)
    assert_left_padded_generation_matches(hf, torchfn.Model(module), params)


@pytest.mark.parametrize("case", list(CASES))
def test_mamba_hybrid_to_hf_gives_back_the_checkpoint_and_loads_in_transformers(case, tmp_path):
    hf, config, sd = hf_checkpoint(*CASES[case], tmp_path)
    module, params = mamba_hybrid_from_hf(config, sd)
    assert_round_trip_and_reload(module, params, mamba_hybrid_to_hf(config, params), sd, tmp_path,
                                 config, ATOL, experts_implementation="eager")


def test_mamba_hybrid_errors_are_named():
    config = dict(BASE, model_type="bamba", attn_layer_indices=[1])
    with pytest.raises(ValueError, match=r"model_type'\] must be one of \('mamba', "
                                         r"'falcon_mamba', 'mamba2', 'bamba', "
                                         r"'granitemoehybrid', 'jamba'\), got 'zamba'"):
        mamba_hybrid_from_hf(dict(config, model_type="zamba"))
    with pytest.raises(ValueError, match=r"attn_layer_offset must be in \[0, attn_layer_period"
                                         r"\), got attn_layer_offset=2, attn_layer_period=2"):
        mamba_hybrid_from_hf(dict(config, model_type="jamba", attn_layer_period=2,
                                  attn_layer_offset=2))
    with pytest.raises(ValueError, match=r"lacks \['num_heads'\]: not a mamba2 config"):
        mamba_hybrid_from_hf(dict(config, model_type="mamba2"))
    with pytest.raises(ValueError, match="mamba_n_heads \\* mamba_d_head = 64 must be "
                                         "mamba_expand \\* hidden_size = 96"):
        mamba_hybrid_from_hf(dict(config, mamba_expand=3))
    with pytest.raises(ValueError, match="layer_types'\\] must list 'mamba' or 'attention'"):
        mamba_hybrid_from_hf(dict(BASE, model_type="granitemoehybrid", layer_types=["x"] * 4))
    module, _ = mamba_hybrid_from_hf(config)
    params = torchfn.Model(module).init(torchfn.random.key(0))
    sd = mamba_hybrid_to_hf(config, params)
    with pytest.raises(ValueError, match=r"has tensors a bamba does not: \['model.x'\]"):
        mamba_hybrid_from_hf(config, {**sd, "model.x": torch.zeros(1)})
    sd.pop("model.layers.0.mamba.D")
    with pytest.raises(ValueError, match=r"missing \['blocks.0.attn.D'\]"):
        mamba_hybrid_from_hf(config, sd)
