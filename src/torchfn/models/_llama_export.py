"""A ``TransformerEncoder``'s params under a Hugging Face checkpoint's names: the inverse
of :func:`llama_from_hf`, so a model trained here loads in ``transformers``."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from torchfn.models._fit import check_params_for
from torchfn.models._llama import (
    _FUSED_MLP,
    _GRANITE_MOE,
    _MOE,
    _NAMES,
    GLOBAL_NAMES,
    XIELU_CONSTANTS,
    _config,
    layer_names,
)
from torchfn.models._transformer import TransformerEncoder

__all__ = ["llama_to_hf"]

_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
_HF_GLOBAL = {ours: hf for hf, ours in GLOBAL_NAMES.items()}
_EXPERT = {  # model_type -> one expert's matrix name, from its index and kind
    "mixtral": "block_sparse_moe.experts.{j}.{w}.weight",
    "phimoe": "block_sparse_moe.experts.{j}.{w}.weight",
    "qwen2_moe": "mlp.experts.{j}.{w}_proj.weight",
    "qwen3_moe": "mlp.experts.{j}.{w}_proj.weight",
    "mellum": "mlp.experts.{j}.{w}_proj.weight",
    "cohere2_moe": "mlp.experts.{j}.{w}_proj.weight",
    "olmoe": "mlp.experts.{j}.{w}_proj.weight",
    "flex_olmo": "mlp.experts.{j}.{w}_proj.weight",
    "hunyuan_v1_moe": "mlp.experts.{j}.{w}_proj.weight",
}


def llama_to_hf(config: Mapping[str, Any], params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``params`` of the ``TransformerEncoder`` that ``llama_from_hf(config)`` builds, under
    the names and shapes of a Hugging Face checkpoint of ``config``.

    ``qkv`` is split into ``q_proj`` / ``k_proj`` / ``v_proj`` (Phi-3 keeps it fused, and
    joins ``gate`` and ``up`` into ``gate_up_proj``), a mixture's stacked
    experts into one matrix per expert (the names a checkpoint on disk has, e.g. Mixtral's
    ``block_sparse_moe.experts.3.w1.weight``), and a tied head is left out, as
    ``save_pretrained`` leaves it. Split and unstacked tensors are copies (safetensors
    refuses tensors that share memory); the others are ``params``' own. Save the result
    with ``safetensors.torch.save_file`` beside the ``config.json`` and
    ``transformers.AutoModelForCausalLM.from_pretrained`` loads it (tested, with the
    logits, for every family ``llama_from_hf`` reads).

    Args:
        config: the ``config.json`` dict the model was built from.
        params: its params (``llama_from_hf``'s, or trained ones).

    Returns:
        ``{hf_name: tensor}``.

    Example::

        >>> import torchfn
        >>> from torchfn.models import llama_from_hf, llama_to_hf
        >>> config = {"hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
        ...           "num_hidden_layers": 1, "intermediate_size": 24, "vocab_size": 10}
        >>> module, _ = llama_from_hf(config)
        >>> params = torchfn.Model(module).init(torchfn.random.key(0))
        >>> sd = llama_to_hf(config, params)
        >>> sd["model.layers.0.self_attn.k_proj.weight"].shape  # 2 kv heads of 4
        torch.Size([8, 16])
        >>> llama_from_hf(config, sd)[1]["blocks.0.attn.qkv.weight"].equal(
        ...     params["blocks.0.attn.qkv.weight"])
        True
    """
    kwargs = _config(config)
    check_params_for(TransformerEncoder, kwargs, params)
    kind = config.get("model_type", "llama")
    router, _, stacked, _ = _MOE.get(kind, (None, None, {}, {}))
    hf_name = {ours: hf for hf, ours in layer_names(kind).items()}
    dense = {ours: hf for hf, ours in _NAMES.items() if hf.startswith("mlp.")}  # a dense
    # layer's MLP in a mixture model (its experts' stacked params have no ".weight")
    hf_expert = {ours: hf for hf, ours in stacked.items()}  # "mlp.gate" -> "w1" / "gate"
    q, kv = kwargs["heads"] * kwargs["head_dim"], kwargs["kv_heads"] * kwargs["head_dim"]
    out: dict[str, Tensor] = {}
    for name, t in params.items():
        block = _BLOCK.fullmatch(name)
        if name in _HF_GLOBAL:
            out[_HF_GLOBAL[name]] = t
        elif block is None:
            raise AssertionError(name)  # every other name is a block's (checked above)
        else:
            at, rest = f"model.layers.{block[1]}.", block[2]
            if kind == "phi3" and rest == "attn.qkv.weight":  # Phi-3's fused [q | k | v]
                out[at + "self_attn.qkv_proj.weight"] = t
            elif kind in _FUSED_MLP and rest == "mlp.gate.weight":  # [gate | up]
                out[at + "mlp.gate_up_proj.weight"] = torch.cat(
                    (t, params[f"blocks.{block[1]}.mlp.up.weight"]))
            elif kind in _FUSED_MLP and rest == "mlp.up.weight":
                pass  # in gate_up_proj
            elif rest in hf_name:
                out[at + hf_name[rest]] = t
                if kind == "apertus" and rest == "mlp.1.alpha_p":  # xIELU's fixed buffers
                    out.update({at + n: torch.tensor(v, dtype=t.dtype, device=t.device)
                                for n, v in XIELU_CONSTANTS.items()})
            elif rest in ("attn.qkv.weight", "attn.qkv.bias"):
                suffix = rest.rsplit(".", 1)[1]
                for p, part in zip("qkv", t.split([q, kv, kv])):
                    out[f"{at}self_attn.{p}_proj.{suffix}"] = part.clone()
            elif rest in dense:
                out[at + dense[rest]] = t
            elif kind in _GRANITE_MOE and rest.startswith(("mlp.gate", "mlp.up", "mlp.down",
                                                           "mlp.shared.")):
                out.update(_granite_fuse(params, f"blocks.{block[1]}.", at, rest))
            elif kind == "gpt_oss" and rest.startswith(("mlp.gate", "mlp.up", "mlp.down")):
                if rest in ("mlp.gate", "mlp.gate_bias", "mlp.down", "mlp.down_bias"):
                    out.update(_gpt_oss_experts(params, f"blocks.{block[1]}.", at, rest))
            elif rest == "mlp.router.weight":
                out[at + router] = t
            else:  # stacked experts (E, ...) -> one matrix each
                for j, part in enumerate(t.unbind(0)):
                    out[at + _EXPERT[kind].format(j=j, w=hf_expert[rest])] = part.clone()
    return out


