"""A Hugging Face xLSTM checkpoint (``xlstm``: xLSTM 7B) as a ``TransformerEncoder`` and its
params, and back: every block an mLSTM layer and a SwiGLU MLP."""

from __future__ import annotations

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
from torchfn.models._transformer import TransformerEncoder

__all__ = ["xlstm_from_hf", "xlstm_to_hf"]

_GLOBAL = {"backbone.embeddings.weight": "embed.weight", "backbone.out_norm.weight": "ln.weight",
           "lm_head.weight": "head.weight"}
_NAMES = {  # a block's HF names -> ours ("single" weights; "fused" ones split below)
    "norm_mlstm.weight": "ln1.weight", "norm_ffn.weight": "ln2.weight",
    **{f"mlstm_layer.{hf}.{kind}": f"attn.{ours}.{kind}" for hf, ours in (
        ("q", "q"), ("k", "k"), ("v", "v"), ("ogate_preact", "o_gate"),
        ("igate_preact", "i_gate"), ("fgate_preact", "f_gate"), ("out_proj", "out"))
       for kind in ("weight", "bias")},
    "mlstm_layer.multihead_norm.weight": "attn.norm",
    "mlstm_layer.multihead_norm.bias": "attn.norm_bias",
    **{f"ffn.{hf}.{kind}": f"mlp.{ours}.{kind}" for hf, ours in (
        ("proj_up_gate", "gate"), ("proj_up", "up"), ("proj_down", "down"))
       for kind in ("weight", "bias")},
}
_FUSED = {  # "fused" weights: HF name -> ours, in the order of their rows
    "mlstm_layer.qkv_opreact": ("attn.q", "attn.k", "attn.v", "attn.o_gate"),
    "mlstm_layer.ifgate_preact": ("attn.i_gate", "attn.f_gate"),
    "ffn.proj_up_gate_z": ("mlp.gate", "mlp.up"),
}


