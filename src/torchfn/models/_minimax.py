"""A Hugging Face MiniMax-01 checkpoint (``minimax``: MiniMax-Text-01, MiniMax-M1) as a
``TransformerEncoder`` and its params, and back: lightning attention in most blocks,
softmax attention in the others, a mixture of experts in every block, and MiniMax's
residual from each sublayer's normalised input."""

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
    join_qkv,
    param_shapes,
    read_state,
    stack_experts,
)
from torchfn.models._lightning import lightning_slopes
from torchfn.models._llama import GLOBAL_NAMES, _ropes
from torchfn.models._transformer import TransformerEncoder

__all__ = ["minimax_from_hf", "minimax_to_hf"]

_EXPERT = re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")
_W = {"w1": "gate", "w3": "up", "w2": "down"}
_COMMON = {"input_layernorm.weight": "ln1.weight",
           "post_attention_layernorm.weight": "ln2.weight",
           "block_sparse_moe.gate.weight": "mlp.router.weight"}
_ATTN = {**{f"self_attn.{p}_proj.weight": f"attn.{p}_proj.weight" for p in "qkv"},
         "self_attn.o_proj.weight": "attn.out.weight"}
_LIGHTNING = {"self_attn.qkv_proj.weight": "attn.qkv.weight",
              "self_attn.output_gate.weight": "attn.gate.weight",
              "self_attn.norm.weight": "attn.norm", "self_attn.out_proj.weight": "attn.out.weight"}
_DECAYS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")  # derived buffers


def _config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``TransformerEncoder``'s keywords for a MiniMax config."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict (a config.json), got {type(config).__name__}")
    if config.get("model_type", "minimax") != "minimax":
        raise ValueError(f"config['model_type'] must be 'minimax', got {config['model_type']!r}")
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                           "intermediate_size", "vocab_size") if config.get(k) is None]
    if missing:
        raise ValueError(f"config lacks {missing}: not a minimax config")
    for key, want in (("hidden_act", "silu"), ("sliding_window", None)):
        if config.get(key, want) != want:
            raise ValueError(f"config[{key!r}] = {config[key]!r} is not supported here "
                             f"(needs {want!r})")
    depth, dim, heads = config["num_hidden_layers"], config["hidden_size"], \
        config["num_attention_heads"]
    types = config.get("layer_types") or ["full_attention" if (i + 1) % 2 else "linear_attention"
                                          for i in range(depth)]
    if len(types) != depth or not set(types) <= {"linear_attention", "full_attention"}:
        raise ValueError(f"config['layer_types'] must list 'linear_attention' or "
                         f"'full_attention' for each of {depth} layers, got {types!r}")
    head_dim = config.get("head_dim") or dim // heads

    def pair(name: str) -> tuple[float, float]:
        return (float(config.get(f"{name}_alpha_factor", 1)),
                float(config.get(f"{name}_beta_factor", 1)))

    return dict(
        dim=dim, heads=heads, depth=depth, vocab_size=config["vocab_size"],
        out_dim=config["vocab_size"], causal=True, head_dim=head_dim,
        kv_heads=config.get("num_key_value_heads") or heads, norm="rms", mlp="swiglu",
        bias=False, norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        max_len=config.get("max_position_embeddings", 131072),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        # (every feature rotated: transformers' MiniMax reads no partial_rotary_factor)
        position_embedding="rotary", **_ropes(config, ["full_attention"] * depth),
        experts=config.get("num_local_experts", 8), top_k=config.get("num_experts_per_tok", 2),
        expert_hidden=config["intermediate_size"], mlp_hidden=config["intermediate_size"],
        linear_attention=dict(kind="lightning", heads=heads, head_dim=head_dim, norm_eps=1e-6),
        layer_linear=[{"slopes": lightning_slopes(heads, i, depth)} if t == "linear_attention"
                      else False for i, t in enumerate(types)],
        normed_residual=dict(attention=pair("full_attn"), linear=pair("linear_attn"),
                             mlp=pair("mlp")))


