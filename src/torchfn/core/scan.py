"""``scan``: a loop that threads a carry and stacks per-step outputs (``jax.lax.scan``).

A recurrence written as ``step(carry, x) -> (carry, y)`` for one time step becomes a
whole-sequence function that composes with ``grad``, ``vmap``, ``jvp``, ``jacrev``,
``hessian`` and ``torch.compile`` (which unrolls it): the loop is plain Python over
torch ops, so every transform sees ordinary differentiable code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch
from torch import Tensor

from torchfn.core import tree as _tree

__all__ = ["scan"]

PyTree = Any


def _leading(xs: PyTree) -> int | None:
    """The common leading size of ``xs``'s leaves (None for no leaves)."""
    leaves, _ = _tree.flatten(xs)
    sizes = set()
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, Tensor) or leaf.dim() == 0:
            got = "a 0-d tensor" if isinstance(leaf, Tensor) else type(leaf).__name__
            raise ValueError(
                f"scan: every leaf of xs must be a tensor with a leading (time) dim, "
                f"leaf {i} is {got}"
            )
        sizes.add(leaf.shape[0])
    if len(sizes) > 1:
        shapes = [tuple(leaf.shape) for leaf in leaves]
        raise ValueError(
            f"scan: the leaves of xs must share their leading dim, got shapes {shapes}"
        )
    return sizes.pop() if sizes else None


def _signature(carry: PyTree) -> tuple:
    leaves, spec = optree.tree_flatten(carry)
    return spec, [(x.shape, x.dtype) if isinstance(x, Tensor) else type(x) for x in leaves]


def _check_carry(want: tuple, carry: PyTree, step: int) -> None:
    leaves, spec = optree.tree_flatten(carry)
    if spec != want[0]:
        raise ValueError(
            f"scan: f must return a carry with the structure of init; step {step} "
            f"returned {_tree._short(spec)}, init is {_tree._short(want[0])}"
        )
    for i, (a, x) in enumerate(zip(want[1], leaves)):
        b = (x.shape, x.dtype) if isinstance(x, Tensor) else type(x)
        if a != b:
            show = lambda s: (tuple(s[0]), s[1]) if isinstance(s, tuple) else s  # noqa: E731
            raise ValueError(
                f"scan: f must keep each carry leaf's shape and dtype; step {step} "
                f"changed leaf {i} from {show(a)} to {show(b)}"
            )


def _empty_outputs(f, init: PyTree, xs: PyTree) -> PyTree:
    """The stacked outputs of zero steps: ``f``'s output shapes from one fake step."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = lambda t: mode.from_tensor(t) if isinstance(t, Tensor) else t  # noqa: E731
        x0 = None if xs is None else _tree.map(lambda t: fake(t.new_empty(t.shape[1:])), xs)
        _, y = f(_tree.map(fake, init), x0)
    return _tree.map(lambda t: torch.empty((0, *t.shape), dtype=t.dtype, device=t.device)
                     if isinstance(t, Tensor) else t, y)


def scan(
    f: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]],
    init: PyTree,
    xs: PyTree = None,
    length: int | None = None,
    *,
    reverse: bool = False,
) -> tuple[PyTree, PyTree]:
    """Run ``carry, y = f(carry, x)`` over the leading dim of ``xs``; stack the ``y``.

    The semantics of ``jax.lax.scan``::

        def scan(f, init, xs, length=None, reverse=False):
            carry, ys = init, []
            for x in (reversed(xs) if reverse else xs):
                carry, y = f(carry, x)
                ys.append(y)
            return carry, stack(reversed(ys) if reverse else ys)

    Args:
      f: ``(carry, x) -> (carry, y)`` for one step. The carry must keep its pytree
        structure, shapes and dtypes from step to step; ``y`` is any pytree of tensors
        (or ``None``).
      init: the first carry, a pytree of tensors.
      xs: a pytree of tensors ``(T, ...)`` sliced along dim 0 (one ``x`` per step), or
        ``None`` (then ``x`` is ``None`` and ``length`` gives T).
      length: T; required when ``xs`` is None, checked against ``xs`` otherwise.
      reverse: run from ``t = T - 1`` down to 0; ``ys[t]`` still belongs to ``xs[t]``
        (a backward RNN is ``scan(..., reverse=True)``).

    Returns:
      ``(carry, ys)``: the last carry and ``y`` stacked along a new dim 0, ``(T, ...)``.

    It is a Python loop: ``grad`` keeps every step's activations (wrap ``f`` in
    ``torchfn.remat`` to recompute them, passing what ``f`` differentiates as
    ``carry`` or ``xs``), and ``torch.compile`` unrolls it.

    Example::

        >>> import torch, torchfn
        >>> def step(h, x):                       # h: (H,), x: (D,)
        ...     h = torch.tanh(w_h @ h + w_x @ x)
        ...     return h, h.sum()
        >>> w_h, w_x = torch.eye(3) * 0.5, torch.ones(3, 2)
        >>> h_T, ys = torchfn.scan(step, torch.zeros(3), torch.ones(5, 2))
        >>> h_T.shape, ys.shape
        (torch.Size([3]), torch.Size([5]))
        >>> _, total = torchfn.scan(lambda c, _: (c + 1, c), torch.tensor(0), length=4)
        >>> total.tolist()
        [0, 1, 2, 3]
    """
    if not callable(f):
        raise TypeError(f"scan: f must be callable, got {type(f).__name__}")
    if not isinstance(reverse, bool):
        raise TypeError(f"scan: reverse must be a bool, got {type(reverse).__name__}")
    if length is not None and (isinstance(length, bool) or not isinstance(length, int)
                               or length < 0):
        raise ValueError(f"scan: length must be an int >= 0, got {length!r}")
    n = None if xs is None else _leading(xs)
    if n is None:
        if length is None:
            raise ValueError("scan: xs has no tensors, so length must give the number of steps")
        n = length
    elif length is not None and length != n:
        raise ValueError(f"scan: length={length} but the leaves of xs have leading dim {n}")
    if n == 0:
        return init, _empty_outputs(f, init, xs)
    want = _signature(init)
    if xs is not None:
        # one unbind per leaf, not a select per step: T selects would each send a whole
        # (T, ...) zero tensor back in the backward (O(T^2)); unbind's backward is a stack
        x_leaves, x_spec = optree.tree_flatten(xs)
        x_steps = [leaf.unbind(0) for leaf in x_leaves]
    carry, ys = init, []
    for step, t in enumerate(range(n - 1, -1, -1) if reverse else range(n)):
        x = None if xs is None else optree.tree_unflatten(x_spec, [s[t] for s in x_steps])
        out = f(carry, x)
        if not isinstance(out, tuple) or len(out) != 2:
            raise TypeError(f"scan: f must return a (carry, y) pair, step {step} returned "
                            f"{type(out).__name__}")
        carry, y = out
        _check_carry(want, carry, step)
        ys.append(y)
    if reverse:
        ys.reverse()
    if all(y is None for y in ys):
        return carry, None
    try:
        return carry, _tree.stack(ys)  # (T, ...) per leaf
    except ValueError as err:  # tree i is step i's output
        raise ValueError(f"scan: f must return outputs y of one structure and shape at "
                         f"every step ({err})") from None
