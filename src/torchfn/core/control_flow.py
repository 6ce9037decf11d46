"""``cond``, ``switch``, ``while_loop`` and ``fori_loop`` that work under ``vmap`` (``jax.lax``'s).

Python control flow on a tensor (``if x > 0:``, ``while err > tol:``) fails under
``torch.func.vmap``: one example's function cannot branch on a value that differs
from example to example. These functions take the branch or the loop as functions,
as JAX does, and behave the same batched or not:

- ``cond`` / ``switch`` run only the chosen branch when every example chooses the
  same one (always, outside ``vmap``), and otherwise run the branches the examples
  chose and select per example, as JAX does under ``vmap``. Unlike JAX, a branch's
  derivative at the examples it was not chosen for never reaches them, so
  ``cond(x > 0, sqrt, neg, x)`` has finite gradients everywhere (JAX gives NaN for
  the negative examples, the "double where" sharp bit);
- ``while_loop`` runs until the condition is false in every example, each example
  keeping its value from the iteration where its own condition turned false (JAX's
  batched ``while_loop``).

Reverse mode differentiates them too (``grad`` through the iterations actually run),
where JAX's ``while_loop`` has forward mode only. They read values back to the host
to decide, so under ``torch.compile`` they run eagerly (a graph break).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from torchfn.core._custom_args import eager_call
from torchfn.core._lanes import lanes

__all__ = ["cond", "switch", "while_loop", "fori_loop"]


def cond(pred: Any, true_fun: Callable, false_fun: Callable, *operands: Any) -> Any:
    """``true_fun(*operands)`` where ``pred``, else ``false_fun(*operands)``.

    Args:
        pred: a bool (or a 0-d bool tensor; one per example under ``vmap``).
        true_fun, false_fun: functions of ``operands`` returning pytrees of tensors
            with the same structure, shapes and dtypes.
        *operands: passed to the branch.

    Example (a per-example branch under ``vmap``)::

        >>> import torch, torchfn
        >>> def f(x):                               # x: ()
        ...     return torchfn.cond(x > 0, torch.sqrt, lambda x: -x, x)
        >>> torch.func.vmap(f)(torch.tensor([4.0, -3.0]))
        tensor([2., 3.])
    """
    return switch(_as_index(pred, "cond", "pred"), [false_fun, true_fun], *operands)


def switch(index: Any, branches: Sequence[Callable], *operands: Any) -> Any:
    """``branches[index](*operands)``, ``index`` clamped to the branches, as ``jax.lax.switch``.

    ``index`` is an int or a 0-d integer tensor (one per example under ``vmap``). When
    the examples choose different branches, each chosen branch runs on all of them and
    the results are selected per example; a branch no example chose does not run.
    """
    if not isinstance(branches, Sequence) or not branches:
        raise TypeError("switch: branches must be a non-empty sequence of functions")
    for i, b in enumerate(branches):
        if not callable(b):
            raise TypeError(f"switch: branches[{i}] must be callable, got {type(b).__name__}")
    n = len(branches)
    if isinstance(index, bool) or not isinstance(index, (int, torch.Tensor)):
        raise TypeError(f"switch: index must be an int or a 0-d integer tensor, got "
                        f"{type(index).__name__}")
    if isinstance(index, int):
        return branches[min(max(index, 0), n - 1)](*operands)
    if index.dim() != 0 or index.is_floating_point() or index.is_complex():
        raise TypeError(f"switch: index must be a 0-d integer tensor, got shape "
                        f"{tuple(index.shape)} and dtype {index.dtype}")
    if torch.compiler.is_compiling():  # it reads the index to decide: run it eagerly
        return eager_call(switch, (index, branches, *operands), {})
    index = index.clamp(0, n - 1)
    chosen = sorted({int(v) for v in lanes(index).reshape(-1).tolist()})
    if len(chosen) == 1:  # every example takes the same branch
        return branches[chosen[0]](*operands)
    # A branch sees the other examples' operands detached: its derivative there (NaN for
    # sqrt at a negative number the other branch handles) then never reaches them.
    outs = [branches[i](*_only_for(index == i, operands)) for i in chosen]
    leaves = [pytree.tree_flatten(o) for o in outs]
    spec = leaves[0][1]
    for i, (ls, s) in zip(chosen[1:], leaves[1:]):
        if s != spec:
            raise TypeError(f"switch: branches[{i}] returned structure {s}, branches"
                            f"[{chosen[0]}] {spec}; the branches must agree")
        for j, (a, b) in enumerate(zip(ls, leaves[0][0])):
            if not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
                got = ((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor)
                       else type(a).__name__)
                raise TypeError(f"switch: leaf {j} of branches[{i}] is {got}, of branches"
                                f"[{chosen[0]}] {(tuple(b.shape), b.dtype)}; the branches "
                                "must agree")
    result = leaves[-1][0]
    for i, (ls, _) in zip(reversed(chosen[:-1]), reversed(leaves[:-1])):
        take = index == i
        result = [torch.where(take, a, r) for a, r in zip(ls, result)]
    return pytree.tree_unflatten(result, spec)


def while_loop(cond_fun: Callable[[Any], Any], body_fun: Callable[[Any], Any],
               init_val: Any) -> Any:
    """``while cond_fun(val): val = body_fun(val)``, per example under ``vmap``.

    Args:
        cond_fun: ``val -> bool`` (a 0-d bool tensor; one per example under ``vmap``).
        body_fun: ``val -> val``, the same structure, shapes and dtypes.
        init_val: a pytree of tensors (and Python values, which must not change).

    Returns:
        The final ``val``. Under ``vmap`` the body runs until every example's condition
        is false; an example whose condition turned false earlier keeps that value.

    Example (Newton's square root, each example to its own tolerance)::

        >>> import torch, torchfn
        >>> def sqrt(a):                            # a: ()
        ...     def step(x):
        ...         return 0.5 * (x + a / x)
        ...     return torchfn.while_loop(lambda x: (x * x - a).abs() > 1e-6 * a, step, a)
        >>> torch.func.vmap(sqrt)(torch.tensor([4.0, 9.0, 1e4]))
        tensor([  2.,   3., 100.])
    """
    if not callable(cond_fun) or not callable(body_fun):
        raise TypeError("while_loop: cond_fun and body_fun must be callable")
    if torch.compiler.is_compiling():  # it reads values to decide: run it eagerly
        return eager_call(while_loop, (cond_fun, body_fun, init_val), {})
    val = init_val
    spec = pytree.tree_structure(init_val)
    while True:
        go = _as_pred(cond_fun(val), "while_loop", "cond_fun's result")
        running = lanes(go)
        if not bool(running.any()):
            return val
        new = body_fun(val)
        _check_same(new, val, spec, "while_loop", "body_fun")
        if bool(running.all()):
            val = new
        else:  # the examples that are done keep their value
            val = pytree.tree_map(functools.partial(_keep_done, go), new, val)


def fori_loop(lower: int, upper: int, body_fun: Callable[[int, Any], Any], init_val: Any) -> Any:
    """``for i in range(lower, upper): val = body_fun(i, val)``, as ``jax.lax.fori_loop``.

    The bounds are Python ints (the same for every example); ``i`` is passed as an int.
    """
    for name, v in (("lower", lower), ("upper", upper)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"fori_loop: {name} must be an int, got {type(v).__name__}")
    spec = pytree.tree_structure(init_val)
    val = init_val
    for i in range(lower, upper):
        new = body_fun(i, val)
        _check_same(new, val, spec, "fori_loop", "body_fun")
        val = new
    return val


def _only_for(take: torch.Tensor, operands: tuple) -> tuple:
    """The operands, differentiable only where ``take`` (the double-where trick)."""
    def leaf(x):
        if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()):
            return torch.where(take, x, x.detach())
        return x

    return pytree.tree_map(leaf, operands)


def _keep_done(go: torch.Tensor, new: Any, old: Any) -> Any:
    return torch.where(go, new, old) if isinstance(new, torch.Tensor) else new


def _as_pred(p: Any, who: str, what: str) -> Any:
    if isinstance(p, bool):
        return torch.tensor(p)
    if not isinstance(p, torch.Tensor) or p.dim() != 0 or p.dtype != torch.bool:
        got = (f"shape {tuple(p.shape)} and dtype {p.dtype}" if isinstance(p, torch.Tensor)
               else type(p).__name__)
        raise TypeError(f"{who}: {what} must be a bool or a 0-d bool tensor, got {got}")
    return p


def _as_index(pred: Any, who: str, what: str) -> Any:
    if isinstance(pred, bool):
        return int(pred)
    return _as_pred(pred, who, what).to(torch.int64)


def _check_same(new: Any, old: Any, spec, who: str, what: str) -> None:
    new_leaves, new_spec = pytree.tree_flatten(new)
    if new_spec != spec:
        raise TypeError(f"{who}: {what} must return the loop value's structure {spec}, got "
                        f"{new_spec}")
    for i, (a, b) in enumerate(zip(new_leaves, pytree.tree_leaves(old))):
        if isinstance(b, torch.Tensor):
            if not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
                got = (tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else type(a).__name__
                raise TypeError(f"{who}: {what} changed leaf {i} from "
                                f"{(tuple(b.shape), b.dtype)} to {got}")
        elif not operator.eq(a, b):
            raise TypeError(f"{who}: {what} changed the non-tensor leaf {i} from {b!r} to "
                            f"{a!r}; only tensors may change")
