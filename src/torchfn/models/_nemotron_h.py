"""A Hugging Face Nemotron-H checkpoint (NVIDIA Nemotron-H, Nemotron Nano 2, Nemotron 3
Nano) as a ``TransformerEncoder``, its params and its routers' state, and back: blocks of
one part each, a Mamba-2 mixer, attention, an MLP or a mixture."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from torchfn.models._fit import (
    check_fit,
    check_state_dict,
    join_qkv,
    param_shapes,
    read_state,
    stack_experts,
)
from torchfn.models._mamba_hybrid import _MAMBA
from torchfn.models._transformer import TransformerEncoder

__all__ = ["nemotron_h_from_hf", "nemotron_h_to_hf"]

_TYPES = ("nemotron_h",)
_EXPERT = re.compile(r"mixer\.experts\.(\d+)\.(up|down)_proj\.weight")
_GLOBAL = {"backbone.embeddings.weight": "embed.weight", "backbone.norm_f.weight": "ln.weight",
           "lm_head.weight": "head.weight"}
_PART = {  # a layer's kind -> its norm's name here, and its other tensors' (but experts)
    "linear_attention": ("ln1.weight", {f"mixer.{n.split('.', 1)[1]}": ours
                                        for n, ours in _MAMBA.items()}),
    "full_attention": ("ln1.weight", {
        **{f"mixer.{p}_proj.weight": f"attn.{p}_proj.weight" for p in "qkv"},  # joined
        "mixer.o_proj.weight": "attn.out.weight"}),
    "mlp": ("ln2.weight", {"mixer.up_proj.weight": "mlp.0.weight",
                           "mixer.down_proj.weight": "mlp.2.weight"}),
    "moe": ("ln2.weight", {"mixer.gate.weight": "mlp.router.weight",
                           "mixer.shared_experts.up_proj.weight": "mlp.shared.0.weight",
                           "mixer.shared_experts.down_proj.weight": "mlp.shared.2.weight"}),
}
_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_BIAS = "mixer.gate.e_score_correction_bias"  # the routers' selection bias: our state


def _types(config: Mapping[str, Any]) -> list[str]:
    """Each layer's kind: ``layers_block_type``, or read from ``hybrid_override_pattern``
    (``M`` Mamba-2, ``*`` attention, ``-`` MLP, ``E`` mixture); their number is the
    model's depth (transformers 5 writes no ``num_hidden_layers``)."""
    types = config.get("layers_block_type")
    if types is None:
        types = [_PATTERN.get(c, c) for c in config.get("hybrid_override_pattern", "")]
    types = list(types)
    depth = config.get("num_hidden_layers", len(types))
    if not types or len(types) != depth or not set(types) <= set(_PART):
        raise ValueError(f"config['layers_block_type'] must list {sorted(_PART)} for each of "
                         f"{depth} layers, got {types!r}")
    return types


