"""A Hugging Face OLMo Hybrid checkpoint (``olmo_hybrid``) as a ``TransformerEncoder`` and
its params, and back: Gated DeltaNet blocks (pre-norm) and OLMo 2's attention blocks
(post-norm), three to one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from torchfn.models._fit import (
    check_fit,
    check_params_for,
    check_state_dict,
    join_pieces,
    join_qkv,
    param_shapes,
    read_state,
)
from torchfn.models._llama import GLOBAL_NAMES, _ropes
from torchfn.models._transformer import TransformerEncoder

__all__ = ["olmo_hybrid_from_hf", "olmo_hybrid_to_hf"]

_MLP = {f"mlp.{p}_proj.weight": f"mlp.{p}.weight" for p in ("gate", "up", "down")}
_ATTN = {  # an attention block's HF names -> ours (q, k, v: joined into attn.qkv)
    **_MLP,
    **{f"self_attn.{p}_proj.{kind}": f"attn.{p}_proj.{kind}" for p in "qkv"
       for kind in ("weight", "bias")},
    "self_attn.o_proj.weight": "attn.out.weight",
    "self_attn.o_proj.bias": "attn.out.bias",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "feedforward_layer_norm.weight": "post_ln1.weight",  # sic, as transformers saves it
    "post_feedforward_layernorm.weight": "post_ln2.weight",
}
_LINEAR = {  # a Gated DeltaNet block's
    **_MLP,
    "attention_layer_norm.weight": "ln1.weight",
    "feedforward_layer_norm.weight": "ln2.weight",
    **{f"linear_attn.{p}_proj.weight": f"attn.{p}_proj.weight" for p in "qkv"},
    "linear_attn.a_proj.weight": "attn.dt.weight",
    "linear_attn.b_proj.weight": "attn.beta.weight",
    "linear_attn.g_proj.weight": "attn.gate.weight",
    "linear_attn.o_proj.weight": "attn.out.weight",
    "linear_attn.A_log": "attn.A_log",
    "linear_attn.dt_bias": "attn.dt_bias",
    "linear_attn.o_norm.weight": "attn.norm.weight",
}
_IN_MEMORY = {  # transformers' names in memory (from_transformers reverts them; a state
    # dict taken from a live model keeps them) -> the checkpoint's
    False: {"post_attention_layernorm.weight": "feedforward_layer_norm.weight"},
    True: {"input_layernorm.weight": "attention_layer_norm.weight",
           "post_attention_layernorm.weight": "feedforward_layer_norm.weight"}}
_CONVS = tuple(f"linear_attn.{p}_conv1d.weight" for p in "qkv")  # one a projection
_BACK = {linear: {ours: hf for hf, ours in (_LINEAR if linear else _ATTN).items()}
         for linear in (False, True)}  # ours -> HF, for each kind of block
_HF_GLOBAL = {ours: hf for hf, ours in GLOBAL_NAMES.items()}


def _types(config: Mapping[str, Any], depth: int) -> list[str]:
    """Each layer's kind: ``layer_types``, or transformers' default (every fourth layer
    attention, the last one if none is)."""
    types = config.get("layer_types")
    if types is None:
        types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(depth)]
        if "full_attention" not in types:
            types[-1] = "full_attention"
    types = list(types)
    if len(types) != depth or not set(types) <= {"linear_attention", "full_attention"} \
            or "linear_attention" not in types:
        raise ValueError(f"config['layer_types'] must list 'linear_attention' (at least once) "
                         f"or 'full_attention' for each of {depth} layers, got {types!r}")
    return types


def _rope(config: Mapping[str, Any], types: list[str]) -> dict[str, Any]:
    """Rotary keywords, or NoPE (``position_embedding="none"``) where the config's
    ``rope_theta`` is null, as the released checkpoints have it."""
    params = config.get("rope_parameters")
    nope = isinstance(params, Mapping) and params.get("rope_theta", 0) is None or (
        params is None and "rope_theta" in config and config["rope_theta"] is None)
    if nope:
        return dict(position_embedding="none")
    return dict(position_embedding="rotary", **_ropes(config, types))


def _config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``TransformerEncoder``'s keywords for an OLMo Hybrid config."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict (a config.json), got {type(config).__name__}")
    if config.get("model_type", "olmo_hybrid") != "olmo_hybrid":
        raise ValueError(f"config['model_type'] must be 'olmo_hybrid', got "
                         f"{config['model_type']!r}")
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                           "intermediate_size", "vocab_size") if config.get(k) is None]
    if missing:
        raise ValueError(f"config lacks {missing}: not an olmo_hybrid config")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config['hidden_act'] = {config['hidden_act']!r} is not supported "
                         "here (needs 'silu')")
    dim, heads, depth = config["hidden_size"], config["num_attention_heads"], \
        config["num_hidden_layers"]
    types = _types(config, depth)
    key_heads = config.get("linear_num_key_heads") or heads
    key_dim = config.get("linear_key_head_dim") or int(0.75 * dim / key_heads)
    bias = bool(config.get("attention_bias", False))
    return dict(
        dim=dim, heads=heads, depth=depth, vocab_size=config["vocab_size"],
        out_dim=config["vocab_size"], causal=True, head_dim=config.get("head_dim") or dim // heads,
        kv_heads=config.get("num_key_value_heads") or heads, norm="rms", mlp="swiglu",
        bias=False, qkv_bias=bias, out_bias=bias, qk_norm=True, qk_norm_scope="all",
        pre_norms={"attention": False, "linear": True},
        post_norms={"attention": True, "linear": False},
        norm_eps=float(config.get("rms_norm_eps", 1e-6)), mlp_hidden=config["intermediate_size"],
        max_len=config.get("max_position_embeddings", 65536),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        linear_attention=dict(
            heads=config.get("linear_num_value_heads") or heads, key_heads=key_heads,
            key_dim=key_dim, value_dim=config.get("linear_value_head_dim") or 2 * key_dim,
            conv_kernel=config.get("linear_conv_kernel_dim", 4), norm_eps=1e-5,
            beta_scale=2.0 if config.get("linear_allow_neg_eigval", True) else 1.0),
        layer_linear=[t == "linear_attention" for t in types],
    ) | _rope(config, ["full_attention"] * depth)


def olmo_hybrid_from_hf(config: Mapping[str, Any], state_dict: Mapping[str, Tensor] | None = None,
                        **overrides: Any) -> tuple[TransformerEncoder, dict[str, Tensor] | None]:
    """The ``TransformerEncoder`` of a Hugging Face OLMo Hybrid ``config``
    (``"olmo_hybrid"``), and the params of its ``state_dict`` under the encoder's names.

    Three layers of four (``layer_types``) mix tokens with :class:`GatedDeltaNet`,
    normalised before each sublayer; the learning rate spans ``(0, 2)``
    (``linear_allow_neg_eigval``: ``beta_scale=2``) and q, k, v, the gate and both
    rates have a projection each (joined here into ``qkv``). The fourth is OLMo 2's
    attention block: the sublayers' outputs are normalised, not their inputs
    (``pre_norms`` / ``post_norms`` by kind), queries and keys over all heads at once
    (``qk_norm_scope="all"``), and no rotary embedding where ``rope_theta`` is null, as
    in the released checkpoints (NoPE). The checkpoint's names are read (its
    ``attention_layer_norm``, ``feedforward_layer_norm`` and a convolution per q / k / v
    projection) and transformers' in-memory ones too. Tested against ``transformers`` 5 on logits,
    both caches, greedy generation (left-padded too) and the round trip.

    Args:
        config: the checkpoint's ``config.json`` as a dict.
        state_dict: its tensors under Hugging Face's names, or None for the module alone.
        overrides: other ``TransformerEncoder`` arguments (``attend``, ``remat``, ...).

    Returns:
        ``(module, params)``; ``params`` is None without a ``state_dict``.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import olmo_hybrid_from_hf
        >>> config = {"model_type": "olmo_hybrid", "hidden_size": 16, "num_attention_heads": 2,
        ...           "num_hidden_layers": 4, "intermediate_size": 24, "vocab_size": 10,
        ...           "rope_parameters": {"rope_theta": None}}
        >>> module, _ = olmo_hybrid_from_hf(config)
        >>> [type(b.attn).__name__ for b in module.blocks]
        ['GatedDeltaNet', 'GatedDeltaNet', 'GatedDeltaNet', 'MultiHeadAttention']
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
    linear = kwargs["layer_linear"]
    params: dict[str, Tensor] = {}
    convs: dict[str, dict[str, Tensor]] = {}  # q, k and v's: one over [q | k | v]

    def read_layer(i: str, rest: str, tensor: Tensor) -> bool:
        if int(i) >= len(linear):
            return False
        at, delta = f"blocks.{int(i)}.", linear[int(i)]  # (a Gated DeltaNet layer)
        rest = _IN_MEMORY[delta].get(rest, rest)
        names = _LINEAR if delta else _ATTN
        if rest in names:
            params[at + names[rest]] = tensor
        elif delta and rest in _CONVS:
            convs.setdefault(at + "attn.conv.weight", {})[rest[12]] = tensor
        elif delta and rest == "linear_attn.conv1d.weight":  # joined, as in memory
            params[at + "attn.conv.weight"] = tensor
        else:
            return False
        return True

    read_state(state_dict.items(), "olmo_hybrid", params, globals_=GLOBAL_NAMES,
               tied=kwargs["tie_embeddings"], read_layer=read_layer)
    join_pieces(params, convs)
    join_qkv(params)
    check_fit(param_shapes(module), params, "state_dict")
    return module, params


