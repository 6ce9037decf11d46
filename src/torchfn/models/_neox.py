"""A Hugging Face GPT-NeoX checkpoint (Pythia, GPT-NeoX-20B) as a ``TransformerEncoder`` and
its params, and back."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from torchfn.models._fit import (
    check_fit,
    check_params_for,
    check_state_dict,
    param_shapes,
    read_state,
)
from torchfn.models._llama import _ropes, partial_rotary
from torchfn.models._transformer import TransformerEncoder

__all__ = ["neox_from_hf", "neox_to_hf"]

_GLOBAL = {"gpt_neox.embed_in.weight": "embed.weight", "embed_out.weight": "head.weight",
           "gpt_neox.final_layer_norm.weight": "ln.weight",
           "gpt_neox.final_layer_norm.bias": "ln.bias"}
_NAMES = {f"{hf}.{kind}": f"{ours}.{kind}" for kind in ("weight", "bias") for hf, ours in (
    ("input_layernorm", "ln1"), ("post_attention_layernorm", "ln2"),
    ("attention.query_key_value", "attn.qkv"), ("attention.dense", "attn.out"),
    ("mlp.dense_h_to_4h", "mlp.0"), ("mlp.dense_4h_to_h", "mlp.2"))}
_IGNORED = re.compile(r".*attention\.(bias|masked_bias|rotary_emb\.inv_freq)$")  # old buffers


def _config(config: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict (a GPT-NeoX config.json), got "
                        f"{type(config).__name__}")
    if config.get("model_type") != "gpt_neox":
        raise ValueError(f"config['model_type'] must be 'gpt_neox', got "
                         f"{config.get('model_type')!r}")
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                           "intermediate_size", "vocab_size") if k not in config]
    if missing:
        raise ValueError(f"config lacks {missing}: not a GPT-NeoX config")
    for key, want in (("hidden_act", "gelu"), ("attention_bias", True)):
        if config.get(key, want) != want:
            raise ValueError(f"config[{key!r}] = {config[key]!r} is not supported here "
                             f"(needs {want!r})")
    dim, heads = config["hidden_size"], config["num_attention_heads"]
    partial = partial_rotary(config) if "rotary_pct" not in config else config["rotary_pct"]
    depth = config["num_hidden_layers"]
    return dict(
        dim=dim, heads=heads, depth=depth, vocab_size=config["vocab_size"],
        out_dim=config["vocab_size"], causal=True,
        max_len=config.get("max_position_embeddings", 2048), position_embedding="rotary",
        norm="layer", mlp="gelu", bias=True, head_bias=False,
        mlp_hidden=config["intermediate_size"], norm_eps=float(config.get("layer_norm_eps", 1e-5)),
        parallel_residual=bool(config.get("use_parallel_residual", True)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        rotary_dim=None if partial == 1 else int(dim // heads * partial),
    ) | _ropes(config, ["full_attention"] * depth)


def _per_head(rows: int, heads: int) -> Tensor:
    """The order that takes GPT-NeoX's fused rows, ``[q_h | k_h | v_h]`` for each head ``h``
    in turn, to ours, all heads' queries then keys then values: ``(3 * heads * hd,)``."""
    hd = rows // (3 * heads)
    index = torch.arange(rows).view(heads, 3, hd)  # (head, q/k/v, feature)
    return index.transpose(0, 1).reshape(-1)


def neox_from_hf(config: Mapping[str, Any], state_dict: Mapping[str, Tensor] | None = None,
                 **overrides: Any) -> tuple[TransformerEncoder, dict[str, Tensor] | None]:
    """The ``TransformerEncoder`` of a Hugging Face GPT-NeoX ``config`` (Pythia, the suite
    interpretability research runs on; GPT-NeoX-20B) and the params of its ``state_dict``.

    GPT-NeoX is LayerNorm with biases, a GELU MLP with biases, rotary positions on the
    first ``rotary_pct`` of each head (``partial_rotary_factor``), biases on every
    projection but the untied head (``head_bias=False``), and a *parallel* residual
    (``use_parallel_residual``: ``x + Attn(LN1(x)) + MLP(LN2(x))``). Its fused
    ``query_key_value`` rows, q, k and v per head, become our ``qkv`` (all heads' q, then
    k, then v). Tested against ``transformers`` on logits, the KV cache, greedy
    generation and the round trip.

    Returns:
        ``(module, params)``; ``params`` is None without a ``state_dict``.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import neox_from_hf, neox_to_hf
        >>> config = {"model_type": "gpt_neox", "hidden_size": 16, "num_attention_heads": 2,
        ...           "num_hidden_layers": 1, "intermediate_size": 32, "vocab_size": 10,
        ...           "rotary_pct": 0.25}
        >>> module, _ = neox_from_hf(config)
        >>> params = torchfn.Model(module).init(torchfn.random.key(0))
        >>> sd = neox_to_hf(config, params)
        >>> neox_from_hf(config, sd)[1]["blocks.0.attn.qkv.weight"].equal(
        ...     params["blocks.0.attn.qkv.weight"])
        True
    """
    kwargs = _config(config)
    kwargs.update(overrides)
    check_state_dict(state_dict)
    module = TransformerEncoder(**kwargs)
    if state_dict is None:
        return module, None
    params: dict[str, Tensor] = {}

    def read_layer(i: str, rest: str, tensor: Tensor) -> bool:
        if rest not in _NAMES:
            return False
        if _NAMES[rest].startswith("attn.qkv"):
            tensor = tensor[_per_head(tensor.shape[0], kwargs["heads"])]
        params[f"blocks.{i}.{_NAMES[rest]}"] = tensor
        return True

    read_state(state_dict.items(), "GPT-NeoX", params, globals_=_GLOBAL,
               tied=kwargs["tie_embeddings"], read_layer=read_layer, layers="gpt_neox.layers.",
               ignore=_IGNORED.fullmatch)
    check_fit(param_shapes(module), params, "state_dict")
    return module, params


def neox_to_hf(config: Mapping[str, Any], params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``params`` of the model ``neox_from_hf(config)`` builds under a GPT-NeoX
    checkpoint's names, ``qkv`` rows back in their per-head order (copies): the round trip
    gives the checkpoint back bit for bit.

    Example::

        >>> import torchfn
        >>> from torchfn.models import neox_from_hf, neox_to_hf
        >>> config = {"model_type": "gpt_neox", "hidden_size": 16, "num_attention_heads": 2,
        ...           "num_hidden_layers": 1, "intermediate_size": 32, "vocab_size": 10}
        >>> params = torchfn.Model(neox_from_hf(config)[0]).init(torchfn.random.key(0))
        >>> neox_to_hf(config, params)["gpt_neox.layers.0.attention.query_key_value.weight"].shape
        torch.Size([48, 16])
    """
    kwargs = _config(config)
    check_params_for(TransformerEncoder, kwargs, params)
    hf_global = {ours: hf for hf, ours in _GLOBAL.items()}
    hf_name = {ours: hf for hf, ours in _NAMES.items()}
    out: dict[str, Tensor] = {}
    for name, t in params.items():
        if name in hf_global:
            out[hf_global[name]] = t
            continue
        _, i, rest = name.split(".", 2)
        if rest.startswith("attn.qkv"):
            t = t[torch.argsort(_per_head(t.shape[0], kwargs["heads"]))]
        out[f"gpt_neox.layers.{i}.{hf_name[rest]}"] = t
    return out
