"""A Hugging Face Ling 3 hybrid checkpoint (``bailing_hybrid``) as a ``TransformerEncoder``,
its params and its router state, and back: Kimi Delta Attention with full-rank gates and a
bounded decay in most blocks, latent attention with a gate per head in the others,
DeepSeek-V3's mixture of experts."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from torchfn.models._deepseek import _check, _rotary_rows
from torchfn.models._fit import check_state_dict, join_pieces, read_state, stack_experts
from torchfn.models._kimi_linear import _get, v3_mixture
from torchfn.models._llama import _ropes
from torchfn.models._rotary_scaling import yarn_mscale
from torchfn.models._transformer import TransformerEncoder

__all__ = ["bailing_hybrid_from_hf", "bailing_hybrid_to_hf"]

_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_GLOBAL = {"model.word_embeddings.weight": "embed.weight", "model.norm.weight": "ln.weight",
           "lm_head.weight": "head.weight"}
_COMMON = {  # every layer's: norms, a dense MLP or the mixture's router and shared expert
    "input_layernorm.weight": "ln1.weight",
    "post_attention_layernorm.weight": "ln2.weight",
    "attention.dense.weight": "attn.out.weight",
    **{f"mlp.{p}_proj.weight": f"mlp.{p}.weight" for p in ("gate", "up", "down")},
    **{f"mlp.shared_experts.{p}_proj.weight": f"mlp.shared.{p}.weight"
       for p in ("gate", "up", "down")},
    "mlp.gate.weight": "mlp.router.weight",
}
_MLA = {  # a latent-attention layer's
    "attention.q_proj.weight": "attn.q.weight",
    "attention.q_a_proj.weight": "attn.q_a.weight",
    "attention.q_a_layernorm.weight": "attn.q_norm.weight",
    "attention.q_b_proj.weight": "attn.q_b.weight",
    "attention.kv_a_proj_with_mqa.weight": "attn.kv_a.weight",
    "attention.kv_a_layernorm.weight": "attn.kv_norm.weight",
    "attention.kv_b_proj.weight": "attn.kv_b.weight",
    "attention.g_proj.weight": "attn.gate.weight",  # one gate per head
}
_KDA = {  # a Kimi Delta Attention layer's, but q/k/v and their convolutions (joined here)
    "attention.f_proj.weight": "attn.f.weight",
    "attention.dt_bias": "attn.dt_bias",
    "attention.A_log": "attn.A_log",
    "attention.b_proj.weight": "attn.beta.weight",
    "attention.g_proj.weight": "attn.g.weight",
    "attention.o_norm.weight": "attn.norm",
}
_JOINED = {**{f"attention.{p}_proj.weight": "attn.qkv.weight" for p in "qkv"},
           **{f"attention.{p}_conv1d.weight": "attn.conv.weight" for p in "qkv"}}
_BIAS = "mlp.gate.expert_bias"  # the selection bias: router state
_ROTATED = ("attn.q.weight", "attn.q_b.weight", "attn.kv_a.weight")


def _config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``TransformerEncoder``'s keywords for a Ling 3 hybrid config."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict (a config.json), got {type(config).__name__}")
    if config.get("model_type") != "bailing_hybrid":
        raise ValueError(f"config['model_type'] must be 'bailing_hybrid', got "
                         f"{config.get('model_type')!r}")
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                           "intermediate_size", "vocab_size", "kv_lora_rank",
                           "qk_rope_head_dim", "qk_nope_head_dim") if config.get(k) is None]
    if missing:
        raise ValueError(f"config lacks {missing}: not a bailing_hybrid config")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False)):
        if config.get(key, want) != want:
            raise ValueError(f"config[{key!r}] = {config[key]!r} is not supported here "
                             f"(needs {want!r})")
    depth, heads = config["num_hidden_layers"], config["num_attention_heads"]
    every = config.get("layer_group_size", 6)
    types = config.get("layer_types") or [
        "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(depth)]
    mlps = config.get("mlp_layer_types") or [
        "dense" if i < config.get("first_k_dense_replace", 2) else "sparse"
        for i in range(depth)]
    for name, got, kinds in (("layer_types", types, {"linear_attention", "full_attention"}),
                             ("mlp_layer_types", mlps, {"dense", "sparse"})):
        if len(got) != depth or not set(got) <= kinds:
            raise ValueError(f"config[{name!r}] must list {sorted(kinds)} for each of {depth} "
                             f"layers, got {got!r}")
    nope, rope = config["qk_nope_head_dim"], config["qk_rope_head_dim"]
    rotary = _ropes(config, ["full_attention"] * depth)
    scale = (nope + rope) ** -0.5
    if rotary["rotary_scaling"] and rotary["rotary_scaling"].get("mscale_all_dim"):
        scaling = rotary["rotary_scaling"]  # YaRN's temperature, on the scores (DeepSeek's)
        scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    eps = float(config.get("rms_norm_eps", 1e-6))
    safe = config.get("kda_safe_gate", True)
    kwargs: dict[str, Any] = dict(
        dim=config["hidden_size"], heads=heads, depth=depth, vocab_size=config["vocab_size"],
        out_dim=config["vocab_size"], causal=True, position_embedding="rotary", norm="rms",
        mlp="swiglu", bias=False, mlp_hidden=config["intermediate_size"], norm_eps=eps,
        max_len=config.get("max_position_embeddings", 4096), attn_scale=scale,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)), **rotary,
        latent_attention=dict(kv_rank=config["kv_lora_rank"], rope_dim=rope, nope_dim=nope,
                              v_dim=config.get("v_head_dim") or nope,
                              q_rank=config.get("q_lora_rank"), head_gate=True),
        linear_attention=dict(
            kind="kda", heads=_get(config, ("linear_num_heads",), heads),
            head_dim=_get(config, ("linear_head_dim",), config.get("head_dim", 128)),
            conv_kernel=_get(config, ("linear_conv_kernel_dim", "short_conv_kernel_size"), 4),
            norm_eps=eps, low_rank_gates=False,
            lower_bound=float(config.get("kda_lower_bound", -5.0)) if safe else None),
        layer_linear=[t == "linear_attention" for t in types])
    kwargs.update(v3_mixture(config, mlps))
    return kwargs


def bailing_hybrid_from_hf(config: Mapping[str, Any],
                           state_dict: Mapping[str, Tensor] | None = None, **overrides: Any,
                           ) -> tuple[TransformerEncoder, dict[str, Tensor] | None,
                                      dict[str, Tensor] | None]:
    """The ``TransformerEncoder`` of a Hugging Face Ling 3 hybrid ``config``
    (``"bailing_hybrid"``), and the params and router state of its ``state_dict``.

    Most blocks mix tokens with :class:`KimiDeltaAttention` whose decay and output gate
    are full-rank projections (``low_rank_gates=False``) and whose decay is bounded below
    (``kda_safe_gate``: ``lower_bound=kda_lower_bound``); every ``layer_group_size``-th
    (``layer_types``) with :class:`LatentAttention`, rotary (DeepSeek's interleaved pairs,
    permuted on load) and a sigmoid gate per head (``head_gate=True``). The MLPs are
    DeepSeek-V3's: dense SwiGLU in the first ``first_k_dense_replace`` (or
    ``mlp_layer_types``), else a sigmoid-scored, group-limited mixture with shared
    experts, whose ``expert_bias`` is router *state* (``blocks.i.mlp.router_bias``).
    Tested against ``transformers`` 5 on logits, both caches, greedy generation
    (left-padded too) and the round trip.

    Args:
        config: the checkpoint's ``config.json`` as a dict.
        state_dict: its tensors under Hugging Face's names, or None for the module alone.
        overrides: other ``TransformerEncoder`` arguments.

    Returns:
        ``(module, params, state)``; ``params`` and ``state`` are None without a
        ``state_dict``.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import bailing_hybrid_from_hf
        >>> config = {"model_type": "bailing_hybrid", "hidden_size": 32,
        ...           "num_attention_heads": 4, "num_hidden_layers": 2,
        ...           "intermediate_size": 48, "vocab_size": 10, "kv_lora_rank": 16,
        ...           "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
        ...           "head_dim": 8, "layer_group_size": 2, "first_k_dense_replace": 2}
        >>> module, _, _ = bailing_hybrid_from_hf(config)
        >>> [type(b.attn).__name__ for b in module.blocks]
        ['KimiDeltaAttention', 'LatentAttention']
        >>> model = torchfn.Model(module)
        >>> model.apply(model.init(torchfn.random.key(0)), torch.tensor([[1, 2, 3]])).shape
        torch.Size([1, 3, 10])
    """
    kwargs = _config(config)
    kwargs.update(overrides)
    check_state_dict(state_dict)
    module = TransformerEncoder(**kwargs)
    if state_dict is None:
        return module, None, None
    linear = kwargs["layer_linear"]
    params: dict[str, Tensor] = {}
    state: dict[str, Tensor] = {}
    joined: dict[str, dict[str, Tensor]] = {}  # our qkv / conv -> the q, k, v parts
    experts: dict[str, dict[int, Tensor]] = {}  # our stacked name -> expert j's matrix

    def read_layer(i: str, rest: str, tensor: Tensor) -> bool:
        if int(i) >= kwargs["depth"]:  # a multi-token-prediction layer, if any: not used here
            return bool(_get(config, ("num_nextn_predict_layers", "num_mtp_layers"), 0))
        at, kda, expert = f"blocks.{i}.", linear[int(i)], _EXPERT.fullmatch(rest)
        names = _COMMON | (_KDA if kda else _MLA)
        if rest in names:
            ours = names[rest]
            if ours in _ROTATED and not kda:  # DeepSeek's interleaved rotary pairs
                tensor = tensor[_rotary_rows(config, ours, tensor.shape[0])]
            params[at + ours] = tensor
        elif kda and rest in _JOINED:  # rows [q | k | v]
            joined.setdefault(at + _JOINED[rest], {})[rest[10]] = tensor
        elif rest == _BIAS:
            state[at + "mlp.router_bias"] = tensor
        elif expert:  # expert j's matrix -> row j of the stacked one
            experts.setdefault(f"{at}mlp.{expert[2]}", {})[int(expert[1])] = tensor
        else:
            return False
        return True

    read_state(state_dict.items(), "bailing_hybrid", params, globals_=_GLOBAL,
               tied=kwargs["tie_embeddings"], read_layer=read_layer)
    join_pieces(params, joined)
    stack_experts(params, experts, kwargs.get("experts"))
    _check(module, params, state)
    return module, params, state


def bailing_hybrid_to_hf(config: Mapping[str, Any], params: Mapping[str, Tensor],
                         state: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
    """``params`` and the routers' ``state`` of the model ``bailing_hybrid_from_hf(config)``
    builds, under a Hugging Face checkpoint's names: q, k, v and their convolutions apart,
    the experts one matrix each (copies), the rotary rows back in their interleaved
    order. The inverse of :func:`bailing_hybrid_from_hf`, bit for bit.

    Example::

        >>> import torchfn
        >>> from torchfn.models import bailing_hybrid_from_hf, bailing_hybrid_to_hf
        >>> config = {"model_type": "bailing_hybrid", "hidden_size": 32,
        ...           "num_attention_heads": 4, "num_hidden_layers": 1,
        ...           "intermediate_size": 48, "vocab_size": 10, "kv_lora_rank": 16,
        ...           "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "head_dim": 8}
        >>> params = torchfn.Model(bailing_hybrid_from_hf(config)[0]).init(
        ...     torchfn.random.key(0))
        >>> bailing_hybrid_to_hf(config, params)["model.layers.0.attention.f_proj.weight"].shape
        torch.Size([32, 32])
    """
    kwargs = _config(config)
    module = TransformerEncoder(**kwargs)
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a dict of tensors, got {type(params).__name__}")
    state = {} if state is None else state
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a dict of tensors or None, got {type(state).__name__}")
    _check(module, params, state)
    back = {ours: hf for hf, ours in _GLOBAL.items()}
    inverse = {kda: {ours: hf for hf, ours in (_COMMON | (_KDA if kda else _MLA)).items()}
               for kda in (False, True)}
    out: dict[str, Tensor] = {}
    for name, t in {**params, **state}.items():
        if name in back:
            out[back[name]] = t
            continue
        i, rest = name.split(".", 2)[1:]
        at, kda = f"model.layers.{i}.", kwargs["layer_linear"][int(i)]
        if rest == "mlp.router_bias":
            out[at + _BIAS] = t
        elif kda and rest in ("attn.qkv.weight", "attn.conv.weight"):  # [q | k | v] rows
            kind = "proj" if rest == "attn.qkv.weight" else "conv1d"
            for p, part in zip("qkv", t.chunk(3)):
                out[f"{at}attention.{p}_{kind}.weight"] = part.clone()
        elif rest in ("mlp.gate", "mlp.up", "mlp.down"):  # stacked experts (E, ...)
            for j, part in enumerate(t.unbind(0)):
                out[f"{at}mlp.experts.{j}.{rest[4:]}_proj.weight"] = part.clone()
        else:
            if rest in _ROTATED and not kda:
                t = t[torch.argsort(_rotary_rows(config, rest, t.shape[0]))]
            out[at + inverse[kda][rest]] = t
    return out
