"""Exponential moving averages: ``ema`` (of updates) and ``ema_params`` (of weights)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from torchfn.optim import _checks, _ops
from torchfn.optim._base import GradientTransformation, check_state, new_count
from torchfn.optim._tree import check_structure

__all__ = ["EmaState", "ema", "ema_params", "power_ema_decay", "sigma_rel_to_gamma"]


class EmaState(NamedTuple):
    count: Tensor  # () int32
    ema: Any  # params' structure


def ema(decay: Any, debias: bool = True) -> GradientTransformation:
    """Replace updates by their moving average ``decay * ema + (1 - decay) * u``.

    With ``debias`` the average is divided by ``1 - decay**t`` (as Adam's first moment).

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.ema(0.9)
        >>> g = {"w": torch.ones(2)}
        >>> tx.update(g, tx.init(g))[0]["w"]
        tensor([1., 1.])
    """
    _checks.unit_interval("decay", decay)

    def init(params: Any) -> EmaState:
        leaves, spec = optree.tree_flatten(params)
        return EmaState(new_count(leaves), optree.tree_unflatten(spec, _ops.zeros_like(leaves)))

    def update(grads: Any, state: EmaState, params: Any = None, *, inplace: Any = None):
        check_state(state, EmaState, "ema")
        g, spec = optree.tree_flatten(grads)
        avg = _ops.lerp(check_structure(state.ema, "optimizer state", grads, "grads"), g, 1 - decay)
        count = state.count + 1
        out = avg
        if debias:
            out = _ops.mul(avg, 1.0 / (1 - decay ** count.to(torch.float64)))
        return optree.tree_unflatten(spec, out), EmaState(count, optree.tree_unflatten(spec, avg))

    return GradientTransformation(init, update)


def ema_params(ema_tree: Any, params: Any, decay: Any) -> Any:
    """One step of a parameter EMA: ``decay * ema_tree + (1 - decay) * params`` (pure).

    Equals ``torch.optim.swa_utils.get_ema_multi_avg_fn(decay)``; start from a copy
    of the initial params and evaluate with the averaged weights.

    Example:
        >>> import torch
        >>> from torchfn.optim import ema_params
        >>> ema_params({"w": torch.zeros(2)}, {"w": torch.ones(2)}, decay=0.9)["w"]
        tensor([0.1000, 0.1000])
    """
    _checks.unit_interval("decay", decay)
    leaves, spec = optree.tree_flatten(ema_tree)
    p = check_structure(params, "params", ema_tree, "ema_tree")
    return optree.tree_unflatten(spec, _ops.lerp(leaves, p, 1 - decay))


def sigma_rel_to_gamma(sigma_rel: float) -> float:
    """The power-function EMA's exponent ``gamma`` for a relative width ``sigma_rel``
    (EDM2, Karras et al. 2024): the root of ``sigma_rel^2 = (g + 1) / ((g + 2)^2 (g + 3))``.

    Example:
        >>> round(sigma_rel_to_gamma(0.10), 3)      # EDM2's widths are 0.05 to 0.15
        6.937
    """
    if not (isinstance(sigma_rel, (int, float)) and 0 < sigma_rel < 12 ** -0.5):
        raise ValueError(f"sigma_rel must lie in (0, 12^-1/2 = 0.2887), got {sigma_rel!r}")
    t = sigma_rel**-2
    # (g + 2)^2 (g + 3) = t (g + 1): g^3 + 7 g^2 + (16 - t) g + (12 - t) = 0, its largest root
    lo, hi = -1.0 + 1e-12, 1e6
    f = lambda g: ((g + 7) * g + 16 - t) * g + 12 - t  # noqa: E731
    for _ in range(200):  # bisection on the increasing branch right of the largest root
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return 0.5 * (lo + hi)


def power_ema_decay(step: int, *, gamma: float | None = None,
                    sigma_rel: float | None = None) -> float:
    """The decay of EDM2's power-function EMA at ``step`` (1, 2, ...):
    ``(1 - 1 / step)^(gamma + 1)``, for :func:`ema_params`. After ``T`` steps the average
    weighs the ``i``-th params about ``(gamma + 1) i^gamma / T^(gamma + 1)``: a profile
    that scales with the run's length (a plain EMA's forgets at a fixed rate). Give
    ``gamma`` or the width ``sigma_rel`` (0.05 to 0.15 in EDM2).

    Example:
        >>> [round(power_ema_decay(t, gamma=6.94), 3) for t in (1, 10, 1000)]
        [0.0, 0.433, 0.992]
    """
    if (gamma is None) == (sigma_rel is None):
        raise ValueError("give exactly one of gamma and sigma_rel")
    if gamma is None:
        gamma = sigma_rel_to_gamma(sigma_rel)
    if not gamma > -1:
        raise ValueError(f"gamma must be > -1, got {gamma!r}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1, got {step!r}")
    return math.pow(1.0 - 1.0 / step, gamma + 1.0)
