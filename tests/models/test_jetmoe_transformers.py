"""``jetmoe_from_hf`` / ``jetmoe_to_hf`` and ``models.MixtureOfAttention`` against
``transformers``' JetMoE: small random models saved with ``save_pretrained`` (the experts'
biases moved off 0), compared on logits, both caches, greedy generation (left-padded too)
and the round trip; the mixture of attention heads against a per-token loop."""

from __future__ import annotations

import pytest
import torch
from _hf_checks import (
    assert_left_padded_generation_matches,
    assert_round_trip_and_reload,
    assert_router_logits_and_aux_loss_match,
    assert_same_logits_caches_and_tokens,
    hf_checkpoint,
)
from _transforms import check_vmap_grad_and_jvp

import torchfn
from torchfn import random
from torchfn.models import MixtureOfAttention, TransformerEncoder, jetmoe_from_hf, jetmoe_to_hf

transformers = pytest.importorskip(
    "transformers", reason="transformers (a dev dependency) is the peer these tests compare "
    "against")

# 2 key/value heads of 8 per attention expert, 2 of 4 experts chosen, untied head
CONFIG = dict(vocab_size=50, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
              num_key_value_heads=2, kv_channels=8, num_local_experts=4,
              num_experts_per_tok=2, tie_word_embeddings=False, pad_token_id=0,
              eos_token_id=1, bos_token_id=2)
ATOL = 5e-6  # transformers routes in float32, even in float64


def checkpoint(tmp_path, **extra):
    return hf_checkpoint("jetmoe", dict(CONFIG, **extra), tmp_path,
                         experts_implementation="eager")


@pytest.mark.parametrize("tied", [False, True])
def test_a_transformers_checkpoint_gives_the_same_logits_caches_and_tokens(tied, tmp_path):
    hf, config, sd = checkpoint(tmp_path, tie_word_embeddings=tied)
    module, params = jetmoe_from_hf(config, sd)
    assert_same_logits_caches_and_tokens(hf, module, params, ATOL)


def test_greedy_generation_from_left_padded_prompts_equals_transformers(tmp_path):
    hf, config, sd = checkpoint(tmp_path)
    module, params = jetmoe_from_hf(config, sd)
    assert_left_padded_generation_matches(hf, torchfn.Model(module), params)


def test_router_logits_of_both_mixtures_and_the_aux_loss_equal_transformers(tmp_path):
    """Each block's attention router's logits, then its MLP router's, as transformers
    records them; the load-balancing loss over all of them (padding masked) is its
    ``aux_loss``."""
    hf, config, sd = checkpoint(tmp_path)
    module, params = jetmoe_from_hf(config, sd)
    assert_router_logits_and_aux_loss_match(hf, module, params, CONFIG["num_experts_per_tok"])


def test_jetmoe_to_hf_gives_back_the_checkpoint_and_loads_in_transformers(tmp_path):
    hf, config, sd = checkpoint(tmp_path)
    module, params = jetmoe_from_hf(config, sd)
    assert_round_trip_and_reload(module, params, jetmoe_to_hf(config, params), sd, tmp_path,
                                 config, ATOL, experts_implementation="eager")


@pytest.mark.parametrize("path", ["sorted", "dense"])
def test_mixture_of_attention_equals_a_loop_and_composes(path, monkeypatch):
    """Token by token: its 2 best experts' queries (softmax of their logits as weights)
    attend causally over the shared keys and values, each expert's output projection
    weighted, plus the bias, on both computations (``dense``: every expert on every
    token, as under ``vmap``); and ``vmap(grad)`` / ``jvp`` go through the routing."""
    from torchfn.models import _moa

    if path == "dense":
        monkeypatch.setattr(_moa, "_batched_transform_active", lambda: True)
    moa = MixtureOfAttention(16, 2, experts=3, top_k=2, head_dim=4, causal=True).double()
    model = torchfn.Model(moa)
    params = {n: t.double() + 0.1 * random.normal(random.key(i), t.shape, torch.float64)
              for i, (n, t) in enumerate(sorted(model.init(random.key(0)).items()))}
    x = random.normal(random.key(9), (2, 6, 16), torch.float64)
    keys, values = (x @ params["kv.weight"].T).unflatten(-1, (2, 2, 4)).unbind(2)  # (B,N,h,D)
    want = torch.zeros_like(x)
    for b in range(2):
        for t in range(6):
            logits = params["router.weight"] @ x[b, t]
            top, chosen = logits.topk(2)
            for w, e in zip(top.softmax(0), chosen):
                q = (params["q_experts"][e] @ x[b, t]).unflatten(0, (2, 4))  # (h, D)
                p = torch.einsum("hd,nhd->hn", q, keys[b, :t + 1]).div(2.0).softmax(-1)
                o = torch.einsum("hn,nhd->hd", p, values[b, :t + 1]).flatten()
                want[b, t] += w * (params["out_experts"][e] @ o)
            want[b, t] += params["out_bias"]
    torch.testing.assert_close(model.apply(params, x), want, rtol=0, atol=1e-12)
    check_vmap_grad_and_jvp(model, params, x)


def test_jetmoe_errors_are_named(tmp_path):
    hf, config, sd = checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"model_type'\] must be 'jetmoe', got 'llama'"):
        jetmoe_from_hf(dict(config, model_type="llama"))
    with pytest.raises(ValueError, match=r"activation_function'\] = 'gelu' is not supported"):
        jetmoe_from_hf(dict(config, activation_function="gelu"))
    with pytest.raises(ValueError, match=r"has tensors a jetmoe does not: \['model.x'\]"):
        jetmoe_from_hf(config, {**sd, "model.x": torch.zeros(1)})
    with pytest.raises(ValueError, match="top_k must be <= experts = 2, got top_k=3"):
        MixtureOfAttention(16, 2, experts=2, top_k=3)
    with pytest.raises(ValueError, match="attn_experts must be a dict of experts"):
        TransformerEncoder(16, 2, 1, attn_experts={"top_k": 2})
    with pytest.raises(ValueError, match="kv_heads None or 2"):
        TransformerEncoder(16, 2, 1, kv_heads=1, attn_experts={"experts": 2})
