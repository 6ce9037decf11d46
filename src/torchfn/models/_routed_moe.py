"""Hugging Face checkpoints whose mixtures choose experts with a selection bias (router
state) behind Llama-like attention, as a ``TransformerEncoder``, its params and its
state, and back: ERNIE 4.5 MoE (``ernie4_5_moe``), MiniMax-M2 (``minimax_m2``), K-EXAONE
(``exaone_moe``), Arcee Trinity (``afmoe``) and MiMo-V2-Flash (``mimo_v2_flash``)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from torchfn.models._fit import (
    check_fit,
    check_state_dict,
    join_pieces,
    param_shapes,
    read_state,
)
from torchfn.models._llama import _QKV, GLOBAL_NAMES
from torchfn.models._llama import _config as _llama_config
from torchfn.models._transformer import TransformerEncoder

__all__ = ["routed_moe_from_hf", "routed_moe_to_hf"]

_TYPES = ("ernie4_5_moe", "minimax_m2", "exaone_moe", "afmoe", "mimo_v2_flash")
_COMMON = {"input_layernorm.weight": "ln1.weight",
           "post_attention_layernorm.weight": "ln2.weight",
           "self_attn.o_proj.weight": "attn.out.weight"}
_NAMES = {  # model_type -> (a layer's other names, the router's, the bias', one expert's)
    "ernie4_5_moe": (
        {**{f"mlp.{p}_proj.weight": f"mlp.{p}.weight" for p in ("gate", "up", "down")},
         **{f"mlp.shared_experts.{p}_proj.weight": f"mlp.shared.{p}.weight"
            for p in ("gate", "up", "down")}},
        "mlp.gate.weight", "mlp.moe_statics.e_score_correction_bias",
        re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight"),
        {"gate": "gate", "up": "up", "down": "down"}),
    "minimax_m2": (
        {"self_attn.q_norm.weight": "attn.q_norm.weight",
         "self_attn.k_norm.weight": "attn.k_norm.weight"},
        "block_sparse_moe.gate.weight", "block_sparse_moe.e_score_correction_bias",
        re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight"),
        {"w1": "gate", "w3": "up", "w2": "down"}),
}
_NAMES["exaone_moe"] = (
    {**_NAMES["ernie4_5_moe"][0], "self_attn.q_norm.weight": "attn.q_norm.weight",
     "self_attn.k_norm.weight": "attn.k_norm.weight"},
    "mlp.gate.weight", "mlp.e_score_correction_bias") + _NAMES["ernie4_5_moe"][3:]
_NAMES["afmoe"] = (  # sandwich norms, an output gate; its router and bias named apart
    {**_NAMES["exaone_moe"][0], "post_attention_layernorm.weight": "post_ln1.weight",
     "pre_mlp_layernorm.weight": "ln2.weight", "post_mlp_layernorm.weight": "post_ln2.weight",
     "self_attn.gate_proj.weight": "attn.gate.weight"},
    "mlp.router.gate.weight", "mlp.expert_bias") + _NAMES["ernie4_5_moe"][3:]
_NAMES["mimo_v2_flash"] = (  # attention sinks on its windowed layers; no shared experts
    {**{f"mlp.{p}_proj.weight": f"mlp.{p}.weight" for p in ("gate", "up", "down")},
     "self_attn.sinks": "attn.sinks",  # (in memory; the checkpoint's name last: written back)
     "self_attn.attention_sink_bias": "attn.sinks"},
    "mlp.gate.weight", "mlp.gate.e_score_correction_bias") + _NAMES["ernie4_5_moe"][3:]
_SKIPPED = re.compile(r"(model\.)?mtp.*")  # ERNIE's multi-token prediction: not used here


def _config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``TransformerEncoder``'s keywords: the attention blocks as ``llama_from_hf`` reads
    ERNIE 4.5 / Llama, then the mixture."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict (a config.json), got {type(config).__name__}")
    kind = config.get("model_type")
    if kind not in _TYPES:
        raise ValueError(f"config['model_type'] must be one of {_TYPES}, got {kind!r}")
    depth = config["num_hidden_layers"]
    if kind == "ernie4_5_moe":
        if config.get("use_bias"):
            raise ValueError("config['use_bias'] = True is not supported here for "
                             "ernie4_5_moe (its shared experts would have biases)")
        kwargs = _llama_config(dict(config, model_type="ernie4_5"))
        experts, hidden = config.get("moe_num_experts", 64), config["moe_intermediate_size"]
        start = config.get("moe_layer_start_index", 1)
        end = config.get("moe_layer_end_index", -1)
        end = depth - 1 if end in (-1, None) else end
        every = config.get("moe_layer_interval", 1)
        sparse = [(i + 1) % every == 0 and start <= i <= end for i in range(depth)]
        shared = config.get("moe_num_shared_experts") or 0
        options: dict[str, Any] = dict(router_bias=True, normalize=True,
                                       shared_hidden=hidden * shared or None)
        top_k = config.get("moe_k", 6)
    elif kind == "exaone_moe":  # EXAONE 4's attention in pre-norm blocks, V3's router
        kwargs = _llama_config(dict(config, model_type="exaone4"))
        kwargs.update(pre_norms=True, post_norms=False)
        experts, hidden = config.get("num_experts", 64), config["moe_intermediate_size"]
        first = config.get("first_k_dense_replace", 1)
        types = config.get("mlp_layer_types") or ["dense" if i < first else "sparse"
                                                  for i in range(depth)]
        if len(types) != depth or not set(types) <= {"dense", "sparse"}:
            raise ValueError(f"config['mlp_layer_types'] must list 'dense' or 'sparse' for "
                             f"each of {depth} layers, got {types!r}")
        sparse = [t == "sparse" for t in types]
        shared = config.get("num_shared_experts") or 0
        options = dict(scoring="sigmoid", router_bias=True,
                       normalize=bool(config.get("norm_topk_prob", True)),
                       routed_scale=float(config.get("routed_scaling_factor", 1.0)),
                       groups=config.get("n_group") or 1, topk_groups=config.get("topk_group") or 1,
                       shared_hidden=hidden * shared or None)
        top_k = config.get("num_experts_per_tok", 8)
    elif kind == "afmoe":  # Arcee Trinity: Llama's attention, gated, sandwich-normed
        kwargs = _llama_config(dict(config, model_type="llama"))
        types = config.get("layer_types") or [
            "full_attention" if (i + 1) % config.get("global_attn_every_n_layers", 4) == 0
            else "sliding_attention" for i in range(depth)]
        w = config.get("sliding_window")
        windows = [(w - 1, None) if t == "sliding_attention" and w else None for t in types]
        kwargs.pop("window", None)
        kwargs.update(qk_norm=True, post_norms=True, attn_gate=True, layer_windows=windows,
                      layer_rotary=[None if t == "sliding_attention" else False
                                    for t in types])  # no rotary on the global layers
        if config.get("mup_enabled"):
            kwargs["embed_scale"] = config["hidden_size"] ** 0.5
        experts, hidden = config.get("num_experts", 64), config["moe_intermediate_size"]
        sparse = [i >= (config.get("num_dense_layers") or 0) for i in range(depth)]
        shared = config.get("num_shared_experts") or 0
        options = dict(scoring="sigmoid", router_bias=True, normalize=True,
                       normalize_eps=1e-20, routed_scale=float(config.get("route_scale", 1.0)),
                       shared_hidden=hidden * shared or None)
        top_k = config.get("num_experts_per_tok", 6)
    elif kind == "mimo_v2_flash":
        kwargs, sparse = _mimo(config, depth)
        experts, hidden = config.get("n_routed_experts", 256), config["moe_intermediate_size"]
        options = dict(scoring="sigmoid", router_bias=True,
                       normalize=bool(config.get("norm_topk_prob", True)),
                       routed_scale=float(config.get("routed_scaling_factor") or 1.0),
                       groups=config.get("n_group") or 1, topk_groups=config.get("topk_group") or 1)
        top_k = config.get("num_experts_per_tok", 8)
    else:  # MiniMax-M2: q/k norms over all heads, sigmoid scores
        kwargs = _llama_config(dict(config, model_type="llama"))
        kwargs.update(qk_norm=True, qk_norm_scope="all")
        experts, hidden = config.get("num_local_experts", 256), config["intermediate_size"]
        sparse = [True] * depth
        options = dict(scoring="sigmoid", router_bias=True, normalize=True)
        top_k = config.get("num_experts_per_tok", 8)
    if not any(sparse):
        raise ValueError(f"config's mixture layers ({kind}) leave no layer a mixture")
    kwargs.update(experts=experts, top_k=top_k, expert_hidden=hidden, moe_options=options,
                  layer_experts=None if all(sparse) else sparse)
    return kwargs


def _mimo(config: Mapping[str, Any], depth: int) -> tuple[dict[str, Any], list[bool]]:
    """MiMo-V2-Flash's attention (``TransformerEncoder`` keywords) and which layers are
    mixtures: windowed layers (all but the first and every sixth) with twice the
    key/value heads and attention sinks, queries and keys ``head_dim`` wide and values
    ``v_head_dim`` (times ``attention_value_scale``), q/k/v biases with
    ``attention_bias``, a rotary base and rotated fraction per layer type."""
    types = config.get("layer_types") or [
        "full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention"
        for i in range(depth)]
    if len(types) != depth or not set(types) <= {"full_attention", "sliding_attention"}:
        raise ValueError(f"config['layer_types'] must list 'full_attention' or "
                         f"'sliding_attention' for each of {depth} layers, got {types!r}")
    config = dict(config, layer_types=types, sliding_window=config.get("sliding_window", 129))
    kwargs = _llama_config(dict(config, model_type="llama", attention_bias=False))
    kwargs.update(qkv_bias=bool(config.get("attention_bias", False)), out_bias=False)
    head_dim, kv = kwargs["head_dim"], kwargs["kv_heads"]
    ropes = config.get("rope_parameters") or {}
    scale = config.get("attention_value_scale", 0.707)
    layers = []
    for t in types:
        # transformers rotates 2 * ceil(int(head_dim * factor) / 2) features
        rot = int(head_dim * (ropes.get(t) or {}).get("partial_rotary_factor", 0.334))
        layer = dict(rotary_dim=min(head_dim, rot + rot % 2),
                     v_dim=config.get("v_head_dim", 128),
                     value_scale=None if scale is None else float(scale))
        if t == "sliding_attention":
            layer.update(kv_heads=2 * kv, sinks=True)
        layers.append(layer)
    kwargs["layer_attention"] = layers
    mlp_types = config.get("mlp_layer_types") or ["dense"] + ["sparse"] * (depth - 1)
    if len(mlp_types) != depth or not set(mlp_types) <= {"dense", "sparse"}:
        raise ValueError(f"config['mlp_layer_types'] must list 'dense' or 'sparse' for each "
                         f"of {depth} layers, got {mlp_types!r}")
    return kwargs, [t == "sparse" for t in mlp_types]


def _qkv_sizes(kwargs: Mapping[str, Any], i: int) -> list[int]:
    """Block ``i``'s rows of q, k and v in its joined ``qkv``."""
    layer = (kwargs.get("layer_attention") or [None] * (i + 1))[i] or {}
    hd = kwargs["head_dim"]
    kv = layer.get("kv_heads", kwargs["kv_heads"])
    return [kwargs["heads"] * hd, kv * hd, kv * layer.get("v_dim", hd)]


