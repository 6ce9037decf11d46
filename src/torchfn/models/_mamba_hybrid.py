"""A Hugging Face Mamba, Falcon-Mamba, Mamba-2, Bamba, Granite 4.0-H (``granitemoehybrid``) or
Jamba checkpoint as a ``TransformerEncoder`` and its params, and back: Mamba or Mamba-2
blocks, alone or with a few attention blocks among them."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from torchfn.models._fit import (
    check_fit,
    check_params_for,
    check_state_dict,
    join_qkv,
    param_shapes,
    read_state,
    stack_experts,
)
from torchfn.models._llama import _ropes, partial_rotary
from torchfn.models._transformer import TransformerEncoder

__all__ = ["mamba_hybrid_from_hf", "mamba_hybrid_to_hf"]

_TYPES = ("mamba", "falcon_mamba", "mamba2", "bamba", "granitemoehybrid", "jamba")
_MAMBA = {f"mamba.{hf}.{kind}": f"attn.{ours}.{kind}" for hf, ours in (
    ("in_proj", "in_proj"), ("conv1d", "conv"), ("out_proj", "out")) for kind in ("weight", "bias")}
_MAMBA |= {"mamba.dt_bias": "attn.dt_bias", "mamba.A_log": "attn.A_log", "mamba.D": "attn.D",
           "mamba.norm.weight": "attn.norm.weight"}
_MAMBA1 = {f"mamba.{hf}.{kind}": f"attn.{ours}.{kind}" for hf, ours in (
    ("in_proj", "in_proj"), ("conv1d", "conv"), ("dt_proj", "dt_proj"), ("out_proj", "out"))
    for kind in ("weight", "bias")}  # Mamba(-1)'s mixer
_MAMBA1 |= {"mamba.x_proj.weight": "attn.x_proj.weight", "mamba.A_log": "attn.A_log",
            "mamba.D": "attn.D"}
_JAMBA = _MAMBA1 | {f"mamba.{p}_layernorm.weight": f"attn.{p}_norm" for p in ("dt", "b", "c")}
_EXPERT = re.compile(r"feed_forward\.experts\.(\d+)\.(gate|up|down)_proj\.weight")  # Jamba's
_ATTN = {f"self_attn.{p}_proj.{kind}": f"attn.{p}_proj.{kind}" for p in "qkv"
         for kind in ("weight", "bias")}  # joined into attn.qkv
_ATTN |= {"self_attn.o_proj.weight": "attn.out.weight", "self_attn.o_proj.bias": "attn.out.bias"}
_FAMILY = {  # model_type -> (final norm, second norm, the layer's MLP names)
    "bamba": ("model.final_layernorm.weight", "pre_ff_layernorm.weight",
              {f"feed_forward.{p}_proj.weight": f"mlp.{p}.weight" for p in ("gate", "up", "down")}),
    "granitemoehybrid": ("model.norm.weight", "post_attention_layernorm.weight", {
        "block_sparse_moe.router.layer.weight": "mlp.router.weight",
        "block_sparse_moe.output_linear.weight": "mlp.down"}),
    "mamba2": ("model.norm_f.weight", None, {}),  # names as _MAMBA2 makes them
    "mamba": ("model.norm_f.weight", None, {}),
    "falcon_mamba": ("model.norm_f.weight", None, {}),
    "jamba": ("model.final_layernorm.weight", "pre_ff_layernorm.weight", {
        "feed_forward.router.weight": "mlp.router.weight",
        **{f"feed_forward.{p}_proj.weight": f"mlp.{p}.weight" for p in ("gate", "up", "down")}}),
}
_FUSED = ("shared_mlp.input_linear.weight", "shared_mlp.output_linear.weight",
          "block_sparse_moe.input_linear.weight")  # Granite's [gate | up] rows, and its MLPs
_MAMBA2 = [  # Mamba's and Mamba-2's own names <-> the hybrids' (a block: a norm, the mixer)
    (r"backbone\.embeddings\.weight", "model.embed_tokens.weight"),
    (r"backbone\.norm_f\.weight", "model.norm_f.weight"),
    (r"backbone\.layers\.(\d+)\.norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"backbone\.layers\.(\d+)\.mixer\.(.+)", r"model.layers.\1.mamba.\2"),
]
_MAMBA2_BACK = [
    (r"model\.embed_tokens\.weight", "backbone.embeddings.weight"),
    (r"model\.norm_f\.weight", "backbone.norm_f.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"backbone.layers.\1.norm.weight"),
    (r"model\.layers\.(\d+)\.mamba\.(.+)", r"backbone.layers.\1.mixer.\2"),
]


def _renamed(name: str, table: list[tuple[str, str]]) -> str:
    """``name`` through the first pattern of ``table`` it matches (else as it is)."""
    for pattern, repl in table:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, repl, name)
    return name


def _check_kind(config: Any) -> str:
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict (a config.json), got {type(config).__name__}")
    kind = config.get("model_type")
    if kind not in _TYPES:
        raise ValueError(f"config['model_type'] must be one of {_TYPES}, got {kind!r}")
    return kind


def _layer_types(config: Mapping[str, Any], kind: str) -> list[bool]:
    """For each layer, whether it is a Mamba-2 one (else attention)."""
    depth = config["num_hidden_layers"]
    if kind == "bamba":
        attn = set(config.get("attn_layer_indices") or [])
        return [i not in attn for i in range(depth)]
    types = list(config.get("layer_types") or ["mamba"] * depth)
    names = {"mamba": True, "linear_attention": True, "attention": False,
             "full_attention": False}
    if len(types) != depth or not set(types) <= set(names):
        raise ValueError(f"config['layer_types'] must list 'mamba' or 'attention' for each of "
                         f"{depth} layers, got {types!r}")
    return [names[t] for t in types]


def _mamba2_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``TransformerEncoder``'s keywords for a Mamba-2 config: blocks of a norm and the
    mixer alone (``mlp="none"``), no position embedding."""
    missing = [k for k in ("hidden_size", "num_heads", "num_hidden_layers", "vocab_size")
               if k not in config]
    if missing:
        raise ValueError(f"config lacks {missing}: not a mamba2 config")
    dim, heads, head_dim = config["hidden_size"], config["num_heads"], config.get("head_dim", 64)
    if heads * head_dim != int(config.get("expand", 2) * dim):
        raise ValueError(f"config: num_heads * head_dim = {heads * head_dim} must be expand * "
                         f"hidden_size = {int(config.get('expand', 2) * dim)}")
    limit = config.get("time_step_limit") or (0.0, float("inf"))
    return dict(
        dim=dim, heads=heads, depth=config["num_hidden_layers"], vocab_size=config["vocab_size"],
        out_dim=config["vocab_size"], causal=True, position_embedding="none", norm="rms",
        mlp="none", bias=False, norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        linear_attention=dict(
            kind="mamba2", heads=heads, head_dim=head_dim,
            state_dim=config.get("state_size", 128), groups=config.get("n_groups", 1),
            conv_kernel=config.get("conv_kernel", 4), bias=bool(config.get("use_bias")),
            conv_bias=bool(config.get("use_conv_bias", True)),
            dt_limit=(float(limit[0]), float(limit[1]))))


