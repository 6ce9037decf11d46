"""``deepseek_from_hf`` without transformers: FP8 checkpoints dequantized block by block,
and the errors a wrong config or state dict gets. (test_deepseek_transformers.py compares
the models with transformers.)"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import torchfn
from torchfn.models import (
    deepseek_from_hf,
    deepseek_to_hf,
    dequantize_fp8,
    dequantize_mxfp4,
    from_pretrained,
    llama_from_hf,
    save_pretrained,
)

CONFIG = {"model_type": "deepseek_v3", "hidden_size": 32, "num_attention_heads": 4,
          "num_hidden_layers": 2, "intermediate_size": 40, "vocab_size": 20,
          "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
          "v_head_dim": 12, "n_routed_experts": 4, "num_experts_per_tok": 2,
          "moe_intermediate_size": 8, "n_shared_experts": 1, "first_k_dense_replace": 1,
          "n_group": 2, "topk_group": 1}
E4M3_MAX = 448.0


def checkpoint(config=CONFIG, seed=0):
    """A random checkpoint of ``config`` under Hugging Face's names, and its state."""
    model = torchfn.Model(deepseek_from_hf(config)[0])
    params = model.init(torchfn.random.key(seed))
    state = {n: torch.randn(t.shape, generator=torch.Generator().manual_seed(seed))
             for n, t in model.init_state().items()}
    return deepseek_to_hf(config, params, state)


def quantize(w, block):
    """``w`` as e4m3 with one float32 scale per block (amax / 448), the way DeepSeek's FP8
    checkpoints are stored: returns ``(w8, scale_inv)``."""
    rows, cols = w.shape
    scale = torch.empty(-(-rows // block[0]), -(-cols // block[1]))
    w8 = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            r, c = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            scale[i, j] = w[r, c].abs().max().clamp_min(1e-12) / E4M3_MAX
            w8[r, c] = (w[r, c] / scale[i, j]).to(torch.float8_e4m3fn)
    return w8, scale


@given(rows=st.integers(1, 40), cols=st.integers(1, 40), b0=st.integers(1, 16),
       b1=st.integers(1, 16))
def test_fp8_blocks_dequantize_to_within_e4m3_rounding(rows, cols, b0, b1):
    """Each block comes back as its e4m3 values times its scale (a loop over the blocks
    here), within e4m3's rounding of the original: 2^-4 of the block's largest entry."""
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * 41 + cols))
    w8, scale = quantize(w, (b0, b1))
    config = {"quantization_config": {"weight_block_size": [b0, b1]}}
    out = dequantize_fp8({"x.weight": w8, "x.weight_scale_inv": scale, "n.weight": w}, config,
                         dtype=torch.float32)
    assert set(out) == {"x.weight", "n.weight"} and out["n.weight"] is w
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            r, c = slice(i * b0, (i + 1) * b0), slice(j * b1, (j + 1) * b1)
            assert torch.equal(out["x.weight"][r, c], w8[r, c].float() * scale[i, j])
            bound = w[r, c].abs().max() * 2.0 ** -4
            assert (out["x.weight"][r, c] - w[r, c]).abs().max() <= bound


def test_an_fp8_checkpoint_loads_as_its_dequantized_weights():
    """Every matrix but the embeddings, head, norms and routers stored in FP8 (as
    DeepSeek-V3's): the model loads with bfloat16 weights equal to dequantizing first."""
    sd = checkpoint()
    config = dict(CONFIG, quantization_config={"quant_method": "fp8",
                                               "weight_block_size": [8, 8]})
    fp8 = {}
    for name, t in sd.items():
        if t.dim() == 2 and "proj" in name:
            fp8[name], fp8[name + "_scale_inv"] = quantize(t, (8, 8))
        else:
            fp8[name] = t
    _, params, state = deepseek_from_hf(config, fp8)
    _, want, want_state = deepseek_from_hf(config, dequantize_fp8(fp8, config))
    assert params.keys() == want.keys() and state.keys() == want_state.keys()
    for name in want:
        assert torch.equal(params[name], want[name]), name
    assert params["blocks.0.attn.kv_b.weight"].dtype == torch.bfloat16
    assert params["embed.weight"].dtype == torch.float32  # not quantized: kept


@pytest.mark.parametrize("kind", ["deepseek_v3", "glm4_moe", "llama"])
def test_save_and_from_pretrained_round_trip_any_family(kind, tmp_path):
    """``save_pretrained`` then ``from_pretrained`` gives the params and state back, for a
    family with router state and one without; ``dtype`` casts the params but the routers,
    which stay float32."""
    config = dict(CONFIG, model_type=kind)
    if kind == "llama":
        config = {k: CONFIG[k] for k in ("hidden_size", "num_attention_heads",
                                         "num_hidden_layers", "intermediate_size",
                                         "vocab_size")}
    build = llama_from_hf if kind == "llama" else deepseek_from_hf
    model = torchfn.Model(build(config)[0])
    params = model.init(torchfn.random.key(0))
    state = {n: t + 0.5 for n, t in model.init_state().items()}
    save_pretrained(tmp_path, config, params, state)
    module, back, back_state, back_config = from_pretrained(tmp_path)
    assert back_config == config and back.keys() == params.keys()
    assert all(torch.equal(back[n], params[n]) for n in params)
    assert back_state.keys() == state.keys() and all(
        torch.equal(back_state[n], state[n]) for n in state)
    assert (kind == "llama") == (state == {})
    _, half, _, _ = from_pretrained(tmp_path, dtype=torch.bfloat16)
    for name, t in half.items():
        want = torch.float32 if name.endswith("mlp.router.weight") else torch.bfloat16
        assert t.dtype == want, name


