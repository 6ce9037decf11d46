"""``recurrent_gemma_from_hf`` / ``recurrent_gemma_to_hf`` and ``models.RGLRU`` against
``transformers``' RecurrentGemma (Griffin): small random models saved with
``save_pretrained``, compared on logits, both caches, greedy generation (left-padded too)
and the round trip. Griffin's recurrent blocks and multi-query attention in a window
shorter than the sequence; the RG-LRU's bounded square-root gradient against
transformers' autograd Function."""

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
from torchfn.models import RGLRU, recurrent_gemma_from_hf, recurrent_gemma_to_hf

transformers = pytest.importorskip(
    "transformers", reason="transformers (a dev dependency) is the peer these tests compare "
    "against")

BASE = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=1, attention_window_size=8,
            pad_token_id=0, bos_token_id=2, eos_token_id=1)
CASES = {  # name: (config, transformers' generate with its cache)
    # RecurrentGemma-2B's pattern: two recurrent blocks, then MQA in a window of 8
    "griffin": (dict(), True),
    # a recurrent width apart from the model's (transformers' cache cannot hold it: its
    # greedy tokens are taken without), biased q/k/v, every other block attention
    "wide": (dict(lru_width=48, attention_bias=True, num_hidden_layers=4,
                  block_types=["recurrent", "attention"], conv1d_width=3), False),
}
ATOL = 2e-5  # transformers normalises and runs the RG-LRU's scan in float32, even in a
# float64 model


def checkpoint(case, tmp_path):
    return hf_checkpoint("recurrent_gemma", dict(BASE, **CASES[case][0]), tmp_path)


@pytest.mark.parametrize("case", list(CASES))
def test_a_transformers_checkpoint_gives_the_same_logits_caches_and_tokens(case, tmp_path):
    hf, config, sd = checkpoint(case, tmp_path)
    module, params = recurrent_gemma_from_hf(config, sd)
    assert_same_logits_caches_and_tokens(hf, module, params, ATOL, use_cache=CASES[case][1])


def test_greedy_generation_from_left_padded_prompts_equals_transformers(tmp_path):
    hf, config, sd = checkpoint("griffin", tmp_path)
    module, params = recurrent_gemma_from_hf(config, sd)
    assert_left_padded_generation_matches(hf, torchfn.Model(module), params)


@pytest.mark.parametrize("case", list(CASES))
def test_recurrent_gemma_to_hf_gives_back_the_checkpoint_and_loads_in_transformers(
        case, tmp_path):
    hf, config, sd = checkpoint(case, tmp_path)
    module, params = recurrent_gemma_from_hf(config, sd)
    assert_round_trip_and_reload(module, params, recurrent_gemma_to_hf(config, params), sd,
                                 tmp_path, config, ATOL)


def test_the_rg_lru_gradient_is_transformers_bounded_one():
    """Gates pushed open so that ``1 - a^2`` falls under the bound's 2.5e-7 at some
    channels: the params' gradients equal transformers' recurrent block's (its
    ``SqrtBoundDerivative``), and differ from the exact ``sqrt``'s there."""
    from transformers.models.recurrent_gemma import modeling_recurrent_gemma as m

    config = transformers.RecurrentGemmaConfig(hidden_size=16, num_attention_heads=2,
                                               lru_width=16, conv1d_width=4)
    torch.manual_seed(0)
    hf = m.RecurrentGemmaRecurrentBlock(config, 0).double()
    with torch.no_grad():
        for p in hf.parameters():  # (transformers leaves the init to its model: empty)
            p.copy_(0.1 * torch.randn_like(p))
        hf.rg_lru.recurrent_param.fill_(-12.0)  # softplus ~ 6e-6: a^2 ~ 1 - 1e-4 r
        hf.rg_lru.recurrent_gate_bias[0].fill_(-8.0)  # r ~ 3e-4 on the first block: < 2.5e-7
    names = {"linear_y": "gate", "linear_x": "in_proj", "linear_out": "out",
             "conv_1d": "conv", "rg_lru.": ""}
    ours = {}
    for name, p in hf.named_parameters():
        for a, b in names.items():
            if name.startswith(a):
                name = b + name[len(a):] if b else name[len(a):]
                break
        ours[name] = p.detach().clone()
    x = torch.randn(2, 9, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(9)[None].expand(2, -1)
    out, _ = hf(x, positions, None, use_cache=False)
    want = torch.autograd.grad(out.square().sum(), list(hf.parameters()))
    want = dict(zip(ours, want))
    for bound, same in ((1000.0, True), (None, False)):
        model = torchfn.Model(RGLRU(16, 2, sqrt_grad_bound=bound))

        def loss(p):
            return model.apply(p, x).square().sum()  # noqa: B023

        torch.testing.assert_close(model.apply(ours, x), out, rtol=1e-5, atol=1e-7)
        got = torch.func.grad(loss)(ours)
        close = torch.allclose(got["recurrent_gate_bias"], want["recurrent_gate_bias"],
                               rtol=1e-4, atol=1e-8)
        assert close == same
        if same:
            for name in ours:
                torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-8)


def test_recurrent_gemma_errors_are_named():
    config = dict(BASE, model_type="recurrent_gemma")
    with pytest.raises(ValueError, match=r"model_type'\] must be 'recurrent_gemma', got "
                                         r"'gemma'"):
        recurrent_gemma_from_hf(dict(config, model_type="gemma"))
    with pytest.raises(ValueError, match=r"block_types'\] must list 'recurrent' or "
                                         r"'attention'"):
        recurrent_gemma_from_hf(dict(config, block_types=["mamba"]))
    with pytest.raises(ValueError, match=r"hidden_activation'\] = 'relu' is not supported"):
        recurrent_gemma_from_hf(dict(config, hidden_activation="relu"))
    with pytest.raises(ValueError, match="heads must divide width = 30, got heads=4"):
        RGLRU(32, 4, width=30)
    with pytest.raises(ValueError, match="sqrt_grad_bound must be a number > 0 or None"):
        RGLRU(32, 4, sqrt_grad_bound=0)
    module, _ = recurrent_gemma_from_hf(config)
    sd = recurrent_gemma_to_hf(config, torchfn.Model(module).init(torchfn.random.key(0)))
    with pytest.raises(ValueError, match=r"has tensors a recurrent_gemma does not: "
                                         r"\['model.x'\]"):
        recurrent_gemma_from_hf(config, {**sd, "model.x": torch.zeros(1)})
    sd.pop("model.layers.2.temporal_block.k_proj.weight")
    with pytest.raises(ValueError, match=r"missing \['blocks.2.attn.qkv.weight'\]"):
        recurrent_gemma_from_hf(config, sd)
