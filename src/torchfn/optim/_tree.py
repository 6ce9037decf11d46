"""Pytree plumbing shared by the transformations (optree; dict keys sorted)."""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch import Tensor


def check_structure(tree: Any, name: str, like: Any, like_name: str) -> list[Tensor]:
    """Leaves of ``tree``; raise if its structure differs from ``like``'s."""
    leaves, spec = optree.tree_flatten(tree)
    like_spec = optree.tree_structure(like)
    if spec != like_spec:
        raise ValueError(
            f"{name} and {like_name} have different tree structures:\n"
            f"  {name}: {spec}\n  {like_name}: {like_spec}"
        )
    return leaves


def check_params(params: Any, grads_spec: optree.PyTreeSpec, who: str) -> list[Tensor]:
    """Leaves of ``params``, which ``who`` needs and must match the grads' structure."""
    if params is None:
        raise ValueError(f"{who} needs params: call update(grads, state, params)")
    leaves, spec = optree.tree_flatten(params)
    if spec != grads_spec:
        raise ValueError(
            f"params and grads have different tree structures:\n"
            f"  params: {spec}\n  grads: {grads_spec}"
        )
    return leaves


def tree_where(pred: Tensor, on_true: Any, on_false: Any) -> Any:
    """Leafwise ``torch.where(pred, a, b)`` over two trees of the same structure."""
    return optree.tree_map(lambda a, b: torch.where(pred, a, b), on_true, on_false)


def device_of(leaves: list[Tensor]) -> torch.device:
    return leaves[0].device if leaves else torch.device("cpu")
