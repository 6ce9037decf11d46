"""A live ``transformers`` model (not a folder) as a ``TransformerEncoder``, its params and
its state."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from torchfn.models._pretrained import load_checkpoint
from torchfn.models._transformer import TransformerEncoder

__all__ = ["from_transformers"]


def from_transformers(model: nn.Module, **overrides: Any
                      ) -> tuple[TransformerEncoder, dict[str, Tensor], dict[str, Tensor],
                                 dict[str, Any]]:
    """A ``transformers`` causal LM in memory (``AutoModelForCausalLM.from_pretrained(...)``,
    or one built from a config) as ``(module, params, state, config)``, as
    :func:`from_pretrained` reads its folder, for every family it reads.

    transformers 5 keeps some weights in memory under other names and shapes than its
    checkpoints (the experts fused into ``gate_up_proj``, Kimi's convolutions joined,
    ...); its own ``revert_weight_conversion`` (what ``save_pretrained`` applies) gives
    the checkpoint's layout back, which the loaders read. The params share memory with
    the model's parameters (nothing is copied but what a loader joins or stacks): clone
    them to train apart from it.

    Args:
        model: a ``transformers.PreTrainedModel`` with a language-model head.
        overrides: other ``TransformerEncoder`` arguments, as for :func:`from_pretrained`.

    Example::

        >>> import torch
        >>> import transformers
        >>> import torchfn
        >>> from torchfn.models import from_transformers
        >>> config = transformers.LlamaConfig(hidden_size=16, num_attention_heads=2,
        ...                                   num_hidden_layers=1, intermediate_size=24,
        ...                                   vocab_size=10)
        >>> hf = transformers.AutoModelForCausalLM.from_config(config).eval()
        >>> module, params, state, _ = from_transformers(hf)
        >>> tokens = torch.tensor([[1, 2, 3]])
        >>> with torch.no_grad():
        ...     want = hf(tokens).logits
        >>> torch.allclose(torchfn.Model(module).apply(params, tokens), want, atol=1e-5)
        True
    """
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError as e:  # pragma: no cover - transformers is the input's own library
        raise ImportError("from_transformers needs transformers (>= 5)") from e
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got "
                        f"{type(model).__name__}")
    tensors = {n: t.detach() for n, t in model.state_dict().items()}
    tensors = revert_weight_conversion(model, tensors)
    config = model.config.to_dict()
    module, params, state = load_checkpoint(config, tensors, **overrides)
    return module, params, state, config
