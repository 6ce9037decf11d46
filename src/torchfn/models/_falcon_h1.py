"""A Hugging Face Falcon-H1 checkpoint (``falcon_h1``) as a ``TransformerEncoder`` and its
params, and back: every block runs attention and a Mamba-2 mixer side by side, with
Falcon-H1's muP multipliers kept as the model's constants (not folded into weights)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from torchfn.models._fit import (
    check_fit,
    check_params_for,
    check_state_dict,
    join_qkv,
    param_shapes,
    read_state,
)
from torchfn.models._llama import _ropes, partial_rotary
from torchfn.models._transformer import TransformerEncoder

__all__ = ["falcon_h1_from_hf", "falcon_h1_to_hf"]

_NAMES = {  # a layer's Hugging Face names -> ours (q, k, v joined into attn.qkv after)
    "input_layernorm.weight": "ln1.weight", "pre_ff_layernorm.weight": "ln2.weight",
    **{f"self_attn.{p}_proj.{kind}": f"attn.{p}_proj.{kind}" for p in "qkv"
       for kind in ("weight", "bias")},
    **{f"self_attn.o_proj.{kind}": f"attn.out.{kind}" for kind in ("weight", "bias")},
    **{f"mamba.{hf}.{kind}": f"linear.{ours}.{kind}" for hf, ours in (
        ("in_proj", "in_proj"), ("conv1d", "conv"), ("out_proj", "out"))
       for kind in ("weight", "bias")},
    **{f"mamba.{p}": f"linear.{p}" for p in ("dt_bias", "A_log", "D")},
    "mamba.norm.weight": "linear.norm.weight",
    **{f"feed_forward.{p}_proj.{kind}": f"mlp.{p}.{kind}" for p in ("gate", "up", "down")
       for kind in ("weight", "bias")},
}
_GLOBAL = {"model.embed_tokens.weight": "embed.weight", "model.final_layernorm.weight": "ln.weight",
           "lm_head.weight": "head.weight"}


def _number(config: Mapping[str, Any], name: str, default: float = 1.0) -> float:
    value = config.get(name)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"config[{name!r}] must be a number, got {value!r}")
    return float(value)


def _numbers(config: Mapping[str, Any], name: str, n: int) -> tuple[float, ...]:
    value = config.get(name)
    value = [1.0] * n if value is None else value
    if not isinstance(value, (list, tuple)) or len(value) != n or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise ValueError(f"config[{name!r}] must be {n} numbers, got {value!r}")
    return tuple(float(v) for v in value)


def _config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``TransformerEncoder``'s keywords for a Falcon-H1 config."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict (a config.json), got {type(config).__name__}")
    if config.get("model_type", "falcon_h1") != "falcon_h1":
        raise ValueError(f"config['model_type'] must be 'falcon_h1', got "
                         f"{config['model_type']!r}")
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                           "intermediate_size", "vocab_size", "mamba_n_heads") if k not in config]
    if missing:
        raise ValueError(f"config lacks {missing}: not a falcon_h1 config")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config['hidden_act'] = {config['hidden_act']!r} is not supported "
                         "here (needs 'silu')")
    dim, heads, depth = config["hidden_size"], config["num_attention_heads"], \
        config["num_hidden_layers"]
    ssm_heads = config["mamba_n_heads"]
    inner = config.get("mamba_d_ssm") or int(config.get("mamba_expand", 2) * dim)
    d_head = config.get("mamba_d_head", "auto")
    d_head = inner // ssm_heads if d_head in ("auto", None) else d_head
    if d_head * ssm_heads != inner:
        raise ValueError(f"config: mamba_n_heads * mamba_d_head = {ssm_heads * d_head} must be "
                         f"the Mamba width mamba_d_ssm (or mamba_expand * hidden_size) = {inner}")
    head_dim = config.get("head_dim") or dim // heads
    eps = float(config.get("rms_norm_eps", 1e-5))
    limit = config.get("time_step_limit") or (0.0, float("inf"))
    norm = "none" if not config.get("mamba_rms_norm", False) else \
        "before_gate" if config.get("mamba_norm_before_gate", True) else "gated"
    ssm_scales = _numbers(config, "ssm_multipliers", 5)
    mlp_scales = _numbers(config, "mlp_multipliers", 2)
    attn_bias = bool(config.get("attention_bias", False))
    kwargs: dict[str, Any] = dict(
        dim=dim, heads=heads, depth=depth, vocab_size=config["vocab_size"],
        out_dim=config["vocab_size"], causal=True, head_dim=head_dim,
        kv_heads=config.get("num_key_value_heads") or heads, norm="rms", mlp="swiglu",
        bias=bool(config.get("mlp_bias", False)), qkv_bias=attn_bias, out_bias=attn_bias,
        head_bias=False, norm_eps=eps, mlp_hidden=config["intermediate_size"],
        max_len=config.get("max_position_embeddings", 8192),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        position_embedding="rotary", **_ropes(config, ["full_attention"] * depth),
        # the key multiplier scales every score: folded into the scale (rotary is linear)
        attn_scale=_number(config, "key_multiplier") / math.sqrt(head_dim),
        linear_attention=dict(
            kind="mamba2", heads=ssm_heads, head_dim=d_head,
            state_dim=config.get("mamba_d_state", 256), groups=config.get("mamba_n_groups", 1),
            conv_kernel=config.get("mamba_d_conv", 4),
            bias=bool(config.get("mamba_proj_bias", False)),
            out_bias=bool(config.get("projectors_bias", False)),
            conv_bias=bool(config.get("mamba_conv_bias", True)), norm=norm, norm_eps=eps,
            dt_limit=(float(limit[0]), float(limit[1])),
            in_scales=None if ssm_scales == (1.0,) * 5 else ssm_scales),
        parallel_linear=dict(attn_in=_number(config, "attention_in_multiplier"),
                             attn_out=_number(config, "attention_out_multiplier"),
                             linear_in=_number(config, "ssm_in_multiplier"),
                             linear_out=_number(config, "ssm_out_multiplier")),
        mlp_scales=None if mlp_scales == (1.0, 1.0) else mlp_scales,
    )
    if partial_rotary(config) != 1:
        kwargs["rotary_dim"] = int(head_dim * partial_rotary(config))
    for ours, name in (("embed_scale", "embedding_multiplier"),
                       ("logit_scale", "lm_head_multiplier")):
        if _number(config, name) != 1.0:
            kwargs[ours] = _number(config, name)
    return kwargs


def falcon_h1_from_hf(config: Mapping[str, Any], state_dict: Mapping[str, Tensor] | None = None,
                      **overrides: Any) -> tuple[TransformerEncoder, dict[str, Tensor] | None]:
    """The ``TransformerEncoder`` of a Hugging Face Falcon-H1 ``config`` (``"falcon_h1"``)
    and the params of its ``state_dict``.

    Every block adds attention (rotary, grouped-query) and a :class:`Mamba2` mixer, side by
    side on the same normalised input (``parallel_linear``: two cache entries a block,
    the attention's keys and values then the mixer's window and state), then a SwiGLU MLP.
    Falcon-H1's multipliers are kept as constants of the model, so its gradients are those
    of the checkpoint's parametrisation: ``attention_in`` / ``attention_out`` /
    ``ssm_in`` / ``ssm_out`` are ``parallel_linear``'s scales, ``ssm_multipliers`` the
    mixer's ``in_scales`` (its projection's z, x, B, C and step-size parts),
    ``mlp_multipliers`` the MLPs' ``mlp_scales``, ``embedding_multiplier`` and
    ``lm_head_multiplier`` ``embed_scale`` and ``logit_scale``; ``key_multiplier`` scales
    the scores (``attn_scale``). ``mamba_rms_norm`` picks the mixer's norm (``"none"``,
    or ``"before_gate"`` / ``"gated"`` by ``mamba_norm_before_gate``). Tested against
    ``transformers`` 5 on logits, both caches, greedy generation (left-padded too) and
    the round trip.

    Args:
        config: the checkpoint's ``config.json`` as a dict.
        state_dict: its tensors under Hugging Face's names, or None for the module alone.
        overrides: other ``TransformerEncoder`` arguments.

    Returns:
        ``(module, params)``; ``params`` is None without a ``state_dict``.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import falcon_h1_from_hf
        >>> config = {"model_type": "falcon_h1", "hidden_size": 16, "num_attention_heads": 2,
        ...           "num_hidden_layers": 2, "intermediate_size": 24, "vocab_size": 10,
        ...           "mamba_n_heads": 2, "mamba_d_ssm": 32, "mamba_d_state": 8}
        >>> module, _ = falcon_h1_from_hf(config)
        >>> type(module.blocks[0].attn).__name__, type(module.blocks[0].linear).__name__
        ('MultiHeadAttention', 'Mamba2')
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
    params: dict[str, Tensor] = {}

    def read_layer(i: str, rest: str, tensor: Tensor) -> bool:
        if rest in _NAMES:
            params[f"blocks.{i}.{_NAMES[rest]}"] = tensor
        return rest in _NAMES

    read_state(state_dict.items(), "falcon_h1", params, globals_=_GLOBAL,
               tied=kwargs["tie_embeddings"], read_layer=read_layer)
    join_qkv(params)
    check_fit(param_shapes(module), params, "state_dict")
    return module, params


