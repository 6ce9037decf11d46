"""``llama4_from_hf`` / ``llama4_to_hf`` against ``transformers``' Llama 4 text model: small
random models saved with ``save_pretrained``, compared on logits, both KV caches, greedy
generation (left-padded too) and the round trip. The chunk (5) and the temperature's
floor scale (4) are small enough that 20 tokens cross both."""

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
    llama4_from_hf,
    llama4_to_hf,
)

transformers = pytest.importorskip(
    "transformers", reason="transformers (a dev dependency) is the peer these tests compare "
    "against")

BASE = dict(vocab_size=50, hidden_size=32, intermediate_size=16, intermediate_size_mlp=48,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            num_local_experts=4, attention_chunk_size=5, floor_scale=4, attn_scale=0.3,
            max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
CASES = {
    # every layer a mixture, q/k norms on the rotary layers, Llama 3 rope scaling
    "scout": dict(rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=4.0,
                                       low_freq_factor=1.0, high_freq_factor=4.0,
                                       original_max_position_embeddings=16)),
    # dense and mixture layers alternating, no q/k norms, two experts a token, biases
    "maverick": dict(interleave_moe_layer_step=2, use_qk_norm=False, num_experts_per_tok=2,
                     attention_bias=True),
}
ATOL = 1e-5  # transformers rotates in float32, even a float64 model


def hf_checkpoint(extra, tmp_path):
    return _hf_checkpoint("llama4_text", dict(BASE, **extra), tmp_path,
                          init=lambda p: p.normal_(0.0, 0.2), attn_implementation="eager")


@pytest.mark.parametrize("case", list(CASES))
def test_a_transformers_checkpoint_gives_the_same_logits_caches_and_tokens(case, tmp_path):
    hf, config, sd = hf_checkpoint(CASES[case], tmp_path)
    module, params = llama4_from_hf(config, sd)
    assert_same_logits_caches_and_tokens(hf, module, params, ATOL, steps=12)


def test_greedy_generation_from_left_padded_prompts_equals_transformers(tmp_path):
    """The chunks count each row's own tokens."""
    hf, config, sd = hf_checkpoint(CASES["scout"], tmp_path)
    module, params = llama4_from_hf(config, sd)
    assert_left_padded_generation_matches(hf, torchfn.Model(module), params, steps=10)


@pytest.mark.parametrize("case", list(CASES))
def test_llama4_to_hf_gives_back_the_checkpoint_and_loads_in_transformers(case, tmp_path):
    hf, config, sd = hf_checkpoint(CASES[case], tmp_path)
    module, params = llama4_from_hf(config, sd)
    assert_round_trip_and_reload(module, params, llama4_to_hf(config, params), sd, tmp_path,
                                 config, ATOL, attn_implementation="eager")


def test_a_multimodal_checkpoint_loads_its_text_model(tmp_path):
    """``model_type="llama4"``: the ``text_config`` is read, ``language_model.`` names
    are the text model's and the vision tower's tensors are skipped; exporting to it is
    refused (its checkpoint needs the vision tower)."""
    _, text, sd = hf_checkpoint(CASES["scout"], tmp_path)
    config = {"model_type": "llama4", "text_config": text, "vision_config": {}}
    multi = {f"language_model.{n}": t for n, t in sd.items()}
    multi["vision_model.patch_embedding.linear.weight"] = torch.zeros(2, 2)
    multi["multi_modal_projector.linear_1.weight"] = torch.zeros(2, 2)
    _, want = llama4_from_hf(text, sd)
    _, got = llama4_from_hf(config, multi)
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    with pytest.raises(ValueError, match="needs the vision tower; pass config"):
        llama4_to_hf(config, got)


def test_llama4_errors_are_named():
    config = dict(BASE, model_type="llama4_text")
    with pytest.raises(ValueError, match=r"model_type'\] must be one of \('llama4_text', "
                                         r"'llama4'\), got 'llama'"):
        llama4_from_hf(dict(config, model_type="llama"))
    with pytest.raises(ValueError, match=r"hidden_act'\] = 'gelu' is not supported"):
        llama4_from_hf(dict(config, hidden_act="gelu"))
    with pytest.raises(ValueError, match=r"text_config'\] must be a dict"):
        llama4_from_hf({"model_type": "llama4"})
    with pytest.raises(ValueError, match="one entry per layer"):
        llama4_from_hf(dict(config, no_rope_layers=[1, 0]))
    module, _ = llama4_from_hf(config)
    params = torchfn.Model(module).init(torchfn.random.key(0))
    sd = llama4_to_hf(config, params)
    with pytest.raises(ValueError, match=r"has tensors a Llama 4 does not: \['model.x'\]"):
        llama4_from_hf(config, {**sd, "model.x": torch.zeros(1)})
    sd.pop("model.layers.1.feed_forward.experts.down_proj")
    with pytest.raises(ValueError, match=r"missing \['blocks.1.mlp.down'\]"):
        llama4_from_hf(config, sd)
    with pytest.raises(ValueError, match=r"params does not fit the config: missing"):
        llama4_to_hf(config, {n: t for n, t in params.items() if n != "embed.weight"})
