"""A Hugging Face DBRX checkpoint (``dbrx``) as a ``TransformerEncoder`` and its params, and
back: a mixture of experts in every block, bias-free LayerNorms, q/k/v clamped."""

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
from torchfn.models._transformer import TransformerEncoder

__all__ = ["dbrx_from_hf", "dbrx_to_hf"]

_GLOBAL = {"transformer.wte.weight": "embed.weight", "transformer.norm_f.weight": "ln.weight",
           "lm_head.weight": "head.weight"}
_NAMES = {"norm_attn_norm.norm_1.weight": "ln1.weight",
          "norm_attn_norm.norm_2.weight": "ln2.weight",
          "norm_attn_norm.attn.Wqkv.weight": "attn.qkv.weight",
          "norm_attn_norm.attn.out_proj.weight": "attn.out.weight",
          "ffn.router.layer.weight": "mlp.router.weight"}
_EXPERTS = {"ffn.experts.mlp.w1": "mlp.gate", "ffn.experts.mlp.v1": "mlp.up",
            "ffn.experts.mlp.w2": "mlp.down"}  # (E hidden, dim) each; w2 transposed


def _config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``TransformerEncoder``'s keywords for a DBRX config."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict (a config.json), got {type(config).__name__}")
    if config.get("model_type", "dbrx") != "dbrx":
        raise ValueError(f"config['model_type'] must be 'dbrx', got {config['model_type']!r}")
    missing = [k for k in ("d_model", "n_heads", "n_layers", "vocab_size", "attn_config",
                           "ffn_config") if config.get(k) is None]
    if missing:
        raise ValueError(f"config lacks {missing}: not a dbrx config")
    attn, ffn = config["attn_config"], config["ffn_config"]
    act = (ffn.get("ffn_act_fn") or {}).get("name", "silu")
    p = ffn.get("moe_normalize_expert_weights", 1.0)
    for key, got, ok in (("ffn_config['ffn_act_fn']", act, act == "silu"),
                         ("ffn_config['moe_normalize_expert_weights']", p, p in (1, None))):
        if not ok:
            raise ValueError(f"config's {key} = {got!r} is not supported here (needs "
                             f"{'silu' if 'act' in key else '1.0 or None'})")
    dim, heads, depth = config["d_model"], config["n_heads"], config["n_layers"]
    # transformers 5 writes rope_parameters, and rotates by it (not by attn_config's theta)
    rope = config.get("rope_parameters") or {}
    theta = rope.get("rope_theta", attn.get("rope_theta", 10000.0))
    kwargs: dict[str, Any] = dict(
        dim=dim, heads=heads, depth=depth, vocab_size=config["vocab_size"],
        out_dim=config["vocab_size"], causal=True, kv_heads=attn.get("kv_n_heads") or heads,
        position_embedding="rotary", rotary_base=float(theta), norm="layer", bias=False,
        norm_eps=1e-5, mlp="swiglu", max_len=config.get("max_seq_len", 2048),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        experts=ffn.get("moe_num_experts", 4), top_k=ffn.get("moe_top_k", 1),
        expert_hidden=ffn["ffn_hidden_size"], mlp_hidden=ffn["ffn_hidden_size"],
        moe_options=dict(normalize=p is not None))
    if attn.get("clip_qkv") is not None:
        kwargs["layer_attention"] = [{"qkv_clip": attn["clip_qkv"]}] * depth
    return kwargs