def _mamba1_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``TransformerEncoder``'s keywords for a Mamba(-1) config: blocks of a norm and the
    :class:`Mamba` mixer alone, no position embedding."""
    missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if k not in config]
    if missing:
        raise ValueError(f"config lacks {missing}: not a mamba config")
    dim = config["hidden_size"]
    rank = config.get("time_step_rank", "auto")
    return dict(
        dim=dim, heads=1, depth=config["num_hidden_layers"], vocab_size=config["vocab_size"],
        out_dim=config["vocab_size"], causal=True, position_embedding="none", norm="rms",
        mlp="none", bias=False, norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
        tie_embeddings=bool(config.get("tie_word_embeddings", True)),
        linear_attention=dict(
            kind="mamba", inner=config.get("intermediate_size", 2 * dim),
            state_dim=config.get("state_size", 16),
            dt_rank=math.ceil(dim / 16) if rank == "auto" else int(rank),
            conv_kernel=config.get("conv_kernel", 4), bias=bool(config.get("use_bias")),
            conv_bias=bool(config.get("use_conv_bias", True)),
            bcdt_norm_eps=float(config.get("mixer_rms_eps", 1e-6))
            if config.get("model_type") == "falcon_mamba" else None))


def _jamba_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``TransformerEncoder``'s keywords for a Jamba config: Mamba blocks (their step-size
    features, ``B`` and ``C`` RMS-normalised with a weight each) and, once every
    ``attn_layer_period`` blocks, attention without position embedding; a softmax top-k
    mixture (weights not renormalised) once every ``expert_layer_period`` blocks, a
    SwiGLU MLP in the others."""
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                           "intermediate_size", "vocab_size") if k not in config]
    if missing:
        raise ValueError(f"config lacks {missing}: not a jamba config")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config['hidden_act'] = {config['hidden_act']!r} is not supported "
                         "here (needs 'silu')")
    dim, heads, depth = config["hidden_size"], config["num_attention_heads"], \
        config["num_hidden_layers"]
    periods = {}
    for part, period, offset in (("attn", 8, 4), ("expert", 2, 1)):
        p = config.get(f"{part}_layer_period", period)
        o = config.get(f"{part}_layer_offset", offset)
        if not (isinstance(p, int) and isinstance(o, int) and 0 <= o < p):
            raise ValueError(f"config: {part}_layer_offset must be in [0, {part}_layer_period), "
                             f"got {part}_layer_offset={o!r}, {part}_layer_period={p!r}")
        periods[part] = [i % p == o for i in range(depth)]
    rank = config.get("mamba_dt_rank", "auto")
    eps = float(config.get("rms_norm_eps", 1e-6))
    kwargs: dict[str, Any] = dict(
        dim=dim, heads=heads, depth=depth, vocab_size=config["vocab_size"],
        out_dim=config["vocab_size"], causal=True, kv_heads=config.get("num_key_value_heads")
        or heads, norm="rms", mlp="swiglu", bias=False, norm_eps=eps,
        mlp_hidden=config["intermediate_size"], position_embedding="none",
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        linear_attention=dict(
            kind="mamba", inner=int(config.get("mamba_expand", 2) * dim),
            state_dim=config.get("mamba_d_state", 16),
            dt_rank=math.ceil(dim / 16) if rank == "auto" else int(rank),
            conv_kernel=config.get("mamba_d_conv", 4),
            bias=bool(config.get("mamba_proj_bias", False)),
            conv_bias=bool(config.get("mamba_conv_bias", True)), bcdt_norm_eps=eps,
            bcdt_norm_weight=True),
        layer_linear=[not a for a in periods["attn"]])
    experts = config.get("num_experts", config.get("num_local_experts", 16))
    if experts > 1 and any(periods["expert"]):
        kwargs.update(experts=experts, top_k=config.get("num_experts_per_tok", 2),
                      moe_options=dict(normalize=False), layer_experts=periods["expert"])
    return kwargs


