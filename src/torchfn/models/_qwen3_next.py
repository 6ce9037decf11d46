"""A Hugging Face Qwen3-Next or Qwen3.5 (text) checkpoint as a ``TransformerEncoder`` and
its params, and back: hybrid stacks of Gated DeltaNet and gated attention."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from torchfn.models._fit import (
    check_fit,
    check_known,
    check_params_for,
    check_state_dict,
    join_qkv,
    param_shapes,
    read_state,
    stack_experts,
)
from torchfn.models._llama import GLOBAL_NAMES, _ropes, partial_rotary
from torchfn.models._transformer import TransformerEncoder

__all__ = ["qwen3_next_from_hf", "qwen3_next_to_hf"]

_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
_MULTIMODAL = ("qwen3_5", "qwen3_5_moe")  # a text_config, and the text model's tensors
_LANGUAGE, _VISION = "model.language_model.", "model.visual."  # under these names
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_COMMON = {  # a layer's HF names -> ours, but the fused and stacked ones
    "input_layernorm.weight": "ln1.weight",
    "post_attention_layernorm.weight": "ln2.weight",
    **{f"mlp.{p}_proj.weight": f"mlp.{p}.weight" for p in ("gate", "up", "down")},
    "mlp.gate.weight": "mlp.router.weight",
    **{f"mlp.shared_expert.{p}_proj.weight": f"mlp.shared.{p}.weight"
       for p in ("gate", "up", "down")},
    "mlp.shared_expert_gate.weight": "mlp.gate_shared.weight",
}
_SELF_ATTN = {  # an attention layer's (q_proj: its query and gate rows, below)
    **{f"self_attn.{p}_proj.{kind}": f"attn.{p}_proj.{kind}" for p in "kv"
       for kind in ("weight", "bias")},  # joined into attn.qkv below
    "self_attn.o_proj.weight": "attn.out.weight",
    "self_attn.o_proj.bias": "attn.out.bias",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
}
_LINEAR_ATTN = {  # a Gated DeltaNet layer's (Qwen3-Next's fused projections: below)
    "linear_attn.conv1d.weight": "attn.conv.weight",
    "linear_attn.dt_bias": "attn.dt_bias",
    "linear_attn.A_log": "attn.A_log",
    "linear_attn.norm.weight": "attn.norm.weight",
    "linear_attn.out_proj.weight": "attn.out.weight",
    "linear_attn.in_proj_qkv.weight": "attn.qkv.weight",  # Qwen3.5: one matrix each
    "linear_attn.in_proj_z.weight": "attn.gate.weight",
    "linear_attn.in_proj_b.weight": "attn.beta.weight",
    "linear_attn.in_proj_a.weight": "attn.dt.weight",
}
_NAMES = _COMMON | _SELF_ATTN | _LINEAR_ATTN  # the HF names are distinct
_MTP = {"mtp.fc.weight": "mtp.0.proj.weight",  # the multi-token-prediction layer's own
        "mtp.pre_fc_norm_embedding.weight": "mtp.0.enorm.weight",
        "mtp.pre_fc_norm_hidden.weight": "mtp.0.hnorm.weight",
        "mtp.norm.weight": "mtp.0.norm.weight"}
_MTP_LAYER = "mtp.layers.0."  # its block: a gated-attention layer
_HF_NAMES = {linear: {ours: hf for hf, ours in (_COMMON | (_LINEAR_ATTN if linear else
                                                           _SELF_ATTN)).items()}
             for linear in (False, True)}  # ours -> HF, for each kind of layer
_HF_GLOBAL = {ours: hf for hf, ours in GLOBAL_NAMES.items()}


def _text(config: Any) -> Mapping[str, Any]:
    """The text model's config: ``config`` itself, or a multimodal Qwen3.5's
    ``text_config`` (with the outer ``tie_word_embeddings``, which transformers follows)."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict (a config.json), got {type(config).__name__}")
    kind = config.get("model_type")
    if kind in _MULTIMODAL:
        text = config.get("text_config")
        if not isinstance(text, Mapping):
            raise ValueError(f"config['text_config'] must be a dict (the text model's "
                             f"config), got {text!r}")
        text = dict(text, model_type=text.get("model_type", f"{kind}_text"))
        if "tie_word_embeddings" in config:
            text["tie_word_embeddings"] = config["tie_word_embeddings"]
        config, kind = text, text["model_type"]
    if kind not in _TYPES:
        raise ValueError(f"config['model_type'] must be one of {_TYPES + _MULTIMODAL}, got "
                         f"{kind!r}")
    return config


