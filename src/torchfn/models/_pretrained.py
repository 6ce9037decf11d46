"""A Hugging Face model folder (``config.json`` and safetensors, one file or shards with
an index) read into a ``TransformerEncoder`` and its params, and written back."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from torchfn.core.checkpoint import _fsync_dir, atomic_write
from torchfn.core.module import Model
from torchfn.models._bailing_hybrid import bailing_hybrid_from_hf, bailing_hybrid_to_hf
from torchfn.models._dbrx import dbrx_from_hf, dbrx_to_hf
from torchfn.models._deepseek import _TYPES as _DEEPSEEK_TYPES
from torchfn.models._deepseek import deepseek_from_hf, deepseek_to_hf
from torchfn.models._falcon_h1 import falcon_h1_from_hf, falcon_h1_to_hf
from torchfn.models._jetmoe import jetmoe_from_hf, jetmoe_to_hf
from torchfn.models._kimi_linear import kimi_linear_from_hf, kimi_linear_to_hf
from torchfn.models._lfm2 import lfm2_from_hf, lfm2_to_hf
from torchfn.models._llama import llama_from_hf
from torchfn.models._llama4 import llama4_from_hf, llama4_to_hf
from torchfn.models._llama_export import llama_to_hf
from torchfn.models._mamba_hybrid import _TYPES as _MAMBA_HYBRID_TYPES
from torchfn.models._mamba_hybrid import mamba_hybrid_from_hf, mamba_hybrid_to_hf
from torchfn.models._minimax import minimax_from_hf, minimax_to_hf
from torchfn.models._nemotron_h import nemotron_h_from_hf, nemotron_h_to_hf
from torchfn.models._neox import neox_from_hf, neox_to_hf
from torchfn.models._olmo_hybrid import olmo_hybrid_from_hf, olmo_hybrid_to_hf
from torchfn.models._phi import phi_from_hf, phi_to_hf
from torchfn.models._qwen3_next import _MULTIMODAL as _QWEN3_5_MULTIMODAL
from torchfn.models._qwen3_next import _TYPES as _QWEN3_NEXT_TYPES
from torchfn.models._qwen3_next import qwen3_next_from_hf, qwen3_next_to_hf
from torchfn.models._recurrent_gemma import recurrent_gemma_from_hf, recurrent_gemma_to_hf
from torchfn.models._routed_moe import _TYPES as _ROUTED_TYPES
from torchfn.models._routed_moe import routed_moe_from_hf, routed_moe_to_hf
from torchfn.models._transformer import TransformerEncoder
from torchfn.models._xlstm import xlstm_from_hf, xlstm_to_hf

__all__ = ["from_pretrained", "save_pretrained", "llama_from_pretrained",
           "llama_save_pretrained", "deepseek_from_pretrained", "deepseek_save_pretrained"]

_OTHERS = {"gpt_neox": (neox_from_hf, neox_to_hf), "phi": (phi_from_hf, phi_to_hf),
           "falcon_h1": (falcon_h1_from_hf, falcon_h1_to_hf),
           "minimax": (minimax_from_hf, minimax_to_hf),
           "olmo_hybrid": (olmo_hybrid_from_hf, olmo_hybrid_to_hf),
           "recurrent_gemma": (recurrent_gemma_from_hf, recurrent_gemma_to_hf),
           "xlstm": (xlstm_from_hf, xlstm_to_hf), "dbrx": (dbrx_from_hf, dbrx_to_hf),
           "jetmoe": (jetmoe_from_hf, jetmoe_to_hf),
           "llama4_text": (llama4_from_hf, llama4_to_hf), "llama4": (llama4_from_hf, llama4_to_hf),
           **{t: (qwen3_next_from_hf, qwen3_next_to_hf)
              for t in _QWEN3_NEXT_TYPES + _QWEN3_5_MULTIMODAL},
           **{t: (mamba_hybrid_from_hf, mamba_hybrid_to_hf) for t in _MAMBA_HYBRID_TYPES}}
_STATEFUL = {"nemotron_h": (nemotron_h_from_hf, nemotron_h_to_hf),  # router state too
             "kimi_linear": (kimi_linear_from_hf, kimi_linear_to_hf),
             "bailing_hybrid": (bailing_hybrid_from_hf, bailing_hybrid_to_hf),
             **{t: (lfm2_from_hf, lfm2_to_hf) for t in ("lfm2", "lfm2_moe")},
             **{t: (routed_moe_from_hf, routed_moe_to_hf) for t in _ROUTED_TYPES}}
_WEIGHTS, _INDEX, _CONFIG = "model.safetensors", "model.safetensors.index.json", "config.json"


def llama_from_pretrained(folder: str | os.PathLike, *, dtype: torch.dtype | None = None,
                          device: str | torch.device = "cpu", **overrides: Any,
                          ) -> tuple[TransformerEncoder, dict[str, Tensor], dict[str, Any]]:
    """The model in ``folder`` (as ``save_pretrained`` or the Hub leave it:
    ``config.json`` and ``model.safetensors``, or shards named by
    ``model.safetensors.index.json``) as ``(module, params, config)``, through
    :func:`llama_from_hf`.

    Args:
        folder: the model's folder.
        dtype: cast the floating-point tensors to it (e.g. ``torch.float32`` for a bf16
            checkpoint); None keeps the checkpoint's.
        device: where the tensors load.
        overrides: other ``TransformerEncoder`` arguments, as for :func:`llama_from_hf`.

    Example::

        >>> import tempfile
        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import llama_from_hf, llama_from_pretrained, llama_save_pretrained
        >>> config = {"hidden_size": 16, "num_attention_heads": 4, "num_hidden_layers": 1,
        ...           "intermediate_size": 24, "vocab_size": 10}
        >>> params = torchfn.Model(llama_from_hf(config)[0]).init(torchfn.random.key(0))
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     llama_save_pretrained(folder, config, params)
        ...     module, back, _ = llama_from_pretrained(folder)
        >>> all(back[n].equal(params[n]) for n in params)
        True
    """
    config, state = _read(folder, dtype, device)
    module, params = llama_from_hf(config, state, **overrides)
    return module, params, config


def llama_save_pretrained(folder: str | os.PathLike, config: Mapping[str, Any],
                          params: Mapping[str, Tensor]) -> None:
    """Write ``params`` (of the model ``llama_from_hf(config)`` builds) to ``folder`` as
    ``config.json`` and ``model.safetensors`` under Hugging Face's names
    (:func:`llama_to_hf`): ``transformers.AutoModelForCausalLM.from_pretrained(folder)``
    loads it. Each file is written to a temporary file and moved over the old one, so a
    failed save leaves the earlier files whole. A folder holding a sharded checkpoint is
    refused (its index would still name the old shards).

    Example::

        >>> import os
        >>> import tempfile
        >>> import torchfn
        >>> from torchfn.models import llama_from_hf, llama_save_pretrained
        >>> config = {"hidden_size": 16, "num_attention_heads": 4, "num_hidden_layers": 1,
        ...           "intermediate_size": 24, "vocab_size": 10}
        >>> params = torchfn.Model(llama_from_hf(config)[0]).init(torchfn.random.key(0))
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     llama_save_pretrained(folder, config, params)
        ...     sorted(os.listdir(folder))
        ['config.json', 'model.safetensors']
    """
    _write(folder, config, llama_to_hf(config, params))


def deepseek_from_pretrained(folder: str | os.PathLike, *, dtype: torch.dtype | None = None,
                             device: str | torch.device = "cpu", **overrides: Any,
                             ) -> tuple[TransformerEncoder, dict[str, Tensor],
                                        dict[str, Tensor], dict[str, Any]]:
    """A DeepSeek-V2 / V3 model folder as ``(module, params, state, config)``, through
    :func:`deepseek_from_hf` (``state``: V3's router biases). Arguments as
    :func:`llama_from_pretrained`'s; an FP8 checkpoint (DeepSeek-V3's own, with
    ``weight_scale_inv`` blocks) is dequantized to bfloat16, then cast to ``dtype``.

    Example::

        >>> import tempfile
        >>> import torchfn
        >>> from torchfn.models import (deepseek_from_hf, deepseek_from_pretrained,
        ...                             deepseek_save_pretrained)
        >>> config = {"model_type": "deepseek_v2", "hidden_size": 16, "num_attention_heads": 2,
        ...           "num_hidden_layers": 1, "intermediate_size": 24, "vocab_size": 10,
        ...           "kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
        ...           "v_head_dim": 4}
        >>> params = torchfn.Model(deepseek_from_hf(config)[0]).init(torchfn.random.key(0))
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     deepseek_save_pretrained(folder, config, params)
        ...     module, back, state, _ = deepseek_from_pretrained(folder)
        >>> all(back[n].equal(params[n]) for n in params), state
        (True, {})
    """
    config, tensors = _read(folder, None, device)
    module, params, state = deepseek_from_hf(config, tensors, **overrides)
    if dtype is not None:
        params = _cast(params, dtype)
    return module, params, state, config


def deepseek_save_pretrained(folder: str | os.PathLike, config: Mapping[str, Any],
                             params: Mapping[str, Tensor],
                             state: Mapping[str, Tensor] | None = None) -> None:
    """Write ``params`` and ``state`` of the model ``deepseek_from_hf(config)`` builds to
    ``folder`` under Hugging Face's names (:func:`deepseek_to_hf`), each file atomically,
    as :func:`llama_save_pretrained` does; ``transformers`` loads the folder (tested).
    The weights are written as they are (an FP8 checkpoint comes back in their dtype).

    Example::

        >>> import os
        >>> import tempfile
        >>> import torchfn
        >>> from torchfn.models import deepseek_from_hf, deepseek_save_pretrained
        >>> config = {"model_type": "deepseek_v2", "hidden_size": 16, "num_attention_heads": 2,
        ...           "num_hidden_layers": 1, "intermediate_size": 24, "vocab_size": 10,
        ...           "kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
        ...           "v_head_dim": 4}
        >>> params = torchfn.Model(deepseek_from_hf(config)[0]).init(torchfn.random.key(0))
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     deepseek_save_pretrained(folder, config, params)
        ...     sorted(os.listdir(folder))
        ['config.json', 'model.safetensors']
    """
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    _write(folder, config, deepseek_to_hf(config, params, state))

def from_pretrained(folder: str | os.PathLike, *, dtype: torch.dtype | None = None,
                    device: str | torch.device = "cpu", **overrides: Any,
                    ) -> tuple[TransformerEncoder, dict[str, Tensor], dict[str, Tensor],
                               dict[str, Any]]:
    """Any model folder torchfn reads, whatever its family, as ``(module, params, state,
    config)``: DeepSeek-V2 / V3 and GLM-4.5 through :func:`deepseek_from_pretrained`,
    Nemotron-H, Kimi Linear, Ling 3 hybrids, LFM2, LFM2-MoE, ERNIE 4.5 MoE, MiniMax-M2,
    K-EXAONE, Arcee Trinity and MiMo-V2-Flash through
    :func:`nemotron_h_from_hf` / :func:`kimi_linear_from_hf` /
    :func:`bailing_hybrid_from_hf` / :func:`lfm2_from_hf` /
    :func:`routed_moe_from_hf` (``state``: their routers' biases),
    GPT-NeoX (Pythia), Phi-2, Llama 4, Qwen3-Next and Qwen3.5, Falcon-H1, Mamba, Mamba-2,
    Bamba, Granite 4.0-H, Jamba, MiniMax-01, OLMo Hybrid, RecurrentGemma and xLSTM through
    :func:`neox_from_hf` / :func:`phi_from_hf` / :func:`llama4_from_hf` /
    :func:`qwen3_next_from_hf` / :func:`falcon_h1_from_hf` / :func:`mamba_hybrid_from_hf` /
    :func:`minimax_from_hf` / :func:`olmo_hybrid_from_hf` /
    :func:`recurrent_gemma_from_hf` / :func:`xlstm_from_hf` (and DBRX and JetMoE through
    :func:`dbrx_from_hf` / :func:`jetmoe_from_hf`), the
    others (Llama, Mistral, Mixtral, Qwen, Phi-3, OLMo 2 and 3, gpt-oss, SmolLM3, GLM, EXAONE 4,
    StarCoder2, Gemma, ...)
    through :func:`llama_from_pretrained`, with their ``state`` (persistent buffers,
    ``{}`` for most) from the module. Arguments as theirs.
    ``Model(module).apply(params, tokens, state=state)`` runs it.

    Example::

        >>> import tempfile
        >>> import torchfn
        >>> from torchfn.models import from_pretrained, llama_from_hf, save_pretrained
        >>> config = {"hidden_size": 16, "num_attention_heads": 4, "num_hidden_layers": 1,
        ...           "intermediate_size": 24, "vocab_size": 10}
        >>> params = torchfn.Model(llama_from_hf(config)[0]).init(torchfn.random.key(0))
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     save_pretrained(folder, config, params)
        ...     module, back, state, _ = from_pretrained(folder)
        >>> all(back[n].equal(params[n]) for n in params), state
        (True, {})
    """
    config, tensors = _read(folder, None, device)
    module, params, state = load_checkpoint(config, tensors, **overrides)
    if dtype is not None:
        params = _cast(params, dtype)
    return module, params, state, config


def load_checkpoint(config: Mapping[str, Any], tensors: Mapping[str, Tensor], **overrides: Any
                    ) -> tuple[TransformerEncoder, dict[str, Tensor], dict[str, Tensor]]:
    """``(module, params, state)`` of a checkpoint's ``config`` and ``tensors`` (under the
    names a folder holds), through its family's loader (by ``config["model_type"]``)."""
    kind = config.get("model_type")
    if kind in _DEEPSEEK_TYPES:
        return deepseek_from_hf(config, tensors, **overrides)
    if kind in _STATEFUL:
        return _STATEFUL[kind][0](config, tensors, **overrides)
    if kind in _OTHERS:
        module, params = _OTHERS[kind][0](config, tensors, **overrides)
        return module, params, {}
    module, params = llama_from_hf(config, tensors, **overrides)
    return module, params, Model(module).init_state()


