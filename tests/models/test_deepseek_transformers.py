"""``deepseek_from_hf`` against ``transformers``' DeepSeek-V2, V3 and GLM-4.5 (``glm4_moe``,
DeepSeek-V3's mixture behind grouped-query attention): small random models
saved with ``save_pretrained``, loaded here, compared on logits (whole sequences and
through the latent cache), greedy generation, and the round trip back to the checkpoint.

As in test_llama_transformers.py, transformers runs its norms, softmax and rotary tables
in float32 even for a float64 model: agreement is ~1e-7, where a wrong rotary layout,
scale or routing is off by ~1e-2."""

from __future__ import annotations

import functools

import pytest
import torch
from _cached import logits_through_cache
from _hf_checks import run_as_an_extra_layer
from safetensors.torch import load_file, save_file

import torchfn
from torchfn.models import (
    StaticKVCache,
    deepseek_from_hf,
    deepseek_from_pretrained,
    deepseek_save_pretrained,
    deepseek_to_hf,
    from_pretrained,
    generate,
    mtp_speculative_generate,
)

transformers = pytest.importorskip(
    "transformers", reason="transformers (a dev dependency) is the peer these tests compare "
    "against; test_mla.py checks the latent attention without it")

BASE = dict(vocab_size=50, hidden_size=32, intermediate_size=40, moe_intermediate_size=12,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
            n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
            first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
            v_head_dim=12, qk_nope_head_dim=8, max_position_embeddings=128,
            rms_norm_eps=1e-5, rope_theta=5000.0)
GLM = dict(vocab_size=50, hidden_size=32, intermediate_size=40, moe_intermediate_size=12,
           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
           n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
           first_k_dense_replace=1, n_group=2, topk_group=1, max_position_embeddings=128,
           rms_norm_eps=1e-5)
CASES = {
    # sigmoid scores, 4 groups of 2 with 2 chosen, routed_scaling_factor, interleaved rope
    "v3": ("deepseek_v3", dict(n_group=4, topk_group=2, routed_scaling_factor=2.5)),
    # no query bottleneck, rotary rows stored half-split, one group
    "v3-plain": ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False, n_group=1,
                                     topk_group=1, norm_topk_prob=False)),
    # YaRN with DeepSeek's mscale: the scores' scale and the rotary table both change
    "v3-yarn": ("deepseek_v3", dict(n_group=2, topk_group=1, rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=8,
        beta_slow=1, mscale=0.707, mscale_all_dim=1.0))),
    # DeepSeek Sparse Attention: past 6 keys each query sees its indexer's top 6 only
    # (8 indexer heads: an exact tie in the indexer's ReLU scores is unlikely)
    "v32": ("deepseek_v32", dict(n_group=2, topk_group=1, index_topk=6, index_head_dim=16,
                                 index_n_heads=8)),
    # GLM-5: the indexer's rotary pairs interleaved, one group
    "glm-dsa": ("glm_moe_dsa", dict(n_group=1, topk_group=1, index_topk=6,
                                    index_head_dim=12, index_n_heads=8)),
    "v2": ("deepseek_v2", dict(topk_method="greedy", routed_scaling_factor=1.5)),
    # V2's groups, ranked by their best score
    "v2-groups": ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=4,
                                      topk_group=2, q_lora_rank=None)),
    # GLM-4.5: grouped-query attention with q/k/v biases, q/k norms and half the head
    # rotated; DeepSeek-V3's router
    "glm4-moe": ("glm4_moe", dict(GLM, attention_bias=True, use_qk_norm=True,
                                  routed_scaling_factor=2.5)),
    "glm4-moe-plain": ("glm4_moe", dict(GLM, use_qk_norm=False, norm_topk_prob=False,
                                        rope_parameters=dict(rope_type="default",
                                                             rope_theta=500.0,
                                                             partial_rotary_factor=1.0))),
    # GLM-4.7-Flash: V3 with its dense and sparse layers listed
    "glm4-moe-lite": ("glm4_moe_lite", dict(n_group=2, topk_group=1, routed_scaling_factor=1.8,
                                            mlp_layer_types=["dense", "sparse", "dense"])),
    # Youtu-LLM: V3's latent attention, a dense MLP in every layer, tied
    "youtu": ("youtu", dict(n_routed_experts=None)),
    # Solar-Open: GLM-4.5's attention without q/k norms, a mixture in every layer
    "solar-open": ("solar_open", dict({k: v for k, v in GLM.items()
                                       if k not in ("intermediate_size", "first_k_dense_replace")},
                                      attention_bias=True, routed_scaling_factor=1.5)),
    # dots.llm1: q/k norms per head, biases on q, k, v and the output, unrenormalised
    "dots1": ("dots1", dict(GLM, attention_bias=True, norm_topk_prob=False,
                            routed_scaling_factor=2.0)),
}
_GQA_CASES = ("glm4_moe", "solar_open", "dots1")


