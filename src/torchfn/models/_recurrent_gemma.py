"""A Hugging Face RecurrentGemma checkpoint (``recurrent_gemma``: Griffin) as a
``TransformerEncoder`` and its params, and back: two Griffin recurrent blocks to one of
local attention."""

from __future__ import annotations

from collections.abc import Mapping
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
)
from torchfn.models._llama import _ropes
from torchfn.models._transformer import TransformerEncoder

__all__ = ["recurrent_gemma_from_hf", "recurrent_gemma_to_hf"]

_GLOBAL = {"model.embed_tokens.weight": "embed.weight", "model.final_norm.weight": "ln.weight",
           "lm_head.weight": "head.weight"}
_BOTH = {"temporal_pre_norm.weight": "ln1.weight", "channel_pre_norm.weight": "ln2.weight",
         **{f"mlp_block.{p}_proj.{kind}": f"mlp.{p}.{kind}" for p in ("gate", "up", "down")
            for kind in ("weight", "bias")}}
_ATTN = {**_BOTH, **{f"temporal_block.{p}_proj.{kind}": f"attn.{p}_proj.{kind}" for p in "qkv"
                     for kind in ("weight", "bias")},  # q, k, v: joined into attn.qkv
         "temporal_block.o_proj.weight": "attn.out.weight",
         "temporal_block.o_proj.bias": "attn.out.bias"}
_RECURRENT = {**_BOTH, **{f"temporal_block.{hf}.{kind}": f"attn.{ours}.{kind}"
                          for hf, ours in (("linear_y", "gate"), ("linear_x", "in_proj"),
                                           ("linear_out", "out"), ("conv_1d", "conv"))
                          for kind in ("weight", "bias")},
              **{f"temporal_block.rg_lru.{n}": f"attn.{n}" for n in (
                  "recurrent_param", "input_gate_weight", "input_gate_bias",
                  "recurrent_gate_weight", "recurrent_gate_bias")}}
_BACK = {linear: {ours: hf for hf, ours in (_RECURRENT if linear else _ATTN).items()}
         for linear in (False, True)}


def _config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``TransformerEncoder``'s keywords for a RecurrentGemma config."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict (a config.json), got {type(config).__name__}")
    if config.get("model_type", "recurrent_gemma") != "recurrent_gemma":
        raise ValueError(f"config['model_type'] must be 'recurrent_gemma', got "
                         f"{config['model_type']!r}")
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                           "intermediate_size", "vocab_size") if config.get(k) is None]
    if missing:
        raise ValueError(f"config lacks {missing}: not a recurrent_gemma config")
    act = config.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new"):
        raise ValueError(f"config['hidden_activation'] = {act!r} is not supported here "
                         "(needs 'gelu_pytorch_tanh')")
    dim, heads, depth = config["hidden_size"], config["num_attention_heads"], \
        config["num_hidden_layers"]
    kinds = list(config.get("block_types") or ("recurrent", "recurrent", "attention"))
    if not kinds or not set(kinds) <= {"recurrent", "attention"}:
        raise ValueError(f"config['block_types'] must list 'recurrent' or 'attention' blocks "
                         f"(repeated over the layers), got {kinds!r}")
    linear = [kinds[i % len(kinds)] == "recurrent" for i in range(depth)]
    head_dim = dim // heads
    rope = config.get("rope_parameters")
    partial = config.get("partial_rotary_factor") or (
        rope.get("partial_rotary_factor") if isinstance(rope, Mapping) else None) or 0.5
    window = config.get("attention_window_size", 2048)
    # Griffin scales the embeddings by sqrt(dim) rounded to bfloat16, whatever the dtype
    scale = float(torch.tensor(dim ** 0.5, dtype=torch.bfloat16))
    return dict(
        dim=dim, heads=heads, depth=depth, vocab_size=config["vocab_size"],
        out_dim=config["vocab_size"], causal=True, head_dim=head_dim,
        kv_heads=config.get("num_key_value_heads") or heads, position_embedding="rotary",
        rotary_dim=int(head_dim * partial), window=(window - 1, None), norm="rms+1",
        mlp="geglu", bias=True, qkv_bias=bool(config.get("attention_bias", False)),
        out_bias=True, norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        mlp_hidden=config["intermediate_size"] // 2, embed_scale=scale,
        logit_softcap=config.get("logits_soft_cap"),
        tie_embeddings=bool(config.get("tie_word_embeddings", True)),
        linear_attention=dict(kind="rg_lru", heads=heads,
                              width=config.get("lru_width") or dim,
                              conv_kernel=config.get("conv1d_width", 4)),
        layer_linear=linear,
    ) | _ropes(config, ["full_attention"] * depth)


