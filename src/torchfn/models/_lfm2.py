"""A Hugging Face LFM2 checkpoint (``lfm2``, Liquid AI) as a ``TransformerEncoder`` and its
params, and back: gated short convolutions in most blocks, attention in the others."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from torchfn.models._fit import (
    check_fit,
    check_known,
    check_params_for,
    check_state_dict,
    join_qkv,
    param_shapes,
)
from torchfn.models._llama import _ropes
from torchfn.models._transformer import TransformerEncoder

__all__ = ["lfm2_from_hf", "lfm2_to_hf"]

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
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


def _mlp_hidden(config: Mapping[str, Any]) -> int:
    """The MLP's width: ``intermediate_size``, or with ``block_auto_adjust_ff_dim`` (the
    default) two thirds of it, times ``block_ffn_dim_multiplier``, rounded up to a
    multiple of ``block_multiple_of``, as transformers' ``Lfm2MLP``."""
    hidden = config.get("block_ff_dim") or config["intermediate_size"]
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
    if config.get("model_type", "lfm2") != "lfm2":
        raise ValueError(f"config['model_type'] must be 'lfm2', got {config['model_type']!r}")
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
    return dict(
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


def lfm2_from_hf(config: Mapping[str, Any], state_dict: Mapping[str, Tensor] | None = None,
                 **overrides: Any) -> tuple[TransformerEncoder, dict[str, Tensor] | None]:
    """The ``TransformerEncoder`` of a Hugging Face LFM2 ``config`` (``"lfm2"``, Liquid AI's
    LFM2) and the params of its ``state_dict``.

    The blocks ``layer_types`` marks ``"conv"`` mix tokens with :class:`ShortConv` (a
    gated causal convolution of ``conv_L_cache`` taps; its cache entry the last inputs),
    the others with grouped-query attention, rotary, with RMS-normalised queries and keys
    per head. The MLPs are SwiGLU of the adjusted width transformers computes
    (``block_auto_adjust_ff_dim``); the final norm is the checkpoint's
    ``embedding_norm``. Tested against ``transformers`` 5 on logits, both caches, greedy
    generation (left-padded too) and the round trip.

    Args:
        config: the checkpoint's ``config.json`` as a dict.
        state_dict: its tensors under Hugging Face's names, or None for the module alone.
        overrides: other ``TransformerEncoder`` arguments.

    Returns:
        ``(module, params)``; ``params`` is None without a ``state_dict``.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import lfm2_from_hf
        >>> config = {"model_type": "lfm2", "hidden_size": 16, "num_attention_heads": 2,
        ...           "num_hidden_layers": 3, "intermediate_size": 48, "vocab_size": 10,
        ...           "layer_types": ["conv", "full_attention", "conv"]}
        >>> module, _ = lfm2_from_hf(config)
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
        return module, None
    conv = kwargs["layer_linear"]
    params: dict[str, Tensor] = {}
    unknown = []
    for name, tensor in state_dict.items():
        layer = _LAYER.fullmatch(name)
        names = _COMMON | (_CONV if layer and conv[int(layer[1])] else _ATTN) if layer and \
            int(layer[1]) < len(conv) else {}
        if name in _GLOBAL:
            if name != "lm_head.weight" or not kwargs["tie_embeddings"]:
                params[_GLOBAL[name]] = tensor
        elif layer and layer[2] in names:
            params[f"blocks.{layer[1]}.{names[layer[2]]}"] = tensor
        else:
            unknown.append(name)
    check_known(unknown, "lfm2")
    join_qkv(params)
    check_fit(param_shapes(module), params, "state_dict")
    return module, params


def lfm2_to_hf(config: Mapping[str, Any], params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``params`` of the model ``lfm2_from_hf(config)`` builds, under a Hugging Face
    checkpoint's names (q, k and v apart: copies). The inverse of :func:`lfm2_from_hf`,
    bit for bit.

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
    check_params_for(TransformerEncoder, kwargs, params)
    inverse = {conv: {ours: hf for hf, ours in (_COMMON | (_CONV if conv else _ATTN)).items()}
               for conv in (False, True)}
    back = {ours: hf for hf, ours in _GLOBAL.items()}
    hd = kwargs["head_dim"]
    sizes = [kwargs["heads"] * hd] + [kwargs["kv_heads"] * hd] * 2
    out: dict[str, Tensor] = {}
    for name, t in params.items():
        if name in back:
            out[back[name]] = t
            continue
        i, rest = name.split(".", 2)[1:]
        if rest == "attn.qkv.weight":
            for p, piece in zip("qkv", t.split(sizes)):
                out[f"model.layers.{i}.self_attn.{p}_proj.weight"] = piece.clone()
        else:
            out[f"model.layers.{i}.{inverse[kwargs['layer_linear'][int(i)]][rest]}"] = t
    return out
