"""``bailing_hybrid_from_hf`` / ``bailing_hybrid_to_hf`` against ``transformers``' Ling 3
hybrid (``bailing_hybrid``): small random models saved with ``save_pretrained``, compared on
logits, both caches, greedy generation (left-padded too) and the round trip. Kimi Delta
Attention with full-rank gates and a bounded ("safe") decay, rotary latent attention
gated per head, DeepSeek-V3's mixture with its router state."""

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
from safetensors.torch import load_file

import torchfn
from torchfn import random
from torchfn.models import bailing_hybrid_from_hf, bailing_hybrid_to_hf

transformers = pytest.importorskip(
    "transformers", reason="transformers (a dev dependency) is the peer these tests compare "
    "against")

BASE = dict(vocab_size=50, hidden_size=32, intermediate_size=40, moe_intermediate_size=12,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, head_dim=6,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
            num_local_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
            routed_scaling_factor=1.5, first_k_dense_replace=1, layer_group_size=3,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
CASES = {
    # KDA (bounded decay), KDA, gated latent attention with a low-rank query; a dense MLP
    # first, then mixtures
    "ling3": dict(q_lora_rank=24),
    # the unbounded decay, latent attention first with the full query projection
    "unsafe": dict(kda_safe_gate=False, q_lora_rank=None,
                   layer_types=["full_attention", "linear_attention", "linear_attention"]),
}
ATOL = 5e-5  # transformers runs the delta rule and the router in float32, even in float64


def checkpoint(case, tmp_path):
    """Also moves the router biases (buffers, which the checkpoint helper leaves at 0)."""
    hf, config, _ = hf_checkpoint("bailing_hybrid", dict(BASE, **CASES[case]), tmp_path,
                                  experts_implementation="eager")
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=torch.Generator().manual_seed(5)))
    hf.save_pretrained(tmp_path)
    return hf, config, load_file(tmp_path / "model.safetensors")


@pytest.mark.parametrize("case", list(CASES))
def test_a_transformers_checkpoint_gives_the_same_logits_caches_and_tokens(case, tmp_path):
    hf, config, sd = checkpoint(case, tmp_path)
    module, params, state = bailing_hybrid_from_hf(config, sd)
    kinds = [type(b.attn).__name__ for b in module.blocks]
    assert kinds.count("KimiDeltaAttention") == 2 and kinds.count("LatentAttention") == 1
    assert set(state) == {"blocks.1.mlp.router_bias", "blocks.2.mlp.router_bias"}
    assert_same_logits_caches_and_tokens(hf, module, params, ATOL, state=state)


def test_greedy_generation_from_left_padded_prompts_equals_transformers(tmp_path):
    hf, config, sd = checkpoint("ling3", tmp_path)
    module, params, state = bailing_hybrid_from_hf(config, sd)
    bound = functools.partial(torchfn.Model(module).apply, state=state)  # the router state
    assert_left_padded_generation_matches(hf, bound, params)


@pytest.mark.parametrize("case", list(CASES))
def test_bailing_hybrid_to_hf_gives_back_the_checkpoint_and_loads_in_transformers(
        case, tmp_path):
    hf, config, sd = checkpoint(case, tmp_path)
    module, params, state = bailing_hybrid_from_hf(config, sd)
    assert_round_trip_and_reload(module, params, bailing_hybrid_to_hf(config, params, state),
                                 sd, tmp_path, config, ATOL, state=state,
                                 experts_implementation="eager")


def test_bailing_hybrid_errors_are_named():
    config = dict(BASE, model_type="bailing_hybrid")
    with pytest.raises(ValueError, match=r"model_type'\] must be 'bailing_hybrid', got 'x'"):
        bailing_hybrid_from_hf(dict(config, model_type="x"))
    with pytest.raises(ValueError, match=r"lacks \['kv_lora_rank'\]: not a bailing_hybrid"):
        bailing_hybrid_from_hf({k: v for k, v in config.items() if k != "kv_lora_rank"})
    with pytest.raises(ValueError, match=r"attention_bias'\] = True is not supported"):
        bailing_hybrid_from_hf(dict(config, attention_bias=True))
    with pytest.raises(ValueError, match=r"layer_types'\] must list \['full_attention', "
                                         r"'linear_attention'\] for each of 3 layers"):
        bailing_hybrid_from_hf(dict(config, layer_types=["mamba"] * 3))
    module, _, _ = bailing_hybrid_from_hf(config)
    model = torchfn.Model(module)
    sd = bailing_hybrid_to_hf(config, model.init(random.key(0)), model.init_state())
    with pytest.raises(ValueError, match=r"has tensors a bailing_hybrid does not: "
                                         r"\['model.x'\]"):
        bailing_hybrid_from_hf(config, {**sd, "model.x": torch.zeros(1)})
    sd.pop("model.layers.0.attention.f_proj.weight")
    with pytest.raises(ValueError, match=r"missing \['blocks.0.attn.f.weight'\]"):
        bailing_hybrid_from_hf(config, sd)