def minimax_from_hf(config: Mapping[str, Any], state_dict: Mapping[str, Tensor] | None = None,
                    **overrides: Any) -> tuple[TransformerEncoder, dict[str, Tensor] | None]:
    """The ``TransformerEncoder`` of a Hugging Face MiniMax-01 ``config`` (``"minimax"``) and
    the params of its ``state_dict``.

    The ``"linear_attention"`` blocks of ``layer_types`` mix tokens with
    :class:`LightningAttention` (linear attention decaying at a fixed rate per head:
    ALiBi's slopes scaled by depth, :func:`lightning_slopes`; the checkpoint's
    ``slope_rate`` and the decays derived from it are checked against them and not
    kept), the others with grouped-query rotary attention. Every MLP is a Mixtral-style
    mixture (softmax top-k, renormalised). Each sublayer adds to its normalised input,
    weighted by the config's ``*_alpha_factor`` / ``*_beta_factor``
    (``normed_residual``). Tested against ``transformers`` 5 on logits, both caches,
    greedy generation (left-padded too) and the round trip.

    Args:
        config: the checkpoint's ``config.json`` as a dict.
        state_dict: its tensors under Hugging Face's names, or None for the module alone.
        overrides: other ``TransformerEncoder`` arguments.

    Returns:
        ``(module, params)``; ``params`` is None without a ``state_dict``.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import minimax_from_hf
        >>> config = {"model_type": "minimax", "hidden_size": 16, "num_attention_heads": 2,
        ...           "num_hidden_layers": 2, "intermediate_size": 24, "vocab_size": 10,
        ...           "num_local_experts": 4, "layer_types": ["linear_attention",
        ...                                                   "full_attention"]}
        >>> module, _ = minimax_from_hf(config)
        >>> [type(b.attn).__name__ for b in module.blocks]
        ['LightningAttention', 'MultiHeadAttention']
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
    experts: dict[str, dict[int, Tensor]] = {}

    def read_layer(layer: str, rest: str, tensor: Tensor) -> bool:
        i = int(layer)
        if i >= kwargs["depth"]:
            return False
        names = _COMMON | (_LIGHTNING if linear[i] is not False else _ATTN)
        expert = _EXPERT.fullmatch(rest)
        if rest in names:
            params[f"blocks.{i}.{names[rest]}"] = tensor
        elif expert:
            experts.setdefault(f"blocks.{i}.mlp.{_W[expert[2]]}", {})[int(expert[1])] = tensor
        elif linear[i] is not False and rest == "self_attn.slope_rate":
            want = torch.tensor(linear[i]["slopes"], dtype=torch.float64)
            if not torch.allclose(tensor.double().reshape(-1), want, rtol=1e-2, atol=0):
                raise ValueError(f"state_dict's model.layers.{layer}.{rest} = "
                                 f"{tensor.reshape(-1).tolist()} is not MiniMax's slope for "
                                 f"layer {i} of {kwargs['depth']} ({want.tolist()}): not "
                                 "supported here")
        elif linear[i] is not False and rest.removeprefix("self_attn.") in _DECAYS:
            pass  # derived from the slopes and the block size
        else:
            return False
        return True

    read_state(state_dict.items(), "minimax", params, globals_=GLOBAL_NAMES,
               tied=kwargs["tie_embeddings"], read_layer=read_layer)
    stack_experts(params, experts, kwargs["experts"])
    join_qkv(params)
    check_fit(param_shapes(module), params, "state_dict")
    return module, params


def _decays(slopes: tuple[float, ...], block: int, like: Tensor) -> dict[str, Tensor]:
    """transformers' lightning-attention buffers from the slopes, as its
    ``MiniMaxLightningAttention.decay_factors`` computes them, in ``like``'s dtype."""
    rate = torch.tensor(slopes, dtype=like.dtype)[:, None, None]  # (H, 1, 1)
    steps = torch.arange(block) + 1
    diagonal = rate * (steps[:, None] - steps[None, :])[None, None]
    return {"slope_rate": rate,
            "query_decay": torch.exp(-rate * steps[:, None]),
            "key_decay": torch.exp(-rate * (block - steps[:, None])),
            "diagonal_decay": torch.exp(torch.where(diagonal >= 0, -diagonal, float("-inf")))}


def minimax_to_hf(config: Mapping[str, Any], params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``params`` of the model ``minimax_from_hf(config)`` builds, under a Hugging Face
    checkpoint's names (q, k and v apart, the experts one matrix each: copies), with the
    lightning layers' decay buffers transformers keeps (recomputed from the slopes and
    ``block_size``). The inverse of :func:`minimax_from_hf`.

    Example::

        >>> import torchfn
        >>> from torchfn.models import minimax_from_hf, minimax_to_hf
        >>> config = {"model_type": "minimax", "hidden_size": 16, "num_attention_heads": 2,
        ...           "num_hidden_layers": 1, "intermediate_size": 24, "vocab_size": 10,
        ...           "layer_types": ["linear_attention"], "block_size": 8}
        >>> params = torchfn.Model(minimax_from_hf(config)[0]).init(torchfn.random.key(0))
        >>> minimax_to_hf(config, params)["model.layers.0.self_attn.diagonal_decay"].shape
        torch.Size([1, 2, 8, 8])
    """
    kwargs = _config(config)
    check_params_for(TransformerEncoder, kwargs, params)
    linear = kwargs["layer_linear"]
    inverse = {lightning: {ours: hf for hf, ours in (
        _COMMON | (_LIGHTNING if lightning else _ATTN)).items()} for lightning in (False, True)}
    back = {ours: hf for hf, ours in GLOBAL_NAMES.items()}
    hd = kwargs["head_dim"]
    sizes = [kwargs["heads"] * hd] + [kwargs["kv_heads"] * hd] * 2
    out: dict[str, Tensor] = {}
    for name, t in params.items():
        if name in back:
            out[back[name]] = t
            continue
        i, rest = name.split(".", 2)[1:]
        at = f"model.layers.{i}."
        if rest == "attn.qkv.weight" and linear[int(i)] is False:
            for p, piece in zip("qkv", t.split(sizes)):
                out[f"{at}self_attn.{p}_proj.weight"] = piece.clone()
        elif rest in ("mlp.gate", "mlp.up", "mlp.down"):  # stacked experts (E, ...)
            w = {ours: hf for hf, ours in _W.items()}[rest[4:]]
            for j, part in enumerate(t.unbind(0)):
                out[f"{at}block_sparse_moe.experts.{j}.{w}.weight"] = part.clone()
        else:
            out[at + inverse[linear[int(i)] is not False][rest]] = t
    for i, options in enumerate(linear):
        if options is not False:
            like = params[f"blocks.{i}.attn.norm"]
            for buffer, t in _decays(options["slopes"], config.get("block_size", 256),
                                     like).items():
                out[f"model.layers.{i}.self_attn.{buffer}"] = t
    return out