def save_pretrained(folder: str | os.PathLike, config: Mapping[str, Any],
                    params: Mapping[str, Tensor],
                    state: Mapping[str, Tensor] | None = None) -> None:
    """Write a model of any family :func:`from_pretrained` reads to ``folder`` (through
    :func:`deepseek_save_pretrained` or :func:`llama_save_pretrained`, by
    ``config["model_type"]``), each file atomically; ``state`` as ``from_pretrained``
    returned it (ignored where the family has none).

    Example::

        >>> import os
        >>> import tempfile
        >>> import torchfn
        >>> from torchfn.models import deepseek_from_hf, save_pretrained
        >>> config = {"model_type": "glm4_moe", "hidden_size": 16, "num_attention_heads": 2,
        ...           "num_hidden_layers": 1, "intermediate_size": 24, "vocab_size": 10}
        >>> params = torchfn.Model(deepseek_from_hf(config)[0]).init(torchfn.random.key(0))
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     save_pretrained(folder, config, params)
        ...     sorted(os.listdir(folder))
        ['config.json', 'model.safetensors']
    """
    if config.get("model_type") in _DEEPSEEK_TYPES:
        deepseek_save_pretrained(folder, config, params, state)
    elif config.get("model_type") in _STATEFUL:
        _write(folder, config, _STATEFUL[config["model_type"]][1](config, params, state))
    elif config.get("model_type") in _OTHERS:
        _write(folder, config, _OTHERS[config["model_type"]][1](config, params))
    else:
        llama_save_pretrained(folder, config, params)