def falcon_h1_to_hf(config: Mapping[str, Any], params: Mapping[str, Tensor]
                    ) -> dict[str, Tensor]:
    """``params`` of the model ``falcon_h1_from_hf(config)`` builds, under a Hugging Face
    checkpoint's names (q, k and v split apart: copies). The inverse of
    :func:`falcon_h1_from_hf`, bit for bit.

    Example::

        >>> import torchfn
        >>> from torchfn.models import falcon_h1_from_hf, falcon_h1_to_hf
        >>> config = {"model_type": "falcon_h1", "hidden_size": 16, "num_attention_heads": 2,
        ...           "num_hidden_layers": 1, "intermediate_size": 24, "vocab_size": 10,
        ...           "mamba_n_heads": 2, "mamba_d_ssm": 32, "mamba_d_state": 8}
        >>> params = torchfn.Model(falcon_h1_from_hf(config)[0]).init(torchfn.random.key(0))
        >>> falcon_h1_to_hf(config, params)["model.layers.0.mamba.in_proj.weight"].shape
        torch.Size([82, 16])
    """
    kwargs = _config(config)
    check_params_for(TransformerEncoder, kwargs, params)
    inverse = {ours: hf for hf, ours in _NAMES.items()}
    back = {ours: hf for hf, ours in _GLOBAL.items()}
    hd = kwargs["head_dim"]
    sizes = [kwargs["heads"] * hd] + [kwargs["kv_heads"] * hd] * 2
    out: dict[str, Tensor] = {}
    for name, t in params.items():
        if name in back:
            out[back[name]] = t
            continue
        i, rest = name.split(".", 2)[1:]
        if rest in ("attn.qkv.weight", "attn.qkv.bias"):
            kind = rest.rsplit(".", 1)[1]
            for p, piece in zip("qkv", t.split(sizes)):
                out[f"model.layers.{i}.self_attn.{p}_proj.{kind}"] = piece.clone()
        else:
            out[f"model.layers.{i}.{inverse[rest]}"] = t
    return out