def _config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``TransformerEncoder``'s keywords for an xLSTM config."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict (a config.json), got {type(config).__name__}")
    if config.get("model_type", "xlstm") != "xlstm":
        raise ValueError(f"config['model_type'] must be 'xlstm', got {config['model_type']!r}")
    dim = config.get("hidden_size") or config.get("embedding_dim")
    depth = config.get("num_hidden_layers") or config.get("num_blocks")
    missing = [k for k, v in (("hidden_size", dim), ("num_hidden_layers", depth),
                              ("num_heads", config.get("num_heads")),
                              ("vocab_size", config.get("vocab_size"))) if v is None]
    if missing:
        raise ValueError(f"config lacks {missing}: not an xlstm config")
    if config.get("use_bias", False):
        raise ValueError(f"config['use_bias'] = {config['use_bias']!r} is not supported here "
                         "(needs False: its block norms would have biases)")
    if config.get("weight_mode", "single") not in ("single", "fused"):
        raise ValueError(f"config['weight_mode'] must be 'single' or 'fused', got "
                         f"{config['weight_mode']!r}")
    heads = config["num_heads"]
    multiple = config.get("ffn_round_up_to_multiple_of", 64)
    hidden = int(((dim * config.get("ffn_proj_factor", 2.667) + multiple - 1) // multiple)
                 * multiple)  # transformers' round_up_to_next_multiple_of
    return dict(
        dim=dim, heads=heads, depth=depth, vocab_size=config["vocab_size"],
        out_dim=config["vocab_size"], causal=True, position_embedding="none", norm="rms",
        mlp="swiglu", bias=False, mlp_hidden=hidden,
        norm_eps=float(config.get("norm_eps", 1e-6)),
        logit_softcap=config.get("output_logit_soft_cap"),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        linear_attention=dict(
            kind="mlstm", heads=heads, qk_dim=int(dim * config.get("qk_dim_factor", 0.5)),
            v_dim=int(dim * config.get("v_dim_factor", 1.0)),
            gate_cap=config.get("gate_soft_cap", 15.0), eps=float(config.get("eps", 1e-6)),
            chunk=config.get("chunk_size", 64)),
    )


def xlstm_from_hf(config: Mapping[str, Any], state_dict: Mapping[str, Tensor] | None = None,
                  **overrides: Any) -> tuple[TransformerEncoder, dict[str, Tensor] | None]:
    """The ``TransformerEncoder`` of a Hugging Face xLSTM ``config`` (``"xlstm"``: xLSTM 7B),
    and the params of its ``state_dict`` under the encoder's names.

    Every block is an :class:`MLSTM` layer (xLSTM's matrix memory with exponential input
    gates, over :func:`torchfn.kernels.mlstm`) then a SwiGLU MLP, each after an RMSNorm;
    no position embedding; the logits soft-capped (``output_logit_soft_cap``). Both
    ``weight_mode``\\ s read: "single" (a matrix a projection) and "fused" (q, k, v and the
    output gate in one, the two gates in one, the MLP's two up-projections in one).
    Tested against ``transformers`` 5 on logits, both caches, greedy generation
    (left-padded too) and the round trip.

    Args:
        config: the checkpoint's ``config.json`` as a dict.
        state_dict: its tensors under Hugging Face's names, or None for the module alone.
        overrides: other ``TransformerEncoder`` arguments (``attend``, ``remat``, ...).

    Returns:
        ``(module, params)``; ``params`` is None without a ``state_dict``.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import xlstm_from_hf
        >>> config = {"model_type": "xlstm", "hidden_size": 16, "num_heads": 2,
        ...           "num_hidden_layers": 2, "vocab_size": 10}
        >>> module, _ = xlstm_from_hf(config)
        >>> [type(b.attn).__name__ for b in module.blocks]
        ['MLSTM', 'MLSTM']
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
    shapes = param_shapes(module)
    params: dict[str, Tensor] = {}

    def read_layer(i: str, rest: str, tensor: Tensor) -> bool:
        fused = rest.rsplit(".", 1)
        if rest in _NAMES:
            params[f"blocks.{i}.{_NAMES[rest]}"] = tensor
        elif fused[0] in _FUSED and len(fused) == 2:
            ours = [f"blocks.{i}.{p}.{fused[1]}" for p in _FUSED[fused[0]]]
            sizes = [shapes.get(n, (0,))[0] for n in ours]
            if sum(sizes) != tensor.shape[0]:
                raise ValueError(f"state_dict's backbone.blocks.{i}.{rest} has "
                                 f"{tensor.shape[0]} rows, not {sum(sizes)} "
                                 f"({' + '.join(map(str, sizes))} of {', '.join(ours)})")
            params.update(zip(ours, tensor.split(sizes)))
        else:
            return False
        return True

    read_state(state_dict.items(), "xlstm", params, globals_=_GLOBAL,
               tied=kwargs["tie_embeddings"], read_layer=read_layer, layers="backbone.blocks.")
    check_fit(shapes, params, "state_dict")
    return module, params


def xlstm_to_hf(config: Mapping[str, Any], params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``params`` of the model ``xlstm_from_hf(config)`` builds, under a Hugging Face
    checkpoint's names, in the config's ``weight_mode`` ("fused": rows joined, copies).
    The inverse of :func:`xlstm_from_hf`, bit for bit.

    Example::

        >>> import torchfn
        >>> from torchfn.models import xlstm_from_hf, xlstm_to_hf
        >>> config = {"model_type": "xlstm", "hidden_size": 16, "num_heads": 2,
        ...           "num_hidden_layers": 1, "vocab_size": 10, "weight_mode": "fused"}
        >>> params = torchfn.Model(xlstm_from_hf(config)[0]).init(torchfn.random.key(0))
        >>> xlstm_to_hf(config, params)["backbone.blocks.0.mlstm_layer.qkv_opreact.weight"].shape
        torch.Size([48, 16])
    """
    kwargs = _config(config)
    check_params_for(TransformerEncoder, kwargs, params)
    fused = config.get("weight_mode", "single") == "fused"
    back = {ours: hf for hf, ours in _GLOBAL.items()}
    names = {ours: hf for hf, ours in _NAMES.items()}
    parts = {f"{p}.{kind}": (hf, kind) for hf, ours in _FUSED.items() for p in ours
             for kind in ("weight", "bias")}
    out: dict[str, Tensor] = {}
    for name, t in params.items():
        if name in back:
            out[back[name]] = t
            continue
        i, rest = name.split(".", 2)[1:]
        at = f"backbone.blocks.{i}."
        if fused and rest in parts:
            hf, kind = parts[rest]
            if rest.startswith(_FUSED[hf][0] + "."):  # the first piece joins them all
                out[f"{at}{hf}.{kind}"] = torch.cat(
                    [params[f"blocks.{i}.{p}.{kind}"] for p in _FUSED[hf]])
        else:
            out[at + names[rest]] = t
    return out
