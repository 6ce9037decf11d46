"""``olmo_hybrid_from_hf`` / ``olmo_hybrid_to_hf`` against ``transformers``' OLMo Hybrid:
small random models saved with ``save_pretrained``, compared on logits, both caches,
greedy generation (left-padded too) and the round trip. Gated DeltaNet blocks normalised
before each sublayer, OLMo 2 attention blocks after, with NoPE as the released
checkpoints and with rotary embeddings."""

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
from torchfn.models import GatedDeltaNet, olmo_hybrid_from_hf, olmo_hybrid_to_hf

transformers = pytest.importorskip(
    "transformers", reason="transformers (a dev dependency) is the peer these tests compare "
    "against")

BASE = dict(vocab_size=50, hidden_size=32, intermediate_size=24, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1)
CASES = {
    # as the released checkpoints: NoPE, the learning rate in (0, 2), equal head counts
    "nope": dict(rope_parameters={"rope_type": "default", "rope_theta": None}),
    # rotary attention, two value heads a key head, biases, beta in (0, 1)
    "rope-grouped": dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                         linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=8, linear_value_head_dim=6, attention_bias=True,
                         linear_allow_neg_eigval=False,
                         layer_types=["full_attention"] + ["linear_attention"] * 3),
}
ATOL = 1e-5  # transformers normalises in float32 (the gated norm too), even in float64


def checkpoint(case, tmp_path):
    return hf_checkpoint("olmo_hybrid", dict(BASE, **CASES[case]), tmp_path)


@pytest.mark.parametrize("case", list(CASES))
def test_a_transformers_checkpoint_gives_the_same_logits_caches_and_tokens(case, tmp_path):
    hf, config, sd = checkpoint(case, tmp_path)
    module, params = olmo_hybrid_from_hf(config, sd)
    assert module.position_embedding == ("none" if case == "nope" else "rotary")
    assert_same_logits_caches_and_tokens(hf, module, params, ATOL)


def test_greedy_generation_from_left_padded_prompts_equals_transformers(tmp_path):
    hf, config, sd = checkpoint("nope", tmp_path)
    module, params = olmo_hybrid_from_hf(config, sd)
    assert_left_padded_generation_matches(hf, torchfn.Model(module), params)


def _own_channels(sd, config):
    """``sd`` with each layer's q / k / v convolutions holding their own projection's
    channels (transformers' ``save_pretrained`` cuts the joined one in equal thirds)."""
    out = dict(sd)
    for name in sd:
        if name.endswith("linear_attn.q_conv1d.weight"):
            names = [name.replace("q_conv1d", f"{p}_conv1d") for p in "qkv"]
            sizes = [sd[name.replace("q_conv1d", f"{p}_proj")].shape[0] for p in "qkv"]
            out.update(zip(names, torch.cat([sd[n] for n in names]).split(sizes)))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_olmo_hybrid_to_hf_gives_back_the_checkpoint_and_loads_in_transformers(case, tmp_path):
    hf, config, sd = checkpoint(case, tmp_path)
    module, params = olmo_hybrid_from_hf(config, sd)
    back = olmo_hybrid_to_hf(config, params)
    assert back["model.layers.1.linear_attn.v_conv1d.weight"].shape[0] == \
        back["model.layers.1.linear_attn.v_proj.weight"].shape[0]
    assert_round_trip_and_reload(module, params, back, _own_channels(sd, config), tmp_path,
                                 config, ATOL)
    # transformers' names in memory load too (a live model's state dict)
    live = {n: t.detach() for n, t in hf.state_dict().items()}
    _, again = olmo_hybrid_from_hf(config, live)
    assert set(again) == set(params) and all(torch.equal(again[n], params[n]) for n in params)


def test_beta_scale_doubles_the_learning_rate_and_is_checked(monkeypatch):
    """``beta_scale=2`` feeds the delta rule ``2 sigmoid(x W_b)``, past 1 where the
    logit is positive (a negative eigenvalue of ``I - beta k k^T``)."""
    import torchfn.models._delta_net as delta_net

    x = torchfn.random.normal(torchfn.random.key(1), (2, 7, 16), dtype=torch.float64)
    scaled = torchfn.Model(GatedDeltaNet(16, 2, key_dim=4, value_dim=4, beta_scale=2.0))
    params = {n: t.double() for n, t in scaled.init(torchfn.random.key(0)).items()}
    seen, real = {}, delta_net._delta_rule

    def spy(q, k, v, g, beta, *rest):
        seen["beta"] = beta
        return real(q, k, v, g, beta, *rest)

    monkeypatch.setattr(delta_net, "_delta_rule", spy)
    scaled.apply(params, x)
    want = 2 * torch.sigmoid(x @ params["beta.weight"].T).transpose(1, 2)
    torch.testing.assert_close(seen["beta"], want, rtol=0, atol=0)
    assert seen["beta"].max() > 1
    for bad in (0, 2.5, True, "2"):
        with pytest.raises(ValueError, match=r"beta_scale must be a number in \(0, 2\], got"):
            GatedDeltaNet(16, 2, beta_scale=bad)


def test_olmo_hybrid_errors_are_named():
    from torchfn.models import TransformerEncoder

    config = dict(BASE, model_type="olmo_hybrid")
    with pytest.raises(ValueError, match=r"model_type'\] must be 'olmo_hybrid', got 'olmo2'"):
        olmo_hybrid_from_hf(dict(config, model_type="olmo2"))
    with pytest.raises(ValueError, match=r"layer_types'\] must list 'linear_attention' \(at "
                                         r"least once\)"):
        olmo_hybrid_from_hf(dict(config, layer_types=["full_attention"] * 4))
    with pytest.raises(ValueError, match=r"hidden_act'\] = 'gelu' is not supported"):
        olmo_hybrid_from_hf(dict(config, hidden_act="gelu"))
    with pytest.raises(ValueError, match=r"pre_norms must be a bool or a dict of bools for "
                                         r"'attention' and 'linear' blocks, got \{'mlp'"):
        TransformerEncoder(32, 4, 1, pre_norms={"mlp": False})
    module, _ = olmo_hybrid_from_hf(config)
    sd = olmo_hybrid_to_hf(config, torchfn.Model(module).init(torchfn.random.key(0)))
    with pytest.raises(ValueError, match=r"has tensors a olmo_hybrid does not: \['model.x'\]"):
        olmo_hybrid_from_hf(config, {**sd, "model.x": torch.zeros(1)})
    sd.pop("model.layers.0.linear_attn.k_proj.weight")
    with pytest.raises(ValueError, match=r"missing \['blocks.0.attn.qkv.weight'\]"):
        olmo_hybrid_from_hf(config, sd)
