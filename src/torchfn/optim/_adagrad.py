"""Adagrad, equal to ``torch.optim.Adagrad`` (``lr_decay``, ``initial_accumulator_value``).

    clr = lr / (1 + (t - 1) lr_decay)
    s = s + g^2
    update = -clr g / (sqrt(s) + eps)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from torchfn.optim import _checks, _ops
from torchfn.optim._base import GradientTransformation, check_state, lr_at, new_count
from torchfn.optim._tree import check_params, check_structure

__all__ = ["AdagradState", "adagrad"]


class AdagradState(NamedTuple):
    count: Tensor  # () int32
    sum: Any  # accumulated squared gradients, params' structure


def adagrad(
    lr: Any = 1e-2,
    lr_decay: Any = 0.0,
    weight_decay: Any = 0.0,
    initial_accumulator_value: float = 0.0,
    eps: Any = 1e-10,
) -> GradientTransformation:
    """Adagrad (Duchi et al.), equal to ``torch.optim.Adagrad`` to float rounding.

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.adagrad(0.1)
        >>> g = {"w": torch.full((2,), 2.0)}
        >>> u, _ = tx.update(g, tx.init(g))
        >>> u["w"]
        tensor([-0.1000, -0.1000])
    """
    _checks.lr(lr)
    _checks.nonneg("lr_decay", lr_decay)
    _checks.nonneg("weight_decay", weight_decay)
    _checks.nonneg("initial_accumulator_value", initial_accumulator_value)
    _checks.nonneg("eps", eps)
    has_wd = not _checks.is_zero(weight_decay)

    def init(params: Any) -> AdagradState:
        leaves, spec = optree.tree_flatten(params)
        acc = [torch.full_like(x, initial_accumulator_value) for x in leaves]
        return AdagradState(new_count(leaves), optree.tree_unflatten(spec, acc))

    def update(grads: Any, state: AdagradState, params: Any = None, *, inplace: Any = None):
        check_state(state, AdagradState, "adagrad")
        g, spec = optree.tree_flatten(grads)
        acc = check_structure(state.sum, "optimizer state", grads, "grads")
        lr_t = lr_at(lr, state.count)
        if has_wd:
            p = check_params(params, spec, "adagrad with weight_decay")
            g = _ops.add(g, p, alpha=weight_decay)
        clr = lr_t / (1 + state.count.to(torch.float64) * lr_decay)
        acc = _ops.addcmul(acc, g, g, 1.0)
        std = _ops.add_scalar_(_ops.sqrt(acc), eps)
        updates = _ops.mul_(_ops.div_list(g, std), -clr)
        new_state = AdagradState(state.count + 1, optree.tree_unflatten(spec, acc))
        return optree.tree_unflatten(spec, updates), new_state

    return GradientTransformation(init, update)
