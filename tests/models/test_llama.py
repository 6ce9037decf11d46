"""``llama_from_hf``: a Llama state dict under Hugging Face's names, run as a
``TransformerEncoder``, against a Llama forward written out from the Hugging Face model's
definition (RMSNorm, rotate-half RoPE, GQA by repeating kv heads, SwiGLU)."""

from __future__ import annotations

import pytest
import torch
from _cached import logits_through_cache

import torchfn
from torchfn import random
from torchfn.models import generate, llama_from_hf

CONFIG = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
          "num_hidden_layers": 2, "intermediate_size": 40, "vocab_size": 50,
          "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 128,
          "hidden_act": "silu", "tie_word_embeddings": False}


def hf_state_dict(config, seed=0):
    """Random float64 tensors under Hugging Face's Llama names and shapes."""
    d, h, hkv = config["hidden_size"], config["num_attention_heads"], \
        config["num_key_value_heads"]
    hd, f, v = d // h, config["intermediate_size"], config["vocab_size"]
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, d)
    for i in range(config["num_hidden_layers"]):
        at = f"model.layers.{i}."
        shapes.update({
            at + "input_layernorm.weight": (d,), at + "post_attention_layernorm.weight": (d,),
            at + "self_attn.q_proj.weight": (h * hd, d), at + "self_attn.k_proj.weight":
            (hkv * hd, d), at + "self_attn.v_proj.weight": (hkv * hd, d),
            at + "self_attn.o_proj.weight": (d, h * hd)})
        if config.get("model_type", "").startswith("qwen2"):
            shapes.update({at + "self_attn.q_proj.bias": (h * hd,),
                           at + "self_attn.k_proj.bias": (hkv * hd,),
                           at + "self_attn.v_proj.bias": (hkv * hd,)})
        if config.get("num_local_experts"):  # Mixtral
            moe = at + "block_sparse_moe."
            shapes[moe + "gate.weight"] = (config["num_local_experts"], d)
            for j in range(config["num_local_experts"]):
                shapes.update({f"{moe}experts.{j}.w1.weight": (f, d),
                               f"{moe}experts.{j}.w3.weight": (f, d),
                               f"{moe}experts.{j}.w2.weight": (d, f)})
        elif config.get("model_type") == "qwen2_moe":
            fe, fs = config["moe_intermediate_size"], config["shared_expert_intermediate_size"]
            shapes[at + "mlp.gate.weight"] = (config["num_experts"], d)
            shapes[at + "mlp.shared_expert_gate.weight"] = (1, d)
            for j, width in [*((f"experts.{j}", fe) for j in range(config["num_experts"])),
                             ("shared_expert", fs)]:
                shapes.update({f"{at}mlp.{j}.gate_proj.weight": (width, d),
                               f"{at}mlp.{j}.up_proj.weight": (width, d),
                               f"{at}mlp.{j}.down_proj.weight": (d, width)})
        else:
            shapes.update({at + "mlp.gate_proj.weight": (f, d), at + "mlp.up_proj.weight":
                           (f, d), at + "mlp.down_proj.weight": (d, f)})
    keys = random.split(random.key(seed), len(shapes))
    out = {}
    for k, (name, shape) in zip(keys, shapes.items()):
        x = random.normal(k, shape, torch.float64)
        out[name] = 1.0 + 0.1 * x if name.endswith("norm.weight") else x * shape[-1] ** -0.5
    return out


