"""Lookahead (Zhang et al. 2019, "Lookahead Optimizer: k steps forward, 1 step back").

An inner optimizer moves the (fast) params; every ``sync_period`` steps the slow
weights move ``slow_step_size`` of the way toward them and the fast params are reset
to the slow ones:

    fast <- fast + inner update                         (every step)
    if t % k == 0:  slow <- slow + alpha (fast - slow);  fast <- slow
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from torchfn.optim import _checks, _ops
from torchfn.optim._base import GradientTransformation, bind_update, check_state, new_count
from torchfn.optim._tree import check_params, check_structure

__all__ = ["LookaheadState", "lookahead"]


class LookaheadState(NamedTuple):
    count: Tensor  # () int32, steps taken
    slow: Any  # the slow weights, params' structure
    inner: Any  # the inner optimizer's state


def lookahead(
    inner: Any, sync_period: int = 5, slow_step_size: Any = 0.5
) -> GradientTransformation:
    """Wrap ``inner`` in Lookahead. Needs params (the fast weights).

    Args:
        inner: any gradient transformation (torchfn's or torchopt's).
        sync_period: k >= 1, the steps between synchronisations.
        slow_step_size: alpha in [0, 1].

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.lookahead(optim.sgd(0.1), sync_period=2, slow_step_size=0.5)
        >>> params = {"w": torch.tensor([1.0])}
        >>> state = tx.init(params)
        >>> for _ in range(2):
        ...     u, state = tx.update({"w": torch.tensor([1.0])}, state, params)
        ...     params = optim.apply_updates(params, u)
        >>> params["w"]  # fast went 1 -> 0.8; the sync pulled both to 1 + 0.5 (0.8 - 1)
        tensor([0.9000])
    """
    if not hasattr(inner, "init") or not hasattr(inner, "update"):
        raise TypeError(f"inner must be a gradient transformation, got {type(inner).__name__}")
    _checks.positive_int("sync_period", sync_period)
    if not isinstance(slow_step_size, Tensor):
        _checks.nonneg("slow_step_size", slow_step_size)
        if slow_step_size > 1:
            raise ValueError(f"slow_step_size must be in [0, 1], got {slow_step_size}")
    inner_update = bind_update(inner)

    def init(params: Any) -> LookaheadState:
        leaves, spec = optree.tree_flatten(params)
        return LookaheadState(
            new_count(leaves),
            optree.tree_unflatten(spec, [x.detach().clone() for x in leaves]),
            inner.init(params),
        )

    def update(grads: Any, state: LookaheadState, params: Any = None, *, inplace: Any = None):
        check_state(state, LookaheadState, "lookahead")
        g, spec = optree.tree_flatten(grads)
        slow = check_structure(state.slow, "lookahead's slow weights", grads, "grads")
        fast = check_params(params, spec, "lookahead")
        inner_updates, inner_state = inner_update(grads, state.inner, params)
        step = check_structure(inner_updates, "inner updates", grads, "grads")
        count = state.count + 1
        sync = torch.remainder(count, sync_period) == 0
        new_fast = _ops.add(fast, step)
        synced = _ops.add(slow, _ops.add(new_fast, slow, alpha=-1.0), alpha=slow_step_size)
        new_slow = _ops.where(sync, synced, slow)
        # the update that takes fast to new_fast, or at a sync to the new slow weights
        updates = _ops.where(sync, _ops.add(synced, fast, alpha=-1.0), step)
        new_state = LookaheadState(count, optree.tree_unflatten(spec, new_slow), inner_state)
        return optree.tree_unflatten(spec, updates), new_state

    return GradientTransformation(init, update)
