"""``neox_from_hf`` and ``phi_from_hf`` against ``transformers``' GPT-NeoX (Pythia's
architecture) and Phi (Phi-1.5, Phi-2): small random models saved with
``save_pretrained``, compared on logits, the KV cache, greedy generation and the round
trip: parallel blocks with two norms and with one, and a sequential GPT-NeoX."""

from __future__ import annotations

import pytest
import torch
from _cached import logits_through_cache
from safetensors.torch import load_file

import torchfn
from torchfn.models import (
    from_pretrained,
    generate,
    llama_from_hf,
    neox_from_hf,
    neox_to_hf,
    phi_from_hf,
    phi_to_hf,
)

transformers = pytest.importorskip(
    "transformers", reason="transformers (a dev dependency) is the peer these tests compare "
    "against")

BASE = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=128)
CASES = {
    "pythia": dict(rotary_pct=0.25),  # parallel residual, a quarter of each head rotated
    "sequential": dict(use_parallel_residual=False, rotary_pct=1.0, rotary_emb_base=500.0),
    # one LayerNorm for both sublayers, tanh GELU, a biased head, 0.4 of each head rotated
    "phi-2": dict(model_type="phi", hidden_size=40, partial_rotary_factor=0.4,
                  num_attention_heads=4, resid_pdrop=0.0, embd_pdrop=0.0),
}
LOADERS = {"gpt_neox": (neox_from_hf, neox_to_hf), "phi": (phi_from_hf, phi_to_hf)}


def hf_checkpoint(extra, tmp_path, seed=0):
    extra = dict(extra)
    kind = extra.pop("model_type", "gpt_neox")
    config = transformers.AutoConfig.for_model(kind, **dict(BASE, **extra))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(tmp_path)
    return model, config.to_dict(), load_file(tmp_path / "model.safetensors")


@pytest.mark.parametrize("case", list(CASES))
def test_a_transformers_checkpoint_gives_the_same_logits_and_tokens(case, tmp_path):
    hf, config, sd = hf_checkpoint(CASES[case], tmp_path)
    module, params = LOADERS[config["model_type"]][0](config, sd)
    model = torchfn.Model(module)
    tokens = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(tokens).logits
        greedy = hf.generate(tokens[:, :6], attention_mask=torch.ones_like(tokens[:, :6]),
                             max_new_tokens=8, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
    torch.testing.assert_close(model.apply(params, tokens), want, rtol=0, atol=2e-6)
    torch.testing.assert_close(logits_through_cache(model, params, tokens, 12), want, rtol=0,
                               atol=2e-6)
    assert torch.equal(generate(model, params, tokens[:, :6], 8), greedy)


@pytest.mark.parametrize("case", list(CASES))
def test_neox_to_hf_gives_back_the_checkpoint_and_loads_in_transformers(case, tmp_path):
    hf, config, sd = hf_checkpoint(CASES[case], tmp_path)
    from_hf, to_hf = LOADERS[config["model_type"]]
    module, params = from_hf(config, sd)
    back = to_hf(config, params)
    assert set(back) == set(sd) and all(torch.equal(back[n], sd[n]) for n in sd)
    _, from_folder, state, _ = from_pretrained(tmp_path)
    assert state == {} and all(torch.equal(from_folder[n], params[n]) for n in params)
    moved = {n: t + 0.01 * torch.randn(t.shape, dtype=t.dtype,
                                       generator=torch.Generator().manual_seed(3))
             for n, t in params.items()}
    out = tmp_path / "trained"
    out.mkdir()
    torchfn.models.save_pretrained(out, config, moved)
    again = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = again(tokens).logits
    torch.testing.assert_close(torchfn.Model(module).apply(moved, tokens), want, rtol=0,
                               atol=2e-6)


def test_neox_errors_are_named():
    config = dict(BASE, model_type="gpt_neox")
    with pytest.raises(ValueError, match=r"'gpt_neox' is not supported here \(use "
                                         r"neox_from_hf\)"):
        llama_from_hf(config)
    with pytest.raises(ValueError, match=r"config\['hidden_act'\] = 'relu' is not supported"):
        neox_from_hf(dict(config, hidden_act="relu"))
    module, _ = neox_from_hf(config)
    params = torchfn.Model(module).init(torchfn.random.key(0))
    sd = neox_to_hf(config, params)
    with pytest.raises(ValueError, match=r"has tensors a GPT-NeoX does not: \['gpt_neox.x'\]"):
        neox_from_hf(config, {**sd, "gpt_neox.x": torch.zeros(1)})
    sd.pop("gpt_neox.layers.0.mlp.dense_h_to_4h.bias")
    with pytest.raises(ValueError, match=r"missing \['blocks.0.mlp.0.bias'\]"):
        neox_from_hf(config, sd)


def test_phi_errors_are_named():
    config = dict(BASE, model_type="phi")
    with pytest.raises(ValueError, match=r"'phi' is not supported here \(use phi_from_hf\)"):
        llama_from_hf(config)
    with pytest.raises(ValueError, match=r"qk_layernorm'\] = True is not supported"):
        phi_from_hf(dict(config, qk_layernorm=True))
    with pytest.raises(ValueError, match=r"hidden_act'\] = 'relu' is not supported"):
        phi_from_hf(dict(config, hidden_act="relu"))
    params = torchfn.Model(phi_from_hf(config)[0]).init(torchfn.random.key(0))
    sd = phi_to_hf(config, params)
    sd.pop("model.layers.1.self_attn.v_proj.bias")
    with pytest.raises(ValueError, match=r"missing \['blocks.1.attn.qkv.bias'\]"):
        phi_from_hf(config, sd)