def routed_moe_from_hf(config: Mapping[str, Any],
                       state_dict: Mapping[str, Tensor] | None = None, **overrides: Any
                       ) -> tuple[TransformerEncoder, dict[str, Tensor] | None,
                                  dict[str, Tensor] | None]:
    """The ``TransformerEncoder`` of a Hugging Face ERNIE 4.5 MoE (``"ernie4_5_moe"``),
    MiniMax-M2 (``"minimax_m2"``), K-EXAONE (``"exaone_moe"``), Arcee Trinity (``"afmoe"``)
    or MiMo-V2-Flash (``"mimo_v2_flash"``) ``config``, and the params
    and router state of its ``state_dict``.

    Both choose their experts by scores plus a learned selection bias
    (``e_score_correction_bias``: router state, ``blocks.i.mlp.router_bias``, as
    DeepSeek-V3's) and weigh them by the unbiased scores, renormalised. ERNIE 4.5 scores by
    softmax, has shared experts and dense layers outside ``moe_layer_start_index`` ..
    ``moe_layer_end_index`` (every ``moe_layer_interval``-th), and ERNIE 4.5's
    interleaved rotary pairs; MiniMax-M2 scores by sigmoid, normalises queries and keys
    over all heads and rotates part of each head (``rotary_dim``); K-EXAONE has EXAONE 4's
    attention (q/k norms per head, windows on three layers of four, no rotary on the
    fourth) in pre-norm blocks and DeepSeek-V3's router (sigmoid scores, expert groups,
    ``routed_scaling_factor``, shared experts); MiMo-V2-Flash (``"mimo_v2_flash"``) has
    V3's router without shared experts behind windowed layers with twice the key/value
    heads and attention sinks, values narrower than the heads and scaled, and a rotated
    fraction per layer type; Arcee Trinity (``"afmoe"``) has norms
    before and after each sublayer, gated attention with q/k norms per head, windows on
    all but every ``global_attn_every_n_layers``-th layer (which has no rotary), and
    sigmoid scores scaled by ``route_scale``. Multi-token-prediction
    tensors are skipped. Tested against ``transformers`` 5 on logits, both caches,
    greedy generation and the round trip.

    Args:
        config: the checkpoint's ``config.json`` as a dict.
        state_dict: its tensors under Hugging Face's names, or None for the module alone.
        overrides: other ``TransformerEncoder`` arguments (``attend``, ``remat``, ...).

    Returns:
        ``(module, params, state)``; ``params`` and ``state`` are None without a
        ``state_dict``.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import routed_moe_from_hf
        >>> config = {"model_type": "minimax_m2", "hidden_size": 16, "num_attention_heads": 2,
        ...           "head_dim": 8, "num_hidden_layers": 1, "intermediate_size": 12,
        ...           "vocab_size": 10, "num_local_experts": 4, "num_experts_per_tok": 2}
        >>> module, _, _ = routed_moe_from_hf(config)
        >>> model = torchfn.Model(module)
        >>> sorted(model.init_state())
        ['blocks.0.mlp.router_bias']
    """
    kwargs = _config(config)
    kwargs.update(overrides)
    check_state_dict(state_dict)
    module = TransformerEncoder(**kwargs)
    if state_dict is None:
        return module, None, None
    kind = config["model_type"]
    names, router, bias, expert_name, stacked = _NAMES[kind]
    names = _COMMON | names
    params: dict[str, Tensor] = {}
    state: dict[str, Tensor] = {}
    pieces: dict[str, dict[Any, Tensor]] = {}  # our joined or stacked name -> its parts

    def read_layer(i: str, rest: str, tensor: Tensor) -> bool:
        at, expert = f"blocks.{i}.", expert_name.fullmatch(rest)
        if rest in names:
            params[at + names[rest]] = tensor
        elif rest == router:
            params[at + "mlp.router.weight"] = tensor
        elif rest == bias:
            state[at + "mlp.router_bias"] = tensor.reshape(-1)  # ERNIE's is (1, E)
        elif rest in _QKV:
            pieces.setdefault(at + _QKV[rest], {})[rest[10]] = tensor
        elif expert:
            pieces.setdefault(f"{at}mlp.{stacked[expert[2]]}", {})[int(expert[1])] = tensor
        else:
            return False
        return True

    read_state(state_dict.items(), kind, params, globals_=GLOBAL_NAMES,
               tied=kwargs["tie_embeddings"], read_layer=read_layer, ignore=_SKIPPED.fullmatch)
    join_pieces(params, pieces, kwargs["experts"])
    check_fit(param_shapes(module), params, "state_dict (params)")
    check_fit({n: tuple(b.shape) for n, b in module.named_buffers()
               if n.endswith("router_bias")}, state, "state_dict (state)")
    return module, params, state


