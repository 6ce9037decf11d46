"""Elementary transformations: ``scale``, ``scale_by_schedule``, ``add_decayed_weights``.

Build an optimizer from parts, Optax style:

    tx = chain(clip_by_global_norm(1.0), add_decayed_weights(1e-4, mask=decay_mask),
               scale_by_schedule(warmup_cosine(1.0, 100, 1000)), scale(-0.1))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optree
from torch import Tensor

from torchfn.optim import _checks, _ops
from torchfn.optim._base import EmptyState, GradientTransformation, check_state, new_count
from torchfn.optim._masking import resolve_mask
from torchfn.optim._tree import check_params

__all__ = ["ScaleByScheduleState", "scale", "scale_by_schedule", "add_decayed_weights"]


def scale(step_size: Any) -> GradientTransformation:
    """Multiply updates by ``step_size`` (a number or 0-d tensor; use -lr for descent).

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.scale(-0.5)
        >>> tx.update({"w": torch.ones(2)}, tx.init(None))[0]["w"]
        tensor([-0.5000, -0.5000])
    """
    _checks._number("step_size", step_size)

    def init(params: Any) -> EmptyState:
        return EmptyState()

    def update(grads: Any, state: Any, params: Any = None, *, inplace: Any = None):
        leaves, spec = optree.tree_flatten(grads)
        return optree.tree_unflatten(spec, _ops.mul(leaves, step_size)), state

    return GradientTransformation(init, update)


class ScaleByScheduleState(NamedTuple):
    count: Tensor  # () int32


def scale_by_schedule(schedule: Callable[[Any], Any]) -> GradientTransformation:
    """Multiply updates by ``schedule(step)``, step = 0, 1, ... kept in the state.

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.scale_by_schedule(optim.exponential_lr(1.0, 0.5))
        >>> g = {"w": torch.ones(1)}
        >>> u, s = tx.update(g, tx.init(g))
        >>> u, s = tx.update(g, s)
        >>> u["w"]
        tensor([0.5000])
    """
    if not callable(schedule):
        raise TypeError(f"schedule must be a function step -> value, got {schedule!r}")

    def init(params: Any) -> ScaleByScheduleState:
        return ScaleByScheduleState(new_count(optree.tree_leaves(params)))

    def update(grads: Any, state: ScaleByScheduleState, params: Any = None, *, inplace=None):
        check_state(state, ScaleByScheduleState, "scale_by_schedule")
        leaves, spec = optree.tree_flatten(grads)
        updates = _ops.mul(leaves, schedule(state.count))
        return optree.tree_unflatten(spec, updates), ScaleByScheduleState(state.count + 1)

    return GradientTransformation(init, update)


def add_decayed_weights(weight_decay: Any = 0.0, *, mask: Any = None) -> GradientTransformation:
    """``updates + weight_decay * params`` (where ``mask`` is True); needs params.

    Placed before ``scale(-lr)`` this is L2 regularisation; after the optimizer's
    scaling, decoupled (AdamW-style) decay.

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.add_decayed_weights(0.1)
        >>> p = {"w": torch.ones(2)}
        >>> tx.update({"w": torch.zeros(2)}, tx.init(p), p)[0]["w"]
        tensor([0.1000, 0.1000])
    """
    _checks.nonneg("weight_decay", weight_decay)

    def init(params: Any) -> EmptyState:
        if mask is not None:
            resolve_mask(mask, params)
        return EmptyState()

    def update(grads: Any, state: Any, params: Any = None, *, inplace: Any = None):
        leaves, spec = optree.tree_flatten(grads)
        p = check_params(params, spec, "add_decayed_weights")
        if mask is None:
            return optree.tree_unflatten(spec, _ops.add(leaves, p, alpha=weight_decay)), state
        keep = resolve_mask(mask, params)
        idx = [i for i, k in enumerate(keep) if k]
        out = list(leaves)
        decayed = _ops.add([leaves[i] for i in idx], [p[i] for i in idx], alpha=weight_decay)
        for i, u in zip(idx, decayed):
            out[i] = u
        return optree.tree_unflatten(spec, out), state

    return GradientTransformation(init, update)
