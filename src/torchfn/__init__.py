"""torchfn: functional, JAX-style research on ``torch.func``.

Models are pure functions of parameter pytrees, randomness comes from explicit
keys, optimizers are pure gradient transformations, and every piece composes
with ``grad`` / ``vmap`` / ``jacrev`` / ``jvp``.

The flat public API is resolved lazily, so ``import torchfn`` stays cheap and
never imports Triton.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # modules
    "random": "torchfn.random",
    "tree": "torchfn.tree",
    "optim": "torchfn.optim",
    "transforms": "torchfn.transforms",
    "losses": "torchfn.losses",
    "models": "torchfn.models",
    "kernels": "torchfn.kernels",
    "data": "torchfn.data",
    "train": "torchfn.train",
    # pure models and checkpoints
    "Model": "torchfn.core.module",
    "save": "torchfn.core.checkpoint",
    "load": "torchfn.core.checkpoint",
    "CheckpointError": "torchfn.core.checkpoint",
    "load_metadata": "torchfn.core.checkpoint",
    "remat": "torchfn.core.remat",
    "checkpoint_policies": "torchfn.core.checkpoint_policies",
    "checkpoint_name": "torchfn.core.checkpoint_policies",
    "custom_vjp": "torchfn.core.custom_vjp",
    "custom_jvp": "torchfn.core.custom_jvp",
    "scan": "torchfn.core.scan",
    "associative_scan": "torchfn.core.associative_scan",
    "cond": "torchfn.core.control_flow",
    "switch": "torchfn.core.control_flow",
    "while_loop": "torchfn.core.control_flow",
    "fori_loop": "torchfn.core.control_flow",
    "segment_sum": "torchfn.core.segment",
    "segment_mean": "torchfn.core.segment",
    "segment_max": "torchfn.core.segment",
    "segment_min": "torchfn.core.segment",
    "segment_softmax": "torchfn.core.segment",
    # training
    "TrainState": "torchfn.train",
    "make_train_step": "torchfn.train",
    "fit": "torchfn.train",
}

_MODULES = {"checkpoint_policies"}  # modules exported from deeper down

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    try:
        module_name = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'torchfn' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    is_module = module_name == f"torchfn.{name}" or name in _MODULES
    value = module if is_module else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
