"""Leaf-list arithmetic: one ``torch._foreach_*`` kernel per op, or a per-leaf loop.

Every optimizer in this package writes its math once against these helpers.
They take lists of tensors (the leaves of a pytree) and scalars that are Python
numbers or 0-d tensors (schedules, injected hyperparameters).

Two paths, chosen per call:

* fast: ``torch._foreach_*`` over the whole list (eager and ``torch.compile``).
* loop: plain per-leaf ops, used when a ``torch.func`` transform is active —
  ``_foreach_*`` ops have no ``vmap`` batching rule (measured on torch 2.13), so
  ``vmap(update)`` over an ensemble of optimizer states takes this path.

Helpers whose name ends in ``_`` MAY work in place on their first argument; call
them only on tensors this package has just created, and always use the returned
list. They work out of place when the list takes part in autograd (in-place
ops would corrupt saved tensors) or when a transform is active.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

Scalar = float | Tensor
Leaves = list[Tensor]


def fast() -> bool:
    """True when ``_foreach_*`` kernels may be used (no ``torch.func`` transform active)."""
    return not torch._C._are_functorch_transforms_active()


def can_mutate(xs: Sequence[Tensor]) -> bool:
    """True when fresh temporaries computed from ``xs`` may be updated in place: no
    transform active, and no autograd graph through ``xs``."""
    if not fast():
        return False
    if torch.is_grad_enabled() and any(x.requires_grad for x in xs):
        return False
    return True


def can_donate(xs: Sequence[Tensor], *scalars: Scalar) -> bool:
    """True when donated state buffers ``xs`` may be overwritten in place: eager,
    no autograd on them, plain Python hyperparameters."""
    return bool(xs) and can_mutate(xs) and not any(_is_tensor(s) for s in scalars)


def _is_tensor(s: Scalar) -> bool:
    return isinstance(s, Tensor)


def mul(xs: Leaves, s: Scalar) -> Leaves:
    """``[x * s]``."""
    if not xs:
        return []
    if fast():
        return list(torch._foreach_mul(xs, s))
    return [x * s for x in xs]


def mul_(xs: Leaves, s: Scalar) -> Leaves:
    """``[x * s]``, in place on fresh ``xs`` when allowed."""
    if xs and can_mutate(xs):
        torch._foreach_mul_(xs, s)
        return xs
    return mul(xs, s)


def div_list(xs: Leaves, ys: Leaves) -> Leaves:
    """``[x / y]``."""
    if not xs:
        return []
    if fast():
        return list(torch._foreach_div(xs, ys))
    return [x / y for x, y in zip(xs, ys)]


def div_into_(xs: Leaves, ys: Leaves) -> Leaves:
    """``[x / y]``, computed in place in the fresh ``ys`` when allowed (saves an
    allocation, which on CPU costs more than the extra ``reciprocal_`` pass)."""
    if ys and can_mutate(ys):
        torch._foreach_reciprocal_(ys)
        torch._foreach_mul_(ys, xs)
        return ys
    return div_list(xs, ys)


def div_(xs: Leaves, s: Scalar) -> Leaves:
    """``[x / s]``, in place on fresh ``xs`` when allowed."""
    if not xs:
        return []
    if can_mutate(xs):
        torch._foreach_div_(xs, s)
        return xs
    if fast():
        return list(torch._foreach_div(xs, s))
    return [x / s for x in xs]


def add_scalar_(xs: Leaves, s: Scalar) -> Leaves:
    """``[x + s]``, in place on fresh ``xs`` when allowed."""
    if not xs:
        return []
    if _is_tensor(s) and torch.compiler.is_compiling():
        # dynamo graph-breaks on _foreach_add_(list, 0-d tensor) (a .item());
        # per-leaf adds fuse into the same kernels
        return [x + s for x in xs]
    if can_mutate(xs):
        torch._foreach_add_(xs, s)
        return xs
    if fast():
        return list(torch._foreach_add(xs, s))
    return [x + s for x in xs]


def add(xs: Leaves, ys: Leaves, alpha: Scalar = 1.0) -> Leaves:
    """``[x + alpha * y]``."""
    if not xs:
        return []
    if fast():
        if _is_tensor(alpha):
            return list(torch._foreach_add(xs, torch._foreach_mul(ys, alpha)))
        return list(torch._foreach_add(xs, ys, alpha=alpha))
    return [x + alpha * y for x, y in zip(xs, ys)]


def add_(xs: Leaves, ys: Leaves, alpha: Scalar = 1.0) -> Leaves:
    """``[x + alpha * y]``, in place on fresh ``xs`` when allowed."""
    if xs and can_mutate(xs):
        if _is_tensor(alpha):
            torch._foreach_add_(xs, torch._foreach_mul(ys, alpha))
        else:
            torch._foreach_add_(xs, ys, alpha=alpha)
        return xs
    return add(xs, ys, alpha)


def lerp(xs: Leaves, ys: Leaves, w: Scalar) -> Leaves:
    """``[x + w * (y - x)]`` (``torch.lerp``)."""
    if not xs:
        return []
    if fast() and not _is_tensor(w):
        return list(torch._foreach_lerp(xs, ys, w))
    if fast():
        d = list(torch._foreach_sub(ys, xs))
        torch._foreach_mul_(d, w)
        torch._foreach_add_(d, xs)
        return d
    return [torch.lerp(x, y, w) if not _is_tensor(w) else x + w * (y - x) for x, y in zip(xs, ys)]


def addcmul(xs: Leaves, ys: Leaves, zs: Leaves, value: Scalar = 1.0) -> Leaves:
    """``[x + value * y * z]``."""
    if not xs:
        return []
    if fast():
        if _is_tensor(value):
            return list(torch._foreach_addcmul(xs, torch._foreach_mul(ys, value), zs))
        return list(torch._foreach_addcmul(xs, ys, zs, value=value))
    return [x + value * y * z for x, y, z in zip(xs, ys, zs)]


def addcmul_(xs: Leaves, ys: Leaves, zs: Leaves, value: Scalar = 1.0) -> Leaves:
    """``[x + value * y * z]``, in place on fresh ``xs`` when allowed."""
    if xs and can_mutate(xs):
        if _is_tensor(value):
            torch._foreach_addcmul_(xs, torch._foreach_mul(ys, value), zs)
        else:
            torch._foreach_addcmul_(xs, ys, zs, value=value)
        return xs
    return addcmul(xs, ys, zs, value)


def sqrt(xs: Leaves) -> Leaves:
    if not xs:
        return []
    if fast():
        return list(torch._foreach_sqrt(xs))
    return [torch.sqrt(x) for x in xs]


def sign(xs: Leaves) -> Leaves:
    if not xs:
        return []
    if fast():
        return list(torch._foreach_sign(xs))
    return [torch.sign(x) for x in xs]


def norms(xs: Leaves) -> Leaves:
    """L2 norm of each leaf, as 0-d tensors."""
    if not xs:
        return []
    if fast():
        return list(torch._foreach_norm(xs, 2))
    return [torch.linalg.vector_norm(x, 2) for x in xs]


def where(pred: Tensor, xs: Leaves, ys: Leaves) -> Leaves:
    """``[torch.where(pred, x, y)]`` for a 0-d boolean ``pred`` (no host sync)."""
    return [torch.where(pred, x, y) for x, y in zip(xs, ys)]


def zeros_like(xs: Leaves) -> Leaves:
    return [torch.zeros_like(x) for x in xs]


def abs(xs: Leaves) -> Leaves:  # noqa: A001 (the leafwise torch.abs)
    """``[|x|]``."""
    if xs and fast():
        return list(torch._foreach_abs(xs))
    return [torch.abs(x) for x in xs]


def maximum(xs: Leaves, ys: Leaves) -> Leaves:
    """``[max(x, y)]`` elementwise."""
    if not xs:
        return []
    if fast():
        return list(torch._foreach_maximum(xs, ys))
    return [torch.maximum(x, y) for x, y in zip(xs, ys)]


def add_scalar(xs: Leaves, s: Scalar) -> Leaves:
    """``[x + s]`` (out of place)."""
    if xs and fast() and not (_is_tensor(s) and torch.compiler.is_compiling()):
        return list(torch._foreach_add(xs, s))
    return [x + s for x in xs]


def mul_list(xs: Leaves, ys: Leaves) -> Leaves:
    """``[x * y]`` elementwise."""
    if not xs:
        return []
    if fast():
        return list(torch._foreach_mul(xs, ys))
    return [x * y for x, y in zip(xs, ys)]