def _config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``TransformerEncoder``'s keywords for a Qwen3-Next / Qwen3.5 (text) config."""
    config = _text(config)
    kind = config["model_type"]
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                           "intermediate_size", "vocab_size", "linear_num_value_heads",
                           "linear_num_key_heads", "linear_key_head_dim",
                           "linear_value_head_dim") if k not in config]
    if missing:
        raise ValueError(f"config lacks {missing}: not a {kind} config")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config['hidden_act'] = {config['hidden_act']!r} is not supported "
                         "here (needs 'silu')")
    dim, heads, depth = config["hidden_size"], config["num_attention_heads"], \
        config["num_hidden_layers"]
    head_dim = config.get("head_dim") or dim // heads
    every = config.get("full_attention_interval", 4)
    types = list(config.get("layer_types") or [
        "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(depth)])
    if len(types) != depth or not set(types) <= {"linear_attention", "full_attention"}:
        raise ValueError(f"config['layer_types'] must list 'linear_attention' or "
                         f"'full_attention' for each of {depth} layers, got {types!r}")
    bias = bool(config.get("attention_bias", False))
    partial = partial_rotary(config)
    kwargs: dict[str, Any] = dict(
        dim=dim, heads=heads, depth=depth, vocab_size=config["vocab_size"],
        out_dim=config["vocab_size"], causal=True, head_dim=head_dim,
        kv_heads=config.get("num_key_value_heads") or heads, position_embedding="rotary",
        rotary_dim=None if partial == 1 else int(head_dim * partial), norm="rms+1",
        mlp="swiglu", bias=False, qkv_bias=bias, out_bias=bias, qk_norm=True, attn_gate=True,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)), mlp_hidden=config["intermediate_size"],
        max_len=config.get("max_position_embeddings", 32768),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        linear_attention=dict(heads=config["linear_num_value_heads"],
                              key_heads=config["linear_num_key_heads"],
                              key_dim=config["linear_key_head_dim"],
                              value_dim=config["linear_value_head_dim"],
                              conv_kernel=config.get("linear_conv_kernel_dim", 4)),
        layer_linear=[t == "linear_attention" for t in types],
    ) | _ropes(config, ["full_attention"] * depth)
    experts = config.get("num_experts") or 0
    if kind != "qwen3_5_text" and experts:
        step, dense = config.get("decoder_sparse_step") or 1, config.get("mlp_only_layers") or []
        sparse = [i not in dense and (i + 1) % step == 0 for i in range(depth)]
        if any(sparse):
            kwargs.update(
                experts=experts, top_k=config.get("num_experts_per_tok", 10),
                expert_hidden=config.get("moe_intermediate_size", config["intermediate_size"]),
                layer_experts=sparse, moe_options=dict(
                    normalize=bool(config.get("norm_topk_prob", True)) if kind == "qwen3_next"
                    else True, shared_hidden=config.get("shared_expert_intermediate_size"),
                    shared_gate=True))
    return kwargs


def _grouped(config: Mapping[str, Any]) -> tuple[int, int, int, int]:
    """Qwen3-Next's grouping of its linear-attention projections: key heads, value heads
    per key head, key dim, value dim."""
    hk, hv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    return hk, hv // hk, config["linear_key_head_dim"], config["linear_value_head_dim"]


