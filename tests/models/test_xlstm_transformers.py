"""``xlstm_from_hf`` / ``xlstm_to_hf`` and ``models.MLSTM`` against ``transformers``' xLSTM
(xLSTM 7B's architecture): small random models saved with ``save_pretrained``, compared on
logits, both caches, greedy generation (left-padded too) and the round trip; input gates
strong enough that unstabilised exponentials would overflow float16. The "fused" weight
layout (which transformers 5.24 cannot build: its init fails on it) against the same
weights in the "single" one."""

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
from torchfn.models import MLSTM, xlstm_from_hf, xlstm_to_hf

transformers = pytest.importorskip(
    "transformers", reason="transformers (a dev dependency) is the peer these tests compare "
    "against")

BASE = dict(vocab_size=50, hidden_size=128, num_hidden_layers=2, num_heads=4, chunk_size=8,
            pad_token_id=0, bos_token_id=2, eos_token_id=1)  # (transformers' cache rounds
# its head sizes from widths rounded up to 64: dim 128 keeps them the layers')
CASES = {
    "xlstm-7b-like": dict(),  # keys half as wide as values, gates capped at 15
    "wide-keys": dict(qk_dim_factor=1.0, gate_soft_cap=10.0),
}
ATOL = 2e-5  # transformers keeps float32 states and logits, even in a float64 model


def _init(p):
    """Weights around 0.1 and gate biases as xLSTM 7B's spread: input gates from -3 to
    12 (e^12 overflows float16 unstabilised), forget gates 1 to 6."""
    p.add_(0.1 * torch.randn_like(p))
    if p.dim() == 1 and p.shape[0] == 4:  # the gates' biases (one a head)
        p.add_(torch.linspace(-3.0, 12.0, 4))


def checkpoint(case, tmp_path):
    return hf_checkpoint("xlstm", dict(BASE, **CASES[case]), tmp_path, init=_init)


@pytest.mark.parametrize("case", list(CASES))
def test_a_transformers_checkpoint_gives_the_same_logits_caches_and_tokens(case, tmp_path):
    hf, config, sd = checkpoint(case, tmp_path)
    module, params = xlstm_from_hf(config, sd)
    assert_same_logits_caches_and_tokens(hf, module, params, ATOL)


def test_greedy_generation_from_left_padded_prompts_equals_transformers(tmp_path):
    hf, config, sd = checkpoint("xlstm-7b-like", tmp_path)
    module, params = xlstm_from_hf(config, sd)
    assert_left_padded_generation_matches(hf, torchfn.Model(module), params)


@pytest.mark.parametrize("case", list(CASES))
def test_xlstm_to_hf_gives_back_the_checkpoint_and_loads_in_transformers(case, tmp_path):
    hf, config, sd = checkpoint(case, tmp_path)
    module, params = xlstm_from_hf(config, sd)
    assert_round_trip_and_reload(module, params, xlstm_to_hf(config, params), sd, tmp_path,
                                 config, ATOL)


def test_the_fused_layout_reads_as_the_single_one(tmp_path):
    _, config, sd = checkpoint("wide-keys", tmp_path)
    _, params = xlstm_from_hf(config, sd)
    fused_config = dict(config, weight_mode="fused")
    fused = dict(sd)
    for hf, pieces in (("mlstm_layer.qkv_opreact", ("q", "k", "v", "ogate_preact")),
                       ("mlstm_layer.ifgate_preact", ("igate_preact", "fgate_preact")),
                       ("ffn.proj_up_gate_z", ("proj_up_gate", "proj_up"))):
        where = hf.rsplit(".", 1)[0]
        for i in range(2):
            for kind in ("weight", "bias"):
                names = [f"backbone.blocks.{i}.{where}.{p}.{kind}" for p in pieces]
                if names[0] in sd:
                    fused[f"backbone.blocks.{i}.{hf}.{kind}"] = torch.cat(
                        [fused.pop(n) for n in names])
    _, got = xlstm_from_hf(fused_config, fused)
    assert set(got) == set(params) and all(torch.equal(got[n], params[n]) for n in params)
    back = xlstm_to_hf(fused_config, got)
    assert set(back) == set(fused) and all(torch.equal(back[n], fused[n]) for n in fused)


def test_xlstm_errors_are_named():
    config = dict(BASE, model_type="xlstm")
    with pytest.raises(ValueError, match=r"model_type'\] must be 'xlstm', got 'mamba'"):
        xlstm_from_hf(dict(config, model_type="mamba"))
    with pytest.raises(ValueError, match=r"use_bias'\] = True is not supported"):
        xlstm_from_hf(dict(config, use_bias=True))
    with pytest.raises(ValueError, match=r"weight_mode'\] must be 'single' or 'fused'"):
        xlstm_from_hf(dict(config, weight_mode="split"))
    with pytest.raises(ValueError, match="heads must divide qk_dim = 18 and v_dim = 32"):
        MLSTM(32, 4, qk_dim=18)
    with pytest.raises(ValueError, match="gate_cap must be a number > 0 or None"):
        MLSTM(32, 4, gate_cap=-1)
    fused = dict(config, weight_mode="fused")
    module, _ = xlstm_from_hf(fused)
    sd = xlstm_to_hf(fused, torchfn.Model(module).init(torchfn.random.key(0)))
    name = "backbone.blocks.0.mlstm_layer.ifgate_preact.bias"
    with pytest.raises(ValueError, match=rf"{name} has 7 rows, not 8 \(4 \+ 4 of "):
        xlstm_from_hf(fused, {**sd, name: sd[name][:7]})
    with pytest.raises(ValueError, match=r"has tensors a xlstm does not: \['backbone.x'\]"):
        xlstm_from_hf(fused, {**sd, "backbone.x": torch.zeros(1)})
    sd.pop("backbone.blocks.1.ffn.proj_down.weight")
    with pytest.raises(ValueError, match=r"missing \['blocks.1.mlp.down.weight'\]"):
        xlstm_from_hf(fused, sd)