def _config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``TransformerEncoder``'s keywords for a Nemotron-H config."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict (a config.json), got {type(config).__name__}")
    if config.get("model_type") not in _TYPES:
        raise ValueError(f"config['model_type'] must be one of {_TYPES}, got "
                         f"{config.get('model_type')!r}")
    missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size",
                           "vocab_size", "mamba_num_heads", "mamba_head_dim") if k not in config]
    if missing:
        raise ValueError(f"config lacks {missing}: not a nemotron_h config")
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu"),
                      ("mlp_bias", False), ("moe_latent_size", None)):
        if config.get(key, want) != want:
            raise ValueError(f"config[{key!r}] = {config[key]!r} is not supported here "
                             f"(needs {want!r})")
    types = _types(config)
    dim, heads = config["hidden_size"], config["num_attention_heads"]
    limit = config.get("time_step_limit") or (0.0, float("inf"))
    kwargs: dict[str, Any] = dict(
        dim=dim, heads=heads, depth=len(types), vocab_size=config["vocab_size"],
        out_dim=config["vocab_size"], causal=True, position_embedding="none",  # NoPE
        head_dim=config.get("head_dim") or dim // heads,
        kv_heads=config.get("num_key_value_heads") or heads, norm="rms", mlp="relu2",
        bias=False, mlp_hidden=config["intermediate_size"],  # (its attention has no biases)
        norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
        max_len=config.get("max_position_embeddings", 4096),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        layer_parts=["mixer" if t.endswith("attention") else "mlp" for t in types],
        layer_linear=[t == "linear_attention" for t in types],
        linear_attention=dict(
            kind="mamba2", heads=config["mamba_num_heads"], head_dim=config["mamba_head_dim"],
            state_dim=config.get("ssm_state_size", 128), groups=config.get("n_groups", 8),
            conv_kernel=config.get("conv_kernel", 4), bias=bool(config.get("use_bias")),
            conv_bias=bool(config.get("use_conv_bias", True)),
            dt_limit=(float(limit[0]), float(limit[1]))),
    )
    if "moe" in types:
        options: dict[str, Any] = dict(
            mlp="relu2", scoring="sigmoid", router_bias=True,
            normalize=bool(config.get("norm_topk_prob", True)),
            routed_scale=float(config.get("routed_scaling_factor", 1.0)),
            groups=config.get("n_group", 1), topk_groups=config.get("topk_group", 1))
        if config.get("n_shared_experts", 1):
            options["shared_hidden"] = config["moe_shared_expert_intermediate_size"]
        kwargs.update(experts=config["n_routed_experts"],
                      top_k=config.get("num_experts_per_tok", 2),
                      expert_hidden=config["moe_intermediate_size"],
                      layer_experts=[t == "moe" for t in types], moe_options=options)
    return kwargs


def nemotron_h_from_hf(config: Mapping[str, Any], state_dict: Mapping[str, Tensor] | None = None,
                       **overrides: Any,
                       ) -> tuple[TransformerEncoder, dict[str, Tensor] | None,
                                  dict[str, Tensor] | None]:
    """The ``TransformerEncoder`` of a Hugging Face Nemotron-H ``config`` (``model_type``
    ``"nemotron_h"``), and the params and state of its ``state_dict``.

    Each layer is a norm and one part (``layers_block_type``, or
    ``hybrid_override_pattern``'s ``M`` / ``*`` / ``-`` / ``E``): a :class:`Mamba2` mixer
    or attention without position embedding (``layer_parts="mixer"``), or a squared-ReLU
    MLP (``mlp="relu2"``) or mixture (``layer_parts="mlp"``). The mixture routes as
    DeepSeek-V3 (sigmoid scores, group-limited choice, renormalised and scaled weights)
    over squared-ReLU experts beside a shared one; its ``e_score_correction_bias`` is
    router *state* (``blocks.i.mlp.router_bias``), returned apart from the params, as
    :func:`deepseek_from_hf` does. The step sizes are clamped to ``time_step_limit``
    (default ``(0, inf)``), as NVIDIA's published implementation and transformers >= 5.25
    do; earlier transformers clamped below at ``time_step_min`` instead. Tested against
    ``transformers`` 5 on logits, both caches, greedy generation and the round trip.

    Returns:
        ``(module, params, state)``; ``params`` and ``state`` are None without a
        ``state_dict``.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import nemotron_h_from_hf
        >>> config = {"model_type": "nemotron_h", "hidden_size": 16, "num_attention_heads": 2,
        ...           "num_hidden_layers": 4, "intermediate_size": 24, "vocab_size": 10,
        ...           "mamba_num_heads": 2, "mamba_head_dim": 16, "n_groups": 1,
        ...           "hybrid_override_pattern": "M-*-"}
        >>> module, _, _ = nemotron_h_from_hf(config)
        >>> [type(b.attn).__name__ if b.attn is not None else "MLP" for b in module.blocks]
        ['Mamba2', 'MLP', 'MultiHeadAttention', 'MLP']
        >>> params = torchfn.Model(module).init(torchfn.random.key(0))
        >>> torchfn.Model(module).apply(params, torch.tensor([[1, 2, 3]])).shape
        torch.Size([1, 3, 10])
    """
    kwargs = _config(config) | overrides
    check_state_dict(state_dict)
    module = TransformerEncoder(**kwargs)
    if state_dict is None:
        return module, None, None
    types = _types(config)
    params: dict[str, Tensor] = {}
    state: dict[str, Tensor] = {}
    experts: dict[str, dict[int, Tensor]] = {}

    def read_layer(i: str, rest: str, tensor: Tensor) -> bool:
        at, expert = f"blocks.{i}.", _EXPERT.fullmatch(rest)
        norm, names = _PART[types[int(i)]]
        if rest == "norm.weight":
            params[at + norm] = tensor
        elif rest in names:
            params[at + names[rest]] = tensor
        elif rest == _BIAS:
            state[at + "mlp.router_bias"] = tensor
        elif expert:  # expert j's matrix -> row j of the stacked one
            experts.setdefault(f"{at}mlp.{expert[2]}", {})[int(expert[1])] = tensor
        else:
            return False
        return True

    read_state(state_dict.items(), "Nemotron-H", params, globals_=_GLOBAL,
               tied=kwargs["tie_embeddings"], read_layer=read_layer, layers="backbone.layers.")
    stack_experts(params, experts, kwargs.get("experts"))
    join_qkv(params)
    check_fit(param_shapes(module), params, "state_dict (params)")
    check_fit({n: tuple(b.shape) for n, b in module.named_buffers()
               if n.endswith("router_bias")}, state, "state_dict (state)")
    return module, params, state


