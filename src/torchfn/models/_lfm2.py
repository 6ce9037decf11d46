"""A Hugging Face LFM2 or LFM2-MoE checkpoint (``lfm2``, ``lfm2_moe``; Liquid AI) as a
``TransformerEncoder``, its params and its router state, and back: gated short
convolutions in most blocks, attention in the others."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from torchfn.models._deepseek import _check
from torchfn.models._fit import check_state_dict, join_qkv, read_state, stack_experts
from torchfn.models._llama import _ropes
from torchfn.models._transformer import TransformerEncoder

__all__ = ["lfm2_from_hf", "lfm2_to_hf"]

_COMMON = {"operator_norm.weight": "ln1.weight", "ffn_norm.weight": "ln2.weight",
           "feed_forward.w1.weight": "mlp.gate.weight", "feed_forward.w3.weight": "mlp.up.weight",
           "feed_forward.w2.weight": "mlp.down.weight"}
_ATTN = {**{f"self_attn.{p}_proj.weight": f"attn.{p}_proj.weight" for p in "qkv"},
         "self_attn.out_proj.weight": "attn.out.weight",
         "self_attn.q_layernorm.weight": "attn.q_norm.weight",
         "self_attn.k_layernorm.weight": "attn.k_norm.weight"}
_CONV = {f"conv.{hf}.{kind}": f"attn.{ours}.{kind}" for hf, ours in (
    ("in_proj", "in_proj"), ("conv", "conv"), ("out_proj", "out")) for kind in ("weight", "bias")}
_GLOBAL = {"model.embed_tokens.weight": "embed.weight", "model.embedding_norm.weight": "ln.weight",
           "lm_head.weight": "head.weight"}
_EXPERT = re.compile(r"feed_forward\.experts\.(\d+)\.(w[123])\.weight")  # LFM2-MoE's
_W = {"w1": "gate", "w3": "up", "w2": "down"}
_ROUTER, _BIAS = "feed_forward.gate.weight", "feed_forward.expert_bias"
_TYPES = ("lfm2", "lfm2_moe")


def _mlp_hidden(config: Mapping[str, Any]) -> int:
    """The MLP's width: ``intermediate_size``, or with ``block_auto_adjust_ff_dim`` (the
    default) two thirds of it, times ``block_ffn_dim_multiplier``, rounded up to a
    multiple of ``block_multiple_of``, as transformers' ``Lfm2MLP``."""
    hidden = config.get("block_ff_dim") or config["intermediate_size"]
    if config.get("model_type") == "lfm2_moe":  # its dense MLPs: the width as given
        return hidden
    if config.get("block_auto_adjust_ff_dim", True):
        hidden = int(2 * hidden / 3)
        if config.get("block_ffn_dim_multiplier") is not None:
            hidden = int(config["block_ffn_dim_multiplier"] * hidden)
            multiple = config.get("block_multiple_of", 256)
            hidden = multiple * ((hidden + multiple - 1) // multiple)
    return hidden


def _layer_types(config: Mapping[str, Any], depth: int) -> list[bool]:
    """For each layer, whether it is a short convolution (else attention)."""
    types = config.get("layer_types")
    if types is None:
        full = config.get("full_attn_idxs")
        full = range(depth) if full is None else full
        types = ["full_attention" if i in full else "conv" for i in range(depth)]
    if len(types) != depth or not set(types) <= {"conv", "full_attention"}:
        raise ValueError(f"config['layer_types'] must list 'conv' or 'full_attention' for each "
                         f"of {depth} layers, got {types!r}")
    return [t == "conv" for t in types]


def _config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``TransformerEncoder``'s keywords for an LFM2 config."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict (a config.json), got {type(config).__name__}")
    kind = config.get("model_type", "lfm2")
    if kind not in _TYPES:
        raise ValueError(f"config['model_type'] must be one of {_TYPES}, got {kind!r}")
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                           "vocab_size") if config.get(k) is None]
    if config.get("intermediate_size") is None and config.get("block_ff_dim") is None:
        missing.append("intermediate_size")
    if missing:
        raise ValueError(f"config lacks {missing}: not an lfm2 config")
    depth, dim, heads = config["num_hidden_layers"], config["hidden_size"], \
        config["num_attention_heads"]
    rope = config if config.get("rope_parameters") or "rope_theta" in config else \
        dict(config, rope_theta=1e6)  # LFM2's default base
    tied = config.get("tie_word_embeddings", config.get("tie_embedding", True))
    kwargs: dict[str, Any] = dict(
        dim=dim, heads=heads, depth=depth, vocab_size=config["vocab_size"],
        out_dim=config["vocab_size"], causal=True, head_dim=config.get("head_dim") or dim // heads,
        kv_heads=config.get("num_key_value_heads") or heads, norm="rms", mlp="swiglu",
        bias=False, qk_norm=True, norm_eps=float(config.get("norm_eps", 1e-5)),
        mlp_hidden=_mlp_hidden(config), max_len=config.get("max_position_embeddings", 128000),
        tie_embeddings=bool(tied), position_embedding="rotary",
        **_ropes(rope, ["full_attention"] * depth),
        linear_attention=dict(kind="short_conv", kernel=config.get("conv_L_cache", 3),
                              bias=bool(config.get("conv_bias", False))),
        layer_linear=_layer_types(config, depth))
    if kind == "lfm2_moe":  # a mixture after the first num_dense_layers
        dense = config.get("num_dense_layers", 2)
        if dense < depth:
            kwargs.update(
                experts=config.get("num_experts", 32), top_k=config.get("num_experts_per_tok", 4),
                expert_hidden=config["moe_intermediate_size"],
                layer_experts=None if dense <= 0 else [i >= dense for i in range(depth)],
                moe_options=dict(scoring="sigmoid", normalize=bool(config.get(
                    "norm_topk_prob", True)), normalize_eps=1e-6, router_bias=bool(config.get(
                        "use_expert_bias", True)), routed_scale=float(config.get(
                            "routed_scaling_factor", 1.0))))
    return kwargs


