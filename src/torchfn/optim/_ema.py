"""Exponential moving averages: ``ema`` (of updates) and ``ema_params`` (of weights)."""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from torchfn.optim import _checks, _ops
from torchfn.optim._base import GradientTransformation, check_state, new_count
from torchfn.optim._tree import check_structure

__all__ = ["EmaState", "ema", "ema_params"]


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
