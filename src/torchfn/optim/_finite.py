"""``all_finite`` and ``apply_if_finite``: skip steps whose gradients hold inf/NaN."""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from torchfn.optim import _checks, _ops
from torchfn.optim._base import GradientTransformation, bind_update, check_state
from torchfn.optim._tree import device_of, tree_where

__all__ = ["ApplyIfFiniteState", "all_finite", "apply_if_finite"]


def all_finite(tree: Any) -> Tensor:
    """A 0-d bool tensor: True when every element of every leaf is finite.

    Example:
        >>> import torch
        >>> from torchfn.optim import all_finite
        >>> all_finite({"a": torch.ones(2), "b": torch.tensor([1.0, float("inf")])})
        tensor(False)
    """
    leaves = optree.tree_leaves(tree)
    if not leaves:
        return torch.ones((), dtype=torch.bool)
    return torch.stack([torch.isfinite(x).all() for x in leaves]).all()


class ApplyIfFiniteState(NamedTuple):
    notfinite_count: Tensor  # () int32, consecutive non-finite steps
    last_finite: Tensor  # () bool
    total_notfinite: Tensor  # () int32, all skipped steps
    inner_state: Any


def apply_if_finite(inner: Any, max_consecutive_errors: int) -> GradientTransformation:
    """Apply ``inner`` only when the incoming grads are all finite.

    A non-finite step yields zero updates and leaves the inner state unchanged,
    and is counted. After more than ``max_consecutive_errors`` in a row the update
    is applied anyway (so a run that keeps failing does not stall silently).
    Decisions are ``torch.where``: no host sync, compiles and vmaps.

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.apply_if_finite(optim.sgd(0.1), max_consecutive_errors=3)
        >>> g = {"w": torch.tensor([1.0, float("nan")])}
        >>> u, s = tx.update(g, tx.init(g))
        >>> u["w"], int(s.total_notfinite)
        (tensor([0., 0.]), 1)
    """
    _checks.positive_int("max_consecutive_errors", max_consecutive_errors, minimum=0)
    call = bind_update(inner)

    def init(params: Any) -> ApplyIfFiniteState:
        device = device_of(optree.tree_leaves(params))
        zero = torch.zeros((), dtype=torch.int32, device=device)
        return ApplyIfFiniteState(
            zero, torch.ones((), dtype=torch.bool, device=device), zero.clone(), inner.init(params)
        )

    def update(grads: Any, state: ApplyIfFiniteState, params: Any = None, *, inplace=None):
        check_state(state, ApplyIfFiniteState, "apply_if_finite")
        finite = all_finite(grads)
        updates, inner_state = call(grads, state.inner_state, params)
        notfinite = torch.where(finite, 0, state.notfinite_count + 1).to(torch.int32)
        apply = finite | (notfinite > max_consecutive_errors)
        leaves, spec = optree.tree_flatten(updates)
        leaves = _ops.where(apply, leaves, _ops.zeros_like(leaves))
        new_state = ApplyIfFiniteState(
            notfinite,
            finite,
            state.total_notfinite + (~finite).to(torch.int32),
            tree_where(apply, inner_state, state.inner_state),
        )
        return optree.tree_unflatten(spec, leaves), new_state

    return GradientTransformation(init, update)
