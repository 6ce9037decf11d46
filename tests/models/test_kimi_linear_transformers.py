"""``kimi_linear_from_hf`` / ``kimi_linear_to_hf`` and ``models.KimiDeltaAttention`` against
``transformers``' Kimi Linear: the layer with the same weights; small random models saved
with ``save_pretrained``, compared on logits, both caches, greedy generation (left-padded
too) and the round trip. Kimi Delta Attention blocks, latent attention without position
embedding, DeepSeek-V3's mixture with its router state."""

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
from torchfn import random
from torchfn.models import KimiDeltaAttention, kimi_linear_from_hf, kimi_linear_to_hf

transformers = pytest.importorskip(
    "transformers", reason="transformers (a dev dependency) is the peer these tests compare "
    "against")

BASE = dict(vocab_size=50, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=6, num_experts=8,
            num_experts_per_tok=2, n_group=2, topk_group=1, linear_head_dim=6,
            linear_num_heads=4, routed_scaling_factor=1.5, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
CASES = {
    # KDA, KDA, latent attention, KDA; a dense MLP first, then mixtures
    "kimi-linear": dict(layer_types=["linear_attention", "linear_attention", "full_attention",
                                     "linear_attention"],
                        mlp_layer_types=["dense", "sparse", "sparse", "sparse"]),
    # a low-rank query, weights not renormalised, every MLP a mixture
    "q-rank": dict(q_lora_rank=12, norm_topk_prob=False,
                   layer_types=["full_attention", "linear_attention", "linear_attention",
                                "full_attention"],
                   mlp_layer_types=["sparse"] * 4),
}
ATOL = 5e-5  # transformers runs the delta rule and the router in float32, even in float64


def checkpoint(case, tmp_path):
    """Also moves the router biases (buffers, which the checkpoint helper leaves at 0)."""
    hf, config, _ = hf_checkpoint("kimi_linear", dict(BASE, **CASES[case]), tmp_path,
                                  experts_implementation="eager")
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=torch.Generator().manual_seed(5)))
    hf.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    return hf, config, load_file(tmp_path / "model.safetensors")


def test_the_layer_equals_transformers_kimi_delta_attention():
    from transformers.models.kimi_linear import modeling_kimi_linear

    config = transformers.AutoConfig.for_model(
        "kimi_linear", **dict(BASE, num_hidden_layers=1, layer_types=["linear_attention"]))
    torch.manual_seed(0)
    hf = modeling_kimi_linear.KimiLinearDeltaAttention(config, 0).double()
    with torch.no_grad():  # (built alone, its decay parameters are left uninitialised)
        hf.forget_gate.A_log.copy_(torch.linspace(1.0, 16.0, 4).log().reshape(1, 1, 4, 1))
        hf.forget_gate.dt_bias.copy_(torch.linspace(-3.0, 1.0, 24))
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    sd = {f"model.layers.0.self_attn.{n.replace('forget_gate.', '')}": t
          for n, t in hf.state_dict().items()}
    conv = sd.pop("model.layers.0.self_attn.conv1d.weight")  # transformers joins them
    for p, part in zip("qkv", conv.chunk(3)):
        sd[f"model.layers.0.self_attn.{p}_conv1d.weight"] = part
    _, params, _ = kimi_linear_from_hf(
        dict(config.to_dict(), mlp_layer_types=["dense"]),
        {**sd, **{n: t for n, t in _other_tensors(config).items()}})
    params = {n[len("blocks.0.attn."):]: t for n, t in params.items()
              if n.startswith("blocks.0.attn.")}
    model = torchfn.Model(KimiDeltaAttention(32, 4, head_dim=6))
    x = random.normal(random.key(1), (2, 70, 32), torch.float64)
    with torch.no_grad():
        want = hf(x)
    torch.testing.assert_close(model.apply(params, x), want, rtol=0, atol=2e-5)


def _other_tensors(config):
    """A one-layer checkpoint's tensors besides its attention: embedding, norms, MLP."""
    dim, hidden = config.hidden_size, config.intermediate_size
    zeros = {"model.embed_tokens.weight": (50, dim), "model.norm.weight": (dim,),
             "lm_head.weight": (50, dim), "model.layers.0.input_layernorm.weight": (dim,),
             "model.layers.0.post_attention_layernorm.weight": (dim,),
             "model.layers.0.mlp.gate_proj.weight": (hidden, dim),
             "model.layers.0.mlp.up_proj.weight": (hidden, dim),
             "model.layers.0.mlp.down_proj.weight": (dim, hidden)}
    return {n: torch.zeros(s, dtype=torch.float64) for n, s in zeros.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_a_transformers_checkpoint_gives_the_same_logits_caches_and_tokens(case, tmp_path):
    hf, config, sd = checkpoint(case, tmp_path)
    module, params, state = kimi_linear_from_hf(config, sd)
    assert set(state) == {f"blocks.{i}.mlp.router_bias" for i in range(4)
                          if module.blocks[i].moe}
    assert_same_logits_caches_and_tokens(hf, module, params, ATOL, state=state)


def test_greedy_generation_from_left_padded_prompts_equals_transformers(tmp_path):
    import functools

    hf, config, sd = checkpoint("kimi-linear", tmp_path)
    module, params, state = kimi_linear_from_hf(config, sd)
    bound = functools.partial(torchfn.Model(module).apply, state=state)  # the router state
    assert_left_padded_generation_matches(hf, bound, params)


@pytest.mark.parametrize("case", list(CASES))
def test_kimi_linear_to_hf_gives_back_the_checkpoint_and_loads_in_transformers(case, tmp_path):
    hf, config, sd = checkpoint(case, tmp_path)
    module, params, state = kimi_linear_from_hf(config, sd)
    assert_round_trip_and_reload(module, params, kimi_linear_to_hf(config, params, state), sd,
                                 tmp_path, config, ATOL, state=state,
                                 experts_implementation="eager")


def test_kimi_linear_errors_are_named():
    config = dict(BASE, model_type="kimi_linear", layer_types=["linear_attention"] * 4)
    with pytest.raises(ValueError, match=r"model_type'\] must be 'kimi_linear', got 'x'"):
        kimi_linear_from_hf(dict(config, model_type="x"))
    with pytest.raises(ValueError, match=r"lacks \['kv_lora_rank'\]: not a kimi_linear"):
        kimi_linear_from_hf({k: v for k, v in config.items() if k != "kv_lora_rank"})
    with pytest.raises(ValueError, match=r"attention_bias'\] = True is not supported"):
        kimi_linear_from_hf(dict(config, attention_bias=True))
    with pytest.raises(ValueError, match=r"layer_types'\] must list 'linear_attention' or "
                                         r"'full_attention' for each of 4 layers"):
        kimi_linear_from_hf(dict(config, layer_types=["mamba"] * 4))
    module, _, _ = kimi_linear_from_hf(config)
    model = torchfn.Model(module)
    sd = kimi_linear_to_hf(config, model.init(random.key(0)), model.init_state())
    with pytest.raises(ValueError, match=r"has tensors a kimi_linear does not: \['model.x'\]"):
        kimi_linear_from_hf(config, {**sd, "model.x": torch.zeros(1)})
    sd.pop("model.layers.0.self_attn.A_log")
    with pytest.raises(ValueError, match=r"missing \['blocks.0.attn.A_log'\]"):
        kimi_linear_from_hf(config, sd)
