"""Adan (Xie et al. 2022, "Adaptive Nesterov Momentum Algorithm"), as the authors'
implementation:

    d = g - g_prev                       (0 on the first step)
    m = b1 m + (1 - b1) g                 delta = b2 delta + (1 - b2) d
    n = b3 n + (1 - b3) (g + b2 d)^2
    u = (m / (1 - b1^t) + b2 delta / (1 - b2^t)) / (sqrt(n / (1 - b3^t)) + eps)
    p <- (p - lr u) / (1 + lr wd)         (proximal weight decay; or p (1 - lr wd) - lr u)

The betas are decay rates, ``(0.98, 0.92, 0.99)`` by default (the paper's ``1 - beta``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from torchfn.optim import _checks, _ops
from torchfn.optim._base import GradientTransformation, check_state, lr_at, new_count
from torchfn.optim._tree import check_params, check_structure

__all__ = ["AdanState", "adan"]


class AdanState(NamedTuple):
    count: Tensor  # () int32, steps taken
    mu: Any  # EMA of gradients
    delta: Any  # EMA of gradient differences
    nu: Any  # EMA of (g + b2 d)^2
    prev_grad: Any  # the last gradient


def adan(
    lr: Any = 1e-3,
    betas: tuple[Any, Any, Any] = (0.98, 0.92, 0.99),
    eps: Any = 1e-8,
    weight_decay: Any = 0.0,
    *,
    proximal: bool = True,
) -> GradientTransformation:
    """Adan: Adam with a Nesterov-style correction from successive gradient differences.

    Args:
        lr: learning rate >= 0, a 0-d tensor, or a schedule ``step -> lr``.
        betas: decay rates of the gradient, difference and squared-correction EMAs,
            each in [0, 1).
        eps: added to the denominator.
        weight_decay: needs params; the proximal step ``p / (1 + lr wd)`` after the update
            (the authors' default), or decoupled ``p (1 - lr wd)`` with ``proximal=False``.

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.adan(0.1)
        >>> g = {"w": torch.tensor([2.0, -1.0])}
        >>> u, _ = tx.update(g, tx.init(g))
        >>> u["w"]  # no difference yet: -lr sign(g)
        tensor([-0.1000,  0.1000])
    """
    _checks.lr(lr)
    b1, b2, b3 = _checks.betas3(betas)
    _checks.nonneg("eps", eps)
    _checks.nonneg("weight_decay", weight_decay)
    has_wd = not _checks.is_zero(weight_decay)

    def init(params: Any) -> AdanState:
        leaves, spec = optree.tree_flatten(params)
        zeros = lambda: optree.tree_unflatten(spec, _ops.zeros_like(leaves))  # noqa: E731
        return AdanState(new_count(leaves), zeros(), zeros(), zeros(), zeros())

    def update(grads: Any, state: AdanState, params: Any = None, *, inplace: Any = None):
        check_state(state, AdanState, "adan")
        g, spec = optree.tree_flatten(grads)
        mu = check_structure(state.mu, "optimizer state", grads, "grads")
        delta, nu, prev = (optree.tree_leaves(x) for x in (state.delta, state.nu,
                                                           state.prev_grad))
        p = check_params(params, spec, "adan with weight_decay") if has_wd else None
        lr_t = lr_at(lr, state.count)
        first = state.count == 0
        count = state.count + 1
        d = _ops.add(g, _ops.where(first, g, prev), alpha=-1.0)  # g - g_prev
        mu = _ops.lerp(mu, g, 1 - b1)
        delta = _ops.lerp(delta, d, 1 - b2)
        corr = _ops.add(g, d, alpha=b2)  # g + b2 d
        nu = _ops.addcmul_(_ops.mul(nu, b3), corr, corr, 1 - b3)
        t = count.to(torch.float64)
        bc1, bc2, bc3 = 1 - b1**t, 1 - b2**t, 1 - b3**t
        denom = _ops.add_scalar_(_ops.div_(_ops.sqrt(nu), torch.sqrt(bc3)), eps)
        # -lr u = (m + (b2 bc1 / bc2) delta) / denom * (-lr / bc1): one scaled add, one scale
        step = _ops.add(mu, delta, alpha=b2 * bc1 / bc2)
        updates = _ops.mul_(_ops.div_into_(step, denom), -lr_t / bc1)
        if has_wd:
            if proximal:  # (p - lr u) / (1 + lr wd) - p = (-lr u - lr wd p) / (1 + lr wd)
                updates = _ops.div_(_ops.add_(updates, p, alpha=-lr_t * weight_decay),
                                    1 + lr_t * weight_decay)
            else:
                updates = _ops.add_(updates, p, alpha=-lr_t * weight_decay)
        new_state = AdanState(count, *(optree.tree_unflatten(spec, x)
                                       for x in (mu, delta, nu, g)))
        return optree.tree_unflatten(spec, updates), new_state

    return GradientTransformation(init, update)