def _granite_fuse(params: Mapping[str, Tensor], ours: str, at: str,
                  rest: str) -> dict[str, Tensor]:
    """GraniteMoe's fused tensors from ours (the inverse of ``_granite_unfuse``): gate and
    up joined as ``input_linear`` rows, down as ``output_linear``; written once, from the
    gate (or down) param."""
    shared = rest.startswith("mlp.shared.")
    hf = "shared_mlp." if shared else "block_sparse_moe."
    base, suffix = ("mlp.shared.", ".weight") if shared else ("mlp.", "")
    if rest == f"{base}down{suffix}":
        return {f"{at}{hf}output_linear.weight": params[ours + rest]}
    if rest == f"{base}gate{suffix}":
        return {f"{at}{hf}input_linear.weight": torch.cat(
            (params[ours + rest], params[f"{ours}{base}up{suffix}"]), dim=-2)}
    return {}  # up: in input_linear


def _gpt_oss_experts(params: Mapping[str, Tensor], ours: str, at: str,
                     rest: str) -> dict[str, Tensor]:
    """gpt-oss's fused expert tensors from ours: ``gate`` and ``up`` ``(E, hidden, dim)``
    into alternate columns of ``gate_up_proj`` ``(E, dim, 2 hidden)`` (and their biases
    into ``gate_up_proj_bias``), ``down`` transposed to ``down_proj``."""
    if rest == "mlp.down":
        return {at + "mlp.experts.down_proj": params[ours + "mlp.down"].transpose(1, 2)
                .contiguous()}
    if rest == "mlp.down_bias":
        return {at + "mlp.experts.down_proj_bias": params[ours + "mlp.down_bias"]}
    bias = rest.endswith("_bias")
    gate = params[ours + ("mlp.gate_bias" if bias else "mlp.gate")]
    up = params[ours + ("mlp.up_bias" if bias else "mlp.up")]
    if not bias:
        gate, up = gate.transpose(1, 2), up.transpose(1, 2)  # (E, dim, hidden)
    fused = torch.stack((gate, up), dim=-1).flatten(-2)  # (..., 2 hidden): g0 u0 g1 u1 ...
    return {at + ("mlp.experts.gate_up_proj_bias" if bias else "mlp.experts.gate_up_proj"):
            fused}
