"""Parameter groups: ``masked``, ``partition``, ``freeze`` and ``decay_mask``.

A mask is a tree of Python bools with the params' structure, or a function
``params -> tree of bools`` (called on params at init and on params, or grads
when params are not given, at update). An inner transformation sees the same
containers with ``None`` in place of the leaves it does not own (``None`` is an
empty subtree for optree and torchopt), so any transformation works inside.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import optree
import torch

from torchfn.optim._base import EmptyState, GradientTransformation, bind_update

__all__ = [
    "MaskedState",
    "PartitionState",
    "masked",
    "partition",
    "freeze",
    "decay_mask",
    "resolve_mask",
]


def _resolve(spec_tree: Any, value: Any, name: str, what: str) -> list[Any]:
    tree_spec = optree.tree_structure(spec_tree)
    resolved = value(spec_tree) if callable(value) else value
    try:
        # flatten_up_to rather than tree_flatten: torch.compile cannot build the treespec
        # of a tree of Python constants (torch 2.13).
        leaves = tree_spec.flatten_up_to(resolved)
    except (ValueError, TypeError):
        raise ValueError(
            f"{name} must be a tree of {what} with the params' structure (or a function "
            f"returning one):\n  {name}: {optree.tree_structure(resolved)}\n"
            f"  params: {tree_spec}"
        ) from None
    return leaves


def resolve_mask(mask: Any, tree: Any, name: str = "mask") -> list[bool]:
    """The mask's leaves as Python bools, one per leaf of ``tree``."""
    leaves = _resolve(tree, mask, name, "bools")
    for leaf in leaves:
        if not isinstance(leaf, bool):
            raise TypeError(f"{name} leaves must be Python bools, got {leaf!r}")
    return leaves


def _select(tree: Any, keep: Sequence[bool]) -> Any:
    """``tree`` with the leaves where ``keep`` is False replaced by ``None``."""
    if tree is None:
        return None
    leaves, spec = optree.tree_flatten(tree)
    return optree.tree_unflatten(spec, [x if k else None for x, k in zip(leaves, keep)])


def _full_leaves(grads: Any, sub_updates: Any) -> list[Any]:
    """Leaves of ``sub_updates`` at every leaf position of ``grads`` (``None`` where absent)."""
    return optree.tree_structure(grads).flatten_up_to(sub_updates)


def _check_tx(name: str, tx: Any) -> None:
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(f"{name} must be a GradientTransformation, got {type(tx).__name__}")


class MaskedState(NamedTuple):
    inner_state: Any


def masked(inner: Any, mask: Any):
    """Apply ``inner`` to the leaves where ``mask`` is True; pass the others through.

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.masked(optim.sgd(0.1), {"w": True, "b": False})
        >>> g = {"w": torch.ones(2), "b": torch.ones(2)}
        >>> u, _ = tx.update(g, tx.init(g))
        >>> u["w"], u["b"]
        (tensor([-0.1000, -0.1000]), tensor([1., 1.]))
    """
    _check_tx("inner", inner)
    call = bind_update(inner)

    def init(params: Any) -> MaskedState:
        keep = resolve_mask(mask, params)
        return MaskedState(inner.init(_select(params, keep)))

    def update(grads: Any, state: MaskedState, params: Any = None, *, inplace: Any = None):
        keep = resolve_mask(mask, params if params is not None else grads)
        leaves, spec = optree.tree_flatten(grads)
        if len(keep) != len(leaves):
            raise ValueError(
                f"mask has {len(keep)} leaves (from params) but grads have {len(leaves)}:"
                f" grads structure {spec}"
            )
        sub, inner_state = call(_select(grads, keep), state.inner_state, _select(params, keep))
        sub_leaves = _full_leaves(grads, sub)
        out = [u if k else g for g, u, k in zip(leaves, sub_leaves, keep)]
        return optree.tree_unflatten(spec, out), MaskedState(inner_state)

    return GradientTransformation(init, update)


class PartitionState(NamedTuple):
    inner_states: dict[str, Any]