def _config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``TransformerEncoder``'s keywords for a Mamba / Falcon-Mamba / Mamba-2 / Bamba /
    Granite 4.0-H / Jamba config."""
    kind = _check_kind(config)
    if kind == "mamba2":
        return _mamba2_config(config)
    if kind in ("mamba", "falcon_mamba"):
        return _mamba1_config(config)
    if kind == "jamba":
        return _jamba_config(config)
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                           "intermediate_size", "vocab_size", "mamba_n_heads", "mamba_d_head")
               if k not in config]
    if missing:
        raise ValueError(f"config lacks {missing}: not a {kind} config")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config['hidden_act'] = {config['hidden_act']!r} is not supported "
                         "here (needs 'silu')")
    dim, heads, depth = config["hidden_size"], config["num_attention_heads"], \
        config["num_hidden_layers"]
    inner = config["mamba_n_heads"] * config["mamba_d_head"]
    if inner != int(config.get("mamba_expand", 2) * dim):
        raise ValueError(f"config: mamba_n_heads * mamba_d_head = {inner} must be mamba_expand "
                         f"* hidden_size = {int(config.get('mamba_expand', 2) * dim)}")
    bias = bool(config.get("attention_bias", False))
    head_dim = config.get("head_dim") or dim // heads
    limit = config.get("time_step_limit") or (0.0, float("inf"))
    kwargs: dict[str, Any] = dict(
        dim=dim, heads=heads, depth=depth, vocab_size=config["vocab_size"],
        out_dim=config["vocab_size"], causal=True, head_dim=head_dim,
        kv_heads=config.get("num_key_value_heads") or heads, norm="rms", mlp="swiglu",
        bias=False, qkv_bias=bias, out_bias=bias, norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        mlp_hidden=config["intermediate_size"],
        max_len=config.get("max_position_embeddings", 4096),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        linear_attention=dict(
            kind="mamba2", heads=config["mamba_n_heads"], head_dim=config["mamba_d_head"],
            state_dim=config.get("mamba_d_state", 128), groups=config.get("mamba_n_groups", 1),
            conv_kernel=config.get("mamba_d_conv", 4), bias=bool(config.get("mamba_proj_bias")),
            conv_bias=bool(config.get("mamba_conv_bias", True)),
            dt_limit=(float(limit[0]), float(limit[1]))),
        layer_linear=_layer_types(config, kind),
    )
    if kind == "bamba" or config.get("position_embedding_type") == "rope":
        partial = partial_rotary(config)  # Bamba: half of each head
        kwargs.update(position_embedding="rotary",
                      rotary_dim=None if partial == 1 else int(head_dim * partial),
                      **_ropes(config, ["full_attention"] * depth))
    else:  # Granite 4.0-H: no position embedding at all (NoPE)
        kwargs["position_embedding"] = "none"
    if kind == "granitemoehybrid":
        kwargs.update(embed_scale=float(config.get("embedding_multiplier", 1.0)),
                      attn_scale=float(config.get("attention_multiplier", head_dim ** -0.5)),
                      residual_scale=float(config.get("residual_multiplier", 1.0)),
                      logit_scale=1.0 / float(config.get("logits_scaling", 1.0)))
        shared = config.get("shared_intermediate_size", config["intermediate_size"])
        if config.get("num_local_experts"):  # a mixture beside the shared MLP
            kwargs.update(experts=config["num_local_experts"],
                          top_k=config.get("num_experts_per_tok", 2),
                          expert_hidden=config["intermediate_size"],
                          moe_options=dict(shared_hidden=shared))
        else:  # the shared MLP alone
            kwargs["mlp_hidden"] = shared
    return kwargs


def mamba_hybrid_from_hf(config: Mapping[str, Any], state_dict: Mapping[str, Tensor] | None = None,
                         **overrides: Any) -> tuple[TransformerEncoder, dict[str, Tensor] | None]:
    """The ``TransformerEncoder`` of a Hugging Face Mamba (``"mamba"``), Falcon-Mamba
    (``"falcon_mamba"``: Mamba with its step sizes, ``B`` and ``C`` RMS-normalised),
    Mamba-2 (``"mamba2"``), Bamba (``"bamba"``), Granite 4.0-H (``"granitemoehybrid"``) or
    Jamba (``"jamba"``) ``config``, and the params of its ``state_dict``.

    Mamba's and Mamba-2's blocks are a norm and the :class:`Mamba` or :class:`Mamba2`
    mixer alone (``mlp="none"``).

    Most blocks mix tokens with :class:`Mamba2` (``linear_attention=dict(kind="mamba2",
    ...)``), the others (Bamba's ``attn_layer_indices``, Granite's ``layer_types``) with
    grouped-query attention: rotary on half of each head in Bamba, none at all (NoPE) in
    Granite 4.0-H unless ``position_embedding_type="rope"``. Granite's blocks have a
    shared SwiGLU MLP (its fused ``input_linear`` split into gate and up) and, with
    ``num_local_experts``, a softmax top-k mixture beside it; its embedding, attention,
    residual and logit multipliers are the encoder's ``embed_scale``, ``attn_scale``,
    ``residual_scale`` and ``logit_scale``.

    Jamba's blocks mix tokens with :class:`Mamba` (its step-size features, ``B`` and ``C``
    RMS-normalised with a weight each: ``bcdt_norm_weight=True``) but once every
    ``attn_layer_period`` (from ``attn_layer_offset``) with attention without position
    embedding; once every ``expert_layer_period`` their MLP is a softmax top-k mixture
    whose weights are not renormalised (``MoE(normalize=False)``, the experts' matrices
    stacked), else SwiGLU. Tested against ``transformers`` 5 on logits, both caches,
    greedy generation and the round trip.

    Args:
        config: the checkpoint's ``config.json`` as a dict.
        state_dict: its tensors under Hugging Face's names, or None for the module alone.
        overrides: other ``TransformerEncoder`` arguments.

    Returns:
        ``(module, params)``; ``params`` is None without a ``state_dict``.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import mamba_hybrid_from_hf
        >>> config = {"model_type": "bamba", "hidden_size": 16, "num_attention_heads": 2,
        ...           "num_hidden_layers": 3, "intermediate_size": 24, "vocab_size": 10,
        ...           "mamba_n_heads": 2, "mamba_d_head": 16, "mamba_d_state": 8,
        ...           "attn_layer_indices": [1]}
        >>> module, _ = mamba_hybrid_from_hf(config)
        >>> [type(b.attn).__name__ for b in module.blocks]
        ['Mamba2', 'MultiHeadAttention', 'Mamba2']
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
    kind = config["model_type"]
    final, second, mlp = _FAMILY[kind]
    names = _mixer(kind) | _ATTN | mlp | {"input_layernorm.weight": "ln1.weight"} | (
        {second: "ln2.weight"} if second else {})
    glob = {"model.embed_tokens.weight": "embed.weight", final: "ln.weight",
            "lm_head.weight": "head.weight"}
    params: dict[str, Tensor] = {}
    experts: dict[str, dict[int, Tensor]] = {}  # Jamba's: our stacked name -> expert j's

    def read_layer(i: str, rest: str, tensor: Tensor) -> bool:
        at = f"blocks.{i}."
        if rest in names:
            params[at + names[rest]] = tensor
        elif rest in _FUSED and kind == "granitemoehybrid":
            params.update({at + n: t for n, t in _unfuse(rest, tensor, "experts" in kwargs)})
        elif kind == "jamba" and (expert := _EXPERT.fullmatch(rest)):
            experts.setdefault(f"{at}mlp.{expert[2]}", {})[int(expert[1])] = tensor
        else:
            return False
        return True

    tensors: Iterable[tuple[str, Tensor]] = state_dict.items()
    if kind in ("mamba", "falcon_mamba", "mamba2"):  # their names as the hybrids'
        tensors = ((_renamed(name, _MAMBA2), t) for name, t in tensors)
    read_state(tensors, kind, params, globals_=glob, tied=kwargs["tie_embeddings"],
               read_layer=read_layer)
    stack_experts(params, experts, kwargs.get("experts"))
    join_qkv(params)
    check_fit(param_shapes(module), params, "state_dict")
    return module, params


