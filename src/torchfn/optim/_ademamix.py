"""AdEMAMix (Pagliardini et al. 2024, "The AdEMAMix Optimizer: Better, Faster, Older"):
Adam plus a second, much slower gradient EMA that keeps old gradients in play.

    m1 = b1 m1 + (1 - b1) g        m2 = b3 m2 + (1 - b3) g        v = b2 v + (1 - b2) g^2
    update = -lr ((m1 / (1 - b1^t) + alpha m2) / (sqrt(v / (1 - b2^t)) + eps) + wd p)

With ``warmup`` (the paper's ``T_alpha_beta3``), ``alpha`` grows linearly from 0 and
``b3`` from ``b1`` (linearly in the half-life ``1 / log b``), both reaching their values
at step ``warmup``; the slow EMA (``b3 = 0.9999``) otherwise destabilises early training.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from torchfn.optim import _checks, _ops
from torchfn.optim._base import GradientTransformation, check_state, lr_at, new_count
from torchfn.optim._tree import check_params, check_structure

__all__ = ["AdEMAMixState", "ademamix"]


class AdEMAMixState(NamedTuple):
    count: Tensor  # () int32, steps taken
    mu: Any  # fast EMA of gradients (b1)
    mu_slow: Any  # slow EMA of gradients (b3)
    nu: Any  # EMA of squared gradients (b2)


def ademamix(
    lr: Any = 1e-3,
    betas: tuple[Any, Any, Any] = (0.9, 0.999, 0.9999),
    alpha: float = 5.0,
    warmup: int | None = None,
    eps: Any = 1e-8,
    weight_decay: Any = 0.0,
) -> GradientTransformation:
    """AdEMAMix: Adam's step plus ``alpha`` times a slow momentum.

    Args:
        lr: learning rate >= 0, a 0-d tensor, or a schedule ``step -> lr``.
        betas: ``(b1, b2, b3)``: the fast EMA, the second moment, the slow EMA.
        alpha: weight of the slow EMA (the paper's 5 to 10).
        warmup: steps over which ``alpha`` and ``b3`` rise to their values (the paper
            sets it to the run's length); ``None`` uses them from the start.
        eps: added to the denominator.
        weight_decay: decoupled (needs params), as the paper's.

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.ademamix(0.1, alpha=5.0)
        >>> g = {"w": torch.tensor([2.0, -1.0])}
        >>> u, _ = tx.update(g, tx.init(g))
        >>> u["w"]  # -lr (sign(g) + alpha (1 - b3) g / |g|)
        tensor([-0.1000,  0.1000])
    """
    _checks.lr(lr)
    b1, b2, b3 = _checks.betas3(betas)
    _checks.nonneg("alpha", alpha)
    if warmup is not None:
        _checks.positive_int("warmup", warmup)
        if not 0 < b1 and not isinstance(b1, Tensor):
            raise ValueError(f"warmup needs betas[0] > 0 (b3 starts there), got {b1}")
    _checks.nonneg("eps", eps)
    _checks.nonneg("weight_decay", weight_decay)
    has_wd = not _checks.is_zero(weight_decay)

    def schedules(t: Tensor) -> tuple[Any, Any]:
        if warmup is None:
            return alpha, b3
        frac = t / warmup
        alpha_t = torch.clamp(frac * alpha, max=alpha)
        lb1, lb3 = math.log(b1), math.log(b3)
        b3_t = torch.clamp(torch.exp(lb1 * lb3 / ((1 - frac) * lb3 + frac * lb1)), max=b3)
        return alpha_t, b3_t

    def init(params: Any) -> AdEMAMixState:
        leaves, spec = optree.tree_flatten(params)
        zeros = lambda: optree.tree_unflatten(spec, _ops.zeros_like(leaves))  # noqa: E731
        return AdEMAMixState(new_count(leaves), zeros(), zeros(), zeros())

    def update(grads: Any, state: AdEMAMixState, params: Any = None, *, inplace: Any = None):
        check_state(state, AdEMAMixState, "ademamix")
        g, spec = optree.tree_flatten(grads)
        mu = check_structure(state.mu, "optimizer state", grads, "grads")
        mu_slow, nu = optree.tree_leaves(state.mu_slow), optree.tree_leaves(state.nu)
        p = check_params(params, spec, "ademamix with weight_decay") if has_wd else None
        lr_t = lr_at(lr, state.count)
        count = state.count + 1
        t = count.to(torch.float64)
        alpha_t, b3_t = schedules(t)
        mu = _ops.lerp(mu, g, 1 - b1)
        if warmup is None:
            mu_slow = _ops.lerp(mu_slow, g, 1 - b3)
        else:  # a float64 0-d weight: lerp wants the leaves' dtype
            mu_slow = [torch.lerp(m, x, (1 - b3_t).to(x.dtype)) for m, x in zip(mu_slow, g)]
        nu = _ops.addcmul_(_ops.mul(nu, b2), g, g, 1 - b2)
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        denom = _ops.add_scalar_(_ops.div_(_ops.sqrt(nu), torch.sqrt(bc2)), eps)
        step = _ops.add_(_ops.mul(mu, 1 / bc1), mu_slow, alpha=alpha_t)
        updates = _ops.mul_(_ops.div_list(step, denom), -lr_t)
        if has_wd:
            updates = _ops.add_(updates, p, alpha=-lr_t * weight_decay)
        new_state = AdEMAMixState(count, *(optree.tree_unflatten(spec, x)
                                           for x in (mu, mu_slow, nu)))
        return optree.tree_unflatten(spec, updates), new_state

    return GradientTransformation(init, update)