def recurrent_gemma_from_hf(config: Mapping[str, Any],
                            state_dict: Mapping[str, Tensor] | None = None, **overrides: Any
                            ) -> tuple[TransformerEncoder, dict[str, Tensor] | None]:
    """The ``TransformerEncoder`` of a Hugging Face RecurrentGemma ``config``
    (``"recurrent_gemma"``, Griffin), and the params of its ``state_dict`` under the
    encoder's names.

    Two blocks of three (``block_types``) mix tokens with :class:`RGLRU`, Griffin's
    recurrent block (a short convolution and the Real-Gated Linear Recurrent Unit, with a
    GELU-gated branch); the third with multi-query attention in a local window
    (``attention_window_size``), half of each head rotated. Gemma's ``1 + weight``
    norms, biased GeGLU MLPs, embeddings scaled by ``sqrt(dim)`` (rounded to bfloat16,
    as Griffin does) and logits soft-capped at 30. Tested against ``transformers`` 5 on
    logits, both caches, greedy generation (left-padded too) and the round trip.

    Args:
        config: the checkpoint's ``config.json`` as a dict.
        state_dict: its tensors under Hugging Face's names, or None for the module alone.
        overrides: other ``TransformerEncoder`` arguments (``attend``, ``remat``, ...).

    Returns:
        ``(module, params)``; ``params`` is None without a ``state_dict``.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import recurrent_gemma_from_hf
        >>> config = {"model_type": "recurrent_gemma", "hidden_size": 16,
        ...           "num_attention_heads": 2, "num_hidden_layers": 3,
        ...           "intermediate_size": 48, "vocab_size": 10, "attention_window_size": 8}
        >>> module, _ = recurrent_gemma_from_hf(config)
        >>> [type(b.attn).__name__ for b in module.blocks]
        ['RGLRU', 'RGLRU', 'MultiHeadAttention']
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

    def read_layer(i: str, rest: str, tensor: Tensor) -> bool:
        if int(i) >= len(linear):
            return False
        names = _RECURRENT if linear[int(i)] else _ATTN
        if rest in names:
            params[f"blocks.{i}.{names[rest]}"] = tensor
        return rest in names

    read_state(state_dict.items(), "recurrent_gemma", params, globals_=_GLOBAL,
               tied=kwargs["tie_embeddings"], read_layer=read_layer)
    join_qkv(params)
    check_fit(param_shapes(module), params, "state_dict")
    return module, params


def recurrent_gemma_to_hf(config: Mapping[str, Any], params: Mapping[str, Tensor]
                          ) -> dict[str, Tensor]:
    """``params`` of the model ``recurrent_gemma_from_hf(config)`` builds, under a Hugging
    Face checkpoint's names, q, k and v apart again (copies). The inverse of
    :func:`recurrent_gemma_from_hf`, bit for bit.

    Example::

        >>> import torchfn
        >>> from torchfn.models import recurrent_gemma_from_hf, recurrent_gemma_to_hf
        >>> config = {"model_type": "recurrent_gemma", "hidden_size": 16,
        ...           "num_attention_heads": 2, "num_hidden_layers": 1,
        ...           "intermediate_size": 48, "vocab_size": 10}
        >>> params = torchfn.Model(recurrent_gemma_from_hf(config)[0]).init(
        ...     torchfn.random.key(0))
        >>> recurrent_gemma_to_hf(config, params)[
        ...     "model.layers.0.temporal_block.rg_lru.input_gate_weight"].shape
        torch.Size([2, 8, 8])
    """
    kwargs = _config(config)
    check_params_for(TransformerEncoder, kwargs, params)
    back = {ours: hf for hf, ours in _GLOBAL.items()}
    hd = kwargs["head_dim"]
    sizes = [kwargs["heads"] * hd] + [kwargs["kv_heads"] * hd] * 2
    out: dict[str, Tensor] = {}
    for name, t in params.items():
        if name in back:
            out[back[name]] = t
            continue
        i, rest = name.split(".", 2)[1:]
        linear = kwargs["layer_linear"][int(i)]
        at = f"model.layers.{i}."
        if not linear and rest in ("attn.qkv.weight", "attn.qkv.bias"):
            for p, piece in zip("qkv", t.split(sizes)):
                out[f"{at}temporal_block.{p}_proj.{rest.rsplit('.', 1)[1]}"] = piece.clone()
        else:
            out[at + _BACK[linear][rest]] = t
    return out
