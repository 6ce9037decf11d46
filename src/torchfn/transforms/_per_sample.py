"""Per-sample gradients: write the loss for one example, batch it with ``vmap(grad)``.

``per_sample_grads(loss_fn)(params, x, y)`` returns the gradient of
``loss_fn(params, x[i], y[i])`` for every ``i``, stacked along a new leading
dimension, in one vectorised call::

    >>> import torch
    >>> from torchfn.transforms import per_sample_grads
    >>> def loss_fn(w, x, y):                 # one example: x (D,), y ()
    ...     return (x @ w - y) ** 2
    >>> w, x, y = torch.ones(3), torch.ones(8, 3), torch.zeros(8)
    >>> per_sample_grads(loss_fn)(w, x, y).shape   # (B, D)
    torch.Size([8, 3])

Which arguments are batched (``in_dims``)
-----------------------------------------
By default the differentiated arguments (``argnums``) are shared by every
example (``in_dim=None``) and every other argument is batched along dim 0.
Pass ``in_dims`` -- one entry per positional argument, as for
:func:`torch.func.vmap` -- to share more arguments, e.g. a model state or a
PRNG key that every example uses::

    per_sample_grads(loss_fn, in_dims=(None, None, 0, 0))(params, state, x, y)

An entry may itself be a pytree of dims matching that argument.

Memory
------
``vmap`` runs every example at once, so peak memory grows with the batch:
the ``B`` gradients plus ``B`` examples' activations. ``chunk_size=k`` runs
``k`` examples at a time (same results, a little slower) and bounds the
activations and temporaries; the ``(B, *shape)`` outputs of
:func:`per_sample_grads` must exist anyway (and vmap's final concatenation
briefly holds them twice). :func:`per_sample_grad_norms` takes the norm inside
the vmapped function, so with ``chunk_size`` only ``k`` gradients ever exist.
Peak RSS measured on CPU, batch 256 (``bench/test_bench_dp.py`` models):

==========================  ===========  ===========
                            chunk None   chunk 16/32
==========================  ===========  ===========
MLP 784-512-256-10, grads   537 MiB      927 MiB (16)
MLP, norms                  929 MiB      69 MiB (16)
2-conv CNN, grads           121 MiB      74 MiB (32)
2-conv CNN, norms           125 MiB      42 MiB (32)
==========================  ===========  ===========

``torch.func.grad`` differentiates with ``create_graph=True``: if ``params``
require grad, the returned gradients keep a graph (so you can differentiate
through them); pass detached params when you don't need that.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.func import grad, grad_and_value, vmap

from torchfn import tree

__all__ = ["per_sample_grads", "per_sample_grad_norms", "clip_coefficients"]

PyTree = Any


def _check_argnums(argnums: int | tuple[int, ...]) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) and not isinstance(argnums, bool) else argnums
    if (
        not isinstance(nums, tuple)
        or not nums
        or not all(isinstance(a, int) and not isinstance(a, bool) and a >= 0 for a in nums)
    ):
        raise TypeError(
            f"argnums must be an int >= 0 or a non-empty tuple of them, got {argnums!r}"
        )
    return nums


def _check_chunk_size(chunk_size: int | None) -> None:
    if chunk_size is not None and (
        not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1
    ):
        raise ValueError(f"chunk_size must be None or an int >= 1, got {chunk_size!r}")


def _resolve_in_dims(
    in_dims: Sequence[Any] | None, argnums: tuple[int, ...], n_args: int
) -> tuple[Any, ...]:
    if max(argnums) >= n_args:
        raise ValueError(
            f"argnums={argnums} refers to argument {max(argnums)}, but only {n_args} "
            "arguments were passed"
        )
    if in_dims is None:
        dims = tuple(None if i in argnums else 0 for i in range(n_args))
    else:
        dims = tuple(in_dims)
        if len(dims) != n_args:
            raise ValueError(
                f"in_dims must have one entry per argument ({n_args}), got {len(dims)}: {in_dims!r}"
            )
        for i in argnums:
            if dims[i] is not None:
                raise ValueError(
                    f"in_dims[{i}] must be None: argument {i} is differentiated (argnums) and "
                    f"shared by all examples, got {dims[i]!r}"
                )
    if all(d is None for d in tree.leaves(dims)):
        raise ValueError(
            "per-sample gradients need at least one batched argument: pass the batch "
            f"after the params (loss_fn(params, *example)); in_dims={dims}"
        )
    return dims


def _vmap_call(f: Callable[..., Any], dims: tuple, chunk_size: int | None, args: tuple) -> Any:
    """``vmap(f)(*args)``, also for an empty batch (vmap itself rejects size 0)."""
    sizes = {
        a.shape[d]
        for a, d in zip(tree.leaves(args), _leaf_dims(dims, args))
        if d is not None and isinstance(a, torch.Tensor) and a.ndim > d
    }
    if sizes != {0}:
        return vmap(f, in_dims=dims, chunk_size=chunk_size)(*args)
    # B = 0 (e.g. an empty Poisson batch): trace one zero example for the output
    # structure, then return its leaves with an empty batch dim.
    leaves, spec = tree.flatten(args)
    one = [
        a.new_zeros(a.shape[:d] + (1,) + a.shape[d + 1 :]) if d is not None else a
        for a, d in zip(leaves, _leaf_dims(dims, args))
    ]
    out = vmap(f, in_dims=dims)(*tree.unflatten(spec, one))
    return tree.map(lambda t: t[:0], out)


def _leaf_dims(dims: tuple, args: tuple) -> list:
    """The in_dim of every leaf of ``args`` (a dims entry may be a prefix pytree)."""
    out = []
    for d, a in zip(dims, args):
        n = len(tree.leaves(a))
        if d is None or isinstance(d, int):
            out.extend([d] * n)
        else:
            out.extend(tree.leaves(d, is_leaf=lambda x: x is None))
    return out


def per_sample_grads(
    loss_fn: Callable[..., Any],
    argnums: int | tuple[int, ...] = 0,
    chunk_size: int | None = None,
    has_aux: bool = False,
    *,
    in_dims: Sequence[Any] | None = None,
    return_value: bool = False,
) -> Callable[..., Any]:
    """Per-example gradients of a loss written for ONE example.

    Args:
        loss_fn: ``loss_fn(params, *example) -> scalar`` (or ``(scalar, aux)``
            with ``has_aux``); sees one example, without a batch dim.
        argnums: which argument(s) to differentiate (as in ``torch.func.grad``).
        chunk_size: examples per vectorised chunk (``None``: all at once).
        has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` comes back batched.
        in_dims: batch dim per positional argument; default: ``None`` for the
            ``argnums`` arguments, ``0`` for the others (see module docs).
        return_value: also return the per-example losses ``(B,)``.

    Returns:
        ``fn(params, *batch)`` returning ``grads`` -- the structure of ``params``
        with a leading ``B`` on every leaf -- or ``(grads, aux)`` with
        ``has_aux``; with ``return_value``: ``(grads, loss)`` /
        ``(grads, (loss, aux))``.

    Example::

        >>> import torch
        >>> from torchfn.transforms import per_sample_grads
        >>> def loss_fn(params, x, y):                     # one example: x (D,), y ()
        ...     return (x @ params["w"] + params["b"] - y) ** 2
        >>> params = {"w": torch.zeros(3), "b": torch.zeros(())}
        >>> x, y = torch.ones(8, 3), torch.ones(8)           # x: (B, D), y: (B,)
        >>> grads = per_sample_grads(loss_fn)(params, x, y)  # leaves (B, *shape)
        >>> grads["w"].shape, grads["b"].shape
        (torch.Size([8, 3]), torch.Size([8]))
        >>> grads["b"].tolist()                            # 2 * (0 - 1) for every example
        [-2.0, -2.0, -2.0, -2.0, -2.0, -2.0, -2.0, -2.0]
    """
    nums = _check_argnums(argnums)
    _check_chunk_size(chunk_size)
    argnums_ = nums[0] if isinstance(argnums, int) else nums
    if return_value:
        g = grad_and_value(loss_fn, argnums=argnums_, has_aux=has_aux)
    else:
        g = grad(loss_fn, argnums=argnums_, has_aux=has_aux)

    def fn(*args: Any) -> Any:
        dims = _resolve_in_dims(in_dims, nums, len(args))
        return _vmap_call(g, dims, chunk_size, args)

    return fn


def _sq_norm(grads: PyTree) -> torch.Tensor:
    leaves = tree.leaves(grads)
    if not leaves:
        raise ValueError("the gradient pytree has no leaves")
    return sum(g.pow(2).sum() for g in leaves)


def per_sample_grad_norms(
    loss_fn: Callable[..., Any],
    argnums: int | tuple[int, ...] = 0,
    chunk_size: int | None = None,
    has_aux: bool = False,
    *,
    in_dims: Sequence[Any] | None = None,
) -> Callable[..., Any]:
    """Global L2 norm of each example's gradient, over the whole gradient pytree.

    Same arguments as :func:`per_sample_grads`. The norm is taken inside the
    vmapped function, so with ``chunk_size`` at most ``chunk_size`` gradients
    are alive at once.

    Returns:
        ``fn(params, *batch) -> norms`` with ``norms: (B,)`` (``(norms, aux)``
        with ``has_aux``).

    Example::

        >>> import torch
        >>> from torchfn.transforms import per_sample_grad_norms
        >>> def loss_fn(w, x, y):                          # one example: x (D,), y ()
        ...     return 0.5 * (x @ w - y) ** 2              # gradient (x @ w - y) * x
        >>> w = torch.zeros(2)
        >>> x = torch.tensor([[3.0, 4.0], [0.0, 1.0]])     # (B, D)
        >>> y = torch.tensor([1.0, 2.0])                   # (B,)
        >>> per_sample_grad_norms(loss_fn)(w, x, y).tolist()
        [5.0, 2.0]
    """
    nums = _check_argnums(argnums)
    _check_chunk_size(chunk_size)
    argnums_ = nums[0] if isinstance(argnums, int) else nums
    g = grad(loss_fn, argnums=argnums_, has_aux=has_aux)

    def one(*args: Any) -> Any:
        if has_aux:
            grads, aux = g(*args)
            return _sq_norm(grads).sqrt(), aux
        return _sq_norm(g(*args)).sqrt()

    def fn(*args: Any) -> Any:
        dims = _resolve_in_dims(in_dims, nums, len(args))
        return _vmap_call(one, dims, chunk_size, args)

    return fn


def clip_coefficients(norms: torch.Tensor, l2_norm_clip: float) -> torch.Tensor:
    """DP-SGD clip factors ``min(1, C / (||g_n|| + 1e-6))`` for norms ``(B,)``.

    Example::

        >>> import torch
        >>> from torchfn.transforms import clip_coefficients
        >>> coef = clip_coefficients(torch.tensor([0.5, 4.0]), l2_norm_clip=2.0)   # (B,)
        >>> [round(c, 4) for c in coef.tolist()]            # small norms are kept as is
        [1.0, 0.5]
    """
    return (l2_norm_clip / (norms + 1e-6)).clamp(max=1.0)
