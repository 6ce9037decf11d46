"""``minimax_from_hf`` / ``minimax_to_hf`` and ``models.LightningAttention`` against
``transformers``' MiniMax-01: small random models saved with ``save_pretrained``, compared
on logits, both caches, greedy generation (left-padded too) and the round trip. Lightning
attention (a fixed decay per head, by depth) and rotary attention, mixtures in every
block, each sublayer added to its normalised input with its own factors."""

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
from torchfn.models import lightning_slopes, minimax_from_hf, minimax_to_hf

transformers = pytest.importorskip(
    "transformers", reason="transformers (a dev dependency) is the peer these tests compare "
    "against")

BASE = dict(vocab_size=50, hidden_size=32, intermediate_size=24, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2, pad_token_id=0, block_size=8)
CASES = {
    # transformers' default alternation, every factor away from 1
    "minimax": dict(full_attn_alpha_factor=1.3, full_attn_beta_factor=0.7,
                    linear_attn_alpha_factor=0.9, linear_attn_beta_factor=1.2,
                    mlp_alpha_factor=1.1, mlp_beta_factor=0.8),
    # three lightning layers of four (as MiniMax-Text-01's seven of eight), wider heads
    "three-of-four": dict(layer_types=["linear_attention"] * 3 + ["full_attention"],
                          head_dim=16),
}
ATOL = 5e-6  # transformers normalises in float32, even in a float64 model


def checkpoint(case, tmp_path):
    return hf_checkpoint("minimax", dict(BASE, **CASES[case]), tmp_path,
                         experts_implementation="eager")


@pytest.mark.parametrize("case", list(CASES))
def test_a_transformers_checkpoint_gives_the_same_logits_caches_and_tokens(case, tmp_path):
    hf, config, sd = checkpoint(case, tmp_path)
    module, params = minimax_from_hf(config, sd)
    assert_same_logits_caches_and_tokens(hf, module, params, ATOL)


def test_greedy_generation_from_left_padded_prompts_equals_transformers(tmp_path):
    hf, config, sd = checkpoint("minimax", tmp_path)
    module, params = minimax_from_hf(config, sd)
    assert_left_padded_generation_matches(hf, torchfn.Model(module), params)


@pytest.mark.parametrize("case", list(CASES))
def test_minimax_to_hf_gives_back_the_checkpoint_and_loads_in_transformers(case, tmp_path):
    """The decay buffers too, recomputed from the slopes bit for bit."""
    hf, config, sd = checkpoint(case, tmp_path)
    module, params = minimax_from_hf(config, sd)
    assert_round_trip_and_reload(module, params, minimax_to_hf(config, params), sd, tmp_path,
                                 config, ATOL, experts_implementation="eager")


def test_the_slopes_are_transformers_and_a_foreign_slope_is_refused(tmp_path):
    hf, config, sd = checkpoint("minimax", tmp_path)
    for i, layer in enumerate(hf.model.layers):
        if hasattr(layer.self_attn, "slope_rate"):
            assert layer.self_attn.slope_rate.reshape(-1).tolist() == list(
                lightning_slopes(4, i, 4))
    name = "model.layers.1.self_attn.slope_rate"
    with pytest.raises(ValueError, match="is not MiniMax's slope for layer 1 of 4"):
        minimax_from_hf(config, {**sd, name: sd[name] * 2})


def test_the_layers_options_are_checked():
    from torchfn.models import LightningAttention, TransformerBlock, TransformerEncoder

    with pytest.raises(ValueError, match=r"slopes must be 4 numbers >= 0 \(one a head\), got "
                                         r"\(0.5,\)"):
        LightningAttention(32, 4, slopes=(0.5,))
    with pytest.raises(ValueError, match=r"normed_residual must be a dict of \(alpha, beta\) "
                                         r"pairs for 'attention', 'linear' and 'mlp'"):
        TransformerEncoder(32, 4, 1, normed_residual={"attn": (1, 1)})
    with pytest.raises(ValueError, match="normed_residual takes the sequential pre-norm block"):
        TransformerBlock(32, 4, normed_residual=((1, 1), (1, 1)), parallel=True)
    with pytest.raises(ValueError, match=r"layer_linear must be a list of depth = 2 bools \(or "
                                         r"dicts"):
        TransformerEncoder(32, 4, 2, linear_attention=dict(kind="lightning", heads=4),
                           layer_linear=[True, "yes"])


def test_minimax_errors_are_named():
    config = dict(BASE, model_type="minimax")
    with pytest.raises(ValueError, match=r"model_type'\] must be 'minimax', got 'mixtral'"):
        minimax_from_hf(dict(config, model_type="mixtral"))
    with pytest.raises(ValueError, match=r"sliding_window'\] = 8 is not supported"):
        minimax_from_hf(dict(config, sliding_window=8))
    with pytest.raises(ValueError, match=r"layer_types'\] must list 'linear_attention' or "
                                         r"'full_attention'"):
        minimax_from_hf(dict(config, layer_types=["x"] * 4))
    module, _ = minimax_from_hf(config)
    sd = minimax_to_hf(config, torchfn.Model(module).init(torchfn.random.key(0)))
    with pytest.raises(ValueError, match=r"has tensors a minimax does not: \['model.x'\]"):
        minimax_from_hf(config, {**sd, "model.x": torch.zeros(1)})
    sd.pop("model.layers.1.self_attn.qkv_proj.weight")
    with pytest.raises(ValueError, match=r"missing \['blocks.1.attn.qkv.weight'\]"):
        minimax_from_hf(config, sd)