def mixtral_moe(sd, config, i, y):
    """Mixtral's sparse MoE block as Hugging Face writes it: softmax over the router's
    logits, the top k renormalised, then a loop over experts on the tokens each got."""
    at = f"model.layers.{i}.block_sparse_moe."
    tokens = y.reshape(-1, y.shape[-1])  # (T, d)
    probs = torch.softmax(tokens @ sd[at + "gate.weight"].T, dim=-1)
    weights, chosen = probs.topk(config["num_experts_per_tok"], dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(tokens)
    for j in range(config["num_local_experts"]):
        rows, slot = torch.where(chosen == j)
        w = lambda name, j=j: sd[f"{at}experts.{j}.{name}.weight"]  # noqa: E731
        t = tokens[rows]
        e = (torch.nn.functional.silu(t @ w("w1").T) * (t @ w("w3").T)) @ w("w2").T
        out[rows] += e * weights[rows, slot, None]
    return out.reshape(y.shape)


def qwen2_moe(sd, config, i, y):
    """Qwen2-MoE's sparse block as Hugging Face writes it: the top k of the router's
    softmax (renormalised only with ``norm_topk_prob``), a loop over experts, plus the
    shared expert scaled by a sigmoid gate."""
    at = f"model.layers.{i}.mlp."
    tokens = y.reshape(-1, y.shape[-1])  # (T, d)

    def swiglu(t, name):
        w = lambda p: sd[f"{at}{name}.{p}_proj.weight"]  # noqa: E731
        return (torch.nn.functional.silu(t @ w("gate").T) * (t @ w("up").T)) @ w("down").T

    probs = torch.softmax(tokens @ sd[at + "gate.weight"].T, dim=-1)
    weights, chosen = probs.topk(config["num_experts_per_tok"], dim=-1)
    if config.get("norm_topk_prob"):
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(tokens)
    for j in range(config["num_experts"]):
        rows, slot = torch.where(chosen == j)
        out[rows] += swiglu(tokens[rows], f"experts.{j}") * weights[rows, slot, None]
    gate = torch.sigmoid(tokens @ sd[at + "shared_expert_gate.weight"].T)  # (T, 1)
    return (out + gate * swiglu(tokens, "shared_expert")).reshape(y.shape)


def hf_llama_forward(sd, config, tokens):
    """Logits (B, N, V) the way Hugging Face's LlamaForCausalLM computes them."""
    d, h, hkv = config["hidden_size"], config["num_attention_heads"], \
        config["num_key_value_heads"]
    hd, eps = d // h, config["rms_norm_eps"]
    b, n = tokens.shape

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rotate_half(x):
        return torch.cat((-x[..., hd // 2:], x[..., :hd // 2]), dim=-1)

    inv_freq = 1.0 / config["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    freqs = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq  # (N, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    causal = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)
    if config.get("sliding_window") and config.get("model_type") != "qwen2":
        # Mistral: keys i - window + 1 .. i
        causal = causal + torch.full((n, n), float("-inf"), dtype=torch.float64).tril(
            -config["sliding_window"])
    x = sd["model.embed_tokens.weight"][tokens]  # (B, N, d)
    for i in range(config["num_hidden_layers"]):
        p = lambda name, i=i: sd[f"model.layers.{i}.{name}"]  # noqa: E731
        y = rms(x, p("input_layernorm.weight"))

        def proj(name, y=y, p=p, i=i):  # Qwen2: with its bias
            out = y @ p(f"self_attn.{name}_proj.weight").T
            bias = sd.get(f"model.layers.{i}.self_attn.{name}_proj.bias")
            return out if bias is None else out + bias

        q = proj("q").view(b, n, h, hd).transpose(1, 2)
        k = proj("k").view(b, n, hkv, hd).transpose(1, 2)
        v = proj("v").view(b, n, hkv, hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1)
        att = torch.softmax(q @ k.transpose(-1, -2) / hd ** 0.5 + causal, dim=-1) @ v
        x = x + att.transpose(1, 2).reshape(b, n, d) @ p("self_attn.o_proj.weight").T
        y = rms(x, p("post_attention_layernorm.weight"))
        if config.get("num_local_experts"):
            x = x + mixtral_moe(sd, config, i, y)
        elif config.get("model_type") == "qwen2_moe":
            x = x + qwen2_moe(sd, config, i, y)
        else:
            gate = torch.nn.functional.silu(y @ p("mlp.gate_proj.weight").T)
            x = x + (gate * (y @ p("mlp.up_proj.weight").T)) @ p("mlp.down_proj.weight").T
    head = sd["model.embed_tokens.weight"] if config["tie_word_embeddings"] else \
        sd["lm_head.weight"]
    return rms(x, sd["model.norm.weight"]) @ head.T


MIXTRAL = {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
QWEN2 = {"model_type": "qwen2", "use_sliding_window": False}  # its window unused
QWEN2_MOE = {"model_type": "qwen2_moe", "num_experts": 5, "num_experts_per_tok": 3,
             "moe_intermediate_size": 12, "shared_expert_intermediate_size": 20,
             "decoder_sparse_step": 1, "mlp_only_layers": []}


@pytest.mark.parametrize("tied, window, kind", [(False, None, {}), (True, None, {}),
                                                (False, 4, {}), (False, 4, MIXTRAL),
                                                (True, 4, QWEN2), (False, None, QWEN2_MOE),
                                                (False, None,
                                                 dict(QWEN2_MOE, norm_topk_prob=True))])
def test_a_llama_checkpoint_runs_as_the_hf_forward_does(tied, window, kind):
    config = dict(CONFIG, tie_word_embeddings=tied, sliding_window=window, **kind)
    sd = hf_state_dict(config)
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # old buffers: ignored
    module, params = llama_from_hf(config, sd)
    model = torchfn.Model(module)
    assert set(params) == set(model.init(random.key(0)))
    tokens = random.randint(random.key(1), (2, 11), 0, 50)
    want = hf_llama_forward(sd, config, tokens)
    torch.testing.assert_close(model.apply(params, tokens), want, rtol=0, atol=1e-11)
    # and it decodes from its cache: the prompt, then one token at a time
    torch.testing.assert_close(logits_through_cache(model, params, tokens, 6), want, rtol=0,
                               atol=1e-11)
    greedy = generate(model, params, tokens[:, :4], 5)
    seq = tokens[:, :4]
    for _ in range(5):
        seq = torch.cat((seq, hf_llama_forward(sd, config, seq)[:, -1:].argmax(-1)), 1)
    assert torch.equal(greedy, seq)


def test_bad_checkpoints_and_configs_are_named():
    sd = hf_state_dict(CONFIG)
    with pytest.raises(ValueError, match=r"state_dict lacks the tensors for \['blocks.1.ln2"):
        llama_from_hf(CONFIG, {k: v for k, v in sd.items()
                               if k != "model.layers.1.post_attention_layernorm.weight"})
    with pytest.raises(ValueError, match="state_dict has tensors a Llama does not"):
        llama_from_hf(CONFIG, dict(sd, **{"model.layers.0.self_attn.g_proj.weight":
                                          torch.ones(8)}))
    with pytest.raises(ValueError, match=r"tensors the config's llama does not use: \['blocks"
                                         r".0.attn.q_norm.weight'\]"):  # a Qwen3 tensor
        llama_from_hf(CONFIG, dict(sd, **{"model.layers.0.self_attn.q_norm.weight":
                                          torch.ones(8)}))
    with pytest.raises(ValueError, match="state_dict shapes do not match the config"):
        llama_from_hf(dict(CONFIG, intermediate_size=48), sd)
    with pytest.raises(ValueError, match=r"config\['hidden_act'\] = 'gelu' is not supported"):
        llama_from_hf(dict(CONFIG, hidden_act="gelu"))
    with pytest.raises(ValueError, match=r"config\['clip_qkv'\] = 8.0 is not supported here "
                                         r"\(needs None\)"):
        llama_from_hf(dict(CONFIG, model_type="olmo2", clip_qkv=8.0))
    with pytest.raises(ValueError, match=r"config\['use_bias'\] = False is not supported here "
                                         r"\(needs True\)"):  # its LayerNorms have biases
        llama_from_hf(dict(CONFIG, model_type="starcoder2", use_bias=False))
    with pytest.raises(ValueError, match=r"config\['attention_bias'\] = True is not supported"):
        llama_from_hf(dict(CONFIG, model_type="qwen3", attention_bias=True))
    with pytest.raises(ValueError, match=r"config\['model_type'\] = 'gpt2' is not supported"):
        llama_from_hf(dict(CONFIG, model_type="gpt2"))
    with pytest.raises(ValueError, match=r"config\['hidden_activation'\] = 'silu' is not "):
        llama_from_hf(dict(CONFIG, model_type="gemma"))  # CONFIG's Llama activation
    with pytest.raises(ValueError, match=r"config\['decoder_sparse_step'\] = 3 and .* leave no"):
        llama_from_hf(dict(CONFIG, **dict(QWEN2_MOE, decoder_sparse_step=3)))
    with pytest.raises(ValueError, match=r"config\['use_sliding_window'\] = True without "):
        llama_from_hf(dict(CONFIG, **dict(QWEN2_MOE, use_sliding_window=True,
                                          sliding_window=4)))
    with pytest.raises(ValueError, match=r"config\['layer_types'\] must list"):
        llama_from_hf(dict(CONFIG, **dict(QWEN2, use_sliding_window=True, sliding_window=4,
                                          layer_types=["sliding_attention"])))
    mixtral = dict(CONFIG, **MIXTRAL)
    sd = hf_state_dict(mixtral)
    with pytest.raises(ValueError, match=r"lacks the tensors for \['blocks.0.mlp.down'\]"):
        llama_from_hf(mixtral, {k: v for k, v in sd.items()
                                if k != "model.layers.0.block_sparse_moe.experts.3.w2.weight"})
    with pytest.raises(ValueError, match="tensors a Mixtral does not"):
        llama_from_hf(mixtral, dict(sd, **{"model.layers.0.mlp.up_proj.weight":
                                           torch.ones(4)}))
    with pytest.raises(ValueError, match=r"config lacks \['vocab_size'\]"):
        llama_from_hf({k: v for k, v in CONFIG.items() if k != "vocab_size"})


def test_mellum_rotates_its_own_fraction_per_layer_type():
    """Mellum's ``partial_rotary_factor`` per layer type becomes each block's
    ``rotary_dim`` (transformers 5.24 builds the narrower table but rotates the whole
    head with it, which fails; so this is checked on the module alone): the full layer
    rotates half its head, the sliding ones all of it, in windows of 4."""
    config = dict(model_type="mellum", hidden_size=32, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, num_hidden_layers=3,
                  intermediate_size=24, vocab_size=50, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=12, sliding_window=4,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                  rope_parameters={"full_attention": dict(rope_theta=5e5,
                                                          partial_rotary_factor=0.5),
                                   "sliding_attention": dict(rope_theta=1e4)})
    module, _ = llama_from_hf(config)
    attn = [b.attn for b in module.blocks]
    assert [a.rotary_dim for a in attn] == [8, 4, 8]
    assert [a.window for a in attn] == [(3, None), None, (3, None)]
    assert [a.rotary_base for a in attn] == [1e4, 5e5, 1e4]
    assert all(a.qk_norm for a in attn)
    model = torchfn.Model(module)
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    params = model.init(torchfn.random.key(0))
    torch.testing.assert_close(logits_through_cache(model, params, tokens, 4),
                               model.apply(params, tokens), rtol=1e-5, atol=1e-5)
