"""RMSprop, equal to ``torch.optim.RMSprop`` (eps outside the square root).

    v = alpha v + (1 - alpha) g^2
    avg = sqrt(v - gbar^2) + eps   (centered, gbar = alpha gbar + (1 - alpha) g)
    avg = sqrt(v) + eps            (otherwise)
    buf = momentum buf + g / avg;  update = -lr buf   (momentum > 0)
    update = -lr g / avg                              (otherwise)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
from torch import Tensor

from torchfn.optim import _checks, _ops
from torchfn.optim._base import GradientTransformation, check_state, lr_at, new_count
from torchfn.optim._tree import check_params, check_structure

__all__ = ["RMSpropState", "rmsprop"]


class RMSpropState(NamedTuple):
    count: Tensor  # () int32
    square_avg: Any  # params' structure
    grad_avg: Any  # params' structure if centered, else () (no leaves: vmaps)
    momentum_buffer: Any  # params' structure if momentum, else ()


def rmsprop(
    lr: Any = 1e-2,
    alpha: Any = 0.99,
    eps: Any = 1e-8,
    weight_decay: Any = 0.0,
    momentum: Any = 0.0,
    centered: bool = False,
) -> GradientTransformation:
    """RMSprop (Hinton), equal to ``torch.optim.RMSprop`` to float rounding.

    Args:
        lr: learning rate >= 0, a 0-d tensor, or a schedule ``step -> lr``.
        alpha: smoothing constant of the squared-gradient average, in [0, 1).
        eps: added to the square root.
        weight_decay: L2 penalty ``g + wd * p``; needs params.
        momentum: momentum coefficient in [0, 1).
        centered: normalise by the estimated variance instead of the second moment.

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.rmsprop(0.01)
        >>> g = {"w": torch.ones(2)}
        >>> u, _ = tx.update(g, tx.init(g))
        >>> u["w"]
        tensor([-0.1000, -0.1000])
    """
    _checks.lr(lr)
    _checks.unit_interval("alpha", alpha)
    _checks.nonneg("eps", eps)
    _checks.nonneg("weight_decay", weight_decay)
    _checks.unit_interval("momentum", momentum)
    if not isinstance(centered, bool):
        raise TypeError(f"centered must be a bool, got {centered!r}")
    has_momentum = not _checks.is_zero(momentum)
    has_wd = not _checks.is_zero(weight_decay)

    def init(params: Any) -> RMSpropState:
        leaves, spec = optree.tree_flatten(params)

        def zeros():
            return optree.tree_unflatten(spec, _ops.zeros_like(leaves))

        return RMSpropState(
            new_count(leaves),
            zeros(),
            zeros() if centered else (),
            zeros() if has_momentum else (),
        )

    def update(grads: Any, state: RMSpropState, params: Any = None, *, inplace: Any = None):
        check_state(state, RMSpropState, "rmsprop")
        g, spec = optree.tree_flatten(grads)
        sq = check_structure(state.square_avg, "optimizer state", grads, "grads")
        lr_t = lr_at(lr, state.count)
        if has_wd:
            p = check_params(params, spec, "rmsprop with weight_decay")
            g = _ops.add(g, p, alpha=weight_decay)
        sq = _ops.addcmul_(_ops.mul(sq, alpha), g, g, 1 - alpha)
        gbar_tree = ()
        if centered:
            gbar = _ops.lerp(optree.tree_leaves(state.grad_avg), g, 1 - alpha)
            avg = _ops.sqrt(_ops.addcmul(sq, gbar, gbar, -1.0))
            gbar_tree = optree.tree_unflatten(spec, gbar)
        else:
            avg = _ops.sqrt(sq)
        avg = _ops.add_scalar_(avg, eps)
        buf_tree = ()
        if has_momentum:
            buf = _ops.mul(optree.tree_leaves(state.momentum_buffer), momentum)
            buf = _ops.add_(buf, _ops.div_list(g, avg))
            updates = _ops.mul(buf, -lr_t)
            buf_tree = optree.tree_unflatten(spec, buf)
        else:
            updates = _ops.mul_(_ops.div_list(g, avg), -lr_t)
        new_state = RMSpropState(
            state.count + 1, optree.tree_unflatten(spec, sq), gbar_tree, buf_tree
        )
        return optree.tree_unflatten(spec, updates), new_state

    return GradientTransformation(init, update)
