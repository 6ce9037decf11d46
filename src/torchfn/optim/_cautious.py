"""Cautious optimizers (Liang et al. 2024, "Cautious optimizers: improving training with
one line of code"): keep only the coordinates of an optimizer's update that point
against the gradient, rescaled so the kept ones carry the whole step. Per tensor:

    keep = (u * g < 0)                      (u is applied by adding; descent opposes g)
    u <- u * keep * numel / (sum(keep) + 1)

as ``pytorch_optimizer``'s ``cautious=True``. The paper leaves decoupled weight decay
out of the mask: put it after, with :func:`decay_weights`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
from torch import Tensor

from torchfn.optim import _checks, _ops
from torchfn.optim._base import (
    GradientTransformation,
    check_state,
    lr_at,
    new_count,
)
from torchfn.optim._tree import check_params

__all__ = ["cautious", "decay_weights", "DecayWeightsState"]


def cautious(inner: GradientTransformation) -> GradientTransformation:
    """``inner``'s updates, masked where they do not oppose the gradient and rescaled.

    Everything ``inner`` adds to its update is masked with it, decoupled weight decay
    included; for C-AdamW / C-Lion as the paper, give ``inner`` no decay and chain
    :func:`decay_weights` after: ``chain(cautious(adam(lr)), decay_weights(lr, wd))``.

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.cautious(optim.sgd(1.0, momentum=0.9))
        >>> s = tx.init({"w": torch.zeros(3)})
        >>> _, s = tx.update({"w": torch.tensor([1.0, 1.0, 1.0])}, s)
        >>> u, _ = tx.update({"w": torch.tensor([1.0, -0.5, 1.0])}, s)
        >>> u["w"]  # the middle one steps uphill (-0.4 where g = -0.5): dropped
        tensor([-1.9000, -0.0000, -1.9000])
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"inner must be a GradientTransformation, got {type(inner).__name__}")

    def update(grads: Any, state: Any, params: Any = None, *, inplace: Any = None):
        updates, state = inner.update(grads, state, params)
        u, spec = optree.tree_flatten(updates)
        g = optree.tree_leaves(grads)
        mutate = _ops.can_mutate(u)
        out = []
        for ui, gi in zip(u, g):
            keep = ui * gi  # a fresh buffer: becomes the 0/1 mask, then the scaled mask
            keep = keep.lt_(0) if mutate else (keep < 0).to(ui.dtype)
            scale = keep.numel() / (keep.sum() + 1)
            keep = keep.mul_(scale) if mutate else keep * scale
            out.append(ui * keep)  # inner's updates may be the caller's tensors: not in place
        return optree.tree_unflatten(spec, out), state

    return GradientTransformation(inner.init, update)


class DecayWeightsState(NamedTuple):
    count: Tensor  # () int32, for a schedule lr


def decay_weights(lr: Any, weight_decay: Any) -> GradientTransformation:
    """``updates - lr * weight_decay * params``: decoupled weight decay (AdamW's) as its
    own step, ``lr`` a number, 0-d tensor or schedule (its step kept in the state).

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.decay_weights(0.1, 0.5)
        >>> p = {"w": torch.ones(2)}
        >>> tx.update({"w": torch.zeros(2)}, tx.init(p), p)[0]["w"]
        tensor([-0.0500, -0.0500])
    """
    _checks.lr(lr)
    _checks.nonneg("weight_decay", weight_decay)

    def init(params: Any) -> DecayWeightsState:
        return DecayWeightsState(new_count(optree.tree_leaves(params)))

    def update(grads: Any, state: DecayWeightsState, params: Any = None, *, inplace=None):
        check_state(state, DecayWeightsState, "decay_weights")
        u, spec = optree.tree_flatten(grads)
        p = check_params(params, spec, "decay_weights")
        out = _ops.add(u, p, alpha=-(lr_at(lr, state.count) * weight_decay))
        return optree.tree_unflatten(spec, out), DecayWeightsState(state.count + 1)

    return GradientTransformation(init, update)
