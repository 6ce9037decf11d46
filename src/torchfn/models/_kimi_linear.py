"""A Hugging Face Kimi Linear checkpoint (``kimi_linear``) as a ``TransformerEncoder``, its
params and its router state, and back: Kimi Delta Attention in most blocks, latent
attention without position embedding in the others, DeepSeek-V3's mixture of experts."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from torchfn.models._deepseek import _check, _routing
from torchfn.models._fit import check_state_dict, join_pieces, read_state
from torchfn.models._llama import GLOBAL_NAMES
from torchfn.models._transformer import TransformerEncoder

__all__ = ["kimi_linear_from_hf", "kimi_linear_to_hf"]

_EXPERT = re.compile(r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w[123])\.weight")
_W = {"w1": "gate", "w3": "up", "w2": "down"}  # an expert's matrices -> ours
_COMMON = {"input_layernorm.weight": "ln1.weight",
           "post_attention_layernorm.weight": "ln2.weight"}
_MLA = {  # a latent-attention layer's names -> ours
    "self_attn.q_proj.weight": "attn.q.weight",
    "self_attn.q_a_proj.weight": "attn.q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn.kv_a.weight",
    "self_attn.kv_a_layernorm.weight": "attn.kv_norm.weight",
    "self_attn.kv_b_proj.weight": "attn.kv_b.weight",
    "self_attn.o_proj.weight": "attn.out.weight",
}
_KDA = {  # a Kimi Delta Attention layer's, but q/k/v and their convolutions (joined here)
    "self_attn.f_a_proj.weight": "attn.f_a.weight",
    "self_attn.f_b_proj.weight": "attn.f_b.weight",
    "self_attn.dt_bias": "attn.dt_bias",
    "self_attn.A_log": "attn.A_log",  # (1, 1, H, 1) there, (H,) here
    "self_attn.b_proj.weight": "attn.beta.weight",
    "self_attn.g_a_proj.weight": "attn.g_a.weight",
    "self_attn.g_b_proj.weight": "attn.g_b.weight",
    "self_attn.o_norm.weight": "attn.norm",
    "self_attn.o_proj.weight": "attn.out.weight",
}
_JOINED = {**{f"self_attn.{p}_proj.weight": "attn.qkv.weight" for p in "qkv"},
           **{f"self_attn.{p}_conv1d.weight": "attn.conv.weight" for p in "qkv"}}
_MLP = {  # the MLP's, under either prefix (transformers writes block_sparse_moe)
    **{f"{at}.{p}_proj.weight": f"mlp.{p}.weight" for at in ("mlp", "block_sparse_moe")
       for p in ("gate", "up", "down")},
    **{f"{at}.shared_experts.{p}_proj.weight": f"mlp.shared.{p}.weight"
       for at in ("mlp", "block_sparse_moe") for p in ("gate", "up", "down")},
    **{f"{at}.gate.weight": "mlp.router.weight" for at in ("mlp", "block_sparse_moe")},
}
_BIAS = ("block_sparse_moe.gate.e_score_correction_bias", "mlp.gate.e_score_correction_bias")


def _get(config: Mapping[str, Any], names: tuple[str, ...], default: Any = None) -> Any:
    """The first of ``names`` the config has (transformers writes some under aliases)."""
    return next((config[n] for n in names if config.get(n) is not None), default)


def _layer_types(config: Mapping[str, Any], depth: int) -> list[bool]:
    """For each layer, whether it is Kimi Delta Attention (else latent attention):
    ``layer_types``, or the checkpoint's ``linear_attn_config`` (1-indexed lists), or
    transformers' default (latent attention at 4, 8, ...)."""
    types = config.get("layer_types")
    linear = config.get("linear_attn_config") or {}
    if types is None and "kda_layers" in linear and "full_attn_layers" in linear:
        types = ["linear_attention" if i + 1 in linear["kda_layers"] else "full_attention"
                 for i in range(depth)]
    if types is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention"
                 for i in range(depth)]
    names = {"linear_attention": True, "full_attention": False}
    if len(types) != depth or not set(types) <= set(names):
        raise ValueError(f"config['layer_types'] must list 'linear_attention' or "
                         f"'full_attention' for each of {depth} layers, got {types!r}")
    return [names[t] for t in types]


