"""Adafactor (Shazeer & Stern 2018) as ``torch.optim.Adafactor`` computes it.

For a leaf with >= 2 dims the second moment is kept factored over its last two
dims: a row mean ``r`` (..., R, 1) and a column mean ``c`` (..., 1, C) in place of
an (R, C) matrix. Smaller leaves keep a full ``v``.

    w = t^beta2_decay                                  (1 at t = 1, then decays)
    r = lerp(r, mean(g^2, -1), w)    c = lerp(c, mean(g^2, -2), w)
    v_hat = r c / mean(r)            (a vector leaf: v = lerp(v, g^2, w))
    u = g / sqrt(max(v_hat, eps1^2))
    alpha = max(eps2, rms(p)) * min(lr, 1 / sqrt(t))
    update = -alpha u / max(1, rms(u) / d)  - lr wd p

Unlike ``torch.optim.Adafactor``, which reads ``rms(p)``, ``rms(u)`` and the step
back to the host for every leaf on every step, everything stays in 0-d tensors:
no device syncs, and the update compiles and ``vmap``s.
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

__all__ = ["AdafactorState", "adafactor"]

_EMPTY = (0,)


class AdafactorState(NamedTuple):
    count: Tensor  # () int32, steps taken
    row: Any  # (..., R, 1) row means of g^2 for leaves with >= 2 dims, else (0,)
    col: Any  # (..., 1, C) column means of g^2 for leaves with >= 2 dims, else (0,)
    nu: Any  # full second moment for leaves with < 2 dims, else (0,)


def _factored(x: Tensor) -> bool:
    return x.ndim >= 2


def _rms(x: Tensor) -> Tensor:
    return torch.linalg.vector_norm(x) / math.sqrt(max(x.numel(), 1))


def adafactor(
    lr: Any = 1e-2,
    beta2_decay: float = -0.8,
    eps: tuple[float | None, float] = (None, 1e-3),
    d: float = 1.0,
    weight_decay: Any = 0.0,
) -> GradientTransformation:
    """Adafactor, equal to ``torch.optim.Adafactor`` to float rounding.

    Memory: O(R + C) per (R, C) matrix instead of Adam's 2 R C. No first moment.

    Args:
        lr: the relative step's cap (``min(lr, 1/sqrt(t))``), a 0-d tensor or a schedule.
        beta2_decay: <= 0; the second moment's weight on the new gradient is
            ``t^beta2_decay``.
        eps: ``(eps1, eps2)``: ``eps1`` floors the second moment (None: the dtype's
            machine epsilon); ``eps2`` floors the parameter scale ``rms(p)``.
        d: clipping threshold >= 1 on the update's RMS.
        weight_decay: decoupled decay ``-lr * wd * p``.

    ``update`` always needs params (the step is relative to their scale).

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.adafactor()
        >>> p = {"w": torch.ones(4, 3)}
        >>> state = tx.init(p)
        >>> state.row["w"].shape, state.col["w"].shape  # factored second moment
        (torch.Size([4, 1]), torch.Size([1, 3]))
        >>> u, state = tx.update({"w": torch.full((4, 3), 0.5)}, state, p)
        >>> u["w"][0, 0]  # -rms(p) * min(lr, 1) * sign(g) at the first step
        tensor(-0.0100)
    """
    _checks.lr(lr)
    if not isinstance(beta2_decay, (int, float)) or isinstance(beta2_decay, bool):
        raise TypeError(f"beta2_decay must be a real number <= 0, got {beta2_decay!r}")
    if not beta2_decay <= 0:
        raise ValueError(f"beta2_decay must be <= 0, got {beta2_decay}")
    try:
        eps1, eps2 = eps
    except (TypeError, ValueError):
        raise ValueError(f"eps must be a pair (eps1 or None, eps2), got {eps!r}") from None
    if eps1 is not None:
        _checks.nonneg("eps[0]", eps1)
    _checks.nonneg("eps[1]", eps2)
    if not isinstance(d, (int, float)) or isinstance(d, bool) or not d >= 1:
        raise ValueError(f"d (the clipping threshold) must be a number >= 1, got {d!r}")
    _checks.nonneg("weight_decay", weight_decay)
    has_wd = not _checks.is_zero(weight_decay)

    def init(params: Any) -> AdafactorState:
        leaves, spec = optree.tree_flatten(params)

        def empty(x: Tensor) -> Tensor:
            return x.new_zeros(_EMPTY)

        def row(x: Tensor) -> Tensor:
            return x.new_zeros((*x.shape[:-1], 1)) if _factored(x) else empty(x)

        def col(x: Tensor) -> Tensor:
            return x.new_zeros((*x.shape[:-2], 1, x.shape[-1])) if _factored(x) else empty(x)

        def full(x: Tensor) -> Tensor:
            return empty(x) if _factored(x) else torch.zeros_like(x)

        return AdafactorState(
            new_count(leaves),
            optree.tree_unflatten(spec, [row(x) for x in leaves]),
            optree.tree_unflatten(spec, [col(x) for x in leaves]),
            optree.tree_unflatten(spec, [full(x) for x in leaves]),
        )

    def update(grads: Any, state: AdafactorState, params: Any = None, *, inplace: Any = None):
        check_state(state, AdafactorState, "adafactor")
        g, spec = optree.tree_flatten(grads)
        rows = check_structure(state.row, "optimizer state", grads, "grads")
        cols, nus = optree.tree_leaves(state.col), optree.tree_leaves(state.nu)
        p = check_params(params, spec, "adafactor")
        lr_t = lr_at(lr, state.count)
        count = state.count + 1
        t = count.to(torch.float64)
        w = t**beta2_decay
        rel = torch.clamp(torch.rsqrt(t), max=lr_t) if not isinstance(lr_t, Tensor) else (
            torch.minimum(lr_t.to(torch.float64), torch.rsqrt(t)))

        # in place on the fresh (R, C) temporaries, where no transform or autograd looks
        fresh = _ops.can_mutate(g)
        updates, new_rows, new_cols, new_nus = [], [], [], []
        for gi, pi, r, c, v in zip(g, p, rows, cols, nus):
            floor = torch.finfo(pi.dtype).eps if eps1 is None else eps1
            wi = w.to(gi.dtype)
            if _factored(gi):
                r = torch.lerp(r, torch.linalg.vector_norm(gi, dim=-1, keepdim=True).square()
                               / gi.shape[-1], wi)  # (..., R, 1)
                c = torch.lerp(c, torch.linalg.vector_norm(gi, dim=-2, keepdim=True).square()
                               / gi.shape[-2], wi)  # (..., 1, C)
                var = r @ c  # (..., R, C)
                r_mean = r.mean(dim=-2, keepdim=True).clamp(min=floor)  # (..., 1, 1)
                var = var.div_(r_mean) if fresh else var / r_mean
            else:
                v = torch.lerp(v, gi * gi, wi)
                var = v.clone() if fresh else v
            if fresh:
                u = var.clamp_(min=floor * floor).rsqrt_().mul_(gi)
            else:
                u = torch.rsqrt(var.clamp(min=floor * floor)) * gi
            alpha = torch.clamp(_rms(pi), min=eps2) * rel
            scale = (-alpha / torch.clamp(_rms(u) / d, min=1.0)).to(u.dtype)
            u = u.mul_(scale) if fresh else u * scale
            if has_wd:
                decay = -lr_t * weight_decay
                u = u.add_(pi, alpha=decay) if fresh and not isinstance(decay, Tensor) else (
                    u + decay * pi)
            updates.append(u)
            new_rows.append(r)
            new_cols.append(c)
            new_nus.append(v)
        new_state = AdafactorState(
            count,
            optree.tree_unflatten(spec, new_rows),
            optree.tree_unflatten(spec, new_cols),
            optree.tree_unflatten(spec, new_nus),
        )
        return optree.tree_unflatten(spec, updates), new_state

    return GradientTransformation(init, update)