def _ungroup(config: Mapping[str, Any], qkvz: Tensor | None, ba: Tensor | None
             ) -> dict[str, Tensor]:
    """Qwen3-Next's ``in_proj_qkvz`` (per key head ``[q | k | v | z]``) and ``in_proj_ba``
    (per key head ``[b | a]``) as ours: ``qkv`` ``[q | k | v]`` over all heads, ``gate``,
    ``beta`` and ``dt``, rows in value-head order."""
    hk, r, dk, dv = _grouped(config)
    out = {}
    if qkvz is not None:
        q, k, v, z = qkvz.unflatten(0, (hk, -1)).split([dk, dk, r * dv, r * dv], 1)
        out["attn.qkv.weight"] = torch.cat([x.flatten(0, 1) for x in (q, k, v)])
        out["attn.gate.weight"] = z.flatten(0, 1)
    if ba is not None:
        b, a = ba.unflatten(0, (hk, -1)).split([r, r], 1)
        out["attn.beta.weight"], out["attn.dt.weight"] = b.flatten(0, 1), a.flatten(0, 1)
    return out


def _regroup(config: Mapping[str, Any], p: Mapping[str, Tensor], at: str) -> dict[str, Tensor]:
    """The inverse of :func:`_ungroup` for block ``at``'s params."""
    hk, r, dk, dv = _grouped(config)
    q, k, v = p[at + "attn.qkv.weight"].split([hk * dk, hk * dk, hk * r * dv])
    parts = [x.unflatten(0, (hk, -1)) for x in (q, k, v, p[at + "attn.gate.weight"])]
    ba = [p[at + n].unflatten(0, (hk, r)) for n in ("attn.beta.weight", "attn.dt.weight")]
    return {"linear_attn.in_proj_qkvz.weight": torch.cat(parts, 1).flatten(0, 1),
            "linear_attn.in_proj_ba.weight": torch.cat(ba, 1).flatten(0, 1)}


