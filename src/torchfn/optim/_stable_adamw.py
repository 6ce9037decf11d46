"""StableAdamW (Wortsman et al. 2023, "Stable and low-precision training for large-scale
vision-language models"): AdamW with AdaFactor's update clipping, as
``pytorch_optimizer.StableAdamW``. Per tensor, the step size is divided by

    RMS = max(1, sqrt(mean(g^2 / max(v, eps^2))))

so a gradient far larger than its running second moment (a loss spike's cause) takes
a smaller step instead of a huge one. The EMAs use debiased decay rates
``b_t = b (1 - b^(t-1)) / (1 - b^t)``, so ``m`` and ``v`` are unbiased without a
correction at the step:

    m = b1_t m + (1 - b1_t) g        v = b2_t v + (1 - b2_t) g^2
    p <- p (1 - lr' wd) - lr' m / (sqrt(v) + eps),    lr' = lr / RMS
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from torchfn.optim import _checks, _ops
from torchfn.optim._base import GradientTransformation, check_state, lr_at, new_count
from torchfn.optim._tree import check_params, check_structure

__all__ = ["StableAdamWState", "stable_adamw"]


class StableAdamWState(NamedTuple):
    count: Tensor  # () int32, steps taken
    mu: Any  # unbiased EMA of gradients
    nu: Any  # unbiased EMA of squared gradients


def _debiased(beta: float, t: Tensor) -> Tensor:
    """``b (1 - b^(t-1)) / (1 - b^t)``: the decay that keeps an EMA unbiased (0 at t = 1)."""
    return beta * (1 - beta ** (t - 1)) / (1 - beta**t)


def stable_adamw(
    lr: Any = 1e-3,
    betas: tuple[Any, Any] = (0.9, 0.99),
    eps: Any = 1e-8,
    weight_decay: Any = 1e-2,
    *,
    decoupled_weight_decay: bool = True,
) -> GradientTransformation:
    """StableAdamW: AdamW whose per-tensor step shrinks when ``g^2 / v`` is large.

    Args:
        lr: learning rate >= 0, a 0-d tensor, or a schedule ``step -> lr``.
        betas: decay rates of the two EMAs, in [0, 1) (debiased each step).
        eps: added to the root; ``eps^2`` floors ``v`` in the RMS.
        weight_decay: needs params; decoupled ``p (1 - lr' wd)`` with the clipped
            ``lr'``, or L2 (``g + wd p``) with ``decoupled_weight_decay=False``.

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.stable_adamw(0.1, weight_decay=0.0)
        >>> g = {"w": torch.tensor([2.0, -1.0])}
        >>> u, _ = tx.update(g, tx.init(g))
        >>> u["w"]  # first step: m = g, v = g^2, RMS = 1
        tensor([-0.1000,  0.1000])
    """
    _checks.lr(lr)
    b1, b2 = _checks.betas(betas)
    _checks.nonneg("eps", eps)
    _checks.nonneg("weight_decay", weight_decay)
    has_wd = not _checks.is_zero(weight_decay)

    def init(params: Any) -> StableAdamWState:
        leaves, spec = optree.tree_flatten(params)
        zeros = lambda: optree.tree_unflatten(spec, _ops.zeros_like(leaves))  # noqa: E731
        return StableAdamWState(new_count(leaves), zeros(), zeros())

    def update(grads: Any, state: StableAdamWState, params: Any = None, *, inplace: Any = None):
        check_state(state, StableAdamWState, "stable_adamw")
        g, spec = optree.tree_flatten(grads)
        mu = check_structure(state.mu, "optimizer state", grads, "grads")
        nu = optree.tree_leaves(state.nu)
        p = check_params(params, spec, "stable_adamw with weight_decay") if has_wd else None
        lr_t = lr_at(lr, state.count)
        count = state.count + 1
        t = count.to(torch.float64)
        if has_wd and not decoupled_weight_decay:
            g = _ops.add(g, p, alpha=weight_decay)
        d1, d2 = _debiased(b1, t), _debiased(b2, t)
        if g:  # float64 scalars in the leaves' dtype (a vmapped 0-d tensor would promote)
            d1, d2 = d1.to(g[0].dtype), d2.to(g[0].dtype)
        mu = _ops.lerp(mu, g, 1 - d1)
        nu = _ops.addcmul_(_ops.mul(nu, d2), g, g, 1 - d2)
        steps = _ops.div_into_(mu, _ops.add_scalar_(_ops.sqrt(nu), eps))  # m / (sqrt(v) + eps)
        mutate = _ops.can_mutate(steps)
        updates = []
        for i, (u, v, gi) in enumerate(zip(steps, nu, g)):
            ratio = v.clamp(min=eps * eps)  # fresh: g^2 / max(v, eps^2), one buffer
            ratio = ratio.reciprocal_().mul_(gi).mul_(gi) if mutate else gi * gi / ratio
            neg_lr = -lr_t / ratio.mean().sqrt().clamp(min=1.0)  # () the clipped step size
            u = u.mul_(neg_lr) if mutate else u * neg_lr
            if has_wd and decoupled_weight_decay:
                decay = neg_lr * weight_decay
                u = u.addcmul_(p[i], decay) if mutate else u + p[i] * decay
            updates.append(u.to(gi.dtype))
        new_state = StableAdamWState(count, optree.tree_unflatten(spec, mu),
                                     optree.tree_unflatten(spec, nu))
        return optree.tree_unflatten(spec, updates), new_state

    return GradientTransformation(init, update)
