"""``qwen3_next_from_hf`` / ``qwen3_next_to_hf`` against ``transformers``' Qwen3-Next and
Qwen3.5 (text, dense and MoE): small random models saved with ``save_pretrained``,
compared on logits, both caches, greedy generation (left-padded too) and the round
trip. Three Gated DeltaNet layers, then one gated-attention layer."""

from __future__ import annotations

import pytest
import torch
from _hf_checks import (
    assert_left_padded_generation_matches,
    assert_round_trip_and_reload,
    assert_same_logits_caches_and_tokens,
    run_as_an_extra_layer,
)
from _hf_checks import hf_checkpoint as _hf_checkpoint

import torchfn
from torchfn.models import (
    from_pretrained,
    qwen3_next_from_hf,
    qwen3_next_to_hf,
)

transformers = pytest.importorskip(
    "transformers", reason="transformers (a dev dependency) is the peer these tests compare "
    "against")

BASE = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
            linear_value_head_dim=6, pad_token_id=0)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
           shared_expert_intermediate_size=20)
CASES = {
    # fused per-key-head projections, a dense MLP in layer 1, biases on the attention
    "qwen3-next": ("qwen3_next", dict(MOE, mlp_only_layers=[1], attention_bias=True)),
    "qwen3.5": ("qwen3_5_text", {}),
    "qwen3.5-moe": ("qwen3_5_moe_text", MOE),
}
ATOL = 5e-5  # transformers runs the delta rule in float32, even in a float64 model


def hf_checkpoint(kind, extra, tmp_path):
    return _hf_checkpoint(kind, dict(BASE, **extra), tmp_path, experts_implementation="eager")


@pytest.mark.parametrize("case", list(CASES))
def test_a_transformers_checkpoint_gives_the_same_logits_caches_and_tokens(case, tmp_path):
    hf, config, sd = hf_checkpoint(*CASES[case], tmp_path)
    module, params = qwen3_next_from_hf(config, sd)
    assert_same_logits_caches_and_tokens(hf, module, params, ATOL)


def test_greedy_generation_from_left_padded_prompts_equals_transformers(tmp_path):
    """The padding leaves the linear layers' states at 0."""
    hf, config, sd = hf_checkpoint(*CASES["qwen3-next"], tmp_path)
    module, params = qwen3_next_from_hf(config, sd)
    assert_left_padded_generation_matches(hf, torchfn.Model(module), params)


@pytest.mark.parametrize("case", list(CASES))
def test_qwen3_next_to_hf_gives_back_the_checkpoint_and_loads_in_transformers(case, tmp_path):
    hf, config, sd = hf_checkpoint(*CASES[case], tmp_path)
    module, params = qwen3_next_from_hf(config, sd)
    assert_round_trip_and_reload(module, params, qwen3_next_to_hf(config, params), sd, tmp_path,
                                 config, ATOL, experts_implementation="eager")


def test_a_multimodal_qwen3_5_folder_loads_its_text_model(tmp_path):
    """The Hub's Qwen3.5 is a vision-language model (``model_type="qwen3_5"``): its folder
    loads as the text model (``text_config``, ``model.language_model.*``, the vision
    tower skipped) with the logits transformers' model gives for text alone; exporting to
    it is refused (its checkpoint needs the vision tower)."""
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                  out_hidden_size=32, patch_size=4, temporal_patch_size=1, spatial_merge_size=1)
    config = transformers.AutoConfig.for_model("qwen3_5", text_config=BASE,
                                               vision_config=vision)
    torch.manual_seed(0)
    hf = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float64)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    hf.eval().save_pretrained(tmp_path)
    module, params, _, read = from_pretrained(tmp_path)
    tokens = torch.randint(3, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=tokens).logits
    torch.testing.assert_close(torchfn.Model(module).apply(params, tokens), want, rtol=0,
                               atol=ATOL)
    with pytest.raises(ValueError, match="needs the vision tower; pass config"):
        qwen3_next_to_hf(read, params)


