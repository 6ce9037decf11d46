"""Adamax (Kingma & Ba, section 7.1: Adam in the infinity norm), equal to
``torch.optim.Adamax``.

    m = b1 m + (1 - b1) g          u = max(b2 u, |g| + eps)
    update = -lr / (1 - b1^t) * m / u
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from torchfn.optim import _checks, _ops
from torchfn.optim._base import GradientTransformation, check_state, lr_at, new_count
from torchfn.optim._tree import check_params, check_structure

__all__ = ["AdamaxState", "adamax"]


class AdamaxState(NamedTuple):
    count: Tensor  # () int32, steps taken
    mu: Any  # first moments, params' structure
    inf_norm: Any  # exponentially weighted infinity norm, params' structure


def adamax(
    lr: Any = 2e-3,
    betas: tuple[Any, Any] = (0.9, 0.999),
    eps: Any = 1e-8,
    weight_decay: Any = 0.0,
) -> GradientTransformation:
    """Adamax, equal to ``torch.optim.Adamax`` to float rounding.

    Args:
        lr: learning rate >= 0, a 0-d tensor, or a schedule ``step -> lr``.
        betas: decay rates of the first moment and of the infinity norm, in [0, 1).
        eps: added to ``|g|`` inside the max (as torch), so ``u`` is never 0.
        weight_decay: L2 penalty added to the gradient; needs params.

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.adamax(0.1)
        >>> g = {"w": torch.tensor([4.0, -0.5])}
        >>> u, _ = tx.update(g, tx.init(g))
        >>> u["w"]  # the first step is -lr * sign(g)
        tensor([-0.1000,  0.1000])
    """
    _checks.lr(lr)
    b1, b2 = _checks.betas(betas)
    _checks.nonneg("eps", eps)
    _checks.nonneg("weight_decay", weight_decay)
    has_wd = not _checks.is_zero(weight_decay)

    def init(params: Any) -> AdamaxState:
        leaves, spec = optree.tree_flatten(params)
        return AdamaxState(
            new_count(leaves),
            optree.tree_unflatten(spec, _ops.zeros_like(leaves)),
            optree.tree_unflatten(spec, _ops.zeros_like(leaves)),
        )

    def update(grads: Any, state: AdamaxState, params: Any = None, *, inplace: Any = None):
        check_state(state, AdamaxState, "adamax")
        g, spec = optree.tree_flatten(grads)
        mu = check_structure(state.mu, "optimizer state", grads, "grads")
        inf_norm = optree.tree_leaves(state.inf_norm)
        lr_t = lr_at(lr, state.count)
        count = state.count + 1
        if has_wd:
            g = _ops.add(g, check_params(params, spec, "adamax with weight_decay"),
                         alpha=weight_decay)
        mu = _ops.lerp(mu, g, 1 - b1)
        inf_norm = _ops.maximum(_ops.mul(inf_norm, b2), _ops.add_scalar_(_ops.abs(g), eps))
        bc1 = 1 - b1 ** count.to(torch.float64)
        updates = _ops.mul_(_ops.div_list(mu, inf_norm), -lr_t / bc1)
        new_state = AdamaxState(
            count, optree.tree_unflatten(spec, mu), optree.tree_unflatten(spec, inf_norm)
        )
        return optree.tree_unflatten(spec, updates), new_state

    return GradientTransformation(init, update)
