"""Gradient clipping as pure transformations: by global norm (``clip_grad_norm_``), by
value (``clip_grad_value_``) and adaptively per unit (AGC)."""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch import Tensor

from torchfn.optim import _checks, _ops
from torchfn.optim._base import EmptyState, GradientTransformation
from torchfn.optim._tree import check_params

__all__ = ["global_norm", "clip_by_global_norm", "clip", "adaptive_grad_clip", "unitwise_norm"]


def global_norm(tree: Any) -> Tensor:
    """L2 norm of all leaves together, a 0-d tensor (``sqrt(sum_i ||x_i||^2)``).

    Example:
        >>> import torch
        >>> from torchfn.optim import global_norm
        >>> global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])})
        tensor(5.)
    """
    leaves = optree.tree_leaves(tree)
    if not leaves:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(_ops.norms(leaves)), 2)


def clip_by_global_norm(max_norm: Any) -> GradientTransformation:
    """Rescale updates so their global L2 norm is at most ``max_norm``.

    Same arithmetic as ``torch.nn.utils.clip_grad_norm_``:
    ``g * min(1, max_norm / (norm + 1e-6))``; no host sync, no branch.

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.clip_by_global_norm(1.0)
        >>> u, _ = tx.update({"w": torch.tensor([3.0, 4.0])}, tx.init(None))
        >>> u["w"]
        tensor([0.6000, 0.8000])
    """
    _checks.nonneg("max_norm", max_norm)

    def init(params: Any) -> EmptyState:
        return EmptyState()

    def update(grads: Any, state: Any, params: Any = None, *, inplace: Any = None):
        leaves, spec = optree.tree_flatten(grads)
        if not leaves:
            return grads, state
        norm = global_norm(leaves)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        return optree.tree_unflatten(spec, _ops.mul(leaves, coef)), state

    return GradientTransformation(init, update)


def clip(max_delta: Any) -> GradientTransformation:
    """Clamp every element to ``[-max_delta, max_delta]``
    (``torch.nn.utils.clip_grad_value_``, optax's ``clip``).

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.clip(1.0)
        >>> tx.update({"w": torch.tensor([-3.0, 0.5, 2.0])}, tx.init(None))[0]["w"]
        tensor([-1.0000,  0.5000,  1.0000])
    """
    _checks.nonneg("max_delta", max_delta)

    def init(params: Any) -> EmptyState:
        return EmptyState()

    def update(grads: Any, state: Any, params: Any = None, *, inplace: Any = None):
        leaves, spec = optree.tree_flatten(grads)
        return optree.tree_unflatten(
            spec, [torch.clamp(g, -max_delta, max_delta) for g in leaves]), state

    return GradientTransformation(init, update)


def unitwise_norm(x: Tensor) -> Tensor:
    """L2 norm per output unit in PyTorch's layout: the whole tensor for ndim <= 1,
    else over every dim but the first, kept for broadcasting: (O, ...) -> (O, 1, ...).

    Example:
        >>> import torch
        >>> from torchfn.optim import unitwise_norm
        >>> unitwise_norm(torch.tensor([[3.0, 4.0], [0.0, 1.0]]))  # a Linear's (out, in)
        tensor([[5.],
                [1.]])
    """
    if x.ndim <= 1:
        return torch.linalg.vector_norm(x)
    return torch.linalg.vector_norm(x, dim=tuple(range(1, x.ndim)), keepdim=True)


def adaptive_grad_clip(clipping: Any = 0.01, eps: Any = 1e-3) -> GradientTransformation:
    """Adaptive gradient clipping (Brock et al. 2021, NFNets), unit by unit.

    Each output unit's gradient is scaled down to at most ``clipping`` times that
    unit's parameter norm (floored at ``eps``): ``g * min(1, c max(||p||, eps) / ||g||)``,
    with the norms of ``unitwise_norm`` (rows of a Linear, output channels of a conv),
    as timm's ``adaptive_clip_grad``. Needs params.

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.adaptive_grad_clip(0.1)
        >>> p = {"w": torch.ones(2, 4)}             # unit norms 2
        >>> g = {"w": torch.tensor([[1.0, 0, 0, 0], [0.1, 0, 0, 0]])}
        >>> tx.update(g, tx.init(p), p)[0]["w"][:, 0]  # row 0 clipped to 0.1 * 2
        tensor([0.2000, 0.1000])
    """
    _checks.nonneg("clipping", clipping)
    _checks.nonneg("eps", eps)

    def init(params: Any) -> EmptyState:
        return EmptyState()

    def update(grads: Any, state: Any, params: Any = None, *, inplace: Any = None):
        leaves, spec = optree.tree_flatten(grads)
        p = check_params(params, spec, "adaptive_grad_clip")
        out = []
        for g, w in zip(leaves, p):
            max_norm = torch.clamp(unitwise_norm(w), min=eps) * clipping
            g_norm = unitwise_norm(g)
            clipped = g * (max_norm / torch.clamp(g_norm, min=1e-6))
            out.append(torch.where(g_norm < max_norm, g, clipped))
        return optree.tree_unflatten(spec, out), state

    return GradientTransformation(init, update)
