"""ADOPT (Taniguchi et al. 2024, "ADOPT: Modified Adam Can Converge with Any beta2"),
as the authors' implementation:

    step 1:  v = g^2, no update
    then:    m = b1 m + (1 - b1) clip(g / max(sqrt(v), eps), t^(1/4))
             update = -lr m
             v = b2 v + (1 - b2) g^2

The gradient is normalised by the second moment of the *previous* steps (so the two
are independent), and momentum is taken after normalising; this removes Adam's
divergence on problems where beta2 is too small. The clip (``|x| <= t^(1/4)`` at step
``t``) keeps the first steps, where ``v`` is one sample, bounded.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from torchfn.optim import _checks, _ops
from torchfn.optim._base import GradientTransformation, check_state, lr_at, new_count
from torchfn.optim._tree import check_params, check_structure

__all__ = ["ADOPTState", "adopt"]


class ADOPTState(NamedTuple):
    count: Tensor  # () int32, steps taken
    mu: Any  # momentum of the normalised gradients
    nu: Any  # EMA of squared gradients, up to the previous step


def adopt(
    lr: Any = 1e-3,
    betas: tuple[Any, Any] = (0.9, 0.9999),
    eps: Any = 1e-6,
    weight_decay: Any = 0.0,
    *,
    clip_power: float | None = 0.25,
    decoupled_weight_decay: bool = False,
) -> GradientTransformation:
    """ADOPT: Adam with the normalisation taken from the past and momentum after it.

    Args:
        lr: learning rate >= 0, a 0-d tensor, or a schedule ``step -> lr``.
        betas: decay rates of the momentum and the second moment, each in [0, 1).
        eps: the floor of ``sqrt(v)``.
        weight_decay: an L2 penalty on the gradient (the authors' default; needs params),
            or decoupled (AdamW's, applied on the first step too) with
            ``decoupled_weight_decay=True``.
        clip_power: clip the normalised gradient to ``t^clip_power`` at step ``t``;
            ``None``: no clip (the paper's first version).

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.adopt(0.1)
        >>> g = {"w": torch.tensor([2.0, -1.0])}
        >>> u, s = tx.update(g, tx.init(g))
        >>> bool((u["w"] == 0).all())  # the first step only measures g^2
        True
        >>> tx.update(g, s)[0]["w"]  # then -lr (1 - b1) g / |g|
        tensor([-0.0100,  0.0100])
    """
    _checks.lr(lr)
    b1, b2 = _checks.betas(betas)
    _checks.nonneg("eps", eps)
    _checks.nonneg("weight_decay", weight_decay)
    if clip_power is not None:
        _checks.nonneg("clip_power", clip_power)
    has_wd = not _checks.is_zero(weight_decay)

    def init(params: Any) -> ADOPTState:
        leaves, spec = optree.tree_flatten(params)
        zeros = lambda: optree.tree_unflatten(spec, _ops.zeros_like(leaves))  # noqa: E731
        return ADOPTState(new_count(leaves), zeros(), zeros())

    def update(grads: Any, state: ADOPTState, params: Any = None, *, inplace: Any = None):
        check_state(state, ADOPTState, "adopt")
        g, spec = optree.tree_flatten(grads)
        mu = check_structure(state.mu, "optimizer state", grads, "grads")
        nu = optree.tree_leaves(state.nu)
        p = check_params(params, spec, "adopt with weight_decay") if has_wd else None
        lr_t = lr_at(lr, state.count)
        first = state.count == 0
        count = state.count + 1
        if has_wd and not decoupled_weight_decay:
            g = _ops.add(g, p, alpha=weight_decay)
        # No branch on the step: on the first, v = 0, and the clip bound (or a factor) is 0,
        # so m stays 0 and so does the update; v's EMA is rescaled to g^2 there.
        live = (~first).to(torch.float64)
        denoms = [torch.clamp(torch.sqrt(v), min=eps) for v in nu]
        normed = _ops.div_list(g, denoms)
        if clip_power is not None:
            c = live * count.to(torch.float64) ** clip_power
            normed = [torch.clamp(x, -c.to(x.dtype), c.to(x.dtype)) for x in normed]
        else:
            normed = _ops.mul_(normed, live)
        mu = _ops.lerp(mu, normed, 1 - b1)
        nu = _ops.addcmul_(_ops.mul(nu, b2), g, g, 1 - b2)
        nu = _ops.mul_(nu, torch.where(first, 1 / (1 - b2), 1.0))
        updates = _ops.mul(mu, -lr_t)
        if has_wd and decoupled_weight_decay:
            updates = _ops.add_(updates, p, alpha=-lr_t * weight_decay)
        new_state = ADOPTState(count, optree.tree_unflatten(spec, mu),
                               optree.tree_unflatten(spec, nu))
        return optree.tree_unflatten(spec, updates), new_state

    return GradientTransformation(init, update)
