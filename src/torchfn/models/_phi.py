"""A Hugging Face Phi checkpoint (Phi-1, Phi-1.5, Phi-2: ``model_type="phi"``) as a
``TransformerEncoder`` and its params, and back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from torchfn.models._fit import (
    check_fit,
    check_params_for,
    check_state_dict,
    join_pieces,
    param_shapes,
    read_state,
)
from torchfn.models._llama import _ropes, partial_rotary
from torchfn.models._transformer import TransformerEncoder

__all__ = ["phi_from_hf", "phi_to_hf"]

_GLOBAL = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
           "lm_head.bias": "head.bias", "model.final_layernorm.weight": "ln.weight",
           "model.final_layernorm.bias": "ln.bias"}
_NAMES = {f"{hf}.{kind}": f"{ours}.{kind}" for kind in ("weight", "bias") for hf, ours in (
    ("input_layernorm", "ln1"), ("self_attn.dense", "attn.out"), ("mlp.fc1", "mlp.0"),
    ("mlp.fc2", "mlp.2"))}
_QKV = {f"self_attn.{p}_proj.{kind}": f"attn.qkv.{kind}" for kind in ("weight", "bias")
        for p in "qkv"}
_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def _config(config: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict (a Phi config.json), got "
                        f"{type(config).__name__}")
    if config.get("model_type") != "phi":
        raise ValueError(f"config['model_type'] must be 'phi', got {config.get('model_type')!r}")
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                           "intermediate_size", "vocab_size") if k not in config]
    if missing:
        raise ValueError(f"config lacks {missing}: not a Phi config")
    act = config.get("hidden_act", "gelu_new")
    if act not in _ACT:
        raise ValueError(f"config['hidden_act'] = {act!r} is not supported here (needs one of "
                         f"{sorted(_ACT)})")
    if config.get("qk_layernorm"):
        raise ValueError("config['qk_layernorm'] = True is not supported here (a LayerNorm "
                         "on each head's q and k)")
    dim, heads, depth = (config["hidden_size"], config["num_attention_heads"],
                         config["num_hidden_layers"])
    head_dim = dim // heads
    partial = partial_rotary(config)
    return dict(
        dim=dim, heads=heads, depth=depth, vocab_size=config["vocab_size"],
        out_dim=config["vocab_size"], causal=True,
        max_len=config.get("max_position_embeddings", 2048), position_embedding="rotary",
        kv_heads=config.get("num_key_value_heads") or heads, norm="layer", mlp=_ACT[act],
        bias=True, mlp_hidden=config["intermediate_size"],
        norm_eps=float(config.get("layer_norm_eps", 1e-5)), parallel_residual="shared",
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        rotary_dim=None if partial == 1 else int(head_dim * partial),
    ) | _ropes(config, ["full_attention"] * depth)


def phi_from_hf(config: Mapping[str, Any], state_dict: Mapping[str, Tensor] | None = None,
                **overrides: Any) -> tuple[TransformerEncoder, dict[str, Tensor] | None]:
    """The ``TransformerEncoder`` of a Hugging Face Phi ``config`` (Phi-1, Phi-1.5, Phi-2)
    and the params of its ``state_dict``.

    Phi's block is parallel with one LayerNorm (``parallel_residual="shared"``: ``x +
    Attn(LN(x)) + MLP(LN(x))``), biases everywhere (the head's too), a tanh-GELU MLP
    (``hidden_act="gelu_new"``: ``mlp="gelu_tanh"``) and rotary positions on
    ``partial_rotary_factor`` of each head (Phi-2: 0.4). q, k and v become one ``qkv``.
    Tested against ``transformers`` on logits, the KV cache, greedy generation and the
    round trip.

    Returns:
        ``(module, params)``; ``params`` is None without a ``state_dict``.

    Example::

        >>> import torchfn
        >>> from torchfn.models import phi_from_hf, phi_to_hf
        >>> config = {"model_type": "phi", "hidden_size": 16, "num_attention_heads": 2,
        ...           "num_hidden_layers": 1, "intermediate_size": 32, "vocab_size": 10,
        ...           "partial_rotary_factor": 0.5}
        >>> module, _ = phi_from_hf(config)
        >>> params = torchfn.Model(module).init(torchfn.random.key(0))
        >>> back = phi_from_hf(config, phi_to_hf(config, params))[1]
        >>> all(back[n].equal(params[n]) for n in params)
        True
    """
    kwargs = _config(config)
    kwargs.update(overrides)
    check_state_dict(state_dict)
    module = TransformerEncoder(**kwargs)
    if state_dict is None:
        return module, None
    params: dict[str, Tensor] = {}
    qkv: dict[str, dict[str, Tensor]] = {}

    def read_layer(i: str, rest: str, tensor: Tensor) -> bool:
        if rest in _NAMES:
            params[f"blocks.{i}.{_NAMES[rest]}"] = tensor
        elif rest in _QKV:  # q, k, v: joined below
            qkv.setdefault(f"blocks.{i}.{_QKV[rest]}", {})[rest[10]] = tensor
        else:
            return False
        return True

    read_state(state_dict.items(), "Phi", params, globals_=_GLOBAL,
               tied=kwargs["tie_embeddings"], read_layer=read_layer,
               ignore=lambda name: name.endswith("rotary_emb.inv_freq"),
               head=("head.weight", "head.bias"))
    join_pieces(params, qkv)
    check_fit(param_shapes(module), params, "state_dict")
    return module, params


def phi_to_hf(config: Mapping[str, Any], params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``params`` of the model ``phi_from_hf(config)`` builds under a Phi checkpoint's
    names, ``qkv`` split into ``q_proj`` / ``k_proj`` / ``v_proj`` (copies): the round trip
    gives the checkpoint back bit for bit.

    Example::

        >>> import torchfn
        >>> from torchfn.models import phi_from_hf, phi_to_hf
        >>> config = {"model_type": "phi", "hidden_size": 16, "num_attention_heads": 2,
        ...           "num_hidden_layers": 1, "intermediate_size": 32, "vocab_size": 10}
        >>> params = torchfn.Model(phi_from_hf(config)[0]).init(torchfn.random.key(0))
        >>> phi_to_hf(config, params)["model.layers.0.self_attn.k_proj.bias"].shape
        torch.Size([16])
    """
    kwargs = _config(config)
    check_params_for(TransformerEncoder, kwargs, params)
    hd = kwargs["dim"] // kwargs["heads"]
    sizes = [kwargs["heads"] * hd, kwargs["kv_heads"] * hd, kwargs["kv_heads"] * hd]
    hf_global = {ours: hf for hf, ours in _GLOBAL.items()}
    hf_name = {ours: hf for hf, ours in _NAMES.items()}
    out: dict[str, Tensor] = {}
    for name, t in params.items():
        if name in hf_global:
            out[hf_global[name]] = t
            continue
        _, i, rest = name.split(".", 2)
        if rest.startswith("attn.qkv."):
            for p, part in zip("qkv", t.split(sizes)):
                out[f"model.layers.{i}.self_attn.{p}_proj.{rest.rsplit('.', 1)[1]}"] = \
                    part.clone()
        else:
            out[f"model.layers.{i}.{hf_name[rest]}"] = t
    return out
