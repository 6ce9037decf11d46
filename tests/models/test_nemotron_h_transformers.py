"""``nemotron_h_from_hf`` / ``nemotron_h_to_hf`` against ``transformers``' Nemotron-H:
small random models saved with ``save_pretrained``, compared on logits, both caches,
greedy generation (left-padded too) and the round trip. Blocks of one part each: Mamba-2,
attention without positions, a squared-ReLU MLP, a DeepSeek-routed mixture."""

from __future__ import annotations

import functools

import pytest
import torch
from _hf_checks import (
    assert_left_padded_generation_matches,
    assert_round_trip_and_reload,
    assert_same_logits_caches_and_tokens,
)
from _hf_checks import hf_checkpoint as _hf_checkpoint

import torchfn
from torchfn.models import nemotron_h_from_hf, nemotron_h_to_hf

transformers = pytest.importorskip(
    "transformers", reason="transformers (a dev dependency) is the peer these tests compare "
    "against")

BASE = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, mamba_num_heads=4, mamba_head_dim=16,
            ssm_state_size=8, n_groups=2, pad_token_id=0)
CASES = {
    # Nemotron Nano 2's kinds of block: Mamba-2, MLP, attention
    "nano": dict(hybrid_override_pattern="M-M*-M"),
    # Nemotron 3 Nano's mixture: sigmoid scores, two groups of which one competes, a
    # selection bias (state), scaled weights, a shared expert
    "moe": dict(hybrid_override_pattern="ME*EM-", n_routed_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=12, moe_shared_expert_intermediate_size=20, n_group=2,
                topk_group=1, routed_scaling_factor=1.5),
}
ATOL = 5e-6  # transformers runs the scan in float32, even in a float64 model


# Before 5.25 transformers' mixer clamped the step sizes below at time_step_min and
# ignored time_step_limit (huggingface/transformers#48989); torchfn follows the config's
# time_step_limit, as NVIDIA's implementation does. On those versions the checkpoints
# here state the limit that transformers applies, so both sides clamp alike.
OLD_CLAMP = tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 25)


def hf_checkpoint(extra, tmp_path):
    config = dict(BASE, **extra)
    if OLD_CLAMP:
        config["time_step_limit"] = (config.get("time_step_min", 0.001), float("inf"))
    return _hf_checkpoint("nemotron_h", config, tmp_path, experts_implementation="eager")


def load(hf, config, sd, tmp_path):
    """Move the selection biases off 0 (in the model and the folder), then read it."""
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(0.3 * torch.randn_like(b))
    hf.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    sd = load_file(tmp_path / "model.safetensors")
    return sd, nemotron_h_from_hf(config, sd)


@pytest.mark.parametrize("case", list(CASES))
def test_a_transformers_checkpoint_gives_the_same_logits_caches_and_tokens(case, tmp_path):
    hf, config, sd = hf_checkpoint(CASES[case], tmp_path)
    sd, (module, params, state) = load(hf, config, sd, tmp_path)
    assert sorted(state) == ([f"blocks.{i}.mlp.router_bias" for i in (1, 3)]
                             if case == "moe" else [])
    assert_same_logits_caches_and_tokens(hf, module, params, ATOL, state=state)


def test_greedy_generation_from_left_padded_prompts_equals_transformers(tmp_path):
    hf, config, sd = hf_checkpoint(CASES["moe"], tmp_path)
    sd, (module, params, state) = load(hf, config, sd, tmp_path)
    run = functools.partial(torchfn.Model(module).apply, state=state)
    assert_left_padded_generation_matches(hf, run, params)


@pytest.mark.parametrize("case", list(CASES))
def test_nemotron_h_to_hf_gives_back_the_checkpoint_and_loads_in_transformers(case, tmp_path):
    hf, config, sd = hf_checkpoint(CASES[case], tmp_path)
    sd, (module, params, state) = load(hf, config, sd, tmp_path)
    assert_round_trip_and_reload(module, params, nemotron_h_to_hf(config, params, state), sd,
                                 tmp_path, config, ATOL, state=state,
                                 experts_implementation="eager")


def test_the_step_sizes_are_clamped_to_time_step_limit_not_time_step_min():
    config = dict(BASE, model_type="nemotron_h", hybrid_override_pattern="M-", time_step_min=0.01)
    assert nemotron_h_from_hf(config)[0].blocks[0].attn.dt_limit == (0.0, float("inf"))
    limited = dict(config, time_step_limit=[0.001, 0.5])
    assert nemotron_h_from_hf(limited)[0].blocks[0].attn.dt_limit == (0.001, 0.5)


def test_nemotron_h_errors_are_named():
    config = dict(BASE, model_type="nemotron_h", hybrid_override_pattern="M-*-")
    with pytest.raises(ValueError, match=r"model_type'\] must be one of \('nemotron_h',\), "
                                         r"got 'mamba2'"):
        nemotron_h_from_hf(dict(config, model_type="mamba2"))
    with pytest.raises(ValueError, match=r"mlp_hidden_act'\] = 'gelu' is not supported"):
        nemotron_h_from_hf(dict(config, mlp_hidden_act="gelu"))
    with pytest.raises(ValueError, match=r"moe_latent_size'\] = 8 is not supported"):
        nemotron_h_from_hf(dict(config, moe_latent_size=8))
    with pytest.raises(ValueError, match=r"layers_block_type'\] must list"):
        nemotron_h_from_hf(dict(config, hybrid_override_pattern="M-X-"))
    module, _, _ = nemotron_h_from_hf(config)
    params = torchfn.Model(module).init(torchfn.random.key(0))
    sd = nemotron_h_to_hf(config, params)
    with pytest.raises(ValueError, match=r"has tensors a Nemotron-H does not: \['backbone.x'\]"):
        nemotron_h_from_hf(config, {**sd, "backbone.x": torch.zeros(1)})
    sd.pop("backbone.layers.1.mixer.up_proj.weight")
    with pytest.raises(ValueError, match=r"missing \['blocks.1.mlp.0.weight'\]"):
        nemotron_h_from_hf(config, sd)