def partition(transforms: Mapping[str, Any], labels: Any):
    """A different transformation per parameter group.

    Args:
        transforms: ``{label: transformation}``.
        labels: a tree of str labels with the params' structure, or ``params -> labels``.

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.partition({"head": optim.adam(1e-3), "body": optim.sgd(1e-2)},
        ...                      {"head": "head", "body": "body"})
        >>> p = {"head": torch.ones(2), "body": torch.ones(2)}
        >>> u, _ = tx.update(p, tx.init(p))
        >>> u["body"]
        tensor([-0.0100, -0.0100])
    """
    if not isinstance(transforms, Mapping) or not transforms:
        raise TypeError(
            f"transforms must be a non-empty dict label -> transformation, got {transforms!r}"
        )
    for k, tx in transforms.items():
        if not isinstance(k, str):
            raise TypeError(f"transforms keys (labels) must be str, got {k!r}")
        _check_tx(f"transforms[{k!r}]", tx)
    calls = {k: bind_update(tx) for k, tx in transforms.items()}

    def _labels(tree: Any) -> list[str]:
        labs = _resolve(tree, labels, "labels", "str labels")
        missing = sorted({str(x) for x in labs} - set(transforms))
        if missing:
            raise ValueError(
                f"labels {missing} have no transformation; transforms has {sorted(transforms)}"
            )
        return labs

    def init(params: Any) -> PartitionState:
        labs = _labels(params)
        return PartitionState(
            {k: tx.init(_select(params, [x == k for x in labs])) for k, tx in transforms.items()}
        )

    def update(grads: Any, state: PartitionState, params: Any = None, *, inplace: Any = None):
        labs = _labels(params if params is not None else grads)
        leaves, spec = optree.tree_flatten(grads)
        if len(labs) != len(leaves):
            raise ValueError(
                f"labels have {len(labs)} leaves but grads have {len(leaves)}: "
                f"grads structure {spec}"
            )
        out: list[Any] = list(leaves)
        new_states = {}
        for k in transforms:
            keep = [x == k for x in labs]
            sub, new_states[k] = calls[k](
                _select(grads, keep), state.inner_states[k], _select(params, keep)
            )
            for i, u in enumerate(_full_leaves(grads, sub)):
                if keep[i]:
                    out[i] = u
        return optree.tree_unflatten(spec, out), PartitionState(new_states)

    return GradientTransformation(init, update)


def freeze(mask: Any):
    """Zero the updates where ``mask`` is True (a frozen backbone); others pass through.

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.chain(optim.sgd(0.1), optim.freeze({"body": True, "head": False}))
        >>> g = {"body": torch.ones(2), "head": torch.ones(2)}
        >>> u, _ = tx.update(g, tx.init(g))
        >>> u["body"], u["head"]
        (tensor([0., 0.]), tensor([-0.1000, -0.1000]))
    """
    def init(params: Any) -> EmptyState:
        resolve_mask(mask, params)
        return EmptyState()

    def update(grads: Any, state: Any, params: Any = None, *, inplace: Any = None):
        frozen = resolve_mask(mask, params if params is not None else grads)
        leaves, spec = optree.tree_flatten(grads)
        out = [torch.zeros_like(g) if f else g for g, f in zip(leaves, frozen)]
        return optree.tree_unflatten(spec, out), state

    return GradientTransformation(init, update)


def decay_mask(params: Any, *, exclude: Sequence[str] = ("bias", "norm")) -> Any:
    """True where weight decay should apply: leaves with ``ndim >= 2`` whose path
    (``"layer.0.weight"``) contains none of ``exclude`` (case-insensitive).

    Biases and norm scales (1-D) get False. Use as ``adamw(mask=decay_mask)`` or
    ``masked(add_decayed_weights(wd), decay_mask)``.

    Example:
        >>> import torch
        >>> from torchfn.optim import decay_mask
        >>> decay_mask({"fc": {"weight": torch.ones(2, 2), "bias": torch.ones(2)}})
        {'fc': {'weight': True, 'bias': False}}
    """
    words = tuple(e.lower() for e in exclude)

    def keep(path: tuple[Any, ...], p: torch.Tensor) -> bool | None:
        if p is None:  # torch.compile's optree polyfill visits None subtrees
            return None
        name = ".".join(str(k) for k in path).lower()
        return bool(p.ndim >= 2 and not any(w in name for w in words))

    return optree.tree_map_with_path(keep, params)