def lfm2_from_hf(config: Mapping[str, Any], state_dict: Mapping[str, Tensor] | None = None,
                 **overrides: Any) -> tuple[TransformerEncoder, dict[str, Tensor] | None,
                                            dict[str, Tensor] | None]:
    """The ``TransformerEncoder`` of a Hugging Face LFM2 or LFM2-MoE ``config``
    (``"lfm2"``, ``"lfm2_moe"``: Liquid AI's) and the params and router state of its
    ``state_dict``.

    The blocks ``layer_types`` marks ``"conv"`` mix tokens with :class:`ShortConv` (a
    gated causal convolution of ``conv_L_cache`` taps; its cache entry the last inputs),
    the others with grouped-query attention, rotary, with RMS-normalised queries and keys
    per head. The MLPs are SwiGLU of the adjusted width transformers computes
    (``block_auto_adjust_ff_dim``); the final norm is the checkpoint's
    ``embedding_norm``. LFM2-MoE's blocks after the first ``num_dense_layers`` have a
    sigmoid-scored mixture instead (top ``num_experts_per_tok``, renormalised as
    transformers does, ``/ (sum + 1e-6)``), whose ``expert_bias`` shifts the choice and is
    router *state* (``blocks.i.mlp.router_bias``, for :func:`moe_bias_update`), as
    DeepSeek-V3's. Tested against ``transformers`` 5 on logits, both caches, greedy
    generation (left-padded too) and the round trip.

    Args:
        config: the checkpoint's ``config.json`` as a dict.
        state_dict: its tensors under Hugging Face's names, or None for the module alone.
        overrides: other ``TransformerEncoder`` arguments.

    Returns:
        ``(module, params, state)``; ``params`` and ``state`` are None without a
        ``state_dict``, ``state`` is ``{}`` for LFM2.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import lfm2_from_hf
        >>> config = {"model_type": "lfm2", "hidden_size": 16, "num_attention_heads": 2,
        ...           "num_hidden_layers": 3, "intermediate_size": 48, "vocab_size": 10,
        ...           "layer_types": ["conv", "full_attention", "conv"]}
        >>> module, _, _ = lfm2_from_hf(config)
        >>> [type(b.attn).__name__ for b in module.blocks]
        ['ShortConv', 'MultiHeadAttention', 'ShortConv']
        >>> params = torchfn.Model(module).init(torchfn.random.key(0))
        >>> torchfn.Model(module).apply(params, torch.tensor([[1, 2, 3]])).shape
        torch.Size([1, 3, 10])
    """
    kwargs = _config(config)
    kwargs.update(overrides)
    check_state_dict(state_dict)
    module = TransformerEncoder(**kwargs)
    if state_dict is None:
        return module, None, None
    conv = kwargs["layer_linear"]
    params: dict[str, Tensor] = {}
    state: dict[str, Tensor] = {}
    experts: dict[str, dict[int, Tensor]] = {}  # our stacked name -> expert j's matrix

    def read_layer(i: str, rest: str, tensor: Tensor) -> bool:
        if int(i) >= len(conv):
            return False
        at, expert = f"blocks.{i}.", _EXPERT.fullmatch(rest)
        names = _COMMON | (_CONV if conv[int(i)] else _ATTN)
        if rest in names:
            params[at + names[rest]] = tensor
        elif rest == _ROUTER:
            params[at + "mlp.router.weight"] = tensor
        elif rest == _BIAS:
            state[at + "mlp.router_bias"] = tensor
        elif expert:
            experts.setdefault(f"{at}mlp.{_W[expert[2]]}", {})[int(expert[1])] = tensor
        else:
            return False
        return True

    read_state(state_dict.items(), config.get("model_type", "lfm2"), params, globals_=_GLOBAL,
               tied=kwargs["tie_embeddings"], read_layer=read_layer)
    stack_experts(params, experts, kwargs.get("experts"))
    join_qkv(params)
    _check(module, params, state)
    return module, params, state