def routed_moe_to_hf(config: Mapping[str, Any], params: Mapping[str, Tensor],
                     state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``params`` and router ``state`` of the model ``routed_moe_from_hf(config)`` builds,
    under a Hugging Face checkpoint's names: q, k and v apart, the experts one matrix
    each (copies), the selection bias back in its place and shape. The inverse of
    :func:`routed_moe_from_hf`, bit for bit.

    Example::

        >>> import torchfn
        >>> from torchfn.models import routed_moe_from_hf, routed_moe_to_hf
        >>> config = {"model_type": "minimax_m2", "hidden_size": 16, "num_attention_heads": 2,
        ...           "head_dim": 8, "num_hidden_layers": 1, "intermediate_size": 12,
        ...           "vocab_size": 10, "num_local_experts": 4, "num_experts_per_tok": 2}
        >>> model = torchfn.Model(routed_moe_from_hf(config)[0])
        >>> sd = routed_moe_to_hf(config, model.init(torchfn.random.key(0)), model.init_state())
        >>> sd["model.layers.0.block_sparse_moe.experts.3.w2.weight"].shape
        torch.Size([16, 12])
    """
    kwargs = _config(config)
    kind = config["model_type"]
    names, router, bias, _, stacked = _NAMES[kind]
    back = {ours: hf for hf, ours in (_COMMON | names).items()}
    hf_expert = {ours: hf for hf, ours in stacked.items()}
    hf_global = {ours: hf for hf, ours in GLOBAL_NAMES.items()}
    out: dict[str, Tensor] = {}
    for name, t in {**params, **state}.items():
        if name in hf_global:
            out[hf_global[name]] = t
            continue
        i, rest = name.split(".", 2)[1:]
        at = f"model.layers.{i}."
        if rest == "mlp.router.weight":
            out[at + router] = t
        elif rest == "mlp.router_bias":
            out[at + bias] = t.reshape(1, -1) if kind == "ernie4_5_moe" else t
        elif rest in ("attn.qkv.weight", "attn.qkv.bias"):
            for p, part in zip("qkv", t.split(_qkv_sizes(kwargs, int(i)))):
                out[f"{at}self_attn.{p}_proj.{rest.rsplit('.', 1)[1]}"] = part.clone()
        elif rest in ("mlp.gate", "mlp.up", "mlp.down"):  # stacked experts (E, ...)
            hf = hf_expert[rest[4:]]
            for j, part in enumerate(t.unbind(0)):
                out[at + _expert(kind, j, hf)] = part.clone()
        else:
            out[at + back[rest]] = t
    return out


def _expert(kind: str, j: int, which: str) -> str:
    """Expert ``j``'s matrix ``which`` (HF's ``gate`` / ``w1`` ...) under its layer."""
    if kind == "minimax_m2":
        return f"block_sparse_moe.experts.{j}.{which}.weight"
    return f"mlp.experts.{j}.{which}_proj.weight"
