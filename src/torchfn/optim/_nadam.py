"""NAdam (Dozat 2016), equal to ``torch.optim.NAdam`` (momentum decay included).

    mu_t = b1 (1 - 0.5 * 0.96^(t * momentum_decay))      prod_t = mu_1 ... mu_t
    m = b1 m + (1 - b1) g          v = b2 v + (1 - b2) g^2
    denom = sqrt(v / (1 - b2^t)) + eps
    update = -lr [(1 - mu_t) / (1 - prod_t) g + mu_{t+1} / (1 - prod_t mu_{t+1}) m] / denom

``weight_decay`` is L2 (``g + wd p``) unless ``decoupled_weight_decay=True``
(NAdamW: ``- lr wd p``), as torch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from torchfn.optim import _checks, _ops
from torchfn.optim._base import GradientTransformation, check_state, lr_at, new_count
from torchfn.optim._tree import check_params, check_structure

__all__ = ["NAdamState", "nadam"]


class NAdamState(NamedTuple):
    count: Tensor  # () int32, steps taken
    mu_product: Tensor  # () float64, product of the momentum coefficients so far
    mu: Any  # first moments, params' structure
    nu: Any  # second moments, params' structure


def nadam(
    lr: Any = 2e-3,
    betas: tuple[Any, Any] = (0.9, 0.999),
    eps: Any = 1e-8,
    weight_decay: Any = 0.0,
    momentum_decay: Any = 4e-3,
    *,
    decoupled_weight_decay: bool = False,
) -> GradientTransformation:
    """NAdam: Adam with Nesterov momentum, equal to ``torch.optim.NAdam`` to rounding.

    Args:
        lr: learning rate >= 0, a 0-d tensor, or a schedule ``step -> lr``.
        betas: decay rates of the first and second moments, each in [0, 1).
        eps: added to the denominator.
        weight_decay: L2 penalty (needs params), decoupled with
            ``decoupled_weight_decay=True``.
        momentum_decay: psi in ``mu_t = b1 (1 - 0.5 * 0.96^(t psi))``.

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.nadam(1e-2)
        >>> g = {"w": torch.ones(2)}
        >>> u, state = tx.update(g, tx.init(g))
        >>> u["w"]  # the first step moves by about lr (with the Nesterov look-ahead)
        tensor([-0.0106, -0.0106])
    """
    _checks.lr(lr)
    b1, b2 = _checks.betas(betas)
    _checks.nonneg("eps", eps)
    _checks.nonneg("weight_decay", weight_decay)
    _checks.nonneg("momentum_decay", momentum_decay)
    has_wd = not _checks.is_zero(weight_decay)

    def init(params: Any) -> NAdamState:
        leaves, spec = optree.tree_flatten(params)
        count = new_count(leaves)
        return NAdamState(
            count,
            torch.ones((), dtype=torch.float64, device=count.device),
            optree.tree_unflatten(spec, _ops.zeros_like(leaves)),
            optree.tree_unflatten(spec, _ops.zeros_like(leaves)),
        )

    def update(grads: Any, state: NAdamState, params: Any = None, *, inplace: Any = None):
        check_state(state, NAdamState, "nadam")
        g, spec = optree.tree_flatten(grads)
        mu = check_structure(state.mu, "optimizer state", grads, "grads")
        nu = optree.tree_leaves(state.nu)
        p = check_params(params, spec, "nadam with weight_decay") if has_wd else None
        lr_t = lr_at(lr, state.count)
        count = state.count + 1
        if has_wd and not decoupled_weight_decay:
            g = _ops.add(g, p, alpha=weight_decay)

        t = count.to(torch.float64)
        mu_t = b1 * (1.0 - 0.5 * 0.96 ** (t * momentum_decay))
        mu_next = b1 * (1.0 - 0.5 * 0.96 ** ((t + 1) * momentum_decay))
        prod = state.mu_product * mu_t
        mu = _ops.lerp(mu, g, 1 - b1)
        nu = _ops.addcmul_(_ops.mul(nu, b2), g, g, 1 - b2)

        bc2_sqrt = torch.sqrt(1 - b2**t)
        # x / (sqrt(v) / c + eps) == c x / (sqrt(v) + c eps)
        denom = _ops.add_scalar_(_ops.sqrt(nu), eps * bc2_sqrt)
        c_grad = -lr_t * bc2_sqrt * (1.0 - mu_t) / (1.0 - prod)
        c_mom = -lr_t * bc2_sqrt * mu_next / (1.0 - prod * mu_next)
        step = _ops.add_(_ops.mul(g, c_grad), mu, alpha=c_mom)
        updates = _ops.div_into_(step, denom)
        if has_wd and decoupled_weight_decay:
            updates = _ops.add_(updates, p, alpha=-lr_t * weight_decay)
        new_state = NAdamState(
            count, prod, optree.tree_unflatten(spec, mu), optree.tree_unflatten(spec, nu)
        )
        return optree.tree_unflatten(spec, updates), new_state

    return GradientTransformation(init, update)
