"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

    c = b1 m + (1 - b1) g
    update = -lr (sign(c) + wd p)
    m = b2 m + (1 - b2) g
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
from torch import Tensor

from torchfn.optim import _checks, _ops
from torchfn.optim._base import GradientTransformation, check_state, lr_at, new_count
from torchfn.optim._tree import check_params, check_structure

__all__ = ["LionState", "lion"]


class LionState(NamedTuple):
    count: Tensor  # () int32
    mu: Any  # momentum, params' structure


def lion(
    lr: Any = 1e-4,
    betas: tuple[Any, Any] = (0.9, 0.99),
    weight_decay: Any = 0.0,
) -> GradientTransformation:
    """Lion: the sign of an interpolated momentum, with decoupled weight decay.

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.lion(0.1)
        >>> g = {"w": torch.tensor([2.0, -3.0])}
        >>> u, _ = tx.update(g, tx.init(g))
        >>> u["w"]
        tensor([-0.1000,  0.1000])
    """
    _checks.lr(lr)
    b1, b2 = _checks.betas(betas)
    _checks.nonneg("weight_decay", weight_decay)
    has_wd = not _checks.is_zero(weight_decay)

    def init(params: Any) -> LionState:
        leaves, spec = optree.tree_flatten(params)
        return LionState(new_count(leaves), optree.tree_unflatten(spec, _ops.zeros_like(leaves)))

    def update(grads: Any, state: LionState, params: Any = None, *, inplace: Any = None):
        check_state(state, LionState, "lion")
        g, spec = optree.tree_flatten(grads)
        mu = check_structure(state.mu, "optimizer state", grads, "grads")
        lr_t = lr_at(lr, state.count)
        direction = _ops.sign(_ops.lerp(mu, g, 1 - b1))
        if has_wd:
            p = check_params(params, spec, "lion with weight_decay")
            direction = _ops.add_(direction, p, alpha=weight_decay)
        updates = _ops.mul_(direction, -lr_t)
        mu = _ops.lerp(mu, g, 1 - b2)
        new_state = LionState(state.count + 1, optree.tree_unflatten(spec, mu))
        return optree.tree_unflatten(spec, updates), new_state

    return GradientTransformation(init, update)