def qwen3_next_from_hf(config: Mapping[str, Any], state_dict: Mapping[str, Tensor] | None = None,
                       **overrides: Any) -> tuple[TransformerEncoder, dict[str, Tensor] | None]:
    """The ``TransformerEncoder`` of a Hugging Face Qwen3-Next (``"qwen3_next"``) or
    Qwen3.5 text (``"qwen3_5_text"``, ``"qwen3_5_moe_text"``) ``config``, and the params of
    its ``state_dict`` under the encoder's names. A multimodal Qwen3.5 checkpoint
    (``"qwen3_5"``, ``"qwen3_5_moe"``, as the Hub has them) gives its text model: the
    ``text_config`` is read, ``model.language_model.*`` are the text model's tensors, and
    the vision tower's (``model.visual.*``) are skipped.

    Three layers of four (``layer_types``) mix tokens with :class:`GatedDeltaNet` (linear
    attention with a fixed-size state: ``linear_attention``, ``layer_linear``); the
    fourth has grouped-query attention whose output is gated (``attn_gate``), with
    zero-centred q/k norms and a quarter of each head rotated (``partial_rotary_factor``).
    Every norm scales by ``1 + weight`` (``norm="rms+1"``). The MoE variants have a
    softmax top-k mixture with a sigmoid-gated shared expert. Qwen3-Next's fused,
    per-key-head ``in_proj_qkvz`` / ``in_proj_ba`` are regrouped into Qwen3.5's layout
    (``qkv``, ``gate``, ``beta``, ``dt``); ``q_proj``'s interleaved query and gate rows
    become ``qkv`` and ``gate``. Tested against ``transformers`` 5 on logits, both
    caches, greedy generation and the round trip.

    The checkpoints' multi-token-prediction layer (``mtp.*``: ``fc`` over ``[norm(embedding)
    | norm(state)]``, a gated-attention layer, a norm; transformers does not read it) is
    skipped, or with ``mtp=1`` read as the model's :class:`MultiTokenPrediction` depth
    (``mtp.0.*``), for ``return_mtp`` and :func:`losses.multi_token_prediction`.

    Args:
        config: the checkpoint's ``config.json`` as a dict.
        state_dict: its tensors under Hugging Face's names, or None for the module alone.
        overrides: other ``TransformerEncoder`` arguments (``attend``, ``remat``, ...).

    Returns:
        ``(module, params)``; ``params`` is None without a ``state_dict``.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import qwen3_next_from_hf
        >>> config = {"model_type": "qwen3_5_text", "hidden_size": 16, "num_attention_heads": 2,
        ...           "num_key_value_heads": 1, "head_dim": 8, "num_hidden_layers": 4,
        ...           "intermediate_size": 24, "vocab_size": 10, "linear_num_value_heads": 2,
        ...           "linear_num_key_heads": 1, "linear_key_head_dim": 8,
        ...           "linear_value_head_dim": 8}
        >>> module, _ = qwen3_next_from_hf(config)
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
    params: dict[str, Tensor] = {}
    experts: dict[str, dict[int, Tensor]] = {}
    grouped: dict[str, dict[str, Tensor]] = {}
    heads, hd = kwargs["heads"], kwargs["head_dim"]

    mtp = kwargs.get("mtp", 0)
    if mtp not in (0, 1):
        raise ValueError(f"mtp must be 0 or 1 (the checkpoints' one multi-token-prediction "
                         f"layer), got {mtp!r}")

    def read_layer(i: str, rest: str, tensor: Tensor) -> bool:
        return read_block(f"blocks.{i}.", rest, tensor)

    def read_mtp(name: str, tensor: Tensor) -> bool:
        """An MTP layer's tensor read (``mtp=1``) or skipped (``mtp=0``): False for a name
        it does not know."""
        if not mtp:
            return True
        if name in _MTP:
            params[_MTP[name]] = tensor
            return True
        return name.startswith(_MTP_LAYER) and read_block(
            "mtp.0.block.", name.removeprefix(_MTP_LAYER), tensor)

    def read_block(at: str, rest: str, tensor: Tensor) -> bool:
        expert = _EXPERT.fullmatch(rest)
        if rest in _NAMES:
            params[at + _NAMES[rest]] = tensor
        elif rest in ("self_attn.q_proj.weight", "self_attn.q_proj.bias"):
            q, gate = tensor.unflatten(0, (heads, 2, hd)).unbind(1)  # per head [query | gate]
            kind = rest.rsplit(".", 1)[1]
            params[f"{at}attn.q_proj.{kind}"] = q.flatten(0, 1)
            params[f"{at}attn.gate.{kind}"] = gate.flatten(0, 1)
        elif rest in ("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight"):
            grouped.setdefault(at, {})[rest] = tensor
        elif expert:  # expert j's matrix -> row j of the stacked one
            experts.setdefault(f"{at}mlp.{expert[2]}", {})[int(expert[1])] = tensor
        else:
            return False
        return True

    tensors: Iterable[tuple[str, Tensor]] = state_dict.items()
    if config.get("model_type") in _MULTIMODAL:  # the vision tower and its merger: not read
        tensors = (("model." + name.removeprefix(_LANGUAGE) if name.startswith(_LANGUAGE)
                    else name, t) for name, t in tensors if not name.startswith(_VISION))
    family = _text(config)["model_type"]
    tensors = list(tensors)
    check_known([n for n, t in tensors if n.startswith("mtp.") and not read_mtp(n, t)], family)
    read_state(((n, t) for n, t in tensors if not n.startswith("mtp.")), family, params,
               globals_=GLOBAL_NAMES, tied=kwargs["tie_embeddings"], read_layer=read_layer)
    for at, pair in grouped.items():
        params.update({at + n: t for n, t in _ungroup(
            _text(config), pair.get("linear_attn.in_proj_qkvz.weight"),
            pair.get("linear_attn.in_proj_ba.weight")).items()})
    stack_experts(params, experts, kwargs.get("experts"))
    join_qkv(params)
    check_fit(param_shapes(module), params, "state_dict")
    return module, params


def qwen3_next_to_hf(config: Mapping[str, Any], params: Mapping[str, Tensor]
                     ) -> dict[str, Tensor]:
    """``params`` of the model ``qwen3_next_from_hf(config)`` builds, under a Hugging Face
    checkpoint's names and layout: Qwen3-Next's linear-attention projections grouped per
    key head again, ``q_proj``'s query and gate rows interleaved per head, experts one
    matrix each (copies where they are rearranged); a multi-token-prediction depth
    (``mtp.0.*``) as the checkpoint's ``mtp.*``. The inverse of :func:`qwen3_next_from_hf`,
    bit for bit.

    Example::

        >>> import torchfn
        >>> from torchfn.models import qwen3_next_from_hf, qwen3_next_to_hf
        >>> config = {"model_type": "qwen3_next", "hidden_size": 16, "num_attention_heads": 2,
        ...           "num_key_value_heads": 1, "head_dim": 8, "num_hidden_layers": 4,
        ...           "intermediate_size": 24, "vocab_size": 10, "num_experts": 0,
        ...           "linear_num_value_heads": 2, "linear_num_key_heads": 1,
        ...           "linear_key_head_dim": 8, "linear_value_head_dim": 8}
        >>> params = torchfn.Model(qwen3_next_from_hf(config)[0]).init(torchfn.random.key(0))
        >>> qwen3_next_to_hf(config, params)["model.layers.0.linear_attn.in_proj_qkvz.weight"].shape
        torch.Size([48, 16])
    """
    if isinstance(config, Mapping) and config.get("model_type") in _MULTIMODAL:
        raise ValueError(f"qwen3_next_to_hf: config is a multimodal Qwen3.5's (model_type "
                         f"{config['model_type']!r}), whose checkpoint needs the vision tower; "
                         f"pass config['text_config'] with model_type "
                         f"'{config['model_type']}_text'")
    kwargs = _config(config)
    if isinstance(params, Mapping) and any(n.startswith("mtp.") for n in params):
        kwargs["mtp"] = 1  # the multi-token-prediction layer, written back as mtp.*
    check_params_for(TransformerEncoder, kwargs, params)
    heads, hd, kv = kwargs["heads"], kwargs["head_dim"], kwargs["kv_heads"] * kwargs["head_dim"]
    next_ = config["model_type"] == "qwen3_next"
    mtp_names = {ours: hf for hf, ours in _MTP.items()}
    out: dict[str, Tensor] = {}
    for name, t in params.items():
        if name in _HF_GLOBAL or name in mtp_names:
            out[_HF_GLOBAL.get(name) or mtp_names[name]] = t
            continue
        if name.startswith("mtp.0.block."):  # the MTP layer's block: a gated-attention layer
            rest, linear = name.removeprefix("mtp.0.block."), False
            at, block = _MTP_LAYER, "mtp.0.block."
        else:
            i, rest = name.split(".", 2)[1:]
            at, block = f"model.layers.{i}.", f"blocks.{i}."
            linear = kwargs["layer_linear"][int(i)]
        if linear and next_ and rest in ("attn.qkv.weight", "attn.gate.weight",
                                         "attn.beta.weight", "attn.dt.weight"):
            if rest == "attn.qkv.weight":
                out.update({at + n: x for n, x in _regroup(config, params, block).items()})
        elif not linear and rest in ("attn.qkv.weight", "attn.qkv.bias"):
            kind = rest.rsplit(".", 1)[1]
            q, k, v = t.split([heads * hd, kv, kv])
            gate = params[f"{block}attn.gate.{kind}"]
            out[f"{at}self_attn.q_proj.{kind}"] = torch.stack(
                (q.unflatten(0, (heads, hd)), gate.unflatten(0, (heads, hd))), 1).flatten(0, 2)
            out[f"{at}self_attn.k_proj.{kind}"] = k.clone()
            out[f"{at}self_attn.v_proj.{kind}"] = v.clone()
        elif not linear and rest in ("attn.gate.weight", "attn.gate.bias"):
            pass  # in q_proj
        elif rest in ("mlp.gate", "mlp.up", "mlp.down"):  # stacked experts (E, ...)
            for j, part in enumerate(t.unbind(0)):
                out[f"{at}mlp.experts.{j}.{rest[4:]}_proj.weight"] = part.clone()
        else:
            out[at + _HF_NAMES[linear][rest]] = t
    return out
