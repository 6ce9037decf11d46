"""``models.from_transformers``: a transformers model in memory, whose weights transformers 5
keeps under other names and shapes than its checkpoints (fused experts, joined
convolutions), gives the logits it gives itself, for a model of each family with such
weights, and of a plain one; bad input is named."""

from __future__ import annotations

import pytest
import torch

import torchfn
from torchfn.models import from_transformers

transformers = pytest.importorskip(
    "transformers", reason="transformers (a dev dependency) is the peer these tests compare "
    "against")

BASE = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)
MLA = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
           num_key_value_heads=4)  # (transformers repeats its latent keys per head)
CASES = {  # kind, config, atol (transformers normalises in float32 even in float64 models;
    # the recurrent rules and routers too in some: more)
    "llama": ("llama", {}, 5e-6),
    "mixtral": ("mixtral", dict(num_local_experts=4), 5e-6),
    "phimoe": ("phimoe", dict(num_local_experts=4, router_jitter_noise=0.5), 5e-6),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=4, moe_intermediate_size=16,
                                    shared_expert_intermediate_size=16), 5e-6),
    "jamba": ("jamba", dict(num_experts=4, attn_layer_period=2, attn_layer_offset=1,
                            expert_layer_period=2, expert_layer_offset=0), 5e-6),
    "minimax": ("minimax", dict(num_local_experts=4, block_size=8,
                                layer_types=["linear_attention", "full_attention"]), 5e-6),
    "kimi_linear": ("kimi_linear", dict(MLA, num_experts=4, moe_intermediate_size=16,
                                        linear_head_dim=8, linear_num_heads=4,
                                        layer_types=["linear_attention", "full_attention"],
                                        mlp_layer_types=["dense", "sparse"]), 5e-5),
    "lfm2_moe": ("lfm2_moe", dict(num_experts=4, moe_intermediate_size=16, num_dense_layers=1,
                                  layer_types=["conv", "full_attention"]), 5e-6),
    "deepseek_v3": ("deepseek_v3", dict(MLA, n_routed_experts=4, moe_intermediate_size=16,
                                        first_k_dense_replace=1, n_group=1, topk_group=1),
                    5e-6),
    "deepseek_v32": ("deepseek_v32", dict(MLA, n_routed_experts=4, moe_intermediate_size=16,
                                          first_k_dense_replace=1, n_group=1, topk_group=1,
                                          q_lora_rank=24, index_topk=4, index_head_dim=16,
                                          index_n_heads=8), 5e-6),  # sparse past 4 keys
    "mimo_v2_flash": ("mimo_v2_flash", dict(n_routed_experts=4, moe_intermediate_size=16,
                                            head_dim=24, v_head_dim=12, sliding_window=4),
                      5e-6),  # sinks in memory as self_attn.sinks
    "bailing_hybrid": ("bailing_hybrid", dict(MLA, num_local_experts=4, moe_intermediate_size=16,
                                              head_dim=8, q_lora_rank=24, layer_group_size=2,
                                              first_k_dense_replace=1, n_group=2,
                                              topk_group=1), 5e-5),
    "jetmoe": ("jetmoe", dict(kv_channels=8, num_local_experts=4), 5e-6),
    "granitemoehybrid": ("granitemoehybrid", dict(num_local_experts=4, mamba_n_heads=4,
                                                  mamba_d_head=16, mamba_d_state=8,
                                                  layer_types=["mamba", "attention"]), 5e-6),
    "qwen3_next": ("qwen3_next", dict(num_experts=4, moe_intermediate_size=16,
                                      shared_expert_intermediate_size=16, head_dim=8,
                                      linear_num_value_heads=4, linear_num_key_heads=2,
                                      linear_key_head_dim=8, linear_value_head_dim=8,
                                      layer_types=["linear_attention", "full_attention"]),
                   5e-5),
    "olmo_hybrid": ("olmo_hybrid", dict(num_hidden_layers=4), 1e-5),  # convolutions joined
    "recurrent_gemma": ("recurrent_gemma", dict(num_hidden_layers=3, num_key_value_heads=1,
                                                attention_window_size=8), 2e-5),
    "xlstm": ("xlstm", dict(hidden_size=128, num_heads=4, chunk_size=8), 2e-5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_model_in_memory_gives_its_own_logits(case):
    kind, extra, atol = CASES[case]
    config = transformers.AutoConfig.for_model(kind, **dict(BASE, **extra))
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float64, experts_implementation="eager").eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    module, params, state, _ = from_transformers(hf)
    tokens = torch.randint(3, 50, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(tokens).logits.double()
    got = torchfn.Model(module).apply(params, tokens, state=state or None)
    torch.testing.assert_close(got, want, rtol=0, atol=atol)


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="model must be a transformers PreTrainedModel, got "
                                        "Linear"):
        from_transformers(torch.nn.Linear(2, 2))
