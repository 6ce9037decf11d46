"""AdaBelief (Zhuang et al. 2020): Adam whose second moment tracks the gradient's
deviation from its mean (the "belief"), not the raw square.

    m = b1 m + (1 - b1) g
    s = b2 s + (1 - b2) (g - m)^2 + eps_root
    update = -lr m / (1 - b1^t) / (sqrt(s / (1 - b2^t)) + eps)

as the authors' ``adabelief-pytorch`` (and optax's ``adabelief``): note that ``(g - m)``
uses the new ``m``, and ``eps_root`` enters ``s`` itself.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from torchfn.optim import _checks, _ops
from torchfn.optim._base import GradientTransformation, check_state, lr_at, new_count
from torchfn.optim._tree import check_params, check_structure

__all__ = ["AdaBeliefState", "adabelief"]


class AdaBeliefState(NamedTuple):
    count: Tensor  # () int32, steps taken
    mu: Any  # first moments, params' structure
    nu: Any  # the belief: EMA of (g - m)^2, params' structure


def adabelief(
    lr: Any = 1e-3,
    betas: tuple[Any, Any] = (0.9, 0.999),
    eps: Any = 1e-16,
    eps_root: Any = 1e-16,
    weight_decay: Any = 0.0,
    *,
    decoupled_weight_decay: bool = True,
) -> GradientTransformation:
    """AdaBelief: large steps where the gradient agrees with its running mean, small ones
    where it does not.

    Args:
        lr: learning rate >= 0, a 0-d tensor, or a schedule ``step -> lr``.
        betas: decay rates of the mean and the belief, each in [0, 1).
        eps: added to the denominator (1e-16 as the paper; its ``sqrt`` scale is that of
            Adam's 1e-8).
        eps_root: added to the belief each step.
        weight_decay: decoupled (AdamW's, the authors' default; needs params), or an L2
            penalty on the gradient with ``decoupled_weight_decay=False``.

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.adabelief(0.1)
        >>> g = {"w": torch.tensor([2.0, -1.0])}
        >>> u, _ = tx.update(g, tx.init(g))
        >>> u["w"]  # first step: g - m = b1 g, so -lr sign(g) / b1
        tensor([-0.1111,  0.1111])
    """
    _checks.lr(lr)
    b1, b2 = _checks.betas(betas)
    _checks.nonneg("eps", eps)
    _checks.nonneg("eps_root", eps_root)
    _checks.nonneg("weight_decay", weight_decay)
    has_wd = not _checks.is_zero(weight_decay)

    def init(params: Any) -> AdaBeliefState:
        leaves, spec = optree.tree_flatten(params)
        zeros = lambda: optree.tree_unflatten(spec, _ops.zeros_like(leaves))  # noqa: E731
        return AdaBeliefState(new_count(leaves), zeros(), zeros())

    def update(grads: Any, state: AdaBeliefState, params: Any = None, *, inplace: Any = None):
        check_state(state, AdaBeliefState, "adabelief")
        g, spec = optree.tree_flatten(grads)
        mu = check_structure(state.mu, "optimizer state", grads, "grads")
        nu = optree.tree_leaves(state.nu)
        p = check_params(params, spec, "adabelief with weight_decay") if has_wd else None
        lr_t = lr_at(lr, state.count)
        count = state.count + 1
        if has_wd and not decoupled_weight_decay:
            g = _ops.add(g, p, alpha=weight_decay)
        mu = _ops.lerp(mu, g, 1 - b1)
        dev = _ops.add(g, mu, alpha=-1.0)  # g - m
        nu = _ops.add_scalar_(_ops.addcmul_(_ops.mul(nu, b2), dev, dev, 1 - b2), eps_root)
        t = count.to(torch.float64)
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        denom = _ops.add_scalar_(_ops.div_(_ops.sqrt(nu), torch.sqrt(bc2)), eps)
        updates = _ops.mul_(_ops.div_list(mu, denom), -lr_t / bc1)
        if has_wd and decoupled_weight_decay:
            updates = _ops.add_(updates, p, alpha=-lr_t * weight_decay)
        new_state = AdaBeliefState(count, optree.tree_unflatten(spec, mu),
                                   optree.tree_unflatten(spec, nu))
        return optree.tree_unflatten(spec, updates), new_state

    return GradientTransformation(init, update)
