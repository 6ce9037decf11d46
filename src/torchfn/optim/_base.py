"""The gradient-transformation protocol, ``chain`` and ``apply_updates``.

A gradient transformation is a pair of pure functions (torchopt's / Optax's protocol):

    state = tx.init(params)
    updates, state = tx.update(grads, state, params)   # params optional
    params = apply_updates(params, updates)            # params + updates

``updates`` are what gets ADDED to the parameters: already scaled by the learning
rate and negated. Nothing is mutated. ``GradientTransformation`` subclasses
torchopt's NamedTuple, so torchopt transforms chain with ours and ours with theirs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch
import torchopt
from torch import Tensor

from torchfn.optim import _ops
from torchfn.optim._tree import check_structure

__all__ = ["GradientTransformation", "EmptyState", "chain", "identity", "apply_updates"]


class GradientTransformation(torchopt.base.GradientTransformation):
    """``init(params) -> state``, ``update(grads, state, params=None) -> (updates, state)``.

    Our ``update`` functions also accept torchopt's ``inplace`` keyword and ignore
    it: they never mutate their arguments.
    """

    __slots__ = ()

    def chain(self, next: Any) -> GradientTransformation:  # torchopt's method name
        return chain(self, next)


class EmptyState(NamedTuple):
    """State of a stateless transformation."""


def takes_inplace(update: Callable[..., Any]) -> bool:
    try:
        sig = inspect.signature(update)
    except (TypeError, ValueError):
        return False
    return any(
        p.name == "inplace" or p.kind is inspect.Parameter.VAR_KEYWORD
        for p in sig.parameters.values()
    )


def call_update(tx: Any, grads: Any, state: Any, params: Any, inplace_kw: bool) -> tuple[Any, Any]:
    if inplace_kw:  # torchopt transforms mutate their input by default
        return tx.update(grads, state, params=params, inplace=False)
    return tx.update(grads, state, params=params)


def takes_extra(update: Callable[..., Any]) -> bool:
    """Whether ``update`` takes optax's extra arguments (``value``, ``grad``,
    ``value_fn``, for line searches): it names ``value_fn`` or takes ``**kwargs``."""
    try:
        sig = inspect.signature(update)
    except (TypeError, ValueError):
        return False
    return any(p.name == "value_fn" or p.kind is inspect.Parameter.VAR_KEYWORD
               for p in sig.parameters.values())


def bind_update(tx: Any) -> Callable[[Any, Any, Any], tuple[Any, Any]]:
    """``(grads, state, params) -> (updates, state)`` calling ``tx.update`` purely."""
    kw = takes_inplace(tx.update)
    return lambda g, s, p: call_update(tx, g, s, p, kw)


def identity() -> GradientTransformation:
    """Leaves updates unchanged."""

    def init(params: Any) -> EmptyState:
        return EmptyState()

    def update(grads: Any, state: Any, params: Any = None, *, inplace: Any = None):
        return grads, state

    return GradientTransformation(init, update)


def chain(*transforms: Any) -> GradientTransformation:
    """Compose transformations left to right; the state is the tuple of their states.

    Any object with torchopt's ``init``/``update`` works, e.g. ``torchopt.transform.scale``;
    torchopt transforms are called with ``inplace=False`` so they stay pure. Keywords
    beyond ``params`` (optax's extra arguments: ``value``, ``grad``, ``value_fn``) go to
    the transforms that take them (line searches, ``lbfgs``).

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adam(1e-3))
        >>> params = {"w": torch.ones(3)}
        >>> state = tx.init(params)
        >>> updates, state = tx.update({"w": torch.ones(3)}, state, params)
        >>> params = optim.apply_updates(params, updates)
    """
    for i, tx in enumerate(transforms):
        if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
            raise TypeError(
                f"chain() argument {i} must have init and update methods "
                f"(a GradientTransformation), got {type(tx).__name__}"
            )
    calls = tuple(bind_update(tx) for tx in transforms)
    extra_ok = tuple(takes_extra(tx.update) for tx in transforms)

    def init(params: Any) -> tuple[Any, ...]:
        return tuple(tx.init(params) for tx in transforms)

    def update(grads: Any, state: tuple[Any, ...], params: Any = None, *, inplace: Any = None,
               **extra: Any):
        if not isinstance(state, tuple) or len(state) != len(transforms):
            got = len(state) if isinstance(state, tuple) else type(state).__name__
            raise ValueError(
                f"chain of {len(transforms)} transforms expects a state tuple of length "
                f"{len(transforms)}, got {got}"
            )
        new_state = []
        for tx, call, ok, s in zip(transforms, calls, extra_ok, state):
            if extra and ok:  # optax's extra arguments (a line search's value_fn, ...)
                grads, s = tx.update(grads, s, params, inplace=False, **extra)
            else:
                grads, s = call(grads, s, params)
            new_state.append(s)
        return grads, tuple(new_state)

    return GradientTransformation(init, update)


def apply_updates(params: Any, updates: Any) -> Any:
    """``params + updates`` leafwise, as a new tree in the params' dtypes (pure).

    Example:
        >>> import torch
        >>> from torchfn.optim import apply_updates
        >>> apply_updates({"w": torch.ones(2)}, {"w": torch.full((2,), -0.5)})["w"]
        tensor([0.5000, 0.5000])
    """
    p_leaves, spec = optree.tree_flatten(params)
    u_leaves = check_structure(updates, "updates", params, "params")
    if all(p.dtype == u.dtype for p, u in zip(p_leaves, u_leaves)):
        new = _ops.add(p_leaves, u_leaves)
    else:
        new = [(p + u).to(p.dtype) for p, u in zip(p_leaves, u_leaves)]
    return optree.tree_unflatten(spec, new)


def lr_at(lr: Any, count: Tensor) -> Any:
    """The learning rate for the step ``count`` (a number, a tensor or a schedule)."""
    if callable(lr) and not isinstance(lr, Tensor):
        return lr(count)
    return lr


def new_count(leaves: list[Tensor]) -> Tensor:
    """A 0-d int32 step counter on the params' device."""
    device = leaves[0].device if leaves else torch.device("cpu")
    return torch.zeros((), dtype=torch.int32, device=device)


def check_state(state: Any, cls: type, who: str) -> None:
    if not isinstance(state, cls):
        raise TypeError(
            f"{who}: state must be a {cls.__name__} (from init), got {type(state).__name__}"
        )