def test_deepseek_errors_are_named():
    with pytest.raises(ValueError, match=r"model_type'\] must be one of \('deepseek_v2', "
                                         r"'deepseek_v3', 'deepseek_v32', .*\), got 'llama'"):
        deepseek_from_hf(dict(CONFIG, model_type="llama"))
    with pytest.raises(ValueError, match=r"config\['model_type'\] = 'deepseek_v3' is not "
                                         r"supported here \(use deepseek_from_hf\)"):
        llama_from_hf(CONFIG)
    with pytest.raises(ValueError, match=r"config lacks \['kv_lora_rank'\]"):
        deepseek_from_hf({k: v for k, v in CONFIG.items() if k != "kv_lora_rank"})
    with pytest.raises(ValueError, match=r"config\['hidden_act'\] = 'gelu' is not supported"):
        deepseek_from_hf(dict(CONFIG, hidden_act="gelu"))
    with pytest.raises(ValueError, match=r"indexer_types'\] = \['full', 'shared'\] is not "
                                         r"supported here \(needs 'full' in each of 2 layers"):
        deepseek_from_hf(dict(CONFIG, model_type="glm_moe_dsa", indexer_types=["full", "shared"]))
    v2 = dict(CONFIG, model_type="deepseek_v2")
    with pytest.raises(ValueError, match=r"topk_method'\] = 'noaux_tc' is not supported for "
                                         r"deepseek_v2"):
        deepseek_from_hf(dict(v2, topk_method="noaux_tc"))
    with pytest.raises(ValueError, match="norm_topk_prob'] = True is not supported for "
                                         "deepseek_v2"):
        deepseek_from_hf(dict(v2, norm_topk_prob=True))
    sd = checkpoint()
    with pytest.raises(ValueError, match=r"has tensors a deepseek_v3 does not: "
                                         r"\['model.layers.0.self_attn.extra'\]"):
        deepseek_from_hf(CONFIG, {**sd, "model.layers.0.self_attn.extra": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"missing \['blocks.0.attn.kv_b.weight'\]"):
        deepseek_from_hf(CONFIG, {n: t for n, t in sd.items() if "0.self_attn.kv_b" not in n})
    no_expert = {n: t for n, t in sd.items() if "experts.3." not in n}
    with pytest.raises(ValueError,
                       match=r"holds experts \[0, 1, 2\] for blocks.1.mlp.(up|gate|down)"):
        deepseek_from_hf(CONFIG, no_expert)
    wide = dict(sd, **{"model.layers.0.self_attn.o_proj.weight": torch.zeros(32, 49)})
    with pytest.raises(ValueError, match=r"\('blocks.0.attn.out.weight', \(32, 49\), \(32, 48\)"):
        deepseek_from_hf(CONFIG, wide)
    # a multi-token-prediction layer past num_hidden_layers is skipped only where the
    # config has one
    mtp = dict(sd, **{"model.layers.2.input_layernorm.weight": torch.ones(32)})
    deepseek_from_hf(dict(CONFIG, num_nextn_predict_layers=1), mtp)
    with pytest.raises(ValueError, match="does not: \\['model.layers.2.input_layernorm"):
        deepseek_from_hf(CONFIG, mtp)
    with pytest.raises(ValueError, match=r"weight_scale_inv'\] must have shape \(1, 1\) for a "
                                         r"weight \(3, 4\) in blocks \(128, 128\), got \(2, 1\)"):
        dequantize_fp8({"a.weight": torch.zeros(3, 4), "a.weight_scale_inv": torch.ones(2, 1)})
    with pytest.raises(ValueError, match="scales without their weights"):
        dequantize_fp8({"a.weight_scale_inv": torch.ones(1, 1)})
    blocks = torch.zeros(1, 2, 1, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"'e.w_blocks'\] must be uint8 \(E, rows, G, 16\) with "
                                         r"'e.w_scales' \(E, rows, G\); got torch.uint8 "
                                         r"\(1, 2, 1, 16\) and \(1, 2\)"):
        dequantize_mxfp4({"e.w_blocks": blocks, "e.w_scales": torch.zeros(1, 2)})
    with pytest.raises(ValueError, match=r"and None"):
        dequantize_mxfp4({"e.w_blocks": blocks})
    params = torchfn.Model(deepseek_from_hf(CONFIG)[0]).init(torchfn.random.key(0))
    with pytest.raises(ValueError, match=r"state_dict \(state\) does not fit the config: "
                                         r"missing \[.blocks.1.mlp.router_bias.\]"):
        deepseek_to_hf(CONFIG, params, {})
