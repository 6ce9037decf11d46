"""``associative_scan``: all prefix combinations in O(log n) depth (``jax.lax.associative_scan``).

For an associative ``fn``, ``out[i] = fn(...fn(fn(x[0], x[1]), x[2])..., x[i])``. A
sequential loop takes n dependent steps; the parallel prefix (Ladner and Fischer's
odd-even recursion) takes about 2 log2(n) rounds, each a few whole-tensor ops, so a
linear recurrence ``h[t] = a[t] h[t-1] + b[t]`` (linear RNNs and state-space models:
S4/S5, Mamba, LRU) runs as a handful of kernels instead of n small ones.

The recursion, on a sequence of length n along ``dim``:

1. combine neighbours pairwise, ``fn(x[0::2], x[1::2])``, giving n // 2 elements;
2. scan those recursively: that gives the prefixes ending at odd positions;
3. the prefixes at even positions 2, 4, ... are ``fn(odd prefix before it, x[even])``;
   position 0 is ``x[0]``;
4. interleave the two.

Everything is plain torch ops (slices, ``fn``, ``cat``), so ``grad``, ``vmap``,
``jvp``, ``jacrev``, ``hessian`` and ``torch.compile`` all go through it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["associative_scan"]


def associative_scan(fn: Callable[[Any, Any], Any], elems: Any, *, reverse: bool = False,
                     dim: int = 0) -> Any:
    """Inclusive scan of ``elems`` along ``dim`` with an associative ``fn``.

    Args:
        fn: ``fn(a, b) -> c``, associative (``fn(fn(a, b), c) == fn(a, fn(b, c))``),
            on pytrees with ``elems``' structure; it is called on slices holding many
            positions at once, so it must work elementwise along ``dim`` (broadcast,
            never reduce over it). It need not be commutative: ``a`` is the earlier
            part of the sequence (the later one with ``reverse=True``).
        elems: pytree of tensors sharing their size n along ``dim``.
        reverse: scan from the end, as JAX does: the flipped sequence is scanned with
            ``fn`` unchanged, so ``out[i] = fn(...fn(x[n-1], x[n-2])..., x[i])`` (the
            later position is ``fn``'s first argument; it matters only for a
            non-commutative ``fn``).
        dim: the scan dimension (negative counts from the end).

    Returns:
        A pytree like ``elems``: ``out[i] = fn(...fn(x[0], x[1])..., x[i])``.

    Example (the linear recurrence ``h[t] = a[t] h[t-1] + b[t]`` from ``h[-1] = 0``)::

        >>> import torch, torchfn
        >>> def compose(first, second):           # (a1, b1) then (a2, b2): h -> a2 (a1 h + b1) + b2
        ...     (a1, b1), (a2, b2) = first, second
        ...     return a2 * a1, a2 * b1 + b2
        >>> a = torch.full((6,), 0.5)              # (T,)
        >>> b = torch.ones(6)
        >>> _, h = torchfn.associative_scan(compose, (a, b))
        >>> h
        tensor([1.0000, 1.5000, 1.7500, 1.8750, 1.9375, 1.9688])
    """
    if not callable(fn):
        raise TypeError(f"associative_scan: fn must be callable, got {type(fn).__name__}")
    leaves, spec = pytree.tree_flatten(elems)
    if not leaves:
        raise ValueError("associative_scan: elems has no tensors")
    sizes = set()
    for path, leaf in pytree.tree_flatten_with_path(elems)[0]:
        where = pytree.keystr(path) or "elems"
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"associative_scan: every leaf of elems must be a tensor, got "
                            f"{type(leaf).__name__} at {where}")
        if not -leaf.dim() <= dim < max(leaf.dim(), 1) or leaf.dim() == 0:
            raise ValueError(f"associative_scan: dim={dim} is out of range for the leaf at "
                             f"{where} with shape {tuple(leaf.shape)}")
        sizes.add(leaf.shape[dim])
    if len(sizes) > 1:
        shapes = [tuple(x.shape) for x in leaves]
        raise ValueError(f"associative_scan: the leaves of elems must share their size along "
                         f"dim={dim}, got shapes {shapes}")
    dims = [dim % x.dim() for x in leaves]

    def combine(a: list, b: list) -> list:
        out = fn(pytree.tree_unflatten(a, spec), pytree.tree_unflatten(b, spec))
        out_leaves, out_spec = pytree.tree_flatten(out)
        if out_spec != spec:
            raise TypeError(f"associative_scan: fn must return elems' structure {spec}, got "
                            f"{out_spec}")
        for i, (o, x) in enumerate(zip(out_leaves, a)):
            if not isinstance(o, torch.Tensor) or o.shape != x.shape:
                got = tuple(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__
                raise ValueError(
                    f"associative_scan: fn must act elementwise along dim={dim}: leaf {i} came "
                    f"back as {got} for inputs of shape {tuple(x.shape)}"
                )
        return out_leaves

    if reverse:  # JAX's: a forward scan of the flipped sequence, fn unchanged
        flipped = [torch.flip(x, (d,)) for x, d in zip(leaves, dims)]
        out = [torch.flip(x, (d,)) for x, d in zip(_scan(combine, flipped, dims), dims)]
    else:
        out = _scan(combine, leaves, dims)
    return pytree.tree_unflatten(out, spec)


def _take(xs: list, dims: list, start: int, stop: int | None = None, step: int = 1) -> list:
    """``x[start:stop:step]`` along each leaf's scan dim."""
    return [x[(slice(None),) * d + (slice(start, stop, step),)] for x, d in zip(xs, dims)]


def _scan(combine: Callable[[list, list], list], xs: list, dims: list) -> list:
    n = xs[0].shape[dims[0]]
    if n < 2:
        return xs
    # 1-2. pairs (x0 x1), (x2 x3), ... combined, then scanned: prefixes at 1, 3, 5, ...
    odd = _scan(combine, combine(_take(xs, dims, 0, n - 1, 2), _take(xs, dims, 1, None, 2)), dims)
    # 3. prefixes at 2, 4, ...: the odd prefix just before, then x at that position
    m = (n - 1) // 2  # how many even positions after 0
    even = combine(_take(odd, dims, 0, m), _take(xs, dims, 2, None, 2)) if m else None
    # 4. interleave: x0, odd[0], even[0], odd[1], even[1], ...
    out = []
    for i, d in enumerate(dims):
        head = _take([xs[i]], [d], 0, 1)[0]
        tail_even = even[i] if even is not None else None
        out.append(_interleave(head, odd[i], tail_even, d))
    return out


def _interleave(head: torch.Tensor, odd: torch.Tensor, even: torch.Tensor | None,
                d: int) -> torch.Tensor:
    """cat(head, odd[0], even[0], odd[1], even[1], ...) along d; even may be one shorter."""
    k = odd.shape[d]
    if even is None:  # n == 2
        return torch.cat([head, odd], d)
    if even.shape[d] == k:  # n odd: pairs (odd[j], even[j]) fill the rest exactly
        pairs = torch.stack([odd, even], d + 1).flatten(d, d + 1)
        return torch.cat([head, pairs], d)
    # n even: odd has one more than even; its last element closes the sequence
    pairs = torch.stack([_take([odd], [d], 0, k - 1)[0], even], d + 1).flatten(d, d + 1)
    return torch.cat([head, pairs, _take([odd], [d], k - 1)[0]], d)
