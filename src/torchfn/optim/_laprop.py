"""LaProp (Ziyin et al. 2020, "LaProp: separating momentum and adaptivity in Adam"):
momentum of the *normalised* gradient, as ``pytorch_optimizer.LaProp``:

    v = b2 v + (1 - b2) g^2
    m = b1 m + (1 - b1) lr g / ((sqrt(v + eps_root) + eps) / sqrt(1 - b2^t))
    p <- (p - m / c) (1 - lr wd)

with ``c`` the learning-rate-weighted debias ``EMA_b1(lr) / lr`` (``1 - b1^t`` for a
constant lr). Adam divides the momentum by the root; LaProp divides each gradient
before it enters the momentum, so ``b1`` and ``b2`` need no ordering (``b1 > b2``
works) and a large gradient cannot blow up the step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from torchfn.optim import _checks, _ops
from torchfn.optim._base import GradientTransformation, check_state, lr_at, new_count
from torchfn.optim._tree import check_params, check_structure

__all__ = ["LaPropState", "laprop"]


class LaPropState(NamedTuple):
    count: Tensor  # () int32, steps taken
    mu: Any  # momentum of lr-scaled normalised gradients
    nu: Any  # EMA of squared gradients
    lr_avg: Tensor  # () float64: EMA_b1 of the learning rates (the momentum's debias)


def laprop(
    lr: Any = 4e-4,
    betas: tuple[Any, Any] = (0.9, 0.999),
    eps: Any = 1e-15,
    weight_decay: Any = 0.0,
    *,
    eps_root: Any = 1e-15,
) -> GradientTransformation:
    """LaProp: Adam with the normalisation inside the momentum.

    Args:
        lr: learning rate >= 0, a 0-d tensor, or a schedule ``step -> lr``.
        betas: decay rates of the momentum and of the squared-gradient EMA, in [0, 1).
        eps: added to the root (LaProp's default is tiny: 1e-15).
        weight_decay: needs params; decoupled, applied after the step as
            ``(p - m / c)(1 - lr wd)``.
        eps_root: added to ``v`` inside the root.

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.laprop(0.1)
        >>> g = {"w": torch.tensor([2.0, -1.0])}
        >>> u, _ = tx.update(g, tx.init(g))
        >>> u["w"]  # the first step is -lr sign(g)
        tensor([-0.1000,  0.1000])
    """
    _checks.lr(lr)
    b1, b2 = _checks.betas(betas)
    _checks.nonneg("eps", eps)
    _checks.nonneg("eps_root", eps_root)
    _checks.nonneg("weight_decay", weight_decay)
    has_wd = not _checks.is_zero(weight_decay)

    def init(params: Any) -> LaPropState:
        leaves, spec = optree.tree_flatten(params)
        zeros = lambda: optree.tree_unflatten(spec, _ops.zeros_like(leaves))  # noqa: E731
        count = new_count(leaves)
        return LaPropState(count, zeros(), zeros(),
                           torch.zeros((), dtype=torch.float64, device=count.device))

    def update(grads: Any, state: LaPropState, params: Any = None, *, inplace: Any = None):
        check_state(state, LaPropState, "laprop")
        g, spec = optree.tree_flatten(grads)
        mu = check_structure(state.mu, "optimizer state", grads, "grads")
        nu = optree.tree_leaves(state.nu)
        p = check_params(params, spec, "laprop with weight_decay") if has_wd else None
        lr_t = lr_at(lr, state.count)
        count = state.count + 1
        nu = _ops.addcmul_(_ops.mul(nu, b2), g, g, 1 - b2)
        lr_avg = state.lr_avg * b1 + (1 - b1) * lr_t
        lr64 = torch.as_tensor(lr_t, dtype=torch.float64, device=lr_avg.device)
        debias = torch.where(lr64 != 0, lr_avg / torch.where(lr64 != 0, lr64, 1.0), 1.0)
        root_bc = torch.sqrt(1 - b2 ** count.to(torch.float64))
        if g:  # float64 scalars in the leaves' dtype (a vmapped 0-d tensor would promote)
            debias, root_bc = debias.to(g[0].dtype), root_bc.to(g[0].dtype)
        root = _ops.add_scalar(nu, eps_root)  # fresh: the denominator, in place
        if _ops.can_mutate(root):
            torch._foreach_sqrt_(root)
        else:
            root = _ops.sqrt(root)
        denom = _ops.div_(_ops.add_scalar_(root, eps), root_bc)
        mu = _ops.add_(_ops.mul(mu, b1), _ops.div_into_(g, denom), alpha=(1 - b1) * lr_t)
        updates = _ops.mul(mu, -1.0 / debias)
        if has_wd:  # p' = (p + u)(1 - lr wd): u' = u (1 - lr wd) - lr wd p
            updates = _ops.add_(_ops.mul_(updates, 1 - lr_t * weight_decay), p,
                                alpha=-lr_t * weight_decay)
        new_state = LaPropState(count, optree.tree_unflatten(spec, mu),
                                optree.tree_unflatten(spec, nu), lr_avg)
        return optree.tree_unflatten(spec, updates), new_state

    return GradientTransformation(init, update)
