"""SGD with momentum, dampening, Nesterov and L2 weight decay (``torch.optim.SGD``).

    g = g + wd * p
    buf = g                                   (first step)
    buf = momentum * buf + (1 - dampening) g  (later steps)
    d = g + momentum * buf if nesterov else buf
    update = -lr * d
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from torchfn.optim import _checks, _ops
from torchfn.optim._base import GradientTransformation, check_state, lr_at, new_count
from torchfn.optim._tree import check_params, check_structure

__all__ = ["SGDState", "sgd"]


class SGDState(NamedTuple):
    count: Tensor  # () int32
    momentum_buffer: Any  # params' structure, or () without momentum (no leaves: vmaps)


def sgd(
    lr: Any = 1e-3,
    momentum: Any = 0.0,
    dampening: Any = 0.0,
    weight_decay: Any = 0.0,
    nesterov: bool = False,
) -> GradientTransformation:
    """Stochastic gradient descent, equal to ``torch.optim.SGD`` to float rounding.

    Args:
        lr: learning rate >= 0, a 0-d tensor, or a schedule ``step -> lr``.
        momentum: heavy-ball coefficient in [0, 1).
        dampening: scales the gradient in the momentum buffer by ``1 - dampening``
            (not on the first step, as torch).
        weight_decay: L2 penalty ``g + wd * p``; needs params.
        nesterov: Nesterov momentum (needs momentum > 0 and dampening 0).

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.sgd(0.1, momentum=0.9)
        >>> g = {"w": torch.ones(2)}
        >>> u, state = tx.update(g, tx.init(g))
        >>> u, state = tx.update(g, state)
        >>> u["w"]
        tensor([-0.1900, -0.1900])
    """
    _checks.lr(lr)
    _checks.unit_interval("momentum", momentum)
    _checks.unit_interval("dampening", dampening)
    _checks.nonneg("weight_decay", weight_decay)
    if not isinstance(nesterov, bool):
        raise TypeError(f"nesterov must be a bool, got {nesterov!r}")
    static_bad = _checks.is_zero(momentum) or (
        not isinstance(dampening, Tensor) and dampening != 0
    )
    if nesterov and static_bad:
        raise ValueError(
            f"nesterov=True needs momentum > 0 and dampening == 0, "
            f"got momentum={momentum}, dampening={dampening}"
        )
    has_momentum = not _checks.is_zero(momentum)
    has_dampening = not _checks.is_zero(dampening)
    has_wd = not _checks.is_zero(weight_decay)

    def init(params: Any) -> SGDState:
        leaves, spec = optree.tree_flatten(params)
        buf = optree.tree_unflatten(spec, _ops.zeros_like(leaves)) if has_momentum else ()
        return SGDState(new_count(leaves), buf)

    def update(grads: Any, state: SGDState, params: Any = None, *, inplace: Any = None):
        check_state(state, SGDState, "sgd")
        g, spec = optree.tree_flatten(grads)
        lr_t = lr_at(lr, state.count)
        if has_wd:
            g = _ops.add(g, check_params(params, spec, "sgd with weight_decay"),
                         alpha=weight_decay)
        buf_tree = ()
        if has_momentum:
            buf = check_structure(state.momentum_buffer, "optimizer state", grads, "grads")
            buf = _ops.mul(buf, momentum)  # 0 on the first step
            if has_dampening:  # torch: the first step takes g undamped
                coef = torch.where(state.count == 0, 1.0, 1.0 - dampening)
                buf = _ops.add_(buf, g, alpha=coef)
            else:
                buf = _ops.add_(buf, g)
            d = _ops.add(g, buf, alpha=momentum) if nesterov else buf
            buf_tree = optree.tree_unflatten(spec, buf)
        else:
            d = g
        updates = _ops.mul(d, -lr_t)
        return optree.tree_unflatten(spec, updates), SGDState(state.count + 1, buf_tree)

    return GradientTransformation(init, update)
