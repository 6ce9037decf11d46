"""A Hugging Face Llama-family checkpoint (Llama, Mistral, Ministral, Ministral 3, Mixtral,
Phi-3.5-MoE, Mellum, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE, Phi-3, OLMo 2 and 3, OLMoE, FlexOlmo,
gpt-oss, SmolLM3, Cohere, Cohere2, Cohere2-MoE, Granite, GraniteMoe, Hunyuan, Hunyuan-MoE,
Seed-OSS, Helium, ERNIE 4.5, EXAONE 4, GLM, GLM-4, Arcee, Jais2, StarCoder2, Apertus, Gemma,
Gemma 2, Gemma 3, VaultGemma) as a ``TransformerEncoder`` and its params."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from torchfn.models._fit import check_state_dict, read_state
from torchfn.models._transformer import TransformerEncoder

__all__ = ["llama_from_hf"]

GLOBAL_NAMES = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "ln.weight",
                "model.norm.bias": "ln.bias",  # (StarCoder2's and Jais2's LayerNorm)
                "lm_head.weight": "head.weight",
                "lm_head.bias": "head.bias"}  # (PhiMoE's lm_head_bias) outside the layers
_NAMES = {  # a layer's HF names -> ours, but for q/k/v (one qkv matrix here)
    "input_layernorm.weight": "ln1.weight",
    "post_attention_layernorm.weight": "ln2.weight",
    "self_attn.o_proj.weight": "attn.out.weight",
    "self_attn.q_norm.weight": "attn.q_norm.weight",  # Qwen3
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "mlp.gate_proj.weight": "mlp.gate.weight",
    "mlp.up_proj.weight": "mlp.up.weight",
    "mlp.down_proj.weight": "mlp.down.weight",
    # biases, where attention_bias / mlp_bias / use_bias give them; LayerNorms' biases
    "self_attn.o_proj.bias": "attn.out.bias",
    **{f"mlp.{p}_proj.bias": f"mlp.{p}.bias" for p in ("gate", "up", "down")},
    "input_layernorm.bias": "ln1.bias",
    "post_attention_layernorm.bias": "ln2.bias",
}
_QKV = {  # HF names -> our joined tensor (rows [q | k | v])
    f"self_attn.{p}_proj.{kind}": f"attn.qkv.{kind}" for kind in ("weight", "bias")
    for p in "qkv"}
_MOE = {  # model_type -> (router, one expert's matrices, their stacked names, shared expert)
    "mixtral": ("block_sparse_moe.gate.weight",
                re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight"),
                {"w1": "mlp.gate", "w3": "mlp.up", "w2": "mlp.down"}, {}),
    "qwen2_moe": ("mlp.gate.weight",
                  re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight"),
                  {"gate": "mlp.gate", "up": "mlp.up", "down": "mlp.down"},
                  {"mlp.shared_expert_gate.weight": "mlp.gate_shared.weight",
                   **{f"mlp.shared_expert.{p}_proj.weight": f"mlp.shared.{p}.weight"
                      for p in ("gate", "up", "down")}}),
}
_MOE["phimoe"] = _MOE["mixtral"]  # Mixtral's names; SparseMixer's routing
_MOE["qwen3_moe"] = _MOE["olmoe"] = _MOE["flex_olmo"] = _MOE["mellum"] = \
    _MOE["qwen2_moe"][:3] + ({},)  # no
# shared expert; Hunyuan's router under its own name, an ungated shared MLP
_MOE["hunyuan_v1_moe"] = ("mlp.gate.wg.weight",) + _MOE["qwen2_moe"][1:3] + (
    {f"mlp.shared_mlp.{p}_proj.weight": f"mlp.shared.{p}.weight" for p in ("gate", "up", "down")},)
_MOE["cohere2_moe"] = _MOE["qwen2_moe"][:3] + ({
    f"mlp.shared_experts.{p}_proj.weight": f"mlp.shared.{p}.weight"
    for p in ("gate", "up", "down")},)  # its shared expert ungated
_GRANITE_MOE = ("granitemoe", "granitemoeshared")
_NO_MATCH = re.compile(r"(?!)")
_MOE.update({kind: ("block_sparse_moe.router.layer.weight", _NO_MATCH, {}, {})
             for kind in _GRANITE_MOE})  # its experts come fused: below
GRANITE_FUSED = ("block_sparse_moe.input_linear.weight", "block_sparse_moe.output_linear.weight",
                 "shared_mlp.input_linear.weight", "shared_mlp.output_linear.weight")
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")  # a buffer older checkpoints carry
_GEMMA = ("gemma", "gemma2", "gemma3_text", "vaultgemma")
_POST_NORMED = ("olmo2", "olmo3", "exaone4", "flex_olmo")  # norms on the outputs only
_UNGATED = {  # model_type -> (hidden_act, its MLP's two projections): act(x W_up) W_down
    "arcee": ("relu2", "up_proj", "down_proj"), "jais2": ("relu2", "up_proj", "down_proj"),
    "starcoder2": ("gelu_pytorch_tanh", "c_fc", "c_proj"),
    "apertus": ("xielu", "up_proj", "down_proj")}
XIELU_CONSTANTS = {"mlp.act_fn.beta": 0.5, "mlp.act_fn.eps": -1e-6}  # Apertus's buffers
_FUSED_MLP = ("phi3", "glm", "glm4")  # gate and up in one gate_up_proj
_TYPES = ("llama", "mistral", "ministral", "ministral3", "hunyuan_v1_dense", "hunyuan_v1_moe",
          "flex_olmo", "granitemoe", "granitemoeshared", "mixtral", "phimoe", "mellum",
          "cohere2_moe",
          "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3", "olmo2", "olmo3", "olmoe",
          "gpt_oss", "smollm3", "cohere", "cohere2", "granite", "seed_oss", "helium",
          "ernie4_5", "exaone4", "glm", "glm4",
          *_UNGATED, *_GEMMA)
_GPT_OSS = {  # gpt-oss's tensors that Llama lacks -> ours (its experts come fused: below)
    "self_attn.sinks": "attn.sinks",
    "self_attn.o_proj.bias": "attn.out.bias",
    "mlp.router.weight": "mlp.router.weight",
    "mlp.router.bias": "mlp.router.bias",
}
_GPT_OSS_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias",
                    "mlp.experts.down_proj", "mlp.experts.down_proj_bias")
_PHI3 = ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")  # Phi-3's fused matrices
_POST_NORM_NAMES = {  # Gemma 2 and 3, OLMo 2: norms on the sublayers' outputs
    "post_attention_layernorm.weight": "post_ln1.weight",
    "pre_feedforward_layernorm.weight": "ln2.weight",
    "post_feedforward_layernorm.weight": "post_ln2.weight",
}


def layer_names(kind: str) -> dict[str, str]:
    """A layer's Hugging Face tensor names -> ours (but q/k/v and the experts) for
    ``model_type`` ``kind``."""
    router, _, _, shared = _MOE.get(kind, (None, None, {}, {}))
    names = {k: v for k, v in _NAMES.items() if not (router and k.startswith("mlp."))}
    names.update(shared)
    if kind in ("gemma2", "gemma3_text") + _POST_NORMED:  # norms on the sublayers' outputs
        names.update(_POST_NORM_NAMES)
    if kind == "vaultgemma":  # Gemma 2 without the norms on the outputs
        del names["post_attention_layernorm.weight"]
        names["pre_feedforward_layernorm.weight"] = "ln2.weight"
    if kind.startswith("hunyuan"):  # its q/k norms (after the rotation)
        names.update({"self_attn.query_layernorm.weight": "attn.q_norm.weight",
                      "self_attn.key_layernorm.weight": "attn.k_norm.weight"})
    if kind == "glm4":  # norms on the outputs too, named apart from the pre-MLP norm
        names.update({"post_self_attn_layernorm.weight": "post_ln1.weight",
                      "post_mlp_layernorm.weight": "post_ln2.weight"})
    if kind in _UNGATED:  # act(x W_up) W_down: an nn.Sequential's 0 and 2
        _, up, down = _UNGATED[kind]
        names = {k: v for k, v in names.items() if not k.startswith("mlp.")}
        names.update({f"mlp.{hf}.{b}": f"mlp.{i}.{b}" for hf, i in ((up, 0), (down, 2))
                      for b in ("weight", "bias")})
    if kind == "apertus":  # its norms' names; xIELU's learned scalars
        del names["input_layernorm.weight"], names["post_attention_layernorm.weight"]
        names.update({"attention_layernorm.weight": "ln1.weight",
                      "feedforward_layernorm.weight": "ln2.weight",
                      "mlp.act_fn.alpha_p": "mlp.1.alpha_p",
                      "mlp.act_fn.alpha_n": "mlp.1.alpha_n"})
    if kind == "gpt_oss":
        names = {k: v for k, v in names.items() if not k.startswith("mlp.")}
        names.update(_GPT_OSS)
    return names


def _gpt_oss_experts(parts: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """gpt-oss's fused experts as ours: ``gate_up_proj`` ``(E, dim, 2 hidden)`` with gate
    and up in alternate columns -> ``gate`` / ``up`` ``(E, hidden, dim)``; ``down_proj``
    ``(E, hidden, dim)`` -> ``down`` ``(E, dim, hidden)``; and their biases."""
    gate_up, bias = parts["mlp.experts.gate_up_proj"], parts["mlp.experts.gate_up_proj_bias"]
    return {"mlp.gate": gate_up[..., ::2].transpose(1, 2), "mlp.up": gate_up[..., 1::2]
            .transpose(1, 2), "mlp.gate_bias": bias[..., ::2], "mlp.up_bias": bias[..., 1::2],
            "mlp.down": parts["mlp.experts.down_proj"].transpose(1, 2),
            "mlp.down_bias": parts["mlp.experts.down_proj_bias"]}


def _rope_of(params: Any, config: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """One ``rope_parameters`` dict (transformers >= 5: ``{"rope_type", "rope_theta",
    <the scaling's keys>}``) as ``(base, scaling)``."""
    if not isinstance(params, Mapping):
        raise ValueError(f"config['rope_parameters'] must be a dict, got {params!r}")
    scaling = dict(params)
    for key in ("partial_rotary_factor", "llama_4_scaling_beta", "max_position_embeddings"):
        scaling.pop(key, None)  # transformers 5 keeps them here (Ministral 3): not scaling
    base = float(scaling.pop("rope_theta", config.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return base, (None if kind == "default" else scaling)


def partial_rotary(config: Mapping[str, Any]) -> float:
    """The rotated fraction of each head: ``partial_rotary_factor``, at the config's top
    level or (transformers 5) in ``rope_parameters``; 1 if neither has it."""
    params = config.get("rope_parameters")
    inner = params.get("partial_rotary_factor") if isinstance(params, Mapping) else None
    return float(config.get("partial_rotary_factor") or inner or 1.0)


def _ropes(config: Mapping[str, Any], types: list[str]) -> dict[str, Any]:
    """RoPE's ``rotary_base`` and ``rotary_scaling`` from ``rope_parameters``
    (transformers >= 5), else from ``rope_theta`` and ``rope_scaling``; and Gemma 3's
    ``layer_rotary``: its windowed layers rotate by their own base
    (``rope_parameters["sliding_attention"]``, or ``rope_local_base_freq``), unscaled."""
    params = config.get("rope_parameters")
    local = None
    if isinstance(params, Mapping) and "full_attention" in params:  # one per layer type
        local = _rope_of(params.get("sliding_attention", params["full_attention"]), config)
        base, scaling = _rope_of(params["full_attention"], config)
    elif params is not None:
        base, scaling = _rope_of(params, config)
    else:
        scaling = config.get("rope_scaling")
        base, scaling = float(config.get("rope_theta", 10000.0)), dict(scaling) if scaling \
            else None
        if "rope_local_base_freq" in config:  # Gemma 3, transformers 4
            local = (float(config["rope_local_base_freq"]), None)
    if scaling and scaling.get("rope_type", scaling.get("type")) == "longrope":
        scaling = _longrope(config, scaling)
    out: dict[str, Any] = dict(rotary_base=base, rotary_scaling=scaling)
    if local is not None and local != (base, scaling) and "sliding_attention" in types:
        out["layer_rotary"] = [local if t == "sliding_attention" else None for t in types]
    nope = config.get("no_rope_layers")  # SmolLM3: 1 for a rotary layer, 0 for NoPE
    if config.get("model_type") == "cohere2":  # rotary on the windowed layers only
        nope = [int(t == "sliding_attention") for t in types]
    if config.get("model_type") == "cohere2_moe":  # and on a dense prefix of global layers
        dense = [not s for s in _listed_mlps(config)]
        force = config.get("prefix_dense_sliding_window_pattern", 1) == 1
        nope = [int(t == "sliding_attention" or (force and d)) for t, d in zip(types, dense)]
    if nope is not None and not all(nope):
        if len(nope) != len(types):
            raise ValueError(f"config['no_rope_layers'] must have one entry per layer "
                             f"({len(types)}), got {nope!r}")
        out["layer_rotary"] = [r if on else False for r, on in
                               zip(out.get("layer_rotary", [None] * len(types)), nope)]
    return out


def _longrope(config: Mapping[str, Any], scaling: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's LongRoPE dict, completed from the config: ``original_max_position_embeddings``
    (a top-level key in Phi-3's configs) and ``factor`` (the context's stretch,
    ``max_position_embeddings / original_max_position_embeddings``, as transformers
    computes it). A ``"type"`` key becomes ``"rope_type"``."""
    scaling = dict(scaling)
    scaling["rope_type"] = scaling.pop("type", None) or scaling["rope_type"]
    original = scaling.setdefault("original_max_position_embeddings",
                                  config.get("original_max_position_embeddings"))
    if original is None:
        raise ValueError("config: LongRoPE needs original_max_position_embeddings")
    if scaling.get("factor") is None:
        scaling["factor"] = max(1.0, config.get("max_position_embeddings", original) / original)
    return scaling


def _layer_types(config: Mapping[str, Any], kind: str) -> list[str]:
    """``"sliding_attention"`` or ``"full_attention"`` for each layer: ``layer_types``
    (transformers >= 4.53 writes it), else the family's rule: Mistral and Mixtral window
    every layer, Qwen2 and Qwen3 (``use_sliding_window``) the layers from
    ``max_window_layers`` on, Qwen3-MoE every layer, Gemma 2 every other one from the
    first, Gemma 3 all but every ``sliding_window_pattern``-th."""
    depth = config["num_hidden_layers"]
    w = config.get("sliding_window")
    if (kind.startswith("qwen") or kind == "smollm3") and not config.get("use_sliding_window"):
        w = None  # Qwen's and SmolLM3's configs keep a sliding_window they use only if told
    if w is None or kind == "gemma":
        return ["full_attention"] * depth
    types = config.get("layer_types")
    if types is None and kind == "mellum":  # (its windows only where layer_types says)
        types = ["full_attention"] * depth
    if types is None:
        if kind == "qwen2_moe":
            raise ValueError("config['use_sliding_window'] = True without 'layer_types' is "
                             "not supported for qwen2_moe (which layers slide differs "
                             "between transformers versions)")
        if kind in ("gemma2", "vaultgemma"):
            slides = [i % 2 == 0 for i in range(depth)]
        elif kind in ("gemma3_text", "olmo3", "exaone4"):  # all but every n-th
            every = config.get("sliding_window_pattern", config.get(
                "_sliding_window_pattern", 6 if kind == "gemma3_text" else 4))
            slides = [(i + 1) % every != 0 for i in range(depth)]
        else:
            first = config.get("max_window_layers", 0) if kind in ("qwen2", "qwen3") else 0
            slides = [i >= first for i in range(depth)]
        types = ["sliding_attention" if x else "full_attention" for x in slides]
    types = list(types)
    if len(types) != depth or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"config['layer_types'] must list 'sliding_attention' or "
                         f"'full_attention' for each of {depth} layers, got {types!r}")
    return types


def _windows(config: Mapping[str, Any], types: list[str]) -> dict[str, Any]:
    """``window`` (every layer alike) or ``layer_windows`` (per layer). A window of ``w``
    lets each token see itself and the ``w - 1`` before it."""
    w = config.get("sliding_window")
    windows = [(w - 1, None) if t == "sliding_attention" else None for t in types]
    return dict(window=windows[0]) if len(set(windows)) == 1 else dict(layer_windows=windows)


def _gemma(config: Mapping[str, Any], kind: str, head_dim: int) -> dict[str, Any]:
    """Gemma's differences from Llama: a tanh-GELU gate, embeddings times
    ``sqrt(hidden_size)``, tied head; from Gemma 2 on, norms after each sublayer too,
    ``query_pre_attn_scalar``, soft-capped scores and logits; Gemma 3 ``qk_norm``."""
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu"):  # Gemma's "gelu" was always the tanh one
        raise ValueError(f"config['hidden_activation'] = {act!r} is not supported here "
                         "(needs 'gelu_pytorch_tanh')")
    out: dict[str, Any] = dict(mlp="geglu", norm="rms+1",
                               embed_scale=config["hidden_size"] ** 0.5,
                               tie_embeddings=bool(config.get("tie_word_embeddings", True)))
    if kind != "gemma":  # (VaultGemma: Gemma 2 without the norms on the outputs)
        out.update(post_norms=kind != "vaultgemma", softcap=config.get("attn_logit_softcapping"),
                   logit_softcap=config.get("final_logit_softcapping"),
                   attn_scale=config.get("query_pre_attn_scalar", head_dim) ** -0.5)
    if kind == "gemma3_text":
        out["qk_norm"] = True
    return out


def _cohere(config: Mapping[str, Any]) -> dict[str, Any]:
    """Cohere (Command R), Cohere2 (Command R7B) and Cohere2-MoE: one LayerNorm without
    bias (Cohere2-MoE: an RMSNorm where ``rms_norm_eps`` is set) for both parallel
    sublayers, rotary pairs interleaved, tied embeddings, logits scaled."""
    if config.get("use_qk_norm"):
        raise ValueError("config['use_qk_norm'] = True is not supported here (Cohere's q/k "
                         "norms have a weight per head)")
    rms = config.get("model_type") == "cohere2_moe" and config.get("rms_norm_eps") is not None
    return dict(norm="rms" if rms else "layer", parallel_residual="shared",
                rotary_interleaved=True, bias=False,
                norm_eps=float(config["rms_norm_eps"] if rms else
                               config.get("layer_norm_eps", 1e-5)),
                tie_embeddings=bool(config.get("tie_word_embeddings", True)),
                logit_scale=float(config.get("logit_scale", 1.0)))


def _moe(config: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """``experts``, ``top_k`` and ``MoE``'s options of a Mixtral / Qwen-MoE / gpt-oss
    config."""
    if kind == "gpt_oss":  # softmax over the top-k logits = Mixtral's renormalised top-k
        return dict(experts=config.get("num_local_experts", 32),
                    top_k=config.get("num_experts_per_tok", 4), moe_options=dict(
                        mlp="swiglu_clamp", expert_bias=True, logit_bias=True,
                        swiglu_limit=float(config.get("swiglu_limit", 7.0)),
                        swiglu_alpha=float(config.get("swiglu_alpha", 1.702))))
    if kind == "mixtral":
        return dict(experts=config.get("num_local_experts", 8),
                    top_k=config.get("num_experts_per_tok", 2))
    if kind == "cohere2_moe":  # softmax over the top-k logits, or sigmoid; dense prefix
        combine = config.get("shared_expert_combination_strategy", "average")
        if combine not in ("sum", "average"):
            raise ValueError(f"config['shared_expert_combination_strategy'] = {combine!r} is "
                             f"not supported here (needs 'sum' or 'average')")
        select = config.get("expert_selection_fn", "softmax")
        if select not in ("softmax", "sigmoid"):
            raise ValueError(f"config['expert_selection_fn'] = {select!r} is not supported "
                             f"here (needs 'softmax' or 'sigmoid')")
        hidden, shared = config["intermediate_size"], config.get("num_shared_experts") or 0
        sparse = _listed_mlps(config)
        return dict(experts=config.get("num_experts", 8),
                    top_k=config.get("num_experts_per_tok", 2), expert_hidden=hidden,
                    mlp_hidden=config.get("prefix_dense_intermediate_size") or hidden,
                    layer_experts=None if all(sparse) else sparse, moe_options=dict(
                        scoring=select, normalize=select == "softmax" or bool(
                            config.get("norm_topk_prob", True)),
                        shared_hidden=hidden * shared or None, shared_combine=combine))
    if kind == "phimoe":  # Phi-3.5-MoE: SparseMixer's top-2, LayerNorms with biases
        return dict(experts=config.get("num_local_experts", 16), top_k=2,
                    norm="layer", moe_options=dict(
                        scoring="sparsemixer",
                        sparsemixer_eps=float(config.get("router_jitter_noise", 0.01))))
    if kind in _GRANITE_MOE:  # Mixtral's routing; GraniteMoeShared's ungated shared MLP
        shared = config.get("shared_intermediate_size") or 0
        return dict(experts=config.get("num_local_experts", 8),
                    top_k=config.get("num_experts_per_tok", 2),
                    moe_options=dict(shared_hidden=shared) if shared else None)
    if kind == "hunyuan_v1_moe":  # Mixtral's routing, experts as wide as the shared MLP
        counts = {name: config.get(name, 1) for name in ("num_experts", "moe_topk")}
        for name, value in counts.items():
            if isinstance(value, (list, tuple)):
                if len(set(value)) != 1:
                    raise ValueError(f"config[{name!r}] = {value!r} is not supported here "
                                     f"(needs one value for every layer)")
                counts[name] = value[0]
        return dict(experts=counts["num_experts"], top_k=counts["moe_topk"],
                    expert_hidden=config["intermediate_size"],
                    moe_options=dict(shared_hidden=config["intermediate_size"]))
    if kind not in ("qwen2_moe", "qwen3_moe", "olmoe", "flex_olmo", "mellum"):
        return {}
    step, dense = config.get("decoder_sparse_step") or 1, config.get("mlp_only_layers") or []
    sparse = [i not in dense and (i + 1) % step == 0 for i in range(config["num_hidden_layers"])]
    if kind == "mellum":  # its dense and sparse layers listed
        sparse = _listed_mlps(config)
    if not any(sparse):
        raise ValueError(f"config['decoder_sparse_step'] = {step!r} and config["
                         f"'mlp_only_layers'] = {dense!r} leave no layer a mixture of experts")
    options: dict[str, Any] = dict(normalize=bool(config.get("norm_topk_prob", False)))
    if kind == "qwen2_moe":  # and a shared expert for every token, sigmoid-gated
        options.update(shared_hidden=config.get("shared_expert_intermediate_size"),
                       shared_gate=True)
    experts = config.get("num_experts") or config.get("num_local_experts", 60)  # v5: the latter
    return dict(experts=experts, top_k=config.get("num_experts_per_tok", 4),
                expert_hidden=config.get("moe_intermediate_size", config["intermediate_size"]),
                moe_options=options, layer_experts=None if all(sparse) else sparse)


def _listed_mlps(config: Mapping[str, Any]) -> list[bool]:
    """Which layers are mixtures, from ``mlp_layer_types`` (``"dense"`` / ``"sparse"``;
    default all sparse)."""
    depth = config["num_hidden_layers"]
    types = config.get("mlp_layer_types") or ["sparse"] * depth
    if len(types) != depth or not set(types) <= {"dense", "sparse"}:
        raise ValueError(f"config['mlp_layer_types'] must list 'dense' or 'sparse' for each "
                         f"of {depth} layers, got {types!r}")
    return [t == "sparse" for t in types]


def _type_rotary(config: Mapping[str, Any], types: list[str], head_dim: int
                 ) -> dict[str, Any]:
    """Mellum's rotated fraction per layer type (``rope_parameters[type]
    ["partial_rotary_factor"]``) as each block's ``rotary_dim``; nothing where every
    layer rotates all of its head."""
    params = config.get("rope_parameters") or {}
    dims = [int(head_dim * ((params.get(t) or {}).get("partial_rotary_factor") or 1.0))
            for t in types]
    if all(d == head_dim for d in dims):
        return {}
    return dict(layer_attention=[{"rotary_dim": d} for d in dims])


def _config(config: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict (a Llama config.json), got "
                        f"{type(config).__name__}")
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                           "intermediate_size", "vocab_size") if k not in config]
    if missing:
        raise ValueError(f"config lacks {missing}: not a Llama config")
    kind = config.get("model_type", "llama")
    if kind not in _TYPES:
        hint = " (use deepseek_from_hf)" if kind in _DEEPSEEK_HINT \
            else " (use neox_from_hf)" if kind == "gpt_neox" else " (use phi_from_hf)" \
            if kind == "phi" else ""
        raise ValueError(f"config['model_type'] = {kind!r} is not supported here{hint} (needs "
                         f"one of {_TYPES})")
    dim, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or dim // heads
    checks = {
        "attention_bias": (config.get("attention_bias", False), kind == "gpt_oss" or (
            _EITHER if kind in _BIASED else False)),
        "mlp_bias": (config.get("mlp_bias", False), _EITHER if kind in _BIASED else False),
        "clip_qkv": (config.get("clip_qkv"), _EITHER if kind == "olmoe" else None),  # the
        # clamp of q, k and v, which transformers applies in OLMoE alone
    }
    if kind in ("starcoder2", "jais2"):  # LayerNorms with a bias: every projection has one
        key = "use_bias" if kind == "starcoder2" else "mlp_bias"
        checks[key] = (config.get(key, True), True)
    if kind.startswith("hunyuan"):
        checks["use_cla"] = (config.get("use_cla", False), False)  # cross-layer attention
    if kind not in _GEMMA:
        checks["hidden_act"] = (config.get("hidden_act", "silu"),
                                _UNGATED[kind][0] if kind in _UNGATED else "silu")
    for key, (got, want) in checks.items():
        if want is not _EITHER and got != want:
            raise ValueError(f"config[{key!r}] = {got!r} is not supported here (needs {want!r})")
    types = _layer_types(config, kind)
    partial = partial_rotary(config)  # Phi-4-mini: 0.75
    return dict(
        dim=dim, heads=heads, depth=config["num_hidden_layers"],
        vocab_size=config["vocab_size"], out_dim=config["vocab_size"], causal=True,
        max_len=config.get("max_position_embeddings", 2048),
        kv_heads=config.get("num_key_value_heads") or heads, head_dim=head_dim,
        position_embedding="rotary", norm="rms", mlp="swiglu",
        mlp_hidden=config["intermediate_size"], norm_eps=float(config.get("rms_norm_eps") or 1e-6),
        tie_embeddings=bool(config.get("tie_word_embeddings", kind in _TIED)),
        qk_norm=kind.startswith("qwen3") or kind in ("apertus", "mellum"),  # on each head
        rotary_dim=None if partial == 1 else int(head_dim * partial),
    ) | _biases(config, kind) | _ropes(config, types) | _windows(config, types) | _moe(
        config, kind) | (_gemma(config, kind, head_dim) if kind in _GEMMA else {}) | (
        # OLMo 2 and 3: norms only on the sublayers' outputs, q/k norms over all heads;
        # EXAONE 4 the same but its q/k norms per head
        dict(pre_norms=False, post_norms=True, qk_norm=True,
             qk_norm_scope="head" if kind == "exaone4" else "all")
        if kind in _POST_NORMED else {}) | (
        # OLMoE: Llama's pre-norm blocks, OLMo 2's q/k norms, Qwen3-MoE's mixture
        dict(qk_norm=True, qk_norm_scope="all") if kind == "olmoe" else {}) | (
        dict(attn_sinks=True) if kind == "gpt_oss" else {}) | (
        _cohere(config) if kind.startswith("cohere") else {}) | (
        # Granite: the embeddings, scores, sublayer outputs and logits each scaled
        dict(embed_scale=float(config.get("embedding_multiplier", 1.0)),
             attn_scale=float(config.get("attention_multiplier", head_dim ** -0.5)),
             residual_scale=float(config.get("residual_multiplier", 1.0)),
             logit_scale=1.0 / float(config.get("logits_scaling", 1.0)))
        if kind in ("granite",) + _GRANITE_MOE else {}) | (
        # Helium, ERNIE 4.5, GLM: rotary pairs interleaved (GLM: in the rotated half)
        dict(rotary_interleaved=True) if kind in ("helium", "ernie4_5", "glm", "glm4") else {}
    ) | (dict(post_norms=True) if kind == "glm4" else {}) | (
        # EXAONE 4 with windows: its global layers have no position embedding (NoPE)
        dict(layer_rotary=[None if t == "sliding_attention" else False for t in types])
        if kind == "exaone4" and config.get("sliding_window") is not None else {}) | (
        _ungated(config, kind) if kind in _UNGATED else {}) | (
        _hunyuan(config, head_dim) if kind.startswith("hunyuan") else {}) | (
        _ministral3(config) if kind == "ministral3" else {}) | (
        _type_rotary(config, types, head_dim) if kind == "mellum" else {}) | (
        dict(layer_attention=[{"qkv_clip": config["clip_qkv"]}] * config["num_hidden_layers"])
        if kind == "olmoe" and config.get("clip_qkv") is not None else {})


_EITHER = object()  # a config check's "any value"
_DEEPSEEK_HINT = ("deepseek_v2", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "youtu",
                  "solar_open", "dots1")  # deepseek_from_hf's
_BIASED = ("llama", "phimoe", "cohere2_moe", "mistral", "ministral", "seed_oss", "helium",
           "arcee", "jais2", "glm", "glm4", "exaone4", "hunyuan_v1_dense",
           "hunyuan_v1_moe")  # attention_bias /
# mlp_bias read
_TIED = ("ernie4_5", "starcoder2")  # tied embeddings unless the config says otherwise


def _biases(config: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """The projections' biases: ``attention_bias`` on q, k, v and the output (Llama's;
    q, k, v alone in GLM, Helium and Seed-OSS, whose ``attention_out_bias`` sets the
    output's), ``mlp_bias`` on the MLP; ERNIE 4.5's and StarCoder2's ``use_bias`` on
    all; Qwen2's q, k, v always, gpt-oss's q, k, v and output always. The head never."""
    attention = bool(config.get("attention_bias", False))
    mlp = bool(config.get("mlp_bias", False))
    if kind in ("ernie4_5", "starcoder2"):
        attention = mlp = bool(config.get("use_bias", kind == "starcoder2"))
    out = attention
    if kind in ("glm", "glm4", "helium"):
        out = False
    elif kind.startswith("hunyuan"):  # (its MLPs never have biases)
        mlp = False
    elif kind == "seed_oss":
        out = bool(config.get("attention_out_bias", False))
    elif kind.startswith("qwen2"):
        attention, out = True, False
    elif kind == "gpt_oss":
        attention = out = True
    if kind == "phimoe":  # its LayerNorms' biases (no dense MLP to take one)
        mlp = True
    return dict(bias=mlp, qkv_bias=attention, out_bias=out,
                head_bias=bool(config.get("lm_head_bias", False)))


def _hunyuan(config: Mapping[str, Any], head_dim: int) -> dict[str, Any]:
    """Hunyuan (dense): q/k norms per head after the rotation; its "dynamic" RoPE with a
    fixed ``alpha`` is NTK-aware scaling, the base stretched to
    ``theta * alpha^(d / (d - 2))``."""
    out: dict[str, Any] = dict(qk_norm=True, qk_norm_scope="rotated")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type"))
    if kind == "dynamic":
        if not rope.get("alpha"):
            raise ValueError(f"config's RoPE {dict(rope)!r}: 'dynamic' without 'alpha' is "
                             f"not supported here (its frequencies follow the length)")
        theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        out.update(rotary_base=theta * float(rope["alpha"]) ** (head_dim / (head_dim - 2)),
                   rotary_scaling=None)
    return out


def _ministral3(config: Mapping[str, Any]) -> dict[str, Any]:
    """Ministral 3: the queries at position ``p`` scaled by
    ``1 + beta log(1 + floor(p / original_max_position_embeddings))``
    (``llama_4_scaling_beta``; Llama 4's temperature, its floor one position earlier)."""
    rope = config.get("rope_parameters") or {}
    beta = rope.get("llama_4_scaling_beta")
    if not beta:
        return {}
    temperature = (float(rope["original_max_position_embeddings"]), float(beta), 0.0)
    return dict(layer_attention=[{"temperature": temperature}] * config["num_hidden_layers"])


def _granite_unfuse(rest: str, t: Tensor) -> list[tuple[str, Tensor]]:
    """GraniteMoe's fused tensors as ours: ``input_linear`` rows ``[gate | up]`` (the
    experts' ``(E, 2 hidden, dim)``, the shared MLP's ``(2 hidden, dim)``), and
    ``output_linear`` the down projections."""
    shared = rest.startswith("shared_mlp.")
    at = "mlp.shared." if shared else "mlp."
    suffix = ".weight" if shared else ""  # the experts' stacked params have no ".weight"
    if rest.endswith("output_linear.weight"):
        return [(f"{at}down{suffix}", t)]
    gate, up = t.chunk(2, dim=-2)
    return [(f"{at}gate{suffix}", gate), (f"{at}up{suffix}", up)]


def _ungated(config: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """Arcee's and Jais2's ``relu(x W_up)^2 W_down`` MLP, StarCoder2's tanh-GELU one;
    StarCoder2 and Jais2 normalise with LayerNorm (weight and bias)."""
    out: dict[str, Any] = dict(mlp={"relu2": "relu2", "xielu": "xielu"}.get(
        _UNGATED[kind][0], "gelu_tanh"))
    if kind in ("starcoder2", "jais2"):
        eps = config.get("norm_epsilon", config.get("layer_norm_eps", 1e-5))
        out.update(norm="layer", norm_eps=float(eps))
    return out


def llama_from_hf(config: Mapping[str, Any], state_dict: Mapping[str, Tensor] | None = None,
                  **overrides: Any) -> tuple[TransformerEncoder, dict[str, Tensor] | None]:
    """The ``TransformerEncoder`` of a Hugging Face Llama ``config``, and the params of
    its ``state_dict`` under the encoder's names.

    Llama is rotary (Hugging Face's half-split pairing, ``rope_theta``, ``rope_scaling``),
    grouped-query attention, RMSNorm (``rms_norm_eps``), SwiGLU (``intermediate_size``),
    no biases and optionally tied embeddings: each an option of ``TransformerEncoder``.
    A ``sliding_window`` (Mistral's config) becomes the encoder's ``window``. Mixtral
    (``num_local_experts``, ``num_experts_per_tok``) becomes ``experts`` / ``top_k``
    (:class:`MoE`, its experts' matrices stacked: ``w1`` -> ``gate``, ``w3`` -> ``up``,
    ``w2`` -> ``down``); Qwen2 (``model_type="qwen2"``) gets its q/k/v biases
    (``qkv_bias=True``), and Qwen2-MoE (``"qwen2_moe"``, every layer sparse) its experts,
    un-renormalised top-k weights (``norm_topk_prob``) and sigmoid-gated shared expert.
    Qwen3 (``"qwen3"``, ``"qwen3_moe"``) gets an RMSNorm on each head's queries and keys
    (``qk_norm=True``). A ``head_dim`` other than ``hidden_size // num_attention_heads``
    (Qwen3, Mistral NeMo) is kept, and windows on some layers only (``layer_types``, or
    Qwen's ``use_sliding_window`` from ``max_window_layers`` on) become ``layer_windows``.
    Cohere and Cohere2 (``"cohere"``, ``"cohere2"``: Command R, R7B) have one LayerNorm
    without bias for both parallel sublayers (``parallel_residual="shared"``), rotary
    pairs interleaved (``rotary_interleaved``), ``logit_scale`` and tied embeddings;
    Cohere2 windows three layers of four and rotates only those (NoPE on the others).
    Granite (``"granite"``) multiplies its embeddings (``embed_scale``), scores
    (``attn_scale``), sublayer outputs (``residual_scale``) and logits (``logit_scale``,
    one over ``logits_scaling``) by its config's constants.
    SmolLM3 (``"smollm3"``) has no position embedding in the layers ``no_rope_layers``
    marks 0 (``layer_rotary`` False there: NoPE).
    OLMo 2 (``"olmo2"``) normalises the sublayers' outputs only (``pre_norms=False,
    post_norms=True``) and its queries and keys over all heads (``qk_norm_scope="all"``).
    OLMoE (``"olmoe"``) has Llama's pre-norm blocks with OLMo 2's q/k norms, and a
    mixture as Qwen3-MoE's (``num_experts``, softmax top-k, ``norm_topk_prob``).
    gpt-oss (``"gpt_oss"``) has biases on q, k, v and the output, a learned attention sink
    per head (``attn_sinks``), windows on alternate layers, YaRN, and a mixture whose
    router has a bias and whose experts are clamped SwiGLUs with biases (:class:`MoE`'s
    ``mlp="swiglu_clamp"``, ``expert_bias``, ``logit_bias``); its fused ``gate_up_proj``
    is split; the Hub's MXFP4 experts are dequantized to bfloat16 (:func:`dequantize_mxfp4`).
    Phi-3 (``"phi3"``) has q/k/v and gate/up fused, and ``partial_rotary_factor``
    becomes ``rotary_dim``; its LongRoPE (Phi-3.5, Phi-4-mini) is ``rotary_scaling``
    ``{"rope_type": "longrope", ...}``, the long factors chosen per call from its
    positions, as transformers does (so a cached decode switches at the same token).
    Gemma (``"gemma"``, ``"gemma2"``, ``"gemma3_text"``) gets its tanh-GELU gate
    (``mlp="geglu"``), RMSNorm scaling by ``1 + weight`` (``norm="rms+1"``) and
    embeddings times ``sqrt(hidden_size)``; Gemma 2 and 3 their norms after each
    sublayer (``post_norms``), ``query_pre_attn_scalar`` (``attn_scale``), score and
    logit soft-capping (``softcap``, ``logit_softcap``) and alternating windows; Gemma 3
    its q/k norms and a RoPE base of its own on the windowed layers (``layer_rotary``).
    OLMo 3 (``"olmo3"``) is OLMo 2 with windows on three layers of four and a RoPE per
    kind of layer; EXAONE 4 (``"exaone4"``) OLMo 2's blocks with q/k norms per head and,
    with windows, no position embedding on its global layers. Ministral
    (``"ministral"``) is Mistral with ``layer_types``; Seed-OSS (``"seed_oss"``) has
    biases on q, k, v (``attention_bias``) and the output (``attention_out_bias``);
    Helium and ERNIE 4.5 (``"helium"``, ``"ernie4_5"``: ``use_bias`` on every
    projection, tied by default) interleave their rotary pairs; GLM and GLM-4 (``"glm"``,
    ``"glm4"``) fuse gate and up, rotate half of each head interleaved and bias q, k and
    v, GLM-4 normalising the sublayers' outputs too. Arcee and Jais2 (``"arcee"``,
    ``"jais2"``) have ungated ``relu(x W_up)^2 W_down`` MLPs (``mlp="relu2"``),
    StarCoder2 (``"starcoder2"``) a tanh-GELU one; Jais2 and StarCoder2 LayerNorms with
    biases and biases on every projection. VaultGemma (``"vaultgemma"``) is Gemma 2
    without the norms on the sublayers' outputs. Hunyuan (``"hunyuan_v1_dense"``)
    normalises each head's queries and keys after the rotation
    (``qk_norm_scope="rotated"``) and stretches its RoPE base by ``alpha``; Ministral 3
    (``"ministral3"``) scales its queries by Llama 4's temperature with the floor one
    position earlier (``temperature=(M, beta, 0)``). Apertus (``"apertus"``) has q/k norms
    per head and an ungated MLP with the learned xIELU activation (``mlp="xielu"``,
    :class:`XIELU`). Mixtures: FlexOlmo (``"flex_olmo"``: OLMo 2's blocks, OLMoE's
    mixture), Hunyuan-MoE (``"hunyuan_v1_moe"``: Mixtral's routing and an ungated shared
    MLP), GraniteMoe and GraniteMoeShared (``"granitemoe"``, ``"granitemoeshared"``:
    Granite's multipliers, experts fused on disk as ``input_linear`` / ``output_linear``,
    split and joined here), Phi-3.5-MoE (``"phimoe"``: SparseMixer's top-2 routing,
    ``MoE(scoring="sparsemixer")``; LayerNorms with biases, biases on q/k/v/o and the head;
    LongRoPE with ``short_mscale`` / ``long_mscale``. Past the original context it takes
    the long factors, as Phi-3.5-MoE's own code does; transformers' port keeps the short
    ones there while switching to ``long_mscale``), Mellum (``"mellum"``: Qwen3-MoE's heads
    and mixture, ``mlp_layer_types``, windows where ``layer_types`` says, a rotary base and
    rotated fraction per layer type), Cohere2-MoE (``"cohere2_moe"``: Cohere2's parallel
    blocks, an RMSNorm where ``rms_norm_eps`` is set, a dense prefix of
    ``prefix_dense_intermediate_size`` that also rotates, softmax over the top-k logits or
    sigmoid scores, shared experts added or averaged, ``MoE(shared_combine=)``). Llama's
    own ``attention_bias`` and
    ``mlp_bias`` are read (biases on q, k, v and the output, on the MLP).
    The q, k and v projections become one ``qkv`` matrix. The checkpoint's tensors are
    used as they are (nothing is copied but ``qkv`` and the stacked experts), so
    ``safetensors.torch.load_file`` of a checkpoint's shards gives ``state_dict``.
    RoPE comes from ``rope_parameters`` (transformers >= 5) or ``rope_theta`` and
    ``rope_scaling`` (earlier configs). Tested against a Llama forward written out from
    the Hugging Face model's definition and against ``transformers`` 5 itself.

    Args:
        config: the checkpoint's ``config.json`` as a dict.
        state_dict: its tensors under Hugging Face's names (``model.layers.0.self_attn.
            q_proj.weight``, ...), or None for the module alone.
        overrides: other ``TransformerEncoder`` arguments (``attend``, ``remat``, ...).

    Returns:
        ``(module, params)``: wrap the module in ``torchfn.Model``; ``params`` is None
        without a ``state_dict``.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import llama_from_hf
        >>> config = {"hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
        ...           "num_hidden_layers": 1, "intermediate_size": 24, "vocab_size": 10}
        >>> module, _ = llama_from_hf(config)
        >>> model = torchfn.Model(module)
        >>> params = model.init(torchfn.random.key(0))
        >>> model.apply(params, torch.tensor([[1, 2, 3]])).shape
        torch.Size([1, 3, 10])
    """
    kwargs = _config(config)
    kwargs.update(overrides)
    check_state_dict(state_dict)
    module = TransformerEncoder(**kwargs)
    if state_dict is None:
        return module, None
    if any(name.endswith("_blocks") for name in state_dict):  # gpt-oss's MXFP4 experts
        from torchfn.models._dequantize import dequantize_mxfp4

        state_dict = dequantize_mxfp4(state_dict)
    params: dict[str, Tensor] = {}
    parts: dict[str, dict[Any, Tensor]] = {}  # our name -> the pieces to join
    kind = config.get("model_type", "llama")
    router, expert_names, stacked, _ = _MOE.get(kind, (None, None, {}, {}))
    names = layer_names(kind)

    def read_layer(i: str, rest: str, tensor: Tensor) -> bool:
        at, expert = f"blocks.{i}.", router and expert_names.fullmatch(rest)
        if rest in names:
            params[at + names[rest]] = tensor
        elif router and rest in _NAMES and rest.startswith("mlp.") and not \
                (kwargs.get("layer_experts") or [True] * kwargs["depth"])[int(i)]:
            params[at + _NAMES[rest]] = tensor  # a dense layer of a mixture model
        elif rest == router:
            params[at + "mlp.router.weight"] = tensor
        elif rest in _QKV:  # q, k, v in that order
            parts.setdefault(at + _QKV[rest], {})[rest[10]] = tensor
        elif kind == "gpt_oss" and rest in _GPT_OSS_EXPERTS:
            parts.setdefault(at + "gpt_oss", {})[rest] = tensor
        elif kind in _FUSED_MLP and rest in _PHI3:  # fused: [q | k | v], [gate | up]
            if rest == "self_attn.qkv_proj.weight":
                params[at + "attn.qkv.weight"] = tensor
            else:
                params[at + "mlp.gate.weight"], params[at + "mlp.up.weight"] = tensor.chunk(2)
        elif expert:  # expert j's matrix -> row j of the stacked one
            parts.setdefault(at + stacked[expert[2]], {})[int(expert[1])] = tensor
        elif kind in _GRANITE_MOE and rest in GRANITE_FUSED:
            params.update({at + n: t for n, t in _granite_unfuse(rest, tensor)})
        elif kind == "apertus" and rest in XIELU_CONSTANTS:
            want = torch.tensor(XIELU_CONSTANTS[rest], dtype=tensor.dtype)
            if tensor.shape != () or not torch.equal(tensor, want):  # (fixed here)
                raise ValueError(f"state_dict's model.layers.{i}.{rest} = {tensor.tolist()!r} "
                                 f"is not supported here (needs xIELU's {want.item()!r})")
        else:
            return False
        return True

    read_state(state_dict.items(), kind.capitalize(), params, globals_=GLOBAL_NAMES,
               tied=kwargs["tie_embeddings"], read_layer=read_layer, ignore=_IGNORED.fullmatch)
    for name, pieces in parts.items():
        if name.endswith("gpt_oss"):
            if len(pieces) == len(_GPT_OSS_EXPERTS):  # else missing, reported below
                at = name[:-len("gpt_oss")]
                params.update({at + n: t for n, t in _gpt_oss_experts(pieces).items()})
        elif name.endswith((".qkv.weight", ".qkv.bias")):
            if len(pieces) == 3:
                params[name] = torch.cat([pieces[p] for p in "qkv"])
        elif sorted(pieces) == list(range(kwargs["experts"])):
            params[name] = torch.stack([pieces[j] for j in range(len(pieces))])  # (E, ...)
    want = {name: tuple(p.shape) for name, p in module.named_parameters()}
    extra = sorted(set(params) - set(want))  # e.g. Qwen3's q_norm in a Llama checkpoint
    if extra:
        raise ValueError(f"state_dict has tensors the config's {kind} does not use: "
                         f"{extra[:5]}" + (f" and {len(extra) - 5} more" if len(extra) > 5
                                           else ""))
    missing = sorted(set(want) - set(params))
    if missing:
        raise ValueError(f"state_dict lacks the tensors for {missing[:5]}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    wrong = [(n, tuple(params[n].shape), want[n]) for n in want if tuple(params[n].shape) !=
             want[n]]
    if wrong:
        raise ValueError(f"state_dict shapes do not match the config: (name, got, want) "
                         f"{wrong[:3]}")
    return module, params
