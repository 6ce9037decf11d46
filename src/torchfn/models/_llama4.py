"""A Hugging Face Llama 4 checkpoint (Scout, Maverick: their text model) as a
``TransformerEncoder`` and its params, and back."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from torchfn.models._fit import (
    check_fit,
    check_params_for,
    check_state_dict,
    join_pieces,
    param_shapes,
    read_state,
)
from torchfn.models._llama import GLOBAL_NAMES, _ropes
from torchfn.models._transformer import TransformerEncoder

__all__ = ["llama4_from_hf", "llama4_to_hf"]

_TYPES = ("llama4_text", "llama4")
_VISION = ("vision_model.", "multi_modal_projector.")  # the multimodal checkpoint's other parts
_NAMES = {  # a layer's HF names -> ours, but q/k/v (one qkv matrix) and the fused experts
    "input_layernorm.weight": "ln1.weight",
    "post_attention_layernorm.weight": "ln2.weight",
    "self_attn.o_proj.weight": "attn.out.weight",
    "self_attn.o_proj.bias": "attn.out.bias",
    "feed_forward.router.weight": "mlp.router.weight",
    **{f"feed_forward.{p}_proj.weight": f"mlp.{p}.weight" for p in ("gate", "up", "down")},
    **{f"feed_forward.shared_expert.{p}_proj.weight": f"mlp.shared.{p}.weight"
       for p in ("gate", "up", "down")},
}
_QKV = {f"self_attn.{p}_proj.{kind}": f"attn.qkv.{kind}" for kind in ("weight", "bias")
        for p in "qkv"}
_GATE_UP, _DOWN = "feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"
_HF_NAMES = {ours: hf for hf, ours in _NAMES.items()}
_HF_GLOBAL = {ours: hf for hf, ours in GLOBAL_NAMES.items()}


def _text(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text model's config: ``config`` itself (``"llama4_text"``) or its
    ``text_config`` (``"llama4"``, the multimodal checkpoint's)."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict (a Llama 4 config.json), got "
                        f"{type(config).__name__}")
    kind = config.get("model_type")
    if kind not in _TYPES:
        raise ValueError(f"config['model_type'] must be one of {_TYPES}, got {kind!r}")
    if kind == "llama4":
        text = config.get("text_config")
        if not isinstance(text, Mapping):
            raise ValueError(f"config['text_config'] must be a dict (the text model's "
                             f"config), got {text!r}")
        return text
    return config


def _config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``TransformerEncoder``'s keywords for a Llama 4 text config (transformers'
    ``Llama4TextConfig`` defaults where a key is missing)."""
    text = _text(config)
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                           "intermediate_size", "vocab_size") if k not in text]
    if missing:
        raise ValueError(f"config lacks {missing}: not a Llama 4 config")
    if text.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config['hidden_act'] = {text['hidden_act']!r} is not supported "
                         "here (needs 'silu')")
    dim, heads, depth = text["hidden_size"], text["num_attention_heads"], \
        text["num_hidden_layers"]
    head_dim = text.get("head_dim") or dim // heads
    every = text.get("no_rope_layer_interval", 4)
    rope = list(text.get("no_rope_layers") or  # 1: a rotary layer; 0: NoPE
                [int((i + 1) % every != 0) for i in range(depth)])
    chunk = text.get("attention_chunk_size", 8192)
    types = list(text.get("layer_types") or [
        "chunked_attention" if r and chunk is not None else "full_attention" for r in rope])
    if len(rope) != depth or len(types) != depth \
            or not set(types) <= {"chunked_attention", "full_attention"}:
        raise ValueError(f"config['no_rope_layers'] and config['layer_types'] must have one "
                         f"entry per layer ({depth}), the latter 'chunked_attention' or "
                         f"'full_attention'; got {rope!r} and {types!r}")
    if "chunked_attention" in types and chunk is None:
        raise ValueError("config['layer_types'] has chunked layers but no "
                         "attention_chunk_size")
    step = text.get("interleave_moe_layer_step", 1)
    moe_layers = text.get("moe_layers")
    moe_layers = set(range(step - 1, depth, step) if moe_layers is None else moe_layers)
    temperature = (float(text.get("floor_scale", 8192)), float(text.get("attn_scale", 0.1)))
    layer_attention = []
    for r, t in zip(rope, types):
        options: dict[str, Any] = {}
        if t == "chunked_attention":
            options["chunk"] = int(chunk)
        if r and text.get("use_qk_norm", True):  # after the rotation in transformers: the
            options["qk_norm"] = "rms_plain"  # same, as a rotation keeps the RMS
        if not r and text.get("attn_temperature_tuning", True):
            options["temperature"] = temperature
        layer_attention.append(options or None)
    bias = bool(text.get("attention_bias", False))
    sparse = [i in moe_layers for i in range(depth)]
    kwargs: dict[str, Any] = dict(
        dim=dim, heads=heads, depth=depth, vocab_size=text["vocab_size"],
        out_dim=text["vocab_size"], causal=True, head_dim=head_dim,
        kv_heads=text.get("num_key_value_heads") or heads, position_embedding="rotary",
        rotary_interleaved=True, norm="rms", mlp="swiglu", bias=False, qkv_bias=bias,
        out_bias=bias, norm_eps=float(text.get("rms_norm_eps", 1e-5)),
        mlp_hidden=text.get("intermediate_size_mlp", 16384),
        max_len=text.get("max_position_embeddings", 131072),
        tie_embeddings=bool(text.get("tie_word_embeddings", False)),
        layer_attention=layer_attention,
    ) | _ropes(dict(text, no_rope_layers=rope), ["full_attention"] * depth)
    if any(sparse):
        kwargs.update(
            experts=text.get("num_local_experts", 16), top_k=text.get("num_experts_per_tok", 1),
            expert_hidden=text["intermediate_size"], layer_experts=sparse,
            moe_options=dict(scoring="sigmoid", normalize=False, weights_on="input",
                             shared_hidden=text["intermediate_size"]))
    return kwargs


