"""Adam and AdamW, with ``torch.optim.Adam``/``AdamW``'s exact formulas.

    m_t = b1 m + (1 - b1) g            v_t = b2 v + (1 - b2) g^2
    update = -lr / (1 - b1^t) * m_t / (sqrt(v_t) / sqrt(1 - b2^t) + eps)

Adam's ``weight_decay`` is L2 (``g + wd * p``, as torch.optim.Adam); AdamW's is
decoupled (``- lr * wd * p``, as torch.optim.AdamW). Bias corrections are computed
in float64 from the step counter, like torch.optim's Python-float path.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from torchfn.optim import _checks, _ops
from torchfn.optim._base import GradientTransformation, check_state, lr_at, new_count
from torchfn.optim._masking import resolve_mask
from torchfn.optim._tree import check_params, check_structure

__all__ = ["AdamState", "adam", "adamw"]


class AdamState(NamedTuple):
    count: Tensor  # () int32, steps taken
    mu: Any  # first moments, params' structure
    nu: Any  # second moments, params' structure


def _adam(lr, betas, eps, weight_decay, decoupled, mask, name) -> GradientTransformation:
    _checks.lr(lr)
    b1, b2 = _checks.betas(betas)
    _checks.nonneg("eps", eps)
    _checks.nonneg("weight_decay", weight_decay)
    has_wd = not _checks.is_zero(weight_decay)

    def init(params: Any) -> AdamState:
        leaves, spec = optree.tree_flatten(params)
        zeros = _ops.zeros_like(leaves)
        return AdamState(
            new_count(leaves),
            optree.tree_unflatten(spec, zeros),
            optree.tree_unflatten(spec, _ops.zeros_like(leaves)),
        )

    def update(
        grads: Any, state: AdamState, params: Any = None, *, inplace: Any = None,
        donate: bool = False,
    ):
        """``donate=True`` lets the update overwrite ``state``'s moment buffers (JAX's
        ``donate_argnums``): the old state must not be used afterwards. It saves two
        parameter-sized buffers of peak memory; eager only, ignored under transforms."""
        check_state(state, AdamState, name)
        g, spec = optree.tree_flatten(grads)
        mu = check_structure(state.mu, "optimizer state", grads, "grads")
        nu = optree.tree_leaves(state.nu)
        p = check_params(params, spec, name + " with weight_decay") if has_wd else None
        lr_t = lr_at(lr, state.count)
        count = state.count + 1
        if has_wd and not decoupled:
            g = _ops.add(g, p, alpha=weight_decay)

        if donate and _ops.can_donate(mu + nu, b1, b2):
            torch._foreach_lerp_(mu, g, 1 - b1)  # in the donated buffers
            torch._foreach_mul_(nu, b2)
            torch._foreach_addcmul_(nu, g, g, value=1 - b2)
        else:
            mu = _ops.lerp(mu, g, 1 - b1)
            nu = _ops.addcmul_(_ops.mul(nu, b2), g, g, 1 - b2)

        t = count.to(torch.float64)
        bc1 = 1 - b1**t
        bc2_sqrt = torch.sqrt(1 - b2**t)
        # m / (sqrt(v) / c + eps) == c * m / (sqrt(v) + c * eps): one pass fewer than torch
        denom = _ops.add_scalar_(_ops.sqrt(nu), eps * bc2_sqrt)
        updates = _ops.mul_(_ops.div_into_(mu, denom), -lr_t * bc2_sqrt / bc1)
        if has_wd and decoupled:
            decay = -lr_t * weight_decay
            if mask is None:
                updates = _ops.add_(updates, p, alpha=decay)
            else:
                keep = resolve_mask(mask, params, "mask")
                idx = [i for i, k in enumerate(keep) if k]
                decayed = _ops.add_([updates[i] for i in idx], [p[i] for i in idx], alpha=decay)
                for i, u in zip(idx, decayed):
                    updates[i] = u
        new_state = AdamState(
            count, optree.tree_unflatten(spec, mu), optree.tree_unflatten(spec, nu)
        )
        return optree.tree_unflatten(spec, updates), new_state

    return GradientTransformation(init, update)


def adam(
    lr: Any = 1e-3,
    betas: tuple[Any, Any] = (0.9, 0.999),
    eps: Any = 1e-8,
    weight_decay: Any = 0.0,
) -> GradientTransformation:
    """Adam (Kingma & Ba), equal to ``torch.optim.Adam`` to float rounding.

    Args:
        lr: learning rate >= 0, a 0-d tensor, or a schedule ``step -> lr``.
        betas: decay rates of the first and second moments, each in [0, 1).
        eps: added to the denominator (outside the square root, as torch).
        weight_decay: L2 penalty added to the gradient (``g + wd * p``); needs params.

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> params = {"w": torch.ones(3)}
        >>> tx = optim.adam(1e-2)
        >>> state = tx.init(params)
        >>> updates, state = tx.update({"w": torch.ones(3)}, state)
        >>> optim.apply_updates(params, updates)["w"]
        tensor([0.9900, 0.9900, 0.9900])
    """
    return _adam(lr, betas, eps, weight_decay, False, None, "adam")


def adamw(
    lr: Any = 1e-3,
    betas: tuple[Any, Any] = (0.9, 0.999),
    eps: Any = 1e-8,
    weight_decay: Any = 1e-2,
    *,
    mask: Any = None,
) -> GradientTransformation:
    """AdamW (Loshchilov & Hutter), equal to ``torch.optim.AdamW`` to float rounding.

    The decay ``-lr * weight_decay * p`` is decoupled from the moments; it needs params.
    ``mask`` (a tree of bools like params, or ``params -> tree of bools``; True = decay)
    limits it, e.g. ``mask=decay_mask`` for no decay on biases and norms.

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
        >>> tx = optim.adamw(1e-3, weight_decay=0.1, mask=optim.decay_mask)
        >>> state = tx.init(params)
        >>> grads = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}
        >>> updates, state = tx.update(grads, state, params)
        >>> round(float(updates["w"][0, 0]), 8), float(updates["b"][0]) == 0
        (-0.0001, True)
    """
    return _adam(lr, betas, eps, weight_decay, True, mask, "adamw")
