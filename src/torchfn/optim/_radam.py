"""RAdam (Liu et al. 2020, "On the Variance of the Adaptive Learning Rate"), equal to
``torch.optim.RAdam``.

    m = b1 m + (1 - b1) g          v = b2 v + (1 - b2) g^2
    rho_inf = 2 / (1 - b2) - 1     rho_t = rho_inf - 2 t b2^t / (1 - b2^t)
    if rho_t > 5:  update = -lr m / (1 - b1^t) * r_t sqrt(1 - b2^t) / (sqrt(v) + eps)
    else:          update = -lr m / (1 - b1^t)                  (SGD with momentum)
    r_t = sqrt((rho_t - 4)(rho_t - 2) rho_inf / ((rho_inf - 4)(rho_inf - 2) rho_t))

The branch is taken with ``torch.where`` on 0-d tensors, so no step reads the
counter back to the host (compiles without graph breaks, works under ``vmap``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from torchfn.optim import _checks, _ops
from torchfn.optim._base import GradientTransformation, check_state, lr_at, new_count
from torchfn.optim._tree import check_params, check_structure

__all__ = ["RAdamState", "radam"]


class RAdamState(NamedTuple):
    count: Tensor  # () int32, steps taken
    mu: Any  # first moments, params' structure
    nu: Any  # second moments, params' structure


def radam(
    lr: Any = 1e-3,
    betas: tuple[Any, Any] = (0.9, 0.999),
    eps: Any = 1e-8,
    weight_decay: Any = 0.0,
    *,
    decoupled_weight_decay: bool = False,
) -> GradientTransformation:
    """RAdam: Adam whose adaptive step is switched on once its variance is tractable.

    Args:
        lr: learning rate >= 0, a 0-d tensor, or a schedule ``step -> lr``.
        betas: decay rates of the first and second moments, each in [0, 1).
        eps: added to the denominator.
        weight_decay: L2 penalty (needs params), decoupled with
            ``decoupled_weight_decay=True``.

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.radam(0.1)
        >>> g = {"w": torch.tensor([2.0, -1.0])}
        >>> u, _ = tx.update(g, tx.init(g))
        >>> u["w"]  # the first steps are SGD with momentum: -lr * g
        tensor([-0.2000,  0.1000])
    """
    _checks.lr(lr)
    b1, b2 = _checks.betas(betas)
    _checks.nonneg("eps", eps)
    _checks.nonneg("weight_decay", weight_decay)
    has_wd = not _checks.is_zero(weight_decay)

    def init(params: Any) -> RAdamState:
        leaves, spec = optree.tree_flatten(params)
        return RAdamState(
            new_count(leaves),
            optree.tree_unflatten(spec, _ops.zeros_like(leaves)),
            optree.tree_unflatten(spec, _ops.zeros_like(leaves)),
        )

    def update(grads: Any, state: RAdamState, params: Any = None, *, inplace: Any = None):
        check_state(state, RAdamState, "radam")
        g, spec = optree.tree_flatten(grads)
        mu = check_structure(state.mu, "optimizer state", grads, "grads")
        nu = optree.tree_leaves(state.nu)
        p = check_params(params, spec, "radam with weight_decay") if has_wd else None
        lr_t = lr_at(lr, state.count)
        count = state.count + 1
        if has_wd and not decoupled_weight_decay:
            g = _ops.add(g, p, alpha=weight_decay)
        mu = _ops.lerp(mu, g, 1 - b1)
        nu = _ops.addcmul_(_ops.mul(nu, b2), g, g, 1 - b2)

        t = count.to(torch.float64)
        bc1 = 1 - b1**t
        bc2 = 1 - b2**t
        rho_inf = 2 / (1 - b2) - 1
        rho_t = rho_inf - 2 * t * b2**t / bc2
        adaptive = rho_t > 5.0
        rect_sq = (rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)
        rect = torch.sqrt(torch.where(adaptive, rect_sq, 1.0))
        # update = -lr / bc1 * m * (adaptive ? rect sqrt(bc2) / (sqrt(v) + eps) : 1)
        scale = -lr_t / bc1
        c_adapt = torch.where(adaptive, scale * rect * torch.sqrt(bc2), 0.0)
        c_plain = torch.where(adaptive, 0.0, scale)
        denom = _ops.add_scalar_(_ops.sqrt(nu), eps)
        updates = _ops.add_(_ops.mul_(_ops.div_list(mu, denom), c_adapt), mu, alpha=c_plain)
        if has_wd and decoupled_weight_decay:
            updates = _ops.add_(updates, p, alpha=-lr_t * weight_decay)
        new_state = RAdamState(
            count, optree.tree_unflatten(spec, mu), optree.tree_unflatten(spec, nu)
        )
        return optree.tree_unflatten(spec, updates), new_state

    return GradientTransformation(init, update)
