"""Adadelta (Zeiler 2012), equal to ``torch.optim.Adadelta``.

    s = rho s + (1 - rho) g^2
    delta = sqrt(a + eps) / sqrt(s + eps) * g
    a = rho a + (1 - rho) delta^2
    update = -lr delta
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
from torch import Tensor

from torchfn.optim import _checks, _ops
from torchfn.optim._base import GradientTransformation, check_state, lr_at, new_count
from torchfn.optim._tree import check_params, check_structure

__all__ = ["AdadeltaState", "adadelta"]


class AdadeltaState(NamedTuple):
    count: Tensor  # () int32, steps taken
    square_avg: Any  # running mean of g^2, params' structure
    acc_delta: Any  # running mean of delta^2, params' structure


def adadelta(
    lr: Any = 1.0,
    rho: Any = 0.9,
    eps: Any = 1e-6,
    weight_decay: Any = 0.0,
) -> GradientTransformation:
    """Adadelta, equal to ``torch.optim.Adadelta`` to float rounding.

    Args:
        lr: scale of the step (1.0 in the paper), a 0-d tensor, or a schedule.
        rho: decay of both running means, in [0, 1).
        eps: added inside both square roots.
        weight_decay: L2 penalty added to the gradient; needs params.

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.adadelta()
        >>> g = {"w": torch.tensor([1.0, -1.0])}
        >>> u, _ = tx.update(g, tx.init(g))
        >>> u["w"]  # sqrt(eps) / sqrt(0.1 + eps) * -g
        tensor([-0.0032,  0.0032])
    """
    _checks.lr(lr)
    _checks.unit_interval("rho", rho)
    _checks.nonneg("eps", eps)
    _checks.nonneg("weight_decay", weight_decay)
    has_wd = not _checks.is_zero(weight_decay)

    def init(params: Any) -> AdadeltaState:
        leaves, spec = optree.tree_flatten(params)
        return AdadeltaState(
            new_count(leaves),
            optree.tree_unflatten(spec, _ops.zeros_like(leaves)),
            optree.tree_unflatten(spec, _ops.zeros_like(leaves)),
        )

    def update(grads: Any, state: AdadeltaState, params: Any = None, *, inplace: Any = None):
        check_state(state, AdadeltaState, "adadelta")
        g, spec = optree.tree_flatten(grads)
        sq = check_structure(state.square_avg, "optimizer state", grads, "grads")
        acc = optree.tree_leaves(state.acc_delta)
        lr_t = lr_at(lr, state.count)
        if has_wd:
            g = _ops.add(g, check_params(params, spec, "adadelta with weight_decay"),
                         alpha=weight_decay)
        sq = _ops.addcmul_(_ops.mul(sq, rho), g, g, 1 - rho)
        std = _ops.sqrt(_ops.add_scalar(sq, eps))
        delta = _ops.mul_list(_ops.div_list(_ops.sqrt(_ops.add_scalar(acc, eps)), std), g)
        acc = _ops.addcmul_(_ops.mul(acc, rho), delta, delta, 1 - rho)
        updates = _ops.mul(delta, -lr_t)
        new_state = AdadeltaState(
            state.count + 1, optree.tree_unflatten(spec, sq), optree.tree_unflatten(spec, acc)
        )
        return optree.tree_unflatten(spec, updates), new_state

    return GradientTransformation(init, update)