@pytest.mark.parametrize("case", ["qwen3-next", "qwen3.5"])
def test_a_multi_token_prediction_layer_is_skipped_or_read(case, tmp_path):
    """A checkpoint's MTP layer (``mtp.*``, which transformers does not read; made here:
    the last layer's tensors moved, its norms and ``fc``): skipped by default (the logits
    unchanged); with ``mtp=1`` depth 1's logits are ``fc[norm(E x[t + 1]) | norm(h(t))]``
    through transformers' own decoder layer (the same tensors), a norm and the head, all
    written out; ``qwen3_next_to_hf`` gives the checkpoint back."""
    hf, config, sd = hf_checkpoint(*CASES[case], tmp_path)
    n, dim = config["num_hidden_layers"], config["hidden_size"]
    gen = torch.Generator().manual_seed(7)
    noise = lambda t: t + 0.1 * torch.randn(t.shape, dtype=t.dtype, generator=gen)  # noqa: E731
    layer = {name.removeprefix(f"model.layers.{n - 1}."): noise(t) for name, t in sd.items()
             if name.startswith(f"model.layers.{n - 1}.")}
    own = {"fc.weight": noise(torch.zeros(dim, 2 * dim, dtype=torch.float64)),
           **{f"{k}.weight": noise(torch.zeros(dim, dtype=torch.float64))  # (1 + w) norms
              for k in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}}
    full = {**sd, **{f"mtp.layers.0.{k}": t for k, t in layer.items()},
            **{f"mtp.{k}": t for k, t in own.items()}}
    tokens = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(1))
    module, params = qwen3_next_from_hf(config, full)  # mtp=0: skipped
    with torch.no_grad():
        want_logits = hf(tokens).logits
        h = hf.model(tokens).last_hidden_state  # (B, N, dim), after the final norm
    torch.testing.assert_close(torchfn.Model(module).apply(params, tokens), want_logits,
                               rtol=0, atol=ATOL)
    module, params = qwen3_next_from_hf(config, full, mtp=1)
    logits, (ahead,) = torchfn.Model(module).apply(params, tokens, return_mtp=True)
    def rms(x, w):  # Qwen3-Next's norms scale by 1 + w
        return x * (x.square().mean(-1, keepdim=True) + config["rms_norm_eps"]).rsqrt() * (1 + w)

    with torch.no_grad():
        e = rms(hf.model.embed_tokens(tokens[:, 1:]), own["pre_fc_norm_embedding.weight"])
        x = torch.cat((e, rms(h[:, :-1], own["pre_fc_norm_hidden.weight"])), -1) \
            @ own["fc.weight"].T
    # transformers: the same layer as the (n + 1)-th, full attention, of a deeper model
    out = run_as_an_extra_layer(hf, sd, layer, x, tmp_path / "deeper",
                                layer_types=list(hf.config.layer_types) + ["full_attention"])
    want = rms(out, own["norm.weight"]) @ sd["lm_head.weight"].T
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=ATOL)
    torch.testing.assert_close(ahead, want, rtol=0, atol=ATOL)
    back = qwen3_next_to_hf(config, params)
    assert set(back) == set(full)
    assert all(torch.equal(back[k], full[k]) for k in full)
    with pytest.raises(ValueError, match="mtp must be 0 or 1"):
        qwen3_next_from_hf(config, full, mtp=2)
    with pytest.raises(ValueError, match="state_dict has tensors a .* does not: \\['mtp.extra'\\]"):
        qwen3_next_from_hf(config, {**full, "mtp.extra": own["norm.weight"]}, mtp=1)


def test_qwen3_next_errors_are_named():
    config = dict(BASE, model_type="qwen3_5_text")
    with pytest.raises(ValueError, match=r"model_type'\] must be one of \('qwen3_next', "
                                         r"'qwen3_5_text', 'qwen3_5_moe_text', 'qwen3_5', "
                                         r"'qwen3_5_moe'\), got 'qwen3_vl'"):
        qwen3_next_from_hf(dict(config, model_type="qwen3_vl"))
    with pytest.raises(ValueError, match=r"text_config'\] must be a dict"):
        qwen3_next_from_hf({"model_type": "qwen3_5"})
    with pytest.raises(ValueError, match=r"lacks \['linear_num_value_heads'\]"):
        qwen3_next_from_hf({k: v for k, v in config.items() if k != "linear_num_value_heads"})
    with pytest.raises(ValueError, match="layer_types'\\] must list 'linear_attention' or "):
        qwen3_next_from_hf(dict(config, layer_types=["sliding_attention"] * 4))
    module, _ = qwen3_next_from_hf(config)
    params = torchfn.Model(module).init(torchfn.random.key(0))
    sd = qwen3_next_to_hf(config, params)
    with pytest.raises(ValueError, match=r"has tensors a qwen3_5_text does not: \['model.x'\]"):
        qwen3_next_from_hf(config, {**sd, "model.x": torch.zeros(1)})
    sd.pop("model.layers.0.linear_attn.A_log")
    with pytest.raises(ValueError, match=r"missing \['blocks.0.attn.A_log'\]"):
        qwen3_next_from_hf(config, sd)
