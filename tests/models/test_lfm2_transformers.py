"""``lfm2_from_hf`` / ``lfm2_to_hf`` and ``models.ShortConv`` against ``transformers``' LFM2
and LFM2-MoE: small random models saved with ``save_pretrained``, compared on logits,
both caches, greedy generation (left-padded too) and the round trip. Gated short
convolutions in most blocks, attention with per-head q/k norms in the others; LFM2-MoE's
sigmoid-routed mixtures with their expert bias as router state."""

from __future__ import annotations

import functools

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
MOE = dict(moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3, num_dense_layers=1,
           routed_scaling_factor=1.5)
CASES = {
    # tied embeddings, the MLP's width adjusted (2/3 of 72, times 1.5, up to 16s: 80)
    "lfm2": ("lfm2", dict(block_ffn_dim_multiplier=1.5, block_multiple_of=16)),
    # biased convolutions and projections, an untied head, a kernel of 4, the width as given
    "conv-bias": ("lfm2", dict(conv_bias=True, conv_L_cache=4, tie_word_embeddings=False,
                               block_auto_adjust_ff_dim=False)),
    # a dense MLP first, then mixtures with the expert bias
    "lfm2-moe": ("lfm2_moe", MOE),
    # no expert bias, weights not renormalised
    "lfm2-moe-plain": ("lfm2_moe", dict(MOE, use_expert_bias=False, norm_topk_prob=False)),
}
ATOL = 5e-6  # transformers normalises in float32, even in a float64 model


def checkpoint(case, tmp_path):
    """Also moves the expert biases (buffers, which the checkpoint helper leaves at 0)."""
    kind, extra = CASES[case]
    hf, config, _ = hf_checkpoint(kind, dict(BASE, **extra), tmp_path,
                                  experts_implementation="eager")
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=torch.Generator().manual_seed(5)))
    hf.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    return hf, config, load_file(tmp_path / "model.safetensors")


@pytest.mark.parametrize("case", list(CASES))
def test_a_transformers_checkpoint_gives_the_same_logits_caches_and_tokens(case, tmp_path):
    hf, config, sd = checkpoint(case, tmp_path)
    module, params, state = lfm2_from_hf(config, sd)
    biased = CASES[case][0] == "lfm2_moe" and CASES[case][1].get("use_expert_bias", True)
    assert set(state) == ({f"blocks.{i}.mlp.router_bias" for i in (1, 2, 3)} if biased
                          else set())
    assert_same_logits_caches_and_tokens(hf, module, params, ATOL, state=state)


@pytest.mark.parametrize("case", ["lfm2", "lfm2-moe"])
def test_greedy_generation_from_left_padded_prompts_equals_transformers(case, tmp_path):
    hf, config, sd = checkpoint(case, tmp_path)
    module, params, state = lfm2_from_hf(config, sd)
    bound = functools.partial(torchfn.Model(module).apply, state=state or None)
    assert_left_padded_generation_matches(hf, bound, params)


@pytest.mark.parametrize("case", list(CASES))
def test_lfm2_to_hf_gives_back_the_checkpoint_and_loads_in_transformers(case, tmp_path):
    hf, config, sd = checkpoint(case, tmp_path)
    module, params, state = lfm2_from_hf(config, sd)
    assert_round_trip_and_reload(module, params, lfm2_to_hf(config, params, state), sd,
                                 tmp_path, config, ATOL, state=state,
                                 experts_implementation="eager")


def test_lfm2_errors_are_named():
    config = dict(BASE, model_type="lfm2")
    with pytest.raises(ValueError, match=r"model_type'\] must be one of \('lfm2', 'lfm2_moe'\), "
                                         r"got 'llama'"):
        lfm2_from_hf(dict(config, model_type="llama"))
    with pytest.raises(ValueError, match=r"lacks \['vocab_size'\]: not an lfm2 config"):
        lfm2_from_hf({k: v for k, v in config.items() if k != "vocab_size"})
    with pytest.raises(ValueError, match=r"layer_types'\] must list 'conv' or 'full_attention'"):
        lfm2_from_hf(dict(config, layer_types=["mamba"] * 4))
    module, _, _ = lfm2_from_hf(config)
    sd = lfm2_to_hf(config, torchfn.Model(module).init(torchfn.random.key(0)))
    with pytest.raises(ValueError, match=r"has tensors a lfm2 does not: \['model.x'\]"):
        lfm2_from_hf(config, {**sd, "model.x": torch.zeros(1)})
    sd.pop("model.layers.0.conv.in_proj.weight")
    with pytest.raises(ValueError, match=r"missing \['blocks.0.attn.in_proj.weight'\]"):
        lfm2_from_hf(config, sd)
