"""``multi_steps``: gradient accumulation as a transformation.

K micro-batches of size B give the same step as one batch of size K*B (for a
mean loss): the mean of the K gradients is fed to the inner optimizer on every
K-th call, and zero updates are emitted in between.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from torchfn.optim import _checks, _ops
from torchfn.optim._base import GradientTransformation, bind_update, check_state
from torchfn.optim._tree import check_structure, device_of, tree_where

__all__ = ["MultiStepsState", "multi_steps"]


class MultiStepsState(NamedTuple):
    mini_step: Tensor  # () int32, micro-batches accumulated so far (0 .. every_k - 1)
    gradient_step: Tensor  # () int32, inner optimizer steps taken
    inner_state: Any
    acc_grads: Any  # running sum of grads, params' structure


def multi_steps(inner: Any, every_k: int) -> GradientTransformation:
    """Accumulate ``every_k`` gradients, then apply ``inner`` to their mean.

    The inner update is computed on every call and selected with ``torch.where``
    (no host sync; ``torch.compile`` and ``vmap`` friendly), so it costs one inner
    update per micro-batch.

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.multi_steps(optim.sgd(1.0), every_k=2)
        >>> p = {"w": torch.zeros(1)}
        >>> s = tx.init(p)
        >>> u, s = tx.update({"w": torch.tensor([1.0])}, s)
        >>> u["w"]
        tensor([0.])
        >>> u, s = tx.update({"w": torch.tensor([3.0])}, s)
        >>> u["w"]
        tensor([-2.])
    """
    _checks.positive_int("every_k", every_k)
    call = bind_update(inner)

    def init(params: Any) -> MultiStepsState:
        leaves, spec = optree.tree_flatten(params)
        zero = torch.zeros((), dtype=torch.int32, device=device_of(leaves))
        acc = optree.tree_unflatten(spec, _ops.zeros_like(leaves))
        return MultiStepsState(zero, zero.clone(), inner.init(params), acc)

    def update(grads: Any, state: MultiStepsState, params: Any = None, *, inplace=None):
        check_state(state, MultiStepsState, "multi_steps")
        g, spec = optree.tree_flatten(grads)
        acc = _ops.add(check_structure(state.acc_grads, "optimizer state", grads, "grads"), g)
        emit = state.mini_step + 1 >= every_k  # () bool
        mean = optree.tree_unflatten(spec, _ops.mul(acc, 1.0 / every_k))
        updates, inner_state = call(mean, state.inner_state, params)
        u = optree.tree_leaves(updates)
        u = _ops.where(emit, u, _ops.zeros_like(u))
        acc = _ops.where(emit, _ops.zeros_like(acc), acc)
        new_state = MultiStepsState(
            torch.where(emit, 0, state.mini_step + 1).to(torch.int32),
            state.gradient_step + emit.to(torch.int32),
            tree_where(emit, inner_state, state.inner_state),
            optree.tree_unflatten(spec, acc),
        )
        return optree.tree_unflatten(spec, u), new_state

    return GradientTransformation(init, update)