def olmo_hybrid_to_hf(config: Mapping[str, Any], params: Mapping[str, Tensor]
                      ) -> dict[str, Tensor]:
    """``params`` of the model ``olmo_hybrid_from_hf(config)`` builds, under a Hugging Face
    checkpoint's names, q, k and v and their convolutions apart again (copies). The
    inverse of :func:`olmo_hybrid_from_hf`, bit for bit.

    Each of ``q_conv1d``, ``k_conv1d``, ``v_conv1d`` holds its own projection's channels
    (key, key, value), as the released checkpoints do; transformers 5's
    ``save_pretrained`` cuts the joined convolution into three equal parts instead
    (``v_conv1d`` then holds some key channels), which loads back the same either way.

    Example::

        >>> import torchfn
        >>> from torchfn.models import olmo_hybrid_from_hf, olmo_hybrid_to_hf
        >>> config = {"model_type": "olmo_hybrid", "hidden_size": 16, "num_attention_heads": 2,
        ...           "num_hidden_layers": 2, "intermediate_size": 24, "vocab_size": 10}
        >>> params = torchfn.Model(olmo_hybrid_from_hf(config)[0]).init(torchfn.random.key(0))
        >>> olmo_hybrid_to_hf(config, params)["model.layers.0.linear_attn.v_proj.weight"].shape
        torch.Size([24, 16])
    """
    kwargs = _config(config)
    check_params_for(TransformerEncoder, kwargs, params)
    lin, hd = kwargs["linear_attention"], kwargs["head_dim"]
    sizes = {False: [kwargs["heads"] * hd] + [kwargs["kv_heads"] * hd] * 2,
             True: [lin["key_heads"] * lin["key_dim"]] * 2 + [lin["heads"] * lin["value_dim"]]}
    out: dict[str, Tensor] = {}
    for name, t in params.items():
        if name in _HF_GLOBAL:
            out[_HF_GLOBAL[name]] = t
            continue
        i, rest = name.split(".", 2)[1:]
        linear = kwargs["layer_linear"][int(i)]
        at, attn = f"model.layers.{i}.", "linear_attn" if linear else "self_attn"
        if rest in ("attn.qkv.weight", "attn.qkv.bias"):
            for p, piece in zip("qkv", t.split(sizes[linear])):
                out[f"{at}{attn}.{p}_proj.{rest.rsplit('.', 1)[1]}"] = piece.clone()
        elif rest == "attn.conv.weight":  # each projection's channels (B, below)
            for n, piece in zip(_CONVS, t.split(sizes[True])):
                out[at + n] = piece.clone()
        else:
            out[at + _BACK[linear][rest]] = t
    return out