def dbrx_from_hf(config: Mapping[str, Any], state_dict: Mapping[str, Tensor] | None = None,
                 **overrides: Any) -> tuple[TransformerEncoder, dict[str, Tensor] | None]:
    """The ``TransformerEncoder`` of a Hugging Face DBRX ``config`` (``"dbrx"``), and the
    params of its ``state_dict`` under the encoder's names.

    Every block is grouped-query rotary attention whose projected q, k and v are clamped
    to ``[-clip_qkv, clip_qkv]`` (``qkv_clip``) and a mixture of ``moe_num_experts``
    SwiGLU experts (softmax, top-k, renormalised), each after a LayerNorm without bias.
    The experts' matrices come stacked on disk as ``(E hidden, dim)`` (``w1``, ``v1``,
    ``w2``): viewed per expert here (``w2`` transposed), joined back by
    :func:`dbrx_to_hf`. Tested against ``transformers`` 5 on logits, both caches, greedy
    generation (left-padded too) and the round trip.

    Args:
        config: the checkpoint's ``config.json`` as a dict.
        state_dict: its tensors under Hugging Face's names, or None for the module alone.
        overrides: other ``TransformerEncoder`` arguments (``attend``, ``remat``, ...).

    Returns:
        ``(module, params)``; ``params`` is None without a ``state_dict``.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import dbrx_from_hf
        >>> config = {"model_type": "dbrx", "d_model": 16, "n_heads": 2, "n_layers": 1,
        ...           "vocab_size": 10, "attn_config": {"kv_n_heads": 1, "clip_qkv": 8},
        ...           "ffn_config": {"ffn_hidden_size": 12, "moe_num_experts": 4,
        ...                          "moe_top_k": 2}}
        >>> module, _ = dbrx_from_hf(config)
        >>> params = torchfn.Model(module).init(torchfn.random.key(0))
        >>> params["blocks.0.mlp.gate"].shape  # (E, hidden, dim)
        torch.Size([4, 12, 16])
    """
    kwargs = _config(config)
    kwargs.update(overrides)
    check_state_dict(state_dict)
    module = TransformerEncoder(**kwargs)
    if state_dict is None:
        return module, None
    experts, hidden = kwargs["experts"], kwargs["expert_hidden"]
    params: dict[str, Tensor] = {}

    def read_layer(i: str, rest: str, tensor: Tensor) -> bool:
        if rest in _NAMES:
            params[f"blocks.{i}.{_NAMES[rest]}"] = tensor
        elif rest in _EXPERTS:
            t = tensor.unflatten(0, (experts, hidden)) if tensor.shape[0] == experts * hidden \
                else tensor  # (else a wrong size, reported below)
            params[f"blocks.{i}.{_EXPERTS[rest]}"] = t.transpose(1, 2) if rest.endswith("w2") \
                else t
        else:
            return False
        return True

    read_state(state_dict.items(), "dbrx", params, globals_=_GLOBAL,
               tied=kwargs["tie_embeddings"], read_layer=read_layer, layers="transformer.blocks.")
    check_fit(param_shapes(module), params, "state_dict")
    return module, params


def dbrx_to_hf(config: Mapping[str, Any], params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``params`` of the model ``dbrx_from_hf(config)`` builds, under a Hugging Face
    checkpoint's names, the experts stacked as ``(E hidden, dim)`` again (views; ``w2``
    transposed back: a copy). The inverse of :func:`dbrx_from_hf`, bit for bit.

    Example::

        >>> import torchfn
        >>> from torchfn.models import dbrx_from_hf, dbrx_to_hf
        >>> config = {"model_type": "dbrx", "d_model": 16, "n_heads": 2, "n_layers": 1,
        ...           "vocab_size": 10, "attn_config": {"kv_n_heads": 1},
        ...           "ffn_config": {"ffn_hidden_size": 12, "moe_num_experts": 4}}
        >>> params = torchfn.Model(dbrx_from_hf(config)[0]).init(torchfn.random.key(0))
        >>> dbrx_to_hf(config, params)["transformer.blocks.0.ffn.experts.mlp.w2"].shape
        torch.Size([48, 16])
    """
    kwargs = _config(config)
    check_params_for(TransformerEncoder, kwargs, params)
    back = {ours: hf for hf, ours in (_GLOBAL | _NAMES | _EXPERTS).items()}
    out: dict[str, Tensor] = {}
    for name, t in params.items():
        if name in back:
            out[back[name]] = t
            continue
        i, rest = name.split(".", 2)[1:]
        hf = back[rest]
        if rest in ("mlp.gate", "mlp.up", "mlp.down"):
            t = (t.transpose(1, 2) if rest == "mlp.down" else t).flatten(0, 1).contiguous()
        out[f"transformer.blocks.{i}.{hf}"] = t
    return out
