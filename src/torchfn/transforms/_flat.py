"""A pytree of float tensors as one vector ``(n,)`` and back: the shared plumbing of the
solvers and samplers that work on flat vectors (``cg``, ``eigsh``, ``hmc``)."""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch import Tensor


class Flat:
    """``like``'s leaves, raveled in ``optree`` order into one vector of their promoted
    dtype; ``who`` names the caller in errors, ``name`` the argument."""

    def __init__(self, like: Any, who: str, name: str):
        leaves, self.spec = optree.tree_flatten(like)
        if not leaves or not all(isinstance(x, Tensor) and x.dtype.is_floating_point
                                 for x in leaves):
            got = [x.dtype if isinstance(x, Tensor) else type(x).__name__ for x in leaves]
            raise TypeError(f"{who}: {name} must be a floating-point tensor or a pytree of "
                            f"them, got {got or 'no leaves'}")
        self.who, self.name = who, name
        self.shapes = [x.shape for x in leaves]
        self.sizes = [x.numel() for x in leaves]
        self.n = sum(self.sizes)
        self.dtype = leaves[0].dtype
        for x in leaves[1:]:
            self.dtype = torch.promote_types(self.dtype, x.dtype)
        self.device = leaves[0].device

    def vector(self, tree: Any, what: str) -> Tensor:
        """``tree`` (``like``'s structure and shapes) as a vector ``(n,)``."""
        leaves, spec = optree.tree_flatten(tree)
        if spec != self.spec or [getattr(x, "shape", None) for x in leaves] != self.shapes:
            got = [tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
                   for x in leaves]
            raise ValueError(f"{self.who}: {what} must have {self.name}'s structure and "
                             f"shapes {[tuple(s) for s in self.shapes]}, got {got}")
        return torch.cat([x.reshape(-1).to(self.dtype) for x in leaves])

    def tree(self, vec: Tensor) -> Any:
        """A vector ``(..., n)`` as ``like``'s structure, each leaf with leading ``(...)``."""
        pieces = vec.split(self.sizes, dim=-1)
        return optree.tree_unflatten(self.spec, [p.reshape((*vec.shape[:-1], *s))
                                                 for p, s in zip(pieces, self.shapes)])