def lfm2_to_hf(config: Mapping[str, Any], params: Mapping[str, Tensor],
               state: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
    """``params`` (and LFM2-MoE's router ``state``) of the model ``lfm2_from_hf(config)``
    builds, under a Hugging Face checkpoint's names (q, k and v apart, the experts one
    matrix each: copies). The inverse of :func:`lfm2_from_hf`, bit for bit.

    Example::

        >>> import torchfn
        >>> from torchfn.models import lfm2_from_hf, lfm2_to_hf
        >>> config = {"model_type": "lfm2", "hidden_size": 16, "num_attention_heads": 2,
        ...           "num_hidden_layers": 1, "intermediate_size": 48, "vocab_size": 10,
        ...           "layer_types": ["conv"]}
        >>> params = torchfn.Model(lfm2_from_hf(config)[0]).init(torchfn.random.key(0))
        >>> lfm2_to_hf(config, params)["model.layers.0.conv.in_proj.weight"].shape
        torch.Size([48, 16])
    """
    kwargs = _config(config)
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a dict of tensors, got {type(params).__name__}")
    state = {} if state is None else state
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a dict of tensors or None, got {type(state).__name__}")
    with torch.device("meta"):
        _check(TransformerEncoder(**kwargs), params, state)
    inverse = {conv: {ours: hf for hf, ours in (_COMMON | (_CONV if conv else _ATTN)).items()}
               for conv in (False, True)}
    back = {ours: hf for hf, ours in _GLOBAL.items()}
    hd = kwargs["head_dim"]
    sizes = [kwargs["heads"] * hd] + [kwargs["kv_heads"] * hd] * 2
    out: dict[str, Tensor] = {}
    for name, t in {**params, **state}.items():
        if name in back:
            out[back[name]] = t
            continue
        i, rest = name.split(".", 2)[1:]
        if rest == "attn.qkv.weight":
            for p, piece in zip("qkv", t.split(sizes)):
                out[f"model.layers.{i}.self_attn.{p}_proj.weight"] = piece.clone()
        elif rest == "mlp.router.weight":
            out[f"model.layers.{i}.{_ROUTER}"] = t
        elif rest == "mlp.router_bias":
            out[f"model.layers.{i}.{_BIAS}"] = t
        elif rest in ("mlp.gate", "mlp.up", "mlp.down"):  # stacked experts (E, ...)
            w = {ours: hf for hf, ours in _W.items()}[rest[4:]]
            for j, part in enumerate(t.unbind(0)):
                out[f"model.layers.{i}.feed_forward.experts.{j}.{w}.weight"] = part.clone()
        else:
            out[f"model.layers.{i}.{inverse[kwargs['layer_linear'][int(i)]][rest]}"] = t
    return out
