"""LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning") and its
layer-wise trust ratio, as optax's ``lamb`` / ``scale_by_trust_ratio``.

    u = m_hat / (sqrt(v_hat + eps_root) + eps) + wd p       (Adam's direction, decayed)
    r = ||p|| / ||u||  per leaf (1 where either norm is 0)
    update = -lr r u

LARS is ``chain(add_decayed_weights(wd), scale_by_trust_ratio(trust_coefficient=1e-3),
sgd(lr, momentum=0.9))``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from torchfn.optim import _checks, _ops
from torchfn.optim._base import (
    EmptyState,
    GradientTransformation,
    check_state,
    lr_at,
    new_count,
)
from torchfn.optim._masking import resolve_mask
from torchfn.optim._tree import check_params, check_structure

__all__ = ["LambState", "lamb", "scale_by_trust_ratio"]


class LambState(NamedTuple):
    count: Tensor  # () int32, steps taken
    mu: Any  # first moments, params' structure
    nu: Any  # second moments, params' structure


def _trust_ratios(p: list[Tensor], u: list[Tensor], min_norm, coefficient, eps) -> list[Tensor]:
    """``coefficient * ||p|| / (||u|| + eps)`` per leaf; 1 where either norm is 0."""
    out = []
    for pn, un in zip(_ops.norms(p), _ops.norms(u)):
        pn, un = torch.clamp(pn, min=min_norm), torch.clamp(un, min=min_norm)
        ratio = coefficient * pn / (un + eps)
        out.append(torch.where((pn == 0) | (un == 0), torch.ones_like(ratio), ratio))
    return out


def scale_by_trust_ratio(
    min_norm: float = 0.0, trust_coefficient: float = 1.0, eps: float = 0.0
) -> GradientTransformation:
    """Scale each leaf's update by ``trust_coefficient * ||p|| / (||u|| + eps)``.

    The layer-wise adaptation of LARS and LAMB. Norms are floored at ``min_norm``;
    where the param or the update norm is 0 the ratio is 1. Needs params.

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.scale_by_trust_ratio()
        >>> p = {"w": torch.full((4,), 3.0)}
        >>> u, _ = tx.update({"w": torch.ones(4)}, tx.init(p), p)
        >>> u["w"]  # rescaled to p's norm
        tensor([3., 3., 3., 3.])
    """
    _checks.nonneg("min_norm", min_norm)
    _checks.nonneg("trust_coefficient", trust_coefficient)
    _checks.nonneg("eps", eps)

    def init(params: Any) -> EmptyState:
        return EmptyState()

    def update(grads: Any, state: Any, params: Any = None, *, inplace: Any = None):
        u, spec = optree.tree_flatten(grads)
        p = check_params(params, spec, "scale_by_trust_ratio")
        ratios = _trust_ratios(p, u, min_norm, trust_coefficient, eps)
        return optree.tree_unflatten(spec, [x * r for x, r in zip(u, ratios)]), state

    return GradientTransformation(init, update)


def lamb(
    lr: Any = 1e-3,
    betas: tuple[Any, Any] = (0.9, 0.999),
    eps: Any = 1e-6,
    weight_decay: Any = 0.0,
    *,
    eps_root: Any = 0.0,
    mask: Any = None,
) -> GradientTransformation:
    """LAMB: Adam's direction plus decay, rescaled per leaf to the param's norm.

    Equal to optax's ``lamb`` (same argument names; ``betas`` for ``b1, b2``).

    Args:
        lr: learning rate >= 0, a 0-d tensor or a schedule.
        betas: decay rates of the first and second moments, each in [0, 1).
        eps: added to the denominator outside the square root.
        weight_decay: added to the direction before the trust ratio (needs params).
        eps_root: added inside the square root.
        mask: where ``weight_decay`` applies (a tree of bools or ``params -> tree``).

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.lamb(0.1)
        >>> p = {"w": torch.full((4,), 2.0)}
        >>> u, _ = tx.update({"w": torch.ones(4)}, tx.init(p), p)
        >>> u["w"]  # the update's norm is lr * ||p||
        tensor([-0.2000, -0.2000, -0.2000, -0.2000])
    """
    _checks.lr(lr)
    b1, b2 = _checks.betas(betas)
    _checks.nonneg("eps", eps)
    _checks.nonneg("eps_root", eps_root)
    _checks.nonneg("weight_decay", weight_decay)
    has_wd = not _checks.is_zero(weight_decay)

    def init(params: Any) -> LambState:
        leaves, spec = optree.tree_flatten(params)
        return LambState(
            new_count(leaves),
            optree.tree_unflatten(spec, _ops.zeros_like(leaves)),
            optree.tree_unflatten(spec, _ops.zeros_like(leaves)),
        )

    def update(grads: Any, state: LambState, params: Any = None, *, inplace: Any = None):
        check_state(state, LambState, "lamb")
        g, spec = optree.tree_flatten(grads)
        mu = check_structure(state.mu, "optimizer state", grads, "grads")
        nu = optree.tree_leaves(state.nu)
        p = check_params(params, spec, "lamb")
        lr_t = lr_at(lr, state.count)
        count = state.count + 1
        mu = _ops.lerp(mu, g, 1 - b1)
        nu = _ops.addcmul_(_ops.mul(nu, b2), g, g, 1 - b2)

        t = count.to(torch.float64)
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        v_hat = _ops.mul(nu, 1 / bc2)
        if not _checks.is_zero(eps_root):
            v_hat = _ops.add_scalar_(v_hat, eps_root)
        root = _ops.sqrt(v_hat)
        denom = _ops.add_scalar_(root, eps)
        direction = _ops.mul_(_ops.div_list(mu, denom), 1 / bc1)
        if has_wd:
            if mask is None:
                direction = _ops.add_(direction, p, alpha=weight_decay)
            else:
                keep = resolve_mask(mask, params, "mask")
                for i, k in enumerate(keep):
                    if k:
                        direction[i] = direction[i] + weight_decay * p[i]
        ratios = _trust_ratios(p, direction, 0.0, 1.0, 0.0)
        updates = [d * (-lr_t * r) for d, r in zip(direction, ratios)]
        new_state = LambState(
            count, optree.tree_unflatten(spec, mu), optree.tree_unflatten(spec, nu)
        )
        return optree.tree_unflatten(spec, updates), new_state

    return GradientTransformation(init, update)