def nemotron_h_to_hf(config: Mapping[str, Any], params: Mapping[str, Tensor],
                     state: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
    """``params`` and ``state`` of the model ``nemotron_h_from_hf(config)`` builds, under a
    Hugging Face checkpoint's names: q, k and v apart, the stacked experts one matrix each
    (copies), ``router_bias`` as ``e_score_correction_bias``. The inverse of
    :func:`nemotron_h_from_hf`, bit for bit.

    Example::

        >>> import torchfn
        >>> from torchfn.models import nemotron_h_from_hf, nemotron_h_to_hf
        >>> config = {"model_type": "nemotron_h", "hidden_size": 16, "num_attention_heads": 2,
        ...           "num_hidden_layers": 2, "intermediate_size": 24, "vocab_size": 10,
        ...           "mamba_num_heads": 2, "mamba_head_dim": 16, "n_groups": 1,
        ...           "hybrid_override_pattern": "M-"}
        >>> params = torchfn.Model(nemotron_h_from_hf(config)[0]).init(torchfn.random.key(0))
        >>> sorted(nemotron_h_to_hf(config, params))[:2]
        ['backbone.embeddings.weight', 'backbone.layers.0.mixer.A_log']
    """
    kwargs = _config(config)
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a dict of tensors, got {type(params).__name__}")
    state = {} if state is None else state
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a dict of tensors or None, got {type(state).__name__}")
    with torch.device("meta"):
        module = TransformerEncoder(**kwargs)
    check_fit(param_shapes(module), params, "params")
    check_fit({n: tuple(b.shape) for n, b in module.named_buffers()
               if n.endswith("router_bias")}, state, "state")
    types = _types(config)
    hd = kwargs["head_dim"]
    sizes = [kwargs["heads"] * hd, kwargs["kv_heads"] * hd, kwargs["kv_heads"] * hd]
    glob = {ours: hf for hf, ours in _GLOBAL.items()}
    out: dict[str, Tensor] = {}
    for name, t in {**params, **state}.items():
        if name in glob:
            out[glob[name]] = t
            continue
        i, rest = name.split(".", 2)[1:]
        at = f"backbone.layers.{i}."
        norm, names = _PART[types[int(i)]]
        inverse = {ours: hf for hf, ours in names.items()}
        if rest == norm:
            out[at + "norm.weight"] = t
        elif rest == "mlp.router_bias":
            out[at + _BIAS] = t
        elif rest == "attn.qkv.weight":
            for p, part in zip("qkv", t.split(sizes)):
                out[f"{at}mixer.{p}_proj.weight"] = part.clone()
        elif rest in ("mlp.up", "mlp.down"):  # stacked experts (E, ...)
            for j, part in enumerate(t.unbind(0)):
                out[f"{at}mixer.experts.{j}.{rest[4:]}_proj.weight"] = part.clone()
        else:
            out[at + inverse[rest]] = t
    return out
