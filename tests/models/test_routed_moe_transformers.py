"""``routed_moe_from_hf`` / ``routed_moe_to_hf`` against ``transformers``' ERNIE 4.5 MoE and
MiniMax-M2: small random models saved with ``save_pretrained`` (their selection biases
large enough to change which experts are chosen), compared on logits, both caches, greedy
generation (left-padded too) and the round trip."""

from __future__ import annotations

import functools

import pytest
import torch
from _hf_checks import (
    assert_left_padded_generation_matches,
    assert_round_trip_and_reload,
    assert_same_logits_caches_and_tokens,
)
from safetensors.torch import load_file

import torchfn
from torchfn.models import routed_moe_from_hf, routed_moe_to_hf

transformers = pytest.importorskip(
    "transformers", reason="transformers (a dev dependency) is the peer these tests compare "
    "against")

BASE = dict(vocab_size=50, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=2,
            eos_token_id=1)
CASES = {
    # softmax scores, 2 shared experts, the first layer dense, interleaved rotary pairs
    "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=12,
                         moe_num_shared_experts=2, head_dim=8),
    # sigmoid scores, q/k norms over all heads, half of each head rotated
    "minimax_m2": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8, rotary_dim=4),
    # EXAONE 4's attention (windows of 4 on three layers of four, NoPE on the fourth) in
    # pre-norm blocks; V3's router: 2 groups of 2 experts, 1 chosen, scaled weights
    "exaone_moe": dict(num_hidden_layers=4, sliding_window=4, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=12, n_group=2,
                       topk_group=1, routed_scaling_factor=2.5, head_dim=8),
    # Arcee Trinity: sandwich norms, gated attention, windows of 4 but on the fourth layer
    # (no rotary there), sigmoid scores times route_scale, muP embeddings
    "afmoe": dict(num_hidden_layers=4, sliding_window=4, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=12, num_shared_experts=1, route_scale=2.0,
                  mup_enabled=True, head_dim=8),
    # MiMo-V2-Flash: windows of 4 (twice the kv heads, sinks) between two global layers,
    # values 12 wide (of 24) and scaled, q/k/v biases, a rotated fraction per layer type
    # (8 and 12 of 24, one base: the two need their own rotary tables), V3's router without
    # shared experts, the first layer dense
    "mimo_v2_flash": dict(
        num_hidden_layers=4, sliding_window=4, head_dim=24, v_head_dim=12,
        attention_bias=True, attention_value_scale=0.707, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=12, n_group=2, topk_group=1,
        routed_scaling_factor=2.0,
        layer_types=["full_attention", "sliding_attention", "sliding_attention",
                     "full_attention"],
        rope_parameters={"full_attention": dict(rope_type="default", rope_theta=5e6,
                                                partial_rotary_factor=0.334),
                         "sliding_attention": dict(rope_type="default", rope_theta=5e6,
                                                   partial_rotary_factor=0.5)}),
}
ATOL = 5e-6  # transformers routes in float32 and normalises in float32, even in float64


def checkpoint(kind, folder):
    config = transformers.AutoConfig.for_model(kind, **dict(BASE, **CASES[kind]))
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float64, experts_implementation="eager").eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
        for name, t in [*hf.named_parameters(), *hf.named_buffers()]:
            if name.endswith("e_score_correction_bias"):  # big enough to change choices
                t.copy_(0.3 * torch.randn_like(t))
    hf.save_pretrained(folder)
    return hf, config.to_dict(), load_file(folder / "model.safetensors")


@pytest.mark.parametrize("kind", list(CASES))
def test_a_transformers_checkpoint_gives_the_same_logits_caches_and_tokens(kind, tmp_path):
    hf, config, sd = checkpoint(kind, tmp_path)
    module, params, state = routed_moe_from_hf(config, sd)
    layers = {"ernie4_5_moe": range(1, 3), "minimax_m2": range(3), "exaone_moe": range(1, 4),
              "afmoe": range(1, 4), "mimo_v2_flash": range(1, 4)}
    assert sorted(state) == [f"blocks.{i}.mlp.router_bias" for i in layers[kind]]
    assert_same_logits_caches_and_tokens(hf, module, params, ATOL, state=state)


def test_greedy_generation_from_left_padded_prompts_equals_transformers(tmp_path):
    hf, config, sd = checkpoint("minimax_m2", tmp_path)
    module, params, state = routed_moe_from_hf(config, sd)
    model = functools.partial(torchfn.Model(module).apply, state=state)
    assert_left_padded_generation_matches(hf, model, params)


@pytest.mark.parametrize("kind", list(CASES))
def test_routed_moe_to_hf_gives_back_the_checkpoint_and_loads_in_transformers(kind, tmp_path):
    hf, config, sd = checkpoint(kind, tmp_path)
    module, params, state = routed_moe_from_hf(config, sd)
    assert_round_trip_and_reload(module, params, routed_moe_to_hf(config, params, state), sd,
                                 tmp_path, config, ATOL, state=state,
                                 experts_implementation="eager")


def test_the_selection_bias_matters_and_errors_are_named(tmp_path):
    """Zeroing the bias (the state) changes the logits: it is read, not ignored."""
    hf, config, sd = checkpoint("ernie4_5_moe", tmp_path)
    module, params, state = routed_moe_from_hf(config, sd)
    model = torchfn.Model(module)
    tokens = torch.randint(3, 50, (2, 11), generator=torch.Generator().manual_seed(1))
    zero = {n: torch.zeros_like(t) for n, t in state.items()}
    assert not torch.allclose(model.apply(params, tokens, state=state),
                              model.apply(params, tokens, state=zero), atol=1e-3)
    with pytest.raises(ValueError, match=r"model_type'\] must be one of \('ernie4_5_moe', "
                                         r"'minimax_m2', 'exaone_moe', 'afmoe', "
                                         r"'mimo_v2_flash'\), got "
                                         r"'mixtral'"):
        routed_moe_from_hf(dict(config, model_type="mixtral"))
    with pytest.raises(ValueError, match=r"use_bias'\] = True is not supported"):
        routed_moe_from_hf(dict(config, use_bias=True))
    with pytest.raises(ValueError, match=r"has tensors a ernie4_5_moe does not: \['model.x'\]"):
        routed_moe_from_hf(config, {**sd, "model.x": torch.zeros(1)})
    sd.pop("model.layers.1.mlp.moe_statics.e_score_correction_bias")
    with pytest.raises(ValueError, match=r"state_dict \(state\).*missing \['blocks.1.mlp."
                                         r"router_bias'\]"):
        routed_moe_from_hf(config, sd)