def llama4_from_hf(config: Mapping[str, Any], state_dict: Mapping[str, Tensor] | None = None,
                   **overrides: Any) -> tuple[TransformerEncoder, dict[str, Tensor] | None]:
    """The ``TransformerEncoder`` of a Hugging Face Llama 4 ``config`` (``model_type``
    ``"llama4_text"``, or ``"llama4"``: the multimodal checkpoint's, whose
    ``text_config`` is read and whose vision tower is skipped), and the params of its
    ``state_dict`` under the encoder's names.

    Llama 4 differs from Llama 3 in four ways, each an option here:

    - Three layers of four (``no_rope_layers``) rotate queries and keys (interleaved
      pairs, ``rotary_interleaved``), attend within chunks of ``attention_chunk_size``
      tokens (``layer_attention``'s ``chunk``: O(N x chunk) work) and normalise queries
      and keys by their RMS without a weight (``qk_norm="rms_plain"``).
    - The fourth has no position embedding (NoPE) and full causal attention, its queries
      scaled by ``1 + attn_scale * log1p(floor((p + 1) / floor_scale))`` (``temperature``).
    - The feed-forward of the ``moe_layers`` (every ``interleave_moe_layer_step``-th) is a
      :class:`MoE` of ``num_local_experts`` SwiGLU experts of ``intermediate_size``:
      sigmoid scores, ``num_experts_per_tok`` (1) chosen, the score scaling the expert's
      *input* (``weights_on="input"``), plus a shared expert. The other layers have a
      dense SwiGLU of ``intermediate_size_mlp``.
    - The experts come fused: ``gate_up_proj`` ``(E, dim, 2 hidden)``, ``down_proj``
      ``(E, hidden, dim)``; they are split and transposed as views, not copied.

    Positions count each row's real tokens (left padding excluded), for the chunks as in
    transformers; the temperature follows them too, where transformers counts cache
    slots (the two differ only for left-padded rows, and only past ``floor_scale`` tokens).
    Tested against ``transformers`` 5 on logits, cached and static-cache decoding and the
    round trip.

    Args:
        config: the checkpoint's ``config.json`` as a dict.
        state_dict: its tensors under Hugging Face's names (``model.layers.0.self_attn.
            q_proj.weight``, or ``language_model.model.layers...`` in a multimodal
            checkpoint), or None for the module alone.
        overrides: other ``TransformerEncoder`` arguments (``attend``, ``remat``, ...).

    Returns:
        ``(module, params)``; ``params`` is None without a ``state_dict``.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import llama4_from_hf
        >>> config = {"model_type": "llama4_text", "hidden_size": 16, "num_attention_heads": 4,
        ...           "num_key_value_heads": 2, "head_dim": 4, "num_hidden_layers": 4,
        ...           "intermediate_size": 8, "intermediate_size_mlp": 24, "vocab_size": 10,
        ...           "num_local_experts": 4, "interleave_moe_layer_step": 2,
        ...           "attention_chunk_size": 8}
        >>> module, _ = llama4_from_hf(config)
        >>> [b.attn.chunk for b in module.blocks], [b.moe for b in module.blocks]
        ([8, 8, 8, None], [False, True, False, True])
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
    qkv: dict[str, dict[str, Tensor]] = {}

    def read_layer(i: str, rest: str, tensor: Tensor) -> bool:
        at = f"blocks.{i}."
        if rest in _NAMES:
            params[at + _NAMES[rest]] = tensor
        elif rest in _QKV:  # q, k, v: joined below
            qkv.setdefault(at + _QKV[rest], {})[rest[10]] = tensor
        elif rest == _GATE_UP:  # (E, dim, 2 hidden): [gate | up] columns
            gate, up = tensor.chunk(2, dim=-1)
            params[at + "mlp.gate"], params[at + "mlp.up"] = gate.transpose(1, 2), \
                up.transpose(1, 2)  # (E, hidden, dim) each
        elif rest == _DOWN:  # (E, hidden, dim) -> (E, dim, hidden)
            params[at + "mlp.down"] = tensor.transpose(1, 2)
        else:
            return False
        return True

    tensors: Iterable[tuple[str, Tensor]] = state_dict.items()
    if config.get("model_type") == "llama4":  # the vision tower and its projector: not read
        tensors = ((name.removeprefix("language_model."), t) for name, t in tensors
                   if not name.startswith(_VISION))
    read_state(tensors, "Llama 4", params, globals_=GLOBAL_NAMES,
               tied=kwargs["tie_embeddings"], read_layer=read_layer)
    join_pieces(params, qkv)
    check_fit(param_shapes(module), params, "state_dict")
    return module, params


def llama4_to_hf(config: Mapping[str, Any], params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``params`` of the model ``llama4_from_hf(config)`` builds, under the names and
    shapes of a Hugging Face ``Llama4ForCausalLM`` checkpoint: q, k and v apart, the
    experts fused again into ``gate_up_proj`` / ``down_proj`` (copies), a tied head left
    out. The inverse of :func:`llama4_from_hf`, bit for bit. A multimodal config
    (``"llama4"``) is refused: its checkpoint needs the vision tower, which is not here;
    pass its ``text_config``.

    Example::

        >>> import torchfn
        >>> from torchfn.models import llama4_from_hf, llama4_to_hf
        >>> config = {"model_type": "llama4_text", "hidden_size": 16, "num_attention_heads": 4,
        ...           "head_dim": 4, "num_hidden_layers": 1, "intermediate_size": 8,
        ...           "vocab_size": 10, "num_local_experts": 4}
        >>> params = torchfn.Model(llama4_from_hf(config)[0]).init(torchfn.random.key(0))
        >>> llama4_to_hf(config, params)["model.layers.0.feed_forward.experts.gate_up_proj"].shape
        torch.Size([4, 16, 16])
    """
    if isinstance(config, Mapping) and config.get("model_type") == "llama4":
        raise ValueError("llama4_to_hf: config is a multimodal Llama 4's (model_type "
                         "'llama4'), whose checkpoint needs the vision tower; pass "
                         "config['text_config'] with model_type 'llama4_text'")
    kwargs = _config(config)
    check_params_for(TransformerEncoder, kwargs, params)
    sizes = [kwargs["heads"] * kwargs["head_dim"]] + [kwargs["kv_heads"] * kwargs["head_dim"]] * 2
    out: dict[str, Tensor] = {}
    for name, t in params.items():
        if name in _HF_GLOBAL:
            out[_HF_GLOBAL[name]] = t
            continue
        i, rest = name.split(".", 2)[1:]
        at = f"model.layers.{i}."
        if rest in ("attn.qkv.weight", "attn.qkv.bias"):
            for p, part in zip("qkv", t.split(sizes)):
                out[f"{at}self_attn.{p}_proj.{rest.rsplit('.', 1)[1]}"] = part.clone()
        elif rest == "mlp.gate":  # with mlp.up: (E, dim, 2 hidden)
            up = params[f"blocks.{i}.mlp.up"]
            out[at + _GATE_UP] = torch.cat((t.transpose(1, 2), up.transpose(1, 2)), -1)
        elif rest == "mlp.down":
            out[at + _DOWN] = t.transpose(1, 2).contiguous()
        elif rest != "mlp.up":
            out[at + _HF_NAMES[rest]] = t
    return out
