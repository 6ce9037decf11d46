"""A Hugging Face Llama checkpoint as a ``TransformerEncoder`` and its params pytree."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from torchfn.models._transformer import TransformerEncoder

__all__ = ["llama_from_hf"]

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_NAMES = {  # a layer's HF names -> ours, but for q/k/v (one qkv matrix here)
    "input_layernorm.weight": "ln1.weight",
    "post_attention_layernorm.weight": "ln2.weight",
    "self_attn.o_proj.weight": "attn.out.weight",
    "mlp.gate_proj.weight": "mlp.gate.weight",
    "mlp.up_proj.weight": "mlp.up.weight",
    "mlp.down_proj.weight": "mlp.down.weight",
}
_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")  # a buffer older checkpoints carry


def _config(config: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict (a Llama config.json), got "
                        f"{type(config).__name__}")
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                           "intermediate_size", "vocab_size") if k not in config]
    if missing:
        raise ValueError(f"config lacks {missing}: not a Llama config")
    dim, heads = config["hidden_size"], config["num_attention_heads"]
    checks = {
        "hidden_act": (config.get("hidden_act", "silu"), "silu"),
        "attention_bias": (config.get("attention_bias", False), False),
        "mlp_bias": (config.get("mlp_bias", False), False),
        "head_dim": (config.get("head_dim") or dim // heads, dim // heads),
    }
    for key, (got, want) in checks.items():
        if got != want:
            raise ValueError(f"config[{key!r}] = {got!r} is not supported here (needs {want!r})")
    return dict(
        dim=dim, heads=heads, depth=config["num_hidden_layers"],
        vocab_size=config["vocab_size"], out_dim=config["vocab_size"], causal=True,
        max_len=config.get("max_position_embeddings", 2048),
        kv_heads=config.get("num_key_value_heads") or heads,
        position_embedding="rotary", rotary_base=float(config.get("rope_theta", 10000.0)),
        rotary_scaling=config.get("rope_scaling"), norm="rms", mlp="swiglu", bias=False,
        mlp_hidden=config["intermediate_size"], norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        # Mistral: each token sees itself and the sliding_window - 1 before it
        window=(config["sliding_window"] - 1, None) if config.get("sliding_window") else None,
    )


def llama_from_hf(config: Mapping[str, Any], state_dict: Mapping[str, Tensor] | None = None,
                  **overrides: Any) -> tuple[TransformerEncoder, dict[str, Tensor] | None]:
    """The ``TransformerEncoder`` of a Hugging Face Llama ``config``, and the params of
    its ``state_dict`` under the encoder's names.

    Llama is rotary (Hugging Face's half-split pairing, ``rope_theta``, ``rope_scaling``),
    grouped-query attention, RMSNorm (``rms_norm_eps``), SwiGLU (``intermediate_size``),
    no biases and optionally tied embeddings: each an option of ``TransformerEncoder``.
    A ``sliding_window`` (Mistral's config) becomes the encoder's ``window``.
    The q, k and v projections become one ``qkv`` matrix. The checkpoint's tensors are
    used as they are (a view or a concatenation; nothing is copied but ``qkv``), so
    ``safetensors.torch.load_file`` of a checkpoint's shards gives ``state_dict``.
    Tested against a Llama forward written out from the Hugging Face model's
    definition, not against ``transformers`` itself (not installed here).

    Args:
        config: the checkpoint's ``config.json`` as a dict.
        state_dict: its tensors under Hugging Face's names (``model.layers.0.self_attn.
            q_proj.weight``, ...), or None for the module alone.
        overrides: other ``TransformerEncoder`` arguments (``attend``, ``remat``, ...).

    Returns:
        ``(module, params)``: wrap the module in ``torchfn.Model``; ``params`` is None
        without a ``state_dict``.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import llama_from_hf
        >>> config = {"hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
        ...           "num_hidden_layers": 1, "intermediate_size": 24, "vocab_size": 10}
        >>> module, _ = llama_from_hf(config)
        >>> model = torchfn.Model(module)
        >>> params = model.init(torchfn.random.key(0))
        >>> model.apply(params, torch.tensor([[1, 2, 3]])).shape
        torch.Size([1, 3, 10])
    """
    kwargs = _config(config)
    kwargs.update(overrides)
    module = TransformerEncoder(**kwargs)
    if state_dict is None:
        return module, None
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a dict of tensors, got {type(state_dict).__name__}")
    params: dict[str, Tensor] = {}
    qkv: dict[int, dict[str, Tensor]] = {}
    unknown = []
    for name, tensor in state_dict.items():
        layer = _LAYER.fullmatch(name)
        if name == "model.embed_tokens.weight":
            params["embed.weight"] = tensor
        elif name == "model.norm.weight":
            params["ln.weight"] = tensor
        elif name == "lm_head.weight":
            if not kwargs["tie_embeddings"]:
                params["head.weight"] = tensor
        elif layer and layer[2] in _NAMES:
            params[f"blocks.{layer[1]}.{_NAMES[layer[2]]}"] = tensor
        elif layer and layer[2] in _QKV:
            qkv.setdefault(int(layer[1]), {})[layer[2]] = tensor
        elif not _IGNORED.fullmatch(name):
            unknown.append(name)
    if unknown:
        raise ValueError(f"state_dict has tensors a Llama does not: {unknown[:5]}"
                         + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""))
    for i, parts in qkv.items():
        if len(parts) == 3:
            params[f"blocks.{i}.attn.qkv.weight"] = torch.cat([parts[n] for n in _QKV])
    want = {name: tuple(p.shape) for name, p in module.named_parameters()}
    missing = sorted(set(want) - set(params))
    if missing:
        raise ValueError(f"state_dict lacks the tensors for {missing[:5]}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    wrong = [(n, tuple(params[n].shape), want[n]) for n in want if tuple(params[n].shape) !=
             want[n]]
    if wrong:
        raise ValueError(f"state_dict shapes do not match the config: (name, got, want) "
                         f"{wrong[:3]}")
    return module, params
