"""``clip_by_global_norm``: ``torch.nn.utils.clip_grad_norm_`` as a pure transformation."""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch import Tensor

from torchfn.optim import _checks, _ops
from torchfn.optim._base import EmptyState, GradientTransformation

__all__ = ["global_norm", "clip_by_global_norm"]


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