def _mixer(kind: str) -> dict[str, str]:
    """The Mamba mixer's Hugging Face names (within a layer) -> ours."""
    return _JAMBA if kind == "jamba" else _MAMBA1 if kind in ("mamba", "falcon_mamba") \
        else _MAMBA


def _unfuse(rest: str, t: Tensor, moe: bool) -> list[tuple[str, Tensor]]:
    """Granite's fused MLP tensors as ours: ``input_linear`` rows ``[gate | up]``."""
    shared = "mlp.shared." if moe else "mlp."  # the shared MLP alone is the block's MLP
    if rest == "shared_mlp.output_linear.weight":
        return [(shared + "down.weight", t)]
    gate, up = t.chunk(2, dim=-2)
    if rest == "shared_mlp.input_linear.weight":
        return [(shared + "gate.weight", gate), (shared + "up.weight", up)]
    return [("mlp.gate", gate), ("mlp.up", up)]  # the experts' (E, 2 hidden, dim)


def mamba_hybrid_to_hf(config: Mapping[str, Any], params: Mapping[str, Tensor]
                       ) -> dict[str, Tensor]:
    """``params`` of the model ``mamba_hybrid_from_hf(config)`` builds, under a Hugging Face
    checkpoint's names: q, k and v apart, Granite's gate and up fused again (copies). The
    inverse of :func:`mamba_hybrid_from_hf`, bit for bit.

    Example::

        >>> import torchfn
        >>> from torchfn.models import mamba_hybrid_from_hf, mamba_hybrid_to_hf
        >>> config = {"model_type": "granitemoehybrid", "hidden_size": 16,
        ...           "num_attention_heads": 2, "num_hidden_layers": 2, "intermediate_size": 8,
        ...           "vocab_size": 10, "mamba_n_heads": 2, "mamba_d_head": 16,
        ...           "num_local_experts": 4, "shared_intermediate_size": 12,
        ...           "layer_types": ["mamba", "attention"]}
        >>> params = torchfn.Model(mamba_hybrid_from_hf(config)[0]).init(torchfn.random.key(0))
        >>> sd = mamba_hybrid_to_hf(config, params)
        >>> sd["model.layers.0.block_sparse_moe.input_linear.weight"].shape  # (E, [gate | up], dim)
        torch.Size([4, 16, 16])
    """
    kwargs = _config(config)
    check_params_for(TransformerEncoder, kwargs, params)
    kind = config["model_type"]
    final, second, mlp = _FAMILY[kind]
    common = mlp | {"input_layernorm.weight": "ln1.weight"} | (
        {second: "ln2.weight"} if second else {})
    mixer = _mixer(kind)
    inverse = {mamba: {ours: hf for hf, ours in ((mixer if mamba else _ATTN) | common).items()}
               for mamba in (False, True)}  # ours -> HF for each kind of layer
    glob = {"embed.weight": "model.embed_tokens.weight", "ln.weight": final,
            "head.weight": "lm_head.weight"}
    hd = kwargs.get("head_dim") or kwargs["dim"] // kwargs["heads"]
    kv = (kwargs.get("kv_heads") or kwargs["heads"]) * hd
    moe = "experts" in kwargs
    out: dict[str, Tensor] = {}
    for name, t in params.items():
        if name in glob:
            out[glob[name]] = t
            continue
        i, rest = name.split(".", 2)[1:]
        at, block = f"model.layers.{i}.", f"blocks.{i}."
        if rest in ("attn.qkv.weight", "attn.qkv.bias"):
            part = rest.rsplit(".", 1)[1]
            for p, piece in zip("qkv", t.split([kwargs["heads"] * hd, kv, kv])):
                out[f"{at}self_attn.{p}_proj.{part}"] = piece.clone()
        elif kind == "granitemoehybrid" and rest in ("mlp.gate", "mlp.shared.gate.weight") or (
                kind == "granitemoehybrid" and not moe and rest == "mlp.gate.weight"):
            up = params[block + rest.replace("gate", "up")]
            fused = "block_sparse_moe.input_linear.weight" if rest == "mlp.gate" else \
                "shared_mlp.input_linear.weight"
            out[at + fused] = torch.cat((t, up), -2)
        elif kind == "granitemoehybrid" and (rest in ("mlp.up", "mlp.shared.up.weight") or (
                not moe and rest == "mlp.up.weight")):
            pass  # fused with its gate
        elif kind == "granitemoehybrid" and rest in ("mlp.shared.down.weight", "mlp.down.weight"):
            out[at + "shared_mlp.output_linear.weight"] = t
        elif kind == "jamba" and rest in ("mlp.gate", "mlp.up", "mlp.down"):  # (E, ...)
            for j, w in enumerate(t.unbind()):
                out[f"{at}feed_forward.experts.{j}.{rest[4:]}_proj.weight"] = w.clone()
        else:
            linear = kwargs.get("layer_linear") or [True] * kwargs["depth"]
            out[at + inverse[linear[int(i)]][rest]] = t
    if kind in ("mamba", "falcon_mamba", "mamba2"):  # back to their own names
        out = {_renamed(n, _MAMBA2_BACK): t for n, t in out.items()}
    return out