def hf_checkpoint(kind, extra, tmp_path, seed=0):
    """A float64 transformers model with random weights (norms and V3's router bias
    included), and its config and state dict as a checkpoint on disk holds them."""
    config = transformers.AutoConfig.for_model(kind, **(extra if kind in _GQA_CASES else
                                                       dict(BASE, **extra)))
    torch.manual_seed(seed)  # transformers' own init draws from the global generator
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float64, experts_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # big enough to change choices
                b.copy_(0.3 * torch.randn_like(b))
    model.eval()
    model.save_pretrained(tmp_path)
    return model, config.to_dict(), load_file(tmp_path / "model.safetensors")


def loaded(config, sd):
    module, params, state = deepseek_from_hf(config, sd)
    model = torchfn.Model(module)
    return model, params, state, functools.partial(model.apply, state=state)


@pytest.mark.parametrize("case", list(CASES))
def test_a_transformers_checkpoint_gives_the_same_logits(case, tmp_path):
    hf, config, sd = hf_checkpoint(*CASES[case], tmp_path)
    model, params, state, run = loaded(config, sd)
    tokens = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(tokens).logits
    torch.testing.assert_close(run(params, tokens), want, rtol=0, atol=2e-6)
    # the latent cache, decoding one token at a time (the absorbed path)
    torch.testing.assert_close(logits_through_cache(run, params, tokens, 12), want, rtol=0,
                               atol=2e-6)



@pytest.mark.parametrize("case", ["v3", "v2-groups", "glm4-moe", "v32"])
def test_greedy_generation_equals_transformers(case, tmp_path):
    """``generate`` (latent cache, absorbed decoding) against transformers' ``generate``
    (its cache of latents, expanded each step), and the same from a StaticKVCache."""
    hf, config, sd = hf_checkpoint(*CASES[case], tmp_path)
    model, params, state, run = loaded(config, sd)
    prompt = torch.randint(1, 50, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10,
                           do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(generate(run, params, prompt, 10), want)
    cache = StaticKVCache.allocate(model, 2, 16, dtype=torch.float64)
    assert torch.equal(generate(run, params, prompt, 10, cache=cache), want)


@pytest.mark.parametrize("case", list(CASES))
def test_deepseek_to_hf_gives_back_the_checkpoint(case, tmp_path):
    """``deepseek_to_hf(deepseek_from_hf(checkpoint))`` is the checkpoint: every name and
    value, rotary rows back in their interleaved order. The folder transformers saved
    loads the same through ``deepseek_from_pretrained``; params changed here, saved by
    ``deepseek_save_pretrained``, load in transformers with the logits they give here."""
    hf, config, sd = hf_checkpoint(*CASES[case], tmp_path)
    model, params, state, run = loaded(config, sd)
    back = deepseek_to_hf(config, params, state)
    assert set(back) == set(sd)
    for name in sd:
        assert torch.equal(back[name], sd[name]), name
    if case not in ("v3", "v2-groups", "glm4-moe", "glm4-moe-lite", "dots1", "glm-dsa"):
        return
    for read in (deepseek_from_pretrained, from_pretrained):
        _, from_folder, folder_state, _ = read(tmp_path)
        assert all(torch.equal(from_folder[n], params[n]) for n in params)
        assert folder_state.keys() == state.keys()
        assert all(torch.equal(folder_state[n], state[n]) for n in state)
    gen = torch.Generator().manual_seed(3)
    moved = {n: t + 0.01 * torch.randn(t.shape, dtype=t.dtype, generator=gen)
             for n, t in params.items()}
    out = tmp_path / "trained"
    out.mkdir()
    deepseek_save_pretrained(out, config, moved, state)
    again = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float64, experts_implementation="eager").eval()
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = again(tokens).logits
    torch.testing.assert_close(run(moved, tokens), want, rtol=0, atol=2e-6)


def with_mtp_layer(config, sd):
    """``sd`` with an MTP layer appended as a checkpoint holds it (``model.layers.{n}.*``):
    the last layer's tensors moved, its own norms and ``eh_proj``, and copies of the
    embedding and the head. Returns it, the block's and the MTP's own tensors, and the
    noise function."""
    n, dim = config["num_hidden_layers"], config["hidden_size"]
    gen = torch.Generator().manual_seed(7)
    noise = lambda t: t + 0.1 * torch.randn(t.shape, dtype=t.dtype, generator=gen)  # noqa: E731
    layer = {name.replace(f"model.layers.{n - 1}.", ""): noise(t) for name, t in sd.items()
             if name.startswith(f"model.layers.{n - 1}.")}
    mine = {"enorm.weight": noise(torch.ones(dim, dtype=torch.float64)),
            "hnorm.weight": noise(torch.ones(dim, dtype=torch.float64)),
            "eh_proj.weight": noise(torch.zeros(dim, 2 * dim, dtype=torch.float64)),
            "shared_head.norm.weight": noise(torch.ones(dim, dtype=torch.float64)),
            "shared_head.head.weight": sd["lm_head.weight"].clone(),
            "embed_tokens.weight": sd["model.embed_tokens.weight"].clone()}
    full = {**sd, **{f"model.layers.{n}.{k}": t for k, t in {**layer, **mine}.items()}}
    return full, layer, mine, noise


