"""A Hugging Face JetMoE checkpoint (``jetmoe``) as a ``TransformerEncoder`` and its params,
and back: a mixture of attention heads and a mixture of MLP experts in every block."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from torchfn.models._fit import (
    check_fit,
    check_params_for,
    check_state_dict,
    param_shapes,
    read_state,
)
from torchfn.models._llama import GLOBAL_NAMES, _ropes
from torchfn.models._transformer import TransformerEncoder

__all__ = ["jetmoe_from_hf", "jetmoe_to_hf"]

_NAMES = {  # a layer's HF names -> ours
    "input_layernorm.weight": "ln1.weight",
    "post_attention_layernorm.weight": "ln2.weight",
    "self_attention.kv_proj.weight": "attn.kv.weight",
    "self_attention.experts.router.layer.weight": "attn.router.weight",
    "self_attention.experts.input_linear.weight": "attn.q_experts",
    "self_attention.experts.output_linear.weight": "attn.out_experts",
    "self_attention.experts.bias": "attn.out_bias",
    "mlp.router.layer.weight": "mlp.router.weight",
    "mlp.output_linear.weight": "mlp.down",
    "mlp.bias": "mlp.out_bias",
}
_FUSED = "mlp.input_linear.weight"  # (E, 2 hidden, dim): [gate | up] rows


def _config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``TransformerEncoder``'s keywords for a JetMoE config."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict (a config.json), got {type(config).__name__}")
    if config.get("model_type") != "jetmoe":
        raise ValueError(f"config['model_type'] must be 'jetmoe', got "
                         f"{config.get('model_type')!r}")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "intermediate_size",
                           "vocab_size", "num_key_value_heads", "kv_channels")
               if config.get(k) is None]
    if missing:
        raise ValueError(f"config lacks {missing}: not a jetmoe config")
    act = config.get("activation_function", "silu")
    if act != "silu":
        raise ValueError(f"config['activation_function'] = {act!r} is not supported here "
                         f"(needs 'silu')")
    depth, experts = config["num_hidden_layers"], config.get("num_local_experts", 8)
    top_k = config.get("num_experts_per_tok", 2)
    return dict(
        dim=config["hidden_size"], heads=config["num_key_value_heads"], depth=depth,
        head_dim=config["kv_channels"], vocab_size=config["vocab_size"],
        out_dim=config["vocab_size"], causal=True, position_embedding="rotary", norm="rms",
        mlp="swiglu", bias=False, mlp_hidden=config["intermediate_size"],
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_len=config.get("max_position_embeddings", 4096),
        tie_embeddings=bool(config.get("tie_word_embeddings", True)),
        attn_experts=dict(experts=experts, top_k=top_k), experts=experts, top_k=top_k,
        moe_options=dict(output_bias=True), **_ropes(config, ["full_attention"] * depth))


def jetmoe_from_hf(config: Mapping[str, Any], state_dict: Mapping[str, Tensor] | None = None,
                   **overrides: Any) -> tuple[TransformerEncoder, dict[str, Tensor] | None]:
    """The ``TransformerEncoder`` of a Hugging Face JetMoE ``config`` (``"jetmoe"``), and
    the params of its ``state_dict`` under the encoder's names.

    Every block's attention is a :class:`MixtureOfAttention`: each token routes to
    ``num_experts_per_tok`` of ``num_local_experts`` query / output projection pairs of
    ``num_key_value_heads`` heads of ``kv_channels``, which share one set of keys and
    values, rotary; its MLP a :class:`MoE` of as many SwiGLU experts (softmax over the
    chosen logits) with an output bias (``output_bias=True``). RMSNorms, tied embeddings
    by default. Tested against ``transformers`` 5 on logits, both caches, greedy
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
        >>> from torchfn.models import jetmoe_from_hf
        >>> config = {"model_type": "jetmoe", "hidden_size": 32, "num_hidden_layers": 2,
        ...           "intermediate_size": 24, "vocab_size": 10, "num_key_value_heads": 2,
        ...           "kv_channels": 8, "num_local_experts": 4, "num_experts_per_tok": 2}
        >>> module, _ = jetmoe_from_hf(config)
        >>> type(module.blocks[0].attn).__name__
        'MixtureOfAttention'
        >>> model = torchfn.Model(module)
        >>> model.apply(model.init(torchfn.random.key(0)), torch.tensor([[1, 2, 3]])).shape
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
        at = f"blocks.{i}."
        if rest in _NAMES:
            params[at + _NAMES[rest]] = tensor
        elif rest == _FUSED:  # (E, 2 hidden, dim) -> gate, up (E, hidden, dim)
            params[at + "mlp.gate"], params[at + "mlp.up"] = tensor.chunk(2, dim=1)
        else:
            return False
        return True

    read_state(state_dict.items(), "jetmoe", params, globals_=GLOBAL_NAMES,
               tied=kwargs["tie_embeddings"], read_layer=read_layer)
    check_fit(param_shapes(module), params, "state_dict")
    return module, params


def jetmoe_to_hf(config: Mapping[str, Any], params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``params`` of the model ``jetmoe_from_hf(config)`` builds, under a Hugging Face
    checkpoint's names (the experts' gate and up joined again: a copy). The inverse of
    :func:`jetmoe_from_hf`, bit for bit.

    Example::

        >>> import torchfn
        >>> from torchfn.models import jetmoe_from_hf, jetmoe_to_hf
        >>> config = {"model_type": "jetmoe", "hidden_size": 32, "num_hidden_layers": 1,
        ...           "intermediate_size": 24, "vocab_size": 10, "num_key_value_heads": 2,
        ...           "kv_channels": 8, "num_local_experts": 4, "num_experts_per_tok": 2}
        >>> params = torchfn.Model(jetmoe_from_hf(config)[0]).init(torchfn.random.key(0))
        >>> jetmoe_to_hf(config, params)["model.layers.0.mlp.input_linear.weight"].shape
        torch.Size([4, 48, 32])
    """
    import torch

    kwargs = _config(config)
    check_params_for(TransformerEncoder, kwargs, params)
    back = {ours: hf for hf, ours in _NAMES.items()}
    hf_global = {ours: hf for hf, ours in GLOBAL_NAMES.items()}
    out: dict[str, Tensor] = {}
    for name, t in params.items():
        if name in hf_global:
            out[hf_global[name]] = t
            continue
        i, rest = name.split(".", 2)[1:]
        at = f"model.layers.{i}."
        if rest == "mlp.gate":  # [gate | up] rows, as the checkpoint fuses them
            out[at + _FUSED] = torch.cat((t, params[f"blocks.{i}.mlp.up"]), dim=1)
        elif rest != "mlp.up":
            out[at + back[rest]] = t
    return out
