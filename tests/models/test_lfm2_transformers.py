"""``lfm2_from_hf`` / ``lfm2_to_hf`` and ``models.ShortConv`` against ``transformers``' LFM2:
small random models saved with ``save_pretrained``, compared on logits, both caches,
greedy generation (left-padded too) and the round trip. Gated short convolutions in most
blocks, attention with per-head q/k norms in the others."""

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
from torchfn.models import lfm2_from_hf, lfm2_to_hf

transformers = pytest.importorskip(
    "transformers", reason="transformers (a dev dependency) is the peer these tests compare "
    "against")

BASE = dict(vocab_size=50, hidden_size=32, intermediate_size=72, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
            layer_types=["conv", "full_attention", "conv", "conv"])
CASES = {
    # tied embeddings, the MLP's width adjusted (2/3 of 72, times 1.5, up to 16s: 80)
    "lfm2": dict(block_ffn_dim_multiplier=1.5, block_multiple_of=16),
    # biased convolutions and projections, an untied head, a kernel of 4, the width as given
    "conv-bias": dict(conv_bias=True, conv_L_cache=4, tie_word_embeddings=False,
                      block_auto_adjust_ff_dim=False),
}
ATOL = 5e-6  # transformers normalises in float32, even in a float64 model


def checkpoint(case, tmp_path):
    return hf_checkpoint("lfm2", dict(BASE, **CASES[case]), tmp_path)


@pytest.mark.parametrize("case", list(CASES))
def test_a_transformers_checkpoint_gives_the_same_logits_caches_and_tokens(case, tmp_path):
    hf, config, sd = checkpoint(case, tmp_path)
    module, params = lfm2_from_hf(config, sd)
    assert_same_logits_caches_and_tokens(hf, module, params, ATOL)


def test_greedy_generation_from_left_padded_prompts_equals_transformers(tmp_path):
    hf, config, sd = checkpoint("lfm2", tmp_path)
    module, params = lfm2_from_hf(config, sd)
    assert_left_padded_generation_matches(hf, torchfn.Model(module), params)


@pytest.mark.parametrize("case", list(CASES))
def test_lfm2_to_hf_gives_back_the_checkpoint_and_loads_in_transformers(case, tmp_path):
    hf, config, sd = checkpoint(case, tmp_path)
    module, params = lfm2_from_hf(config, sd)
    assert_round_trip_and_reload(module, params, lfm2_to_hf(config, params), sd, tmp_path,
                                 config, ATOL)


def test_lfm2_errors_are_named():
    config = dict(BASE, model_type="lfm2")
    with pytest.raises(ValueError, match=r"model_type'\] must be 'lfm2', got 'llama'"):
        lfm2_from_hf(dict(config, model_type="llama"))
    with pytest.raises(ValueError, match=r"lacks \['vocab_size'\]: not an lfm2 config"):
        lfm2_from_hf({k: v for k, v in config.items() if k != "vocab_size"})
    with pytest.raises(ValueError, match=r"layer_types'\] must list 'conv' or 'full_attention'"):
        lfm2_from_hf(dict(config, layer_types=["mamba"] * 4))
    module, _ = lfm2_from_hf(config)
    sd = lfm2_to_hf(config, torchfn.Model(module).init(torchfn.random.key(0)))
    with pytest.raises(ValueError, match=r"has tensors a lfm2 does not: \['model.x'\]"):
        lfm2_from_hf(config, {**sd, "model.x": torch.zeros(1)})
    sd.pop("model.layers.0.conv.in_proj.weight")
    with pytest.raises(ValueError, match=r"missing \['blocks.0.attn.in_proj.weight'\]"):
        lfm2_from_hf(config, sd)
