"""The checks every checkpoint loader and exporter makes: the tensors a module has, no
others, each of its shape; with errors that name what is missing, unused or misshapen."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["check_fit", "check_params_for"]


def check_fit(want: Mapping[str, tuple], got: Mapping[str, Tensor], what: str) -> None:
    """``got`` holds exactly the names of ``want`` (name -> shape), each of its shape, or a
    ValueError: ``{what} does not fit the config: missing [...], unused [...], (name, got,
    want) [...]``."""
    shapes = {n: tuple(t.shape) for n, t in got.items()}
    missing, extra = sorted(set(want) - set(shapes)), sorted(set(shapes) - set(want))
    wrong = [(n, shapes[n], want[n]) for n in want if n in shapes and shapes[n] != want[n]]
    if missing or extra or wrong:
        raise ValueError(f"{what} does not fit the config: missing {missing[:5]}, unused "
                         f"{extra[:5]}, (name, got, want) {wrong[:3]}")


def param_shapes(module: nn.Module) -> dict[str, tuple]:
    """``{name: shape}`` of a module's parameters."""
    return {n: tuple(p.shape) for n, p in module.named_parameters()}


def check_params_for(build: Any, kwargs: Mapping[str, Any], params: Any) -> None:
    """``params`` fit the module ``build(**kwargs)`` (built on the meta device: no memory),
    for an exporter."""
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a dict of tensors, got {type(params).__name__}")
    with torch.device("meta"):
        want = param_shapes(build(**kwargs))
    check_fit(want, params, "params")