def _config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``TransformerEncoder``'s keywords for a Kimi Linear config."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict (a config.json), got {type(config).__name__}")
    if config.get("model_type", "kimi_linear") != "kimi_linear":
        raise ValueError(f"config['model_type'] must be 'kimi_linear', got "
                         f"{config['model_type']!r}")
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                           "intermediate_size", "vocab_size", "kv_lora_rank",
                           "qk_rope_head_dim", "qk_nope_head_dim") if config.get(k) is None]
    if missing:
        raise ValueError(f"config lacks {missing}: not a kimi_linear config")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False)):
        if config.get(key, want) != want:
            raise ValueError(f"config[{key!r}] = {config[key]!r} is not supported here "
                             f"(needs {want!r})")
    depth, dim = config["num_hidden_layers"], config["hidden_size"]
    linear = config.get("linear_attn_config") or {}
    nope, rope = config["qk_nope_head_dim"], config["qk_rope_head_dim"]
    kwargs: dict[str, Any] = dict(
        dim=dim, heads=config["num_attention_heads"], depth=depth,
        vocab_size=config["vocab_size"], out_dim=config["vocab_size"], causal=True,
        position_embedding="none", norm="rms", mlp="swiglu", bias=False,
        mlp_hidden=config["intermediate_size"], norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        latent_attention=dict(kv_rank=config["kv_lora_rank"], rope_dim=rope, nope_dim=nope,
                              v_dim=config.get("v_head_dim") or nope,
                              q_rank=config.get("q_lora_rank")),
        linear_attention=dict(
            kind="kda", heads=_get(config, ("linear_num_heads",), linear.get("num_heads", 32)),
            head_dim=_get(config, ("linear_head_dim",), linear.get("head_dim", 128)),
            conv_kernel=_get(config, ("linear_conv_kernel_dim",),
                             linear.get("short_conv_kernel_size", 4))),
        layer_linear=_layer_types(config, depth))
    types = config.get("mlp_layer_types")
    if types is None:
        first = config.get("first_k_dense_replace", 1)
        types = ["dense" if i < first else "sparse" for i in range(depth)]
    if len(types) != depth or not set(types) <= {"dense", "sparse"}:
        raise ValueError(f"config['mlp_layer_types'] must list 'dense' or 'sparse' for each "
                         f"of {depth} layers, got {types!r}")
    kwargs.update(v3_mixture(config, types))
    return kwargs


def v3_mixture(config: Mapping[str, Any], types: list[str]) -> dict[str, Any]:
    """``TransformerEncoder``'s mixture keywords for DeepSeek-V3's router under the names
    Kimi Linear's and Ling's configs use (or DeepSeek's), in the layers ``types`` marks
    ``"sparse"``; nothing where none is."""
    if "sparse" not in types:
        return {}
    deepseek = {  # DeepSeek-V3's names for the same router
        "moe_intermediate_size": config["moe_intermediate_size"],
        "n_shared_experts": _get(config, ("num_shared_experts", "n_shared_experts"), 1),
        "routed_scaling_factor": config.get("routed_scaling_factor", 1.0),
        "norm_topk_prob": _get(config, ("moe_renormalize", "norm_topk_prob"), True),
        "n_group": _get(config, ("num_expert_group", "n_group"), 1),
        "topk_group": config.get("topk_group") or 1}
    return dict(experts=_get(config, ("num_experts", "num_local_experts"), 256),
                top_k=_get(config, ("num_experts_per_token", "num_experts_per_tok"), 8),
                expert_hidden=config["moe_intermediate_size"],
                moe_options=_routing(deepseek, "deepseek_v3"),
                layer_experts=None if set(types) == {"sparse"} else
                [t == "sparse" for t in types])


def kimi_linear_from_hf(config: Mapping[str, Any],
                        state_dict: Mapping[str, Tensor] | None = None, **overrides: Any,
                        ) -> tuple[TransformerEncoder, dict[str, Tensor] | None,
                                   dict[str, Tensor] | None]:
    """The ``TransformerEncoder`` of a Hugging Face Kimi Linear ``config``
    (``"kimi_linear"``), and the params and router state of its ``state_dict``.

    Most blocks mix tokens with :class:`KimiDeltaAttention` (the gated delta rule with a
    decay per key channel; its q, k and v projections, and their convolutions, joined
    into one each here), the others (``layer_types``, or the checkpoint's
    ``linear_attn_config``) with :class:`LatentAttention` without position embedding
    (``rotary=False``: its "rope" key part shared by the heads but not rotated). The
    MLPs are DeepSeek-V3's: dense SwiGLU in the first ``first_k_dense_replace`` (or
    ``mlp_layer_types``), else a sigmoid-scored, group-limited mixture with a shared
    expert, whose ``e_score_correction_bias`` is router *state* as in
    :func:`deepseek_from_hf`. Tested against ``transformers`` 5 on logits, both caches,
    greedy generation (left-padded too) and the round trip.

    Args:
        config: the checkpoint's ``config.json`` as a dict.
        state_dict: its tensors under Hugging Face's names, or None for the module alone.
        overrides: other ``TransformerEncoder`` arguments.

    Returns:
        ``(module, params, state)``; ``params`` and ``state`` are None without a
        ``state_dict``.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import kimi_linear_from_hf
        >>> config = {"model_type": "kimi_linear", "hidden_size": 32, "num_attention_heads": 4,
        ...           "num_hidden_layers": 2, "intermediate_size": 48, "vocab_size": 10,
        ...           "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
        ...           "v_head_dim": 8, "moe_intermediate_size": 8, "num_experts": 4,
        ...           "num_experts_per_token": 2, "linear_num_heads": 4, "linear_head_dim": 8,
        ...           "layer_types": ["linear_attention", "full_attention"]}
        >>> module, _, _ = kimi_linear_from_hf(config)
        >>> [type(b.attn).__name__ for b in module.blocks]
        ['KimiDeltaAttention', 'LatentAttention']
        >>> model = torchfn.Model(module)
        >>> params, state = model.init(torchfn.random.key(0)), model.init_state()
        >>> model.apply(params, torch.tensor([[1, 2, 3]]), state=state).shape
        torch.Size([1, 3, 10])
    """
    kwargs = _config(config)
    kwargs.update(overrides)
    check_state_dict(state_dict)
    module = TransformerEncoder(**kwargs)
    if state_dict is None:
        return module, None, None
    linear = kwargs["layer_linear"]
    params: dict[str, Tensor] = {}
    state: dict[str, Tensor] = {}
    pieces: dict[str, dict[Any, Tensor]] = {}  # our joined or stacked name -> its parts

    def read_layer(i: str, rest: str, tensor: Tensor) -> bool:
        if int(i) >= kwargs["depth"]:
            return False
        at, kda, expert = f"blocks.{i}.", linear[int(i)], _EXPERT.fullmatch(rest)
        names = _COMMON | _MLP | (_KDA if kda else _MLA)
        if rest in names:
            if rest == "self_attn.A_log":
                tensor = tensor.reshape(-1)  # (1, 1, H, 1) -> (H,)
            params[at + names[rest]] = tensor
        elif kda and rest in _JOINED:  # rows [q | k | v]
            pieces.setdefault(at + _JOINED[rest], {})[rest[10]] = tensor
        elif rest in _BIAS:
            state[at + "mlp.router_bias"] = tensor
        elif expert:  # expert j's matrix -> row j of the stacked one
            pieces.setdefault(f"{at}mlp.{_W[expert[2]]}", {})[int(expert[1])] = tensor
        else:
            return False
        return True

    read_state(state_dict.items(), "kimi_linear", params, globals_=GLOBAL_NAMES,
               tied=kwargs["tie_embeddings"], read_layer=read_layer)
    join_pieces(params, pieces, kwargs.get("experts"))
    _check(module, params, state)
    return module, params, state