@pytest.mark.parametrize("case", ["v3", "glm4-moe"])
def test_a_multi_token_prediction_layer_reads_as_transformers_runs_its_layer(case, tmp_path):
    """A checkpoint's MTP layer (``num_nextn_predict_layers``: transformers builds none,
    so its tensors are made here: the last layer's moved, its norms, ``eh_proj`` and the
    embedding and head copies) read with ``mtp=1``: depth 1's logits are transformers'
    own decoder layer, loaded with those tensors, run as DeepSeek's MTP (``eh_proj[enorm(E
    x[t + 1]) | hnorm(h(t))]``, ``h`` the model's final states, then its shared head);
    the round trip gives the checkpoint back; a head copy that is not the model's is
    refused."""
    kind, extra = CASES[case]
    hf, config, sd = hf_checkpoint(kind, dict(extra, num_nextn_predict_layers=1), tmp_path)
    n = config["num_hidden_layers"]
    full, layer, mine, noise = with_mtp_layer(config, sd)
    module, params, state = deepseek_from_hf(config, full, mtp=1)
    tokens = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    logits, (ahead,) = torchfn.Model(module).apply(params, tokens, state=state,
                                                   return_mtp=True)
    def rms(x, w):
        return x * (x.square().mean(-1, keepdim=True) + config["rms_norm_eps"]).rsqrt() * w

    with torch.no_grad():
        h = hf.model(tokens).last_hidden_state  # (B, N, dim), after the final norm
        x = torch.cat((rms(hf.model.embed_tokens(tokens[:, 1:]), mine["enorm.weight"]),
                       rms(h[:, :-1], mine["hnorm.weight"])), -1) @ mine["eh_proj.weight"].T
    # transformers: the same layer as the (n + 1)-th of a deeper model, run by hand
    out = run_as_an_extra_layer(hf, sd, layer, x, tmp_path / "deeper")
    want = rms(out, mine["shared_head.norm.weight"]) @ sd["lm_head.weight"].T
    torch.testing.assert_close(logits, hf(tokens).logits, rtol=0, atol=2e-6)
    torch.testing.assert_close(ahead, want, rtol=0, atol=2e-6)
    back = deepseek_to_hf(config, params, state)
    assert set(back) == set(full)
    assert all(torch.equal(back[k], full[k]) for k in full)
    bad = dict(full, **{f"model.layers.{n}.shared_head.head.weight": noise(sd["lm_head.weight"])})
    with pytest.raises(ValueError, match=f"state_dict's model.layers.{n}.shared_head.head.weight "
                                         "is not the model's head.weight"):
        deepseek_from_hf(config, bad, mtp=1)


@pytest.mark.parametrize("case", ["v3", "glm4-moe"])
def test_self_speculative_decoding_matches_transformers_mtp(case, tmp_path):
    """transformers' own MTP (``MtpModel``, ``generate(use_mtp=True)``) on a checkpoint with
    an MTP layer: its depth-1 logits equal ours (``return_mtp``), and its MTP-drafted
    greedy decoding equals ``mtp_speculative_generate``'s, which decodes the rows as one
    batch where transformers takes one row at a time."""
    from transformers.modeling_layers import MtpModel

    kind, extra = CASES[case]
    _, config, sd = hf_checkpoint(kind, dict(extra, num_nextn_predict_layers=1), tmp_path)
    n = config["num_hidden_layers"]
    full, *_ = with_mtp_layer(config, sd)
    save_file(full, tmp_path / "model.safetensors")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float64, experts_implementation="eager").eval()
    # transformers 5.24's DeepSeek-V3 finds its MTP layer as `model.layers.61` (the real
    # model's depth); this one's is layer n
    hf._keys_to_ignore_on_load_unexpected = {rf"model\.layers\.{n}\..*"}
    mtp = MtpModel.from_pretrained(hf, device_map={"": "cpu"}).eval()
    hf.generation_config.eos_token_id = None  # decode all 10 tokens, as ours do
    module, params, state = deepseek_from_hf(config, full, mtp=1)
    run = functools.partial(torchfn.Model(module).apply, state=state)
    tokens = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    _, (ahead,) = run(params, tokens, return_mtp=True)
    with torch.no_grad():
        h = hf.model(tokens).last_hidden_state  # (B, N, dim)
        positions = torch.arange(11)[None].expand(2, -1)
        want = mtp._project_to_logits(mtp.forward_layer(0, h[:, :-1], positions, None,
                                                        input_ids=tokens[:, 1:]))
    torch.testing.assert_close(ahead, want, rtol=0, atol=2e-6)
    prompt = tokens[:, :6]
    ours = mtp_speculative_generate(run, params, prompt, 10)
    for row in range(2):
        theirs = hf.generate(prompt[row:row + 1], max_new_tokens=10, do_sample=False,
                             use_mtp=True)
        assert torch.equal(ours[row], theirs[0])
    assert torch.equal(ours, generate(run, params, prompt, 10))
