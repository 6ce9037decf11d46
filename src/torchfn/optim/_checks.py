"""Argument checks with messages that name the argument, the expectation and the value.

Tensor-valued hyperparameters (``inject_hyperparams``, ``vmap`` over an ensemble)
are not checked: reading their value would sync the device or fail under vmap.
"""

from __future__ import annotations

import numbers
from typing import Any

from torch import Tensor


def _number(name: str, value: Any) -> bool:
    """True for a Python/numpy real number; False for a tensor; TypeError otherwise."""
    if isinstance(value, Tensor):
        if value.ndim != 0:
            raise ValueError(
                f"{name} must be a scalar (0-d tensor), got shape {tuple(value.shape)}"
            )
        return False
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number or a 0-d tensor, got {value!r}")
    return True


def nonneg(name: str, value: Any) -> None:
    if _number(name, value) and not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def positive(name: str, value: Any) -> None:
    if _number(name, value) and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def unit_interval(name: str, value: Any) -> None:
    """0 <= value < 1 (betas, decays, momentum-like coefficients)."""
    if _number(name, value) and not 0 <= value < 1:
        raise ValueError(f"{name} must be in [0, 1), got {value}")


def positive_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def lr(value: Any, name: str = "lr") -> None:
    """A learning rate: number >= 0, 0-d tensor, or a schedule ``step -> lr``."""
    if callable(value) and not isinstance(value, Tensor):
        return
    nonneg(name, value)


def betas(value: Any) -> tuple[Any, Any]:
    try:
        b1, b2 = value
    except (TypeError, ValueError):
        raise ValueError(f"betas must be a pair (beta1, beta2), got {value!r}") from None
    unit_interval("betas[0]", b1)
    unit_interval("betas[1]", b2)
    return b1, b2


def betas3(value: Any) -> tuple[Any, Any, Any]:
    try:
        b1, b2, b3 = value
    except (TypeError, ValueError):
        raise ValueError(f"betas must be a triple (beta1, beta2, beta3), got {value!r}") from None
    for i, b in enumerate((b1, b2, b3)):
        unit_interval(f"betas[{i}]", b)
    return b1, b2, b3


def is_zero(value: Any) -> bool:
    """Statically zero (a Python 0); a tensor is never statically zero."""
    return not isinstance(value, Tensor) and value == 0