def kimi_linear_to_hf(config: Mapping[str, Any], params: Mapping[str, Tensor],
                      state: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
    """``params`` and the routers' ``state`` of the model ``kimi_linear_from_hf(config)``
    builds, under the names ``transformers`` writes (the MLPs under ``block_sparse_moe``;
    q, k, v and their convolutions apart, the experts one matrix each: copies). The
    inverse of :func:`kimi_linear_from_hf`, bit for bit.

    Example::

        >>> import torchfn
        >>> from torchfn.models import kimi_linear_from_hf, kimi_linear_to_hf
        >>> config = {"model_type": "kimi_linear", "hidden_size": 32, "num_attention_heads": 4,
        ...           "num_hidden_layers": 1, "intermediate_size": 48, "vocab_size": 10,
        ...           "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
        ...           "linear_num_heads": 4, "linear_head_dim": 8}
        >>> params = torchfn.Model(kimi_linear_from_hf(config)[0]).init(torchfn.random.key(0))
        >>> kimi_linear_to_hf(config, params)["model.layers.0.self_attn.A_log"].shape
        torch.Size([1, 1, 4, 1])
    """
    kwargs = _config(config)
    module = TransformerEncoder(**kwargs)
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a dict of tensors, got {type(params).__name__}")
    state = {} if state is None else state
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a dict of tensors or None, got {type(state).__name__}")
    _check(module, params, state)
    back = {ours: hf for hf, ours in GLOBAL_NAMES.items()}
    inverse = {kda: {ours: hf for hf, ours in (_COMMON | (_KDA if kda else _MLA)).items()}
               | {ours: hf for hf, ours in _MLP.items() if hf.startswith("block_sparse_moe")}
               for kda in (False, True)}
    out: dict[str, Tensor] = {}
    for name, t in {**params, **state}.items():
        if name in back:
            out[back[name]] = t
            continue
        i, rest = name.split(".", 2)[1:]
        at = f"model.layers.{i}."
        if rest == "mlp.router_bias":
            out[at + _BIAS[0]] = t
        elif rest in ("attn.qkv.weight", "attn.conv.weight"):  # [q | k | v] rows
            kind = "proj" if rest == "attn.qkv.weight" else "conv1d"
            for p, part in zip("qkv", t.chunk(3)):
                out[f"{at}self_attn.{p}_{kind}.weight"] = part.clone()
        elif rest in ("mlp.gate", "mlp.up", "mlp.down"):  # stacked experts (E, ...)
            w = {ours: hf for hf, ours in _W.items()}[rest[4:]]
            for j, part in enumerate(t.unbind(0)):
                out[f"{at}block_sparse_moe.experts.{j}.{w}.weight"] = part.clone()
        elif rest == "attn.A_log" and kwargs["layer_linear"][int(i)]:
            out[at + "self_attn.A_log"] = t.reshape(1, 1, -1, 1)
        else:
            out[at + inverse[kwargs["layer_linear"][int(i)]][rest]] = t
    return out