def _cast(params: Mapping[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    """Floating-point params in ``dtype``; routers in at least float32, as transformers
    keeps them."""
    return {n: t.to(torch.promote_types(dtype, torch.float32)
                    if n.endswith("mlp.router.weight") else dtype)
            if t.is_floating_point() else t for n, t in params.items()}

def _read(folder: Any, dtype: torch.dtype | None, device: str | torch.device,
          ) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A model folder's ``config.json`` and tensors (one file or the index's shards),
    floating-point ones cast to ``dtype`` (None: kept)."""
    folder = _folder(folder, "folder")
    path = os.path.join(folder, _CONFIG)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"folder: {folder!r} has no {_CONFIG}")
    with open(path) as f:
        config = json.load(f, object_hook=_from_json)
    if os.path.isfile(os.path.join(folder, _WEIGHTS)):
        files = [_WEIGHTS]
    elif os.path.isfile(os.path.join(folder, _INDEX)):
        with open(os.path.join(folder, _INDEX)) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        raise FileNotFoundError(f"folder: {folder!r} has neither {_WEIGHTS} nor {_INDEX}")
    state: dict[str, Tensor] = {}
    for name in files:
        shard = os.path.join(folder, name)
        if not os.path.isfile(shard):
            raise FileNotFoundError(f"folder: {_INDEX} names {name!r}, which is missing")
        state.update(load_file(shard, device=str(device)))
    if dtype is not None:
        state = {n: t.to(dtype) if t.is_floating_point() else t for n, t in state.items()}
    return config, state


def _write(folder: Any, config: Mapping[str, Any], named: Mapping[str, Tensor]) -> None:
    """``config.json`` and ``model.safetensors`` into ``folder``, each atomically."""
    folder = _folder(folder, "folder")
    if os.path.exists(os.path.join(folder, _INDEX)):
        raise FileExistsError(f"folder: {folder!r} holds a sharded checkpoint ({_INDEX}); "
                              "save to another folder")
    tensors = {n: t.detach().contiguous().cpu() for n, t in named.items()}
    text = json.dumps(_to_json(dict(config)), indent=2, sort_keys=True)
    atomic_write(os.path.join(folder, _WEIGHTS),
                 lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    atomic_write(os.path.join(folder, _CONFIG), lambda tmp: _write_text(tmp, text))
    _fsync_dir(folder)


def _from_json(obj: dict) -> Any:
    """transformers writes a float JSON has no literal for (inf, nan) as
    ``{"__float__": "Infinity"}`` (Mamba-2's ``time_step_limit``): back to the float."""
    return float(obj["__float__"]) if set(obj) == {"__float__"} else obj


def _to_json(value: Any) -> Any:
    """``value`` with its non-finite floats as transformers writes them."""
    if isinstance(value, float) and not math.isfinite(value):
        return {"__float__": str(value).replace("inf", "Infinity").replace("nan", "NaN")}
    if isinstance(value, Mapping):
        return {k: _to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    return value


def _folder(folder: Any, name: str) -> str:
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"{name} must be a str or os.PathLike, got {type(folder).__name__}")
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{name}: {folder!r} is not a folder")
    return folder


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
