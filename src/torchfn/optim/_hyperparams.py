"""``inject_hyperparams``: hyperparameters as tensors in the optimizer state.

With the learning rate in the state it can be read, changed between steps
(``state._replace(hyperparams={**state.hyperparams, "lr": new_lr})``), driven by
a schedule, checkpointed, and ``vmap``-ed: an ensemble whose members train with
different learning rates is one stacked state.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from torchfn.optim._base import (
    GradientTransformation,
    call_update,
    check_state,
    new_count,
    takes_inplace,
)

__all__ = ["InjectHyperparamsState", "inject_hyperparams"]


class InjectHyperparamsState(NamedTuple):
    count: Tensor  # () int32
    hyperparams: dict[str, Any]  # name -> () float32 tensor (or a tuple of them)
    inner_state: Any


def _is_number(v: Any) -> bool:
    return isinstance(v, (numbers.Real, Tensor)) and not isinstance(v, bool)


def _injectable(v: Any) -> bool:
    if _is_number(v):
        return True
    return isinstance(v, tuple) and len(v) > 0 and all(_is_number(x) for x in v)


def _as_tensor(v: Any, device: torch.device) -> Any:
    if isinstance(v, tuple):
        return tuple(_as_tensor(x, device) for x in v)
    return torch.as_tensor(v, dtype=torch.float32, device=device)


def _check_schedule(name: str, fn: Callable[[Any], Any]) -> None:
    hint = (
        f"inject_hyperparams: argument {name!r} is callable, so it is treated as a schedule "
        f"step -> value; if it is not one (e.g. a mask), list it in static_args"
    )
    try:
        value = fn(0)
    except Exception as err:
        raise TypeError(f"{hint} (calling it with step 0 raised {err!r})") from err
    if not _is_number(value) or (isinstance(value, Tensor) and value.ndim != 0):
        raise TypeError(f"{hint} (it returned {value!r} for step 0)")


def inject_hyperparams(
    opt_factory: Callable[..., Any], *, static_args: Iterable[str] = ()
) -> Callable[..., GradientTransformation]:
    """Wrap ``opt_factory`` so its numeric arguments live in the state as 0-d tensors.

    Numbers (and tuples of numbers such as ``betas``) become float32 tensors in
    ``state.hyperparams``; a callable argument is a schedule ``step -> value``
    re-evaluated every step (its current value is stored). Bools, strings and
    names in ``static_args`` stay static: list other callables there, e.g.
    ``inject_hyperparams(adamw, static_args=("mask",))(lr=1e-3, mask=decay_mask)``.

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.inject_hyperparams(optim.adam)(lr=1e-3)
        >>> p = {"w": torch.ones(2)}
        >>> state = tx.init(p)
        >>> state.hyperparams["lr"]
        tensor(0.0010)
        >>> state = state._replace(hyperparams={**state.hyperparams, "lr": torch.tensor(0.1)})
        >>> u, state = tx.update({"w": torch.ones(2)}, state)
        >>> u["w"]
        tensor([-0.1000, -0.1000])
    """
    if not callable(opt_factory):
        raise TypeError(
            f"opt_factory must be a callable returning a transformation, got {opt_factory!r}"
        )
    static_names = frozenset(static_args)
    try:
        signature = inspect.signature(opt_factory)
    except (TypeError, ValueError):
        signature = None

    def wrapped(*args: Any, **kwargs: Any) -> GradientTransformation:
        if args:
            if signature is None:
                raise TypeError("pass hyperparameters by keyword to inject_hyperparams(...)(...)")
            kwargs = dict(signature.bind_partial(*args, **kwargs).arguments)
        probe = opt_factory(**kwargs)  # validates the arguments once, with their static values
        inplace_kw = takes_inplace(probe.update)
        schedules = {
            k: v
            for k, v in kwargs.items()
            if k not in static_names and callable(v) and not isinstance(v, Tensor)
        }
        for k, f in schedules.items():
            _check_schedule(k, f)
        injected = [k for k, v in kwargs.items() if k not in static_names and _injectable(v)]
        static = {k: v for k, v in kwargs.items() if k not in schedules and k not in injected}

        def build(hyperparams: dict[str, Any]) -> Any:
            return opt_factory(**static, **hyperparams)

        def init(params: Any) -> InjectHyperparamsState:
            leaves = optree.tree_leaves(params)
            count = new_count(leaves)
            hp = {k: _as_tensor(kwargs[k], count.device) for k in injected}
            hp.update({k: _as_tensor(f(count), count.device) for k, f in schedules.items()})
            return InjectHyperparamsState(count, hp, build(hp).init(params))

        def update(grads: Any, state: InjectHyperparamsState, params: Any = None, *, inplace=None):
            check_state(state, InjectHyperparamsState, "inject_hyperparams")
            hp = dict(state.hyperparams)
            for k, f in schedules.items():
                hp[k] = _as_tensor(f(state.count), state.count.device)
            inner = build(hp)
            updates, inner_state = call_update(inner, grads, state.inner_state, params, inplace_kw)
            return updates, InjectHyperparamsState(state.count + 1, hp, inner_state)

        return GradientTransformation(init, update)

    return wrapped
