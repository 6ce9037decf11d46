"""Discrete samplers: ``bernoulli``, ``permutation``, ``categorical``, ``choice``."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from torchfn.core.random._bits import _generate, _random_bits, _unit
from torchfn.core.random._checks import (
    _broadcasts_to,
    _check_broadcast,
    _check_key,
    _check_shape,
    _eager_tensor,
    _scalar,
)
from torchfn.core.random._floats import gumbel, uniform
from torchfn.core.random._integers import randint
from torchfn.core.random._keys import split


def bernoulli(
    key: Tensor, p: float | Tensor = 0.5, shape: int | Sequence[int] | None = None
) -> Tensor:
    """Boolean samples that are True with probability ``p`` (``jax.random.bernoulli``).

    Args:
      key: ``(2,)`` int32 key.
      p: probability in ``[0, 1]``, a float (drawn in float32) or a float tensor
        (drawn in its dtype) broadcastable to ``shape``.
      shape: output shape; default ``p.shape`` (``()`` for a float).

    Returns:
      mask: ``shape`` bool tensor, ``uniform(key, shape, p.dtype) < p``.

    Example::

        >>> from torchfn import random
        >>> m = random.bernoulli(random.key(0), 0.25, (10_000,))
        >>> abs(float(m.float().mean()) - 0.25) < 0.02
        True
    """
    k = _check_key(key, "bernoulli")
    if isinstance(p, bool) or not isinstance(p, (int, float, Tensor)):
        raise TypeError(f"bernoulli: p must be a float or a float tensor, got {type(p).__name__}")
    if isinstance(p, Tensor):
        if not p.is_floating_point():
            raise TypeError(f"bernoulli: p must be a floating tensor, got {p.dtype}")
        if _eager_tensor(p) and not bool(((p >= 0) & (p <= 1)).all()):
            raise ValueError(f"bernoulli: p must be in [0, 1], got {p}")
        dtype = p.dtype
        p = p.to(k.device)
        if shape is None:
            shape = tuple(p.shape)
    else:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"bernoulli: p must be in [0, 1], got {p}")
        dtype = torch.float32
        if shape is None:
            shape = ()
    shape = _check_shape(shape, "bernoulli")
    _check_broadcast(shape, "bernoulli", p=p)
    if isinstance(p, Tensor):
        return _generate(k, shape, dtype, lambda y0, y1: _unit(y0, y1, dtype)) < p
    p_t = _scalar(p, dtype, k.device)
    return _generate(k, shape, torch.bool, lambda y0, y1: _unit(y0, y1, dtype) < p_t)


def _shuffle_index(k: Tensor, n: int) -> Tensor:
    """JAX's ``_shuffle`` of ``arange(n)``: sorts by fresh 32-bit keys, 1 round per
    ~1600 elements' worth of collision risk (ceil(3 ln n / ln(2**32 - 1)) rounds)."""
    rounds = math.ceil(3 * math.log(max(1, n)) / math.log(2**32 - 1))
    idx = torch.arange(n, device=k.device)
    for _ in range(rounds):
        k, sub = split(k)
        sort_keys = _random_bits(sub, 32, (n,)) ^ (-(1 << 31))  # unsigned order as signed
        perm = torch.sort(sort_keys, stable=True).indices
        idx = idx.index_select(0, perm)
    return idx


def permutation(key: Tensor, x: int | Tensor) -> Tensor:
    """A random permutation of ``arange(x)``, or of ``x``'s rows (``jax.random.permutation``).

    Args:
      key: ``(2,)`` int32 key.
      x: an int ``n >= 0`` or a tensor with at least one dimension.

    Returns:
      ``(n,)`` int64 permutation, or ``x`` with its rows shuffled.

    Example::

        >>> from torchfn import random
        >>> p = random.permutation(random.key(0), 5)
        >>> sorted(p.tolist())
        [0, 1, 2, 3, 4]
    """
    k = _check_key(key, "permutation")
    if isinstance(x, Tensor):
        if x.dim() == 0:
            raise ValueError(
                "permutation: x must be an int or a tensor with >= 1 dim, got a 0-d tensor"
            )
        return x.index_select(0, _shuffle_index(k, x.shape[0]).to(x.device))
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"permutation: x must be an int or a tensor, got {type(x).__name__} {x!r}")
    if x < 0:
        raise ValueError(f"permutation: x must be >= 0, got {x}")
    return _shuffle_index(k, x)


def categorical(
    key: Tensor,
    logits: Tensor,
    axis: int = -1,
    shape: int | Sequence[int] | None = None,
) -> Tensor:
    """Sample category indices from unnormalized log-probabilities (Gumbel-max, as JAX).

    Args:
      key: ``(2,)`` int32 key.
      logits: ``(..., K, ...)`` float tensor; ``axis`` indexes the categories.
        ``-inf`` marks impossible categories.
      axis: the category axis.
      shape: output shape, ``(*prefix, *batch)`` where ``batch`` is
        ``logits.shape`` without ``axis``; default ``batch``.

    Returns:
      idx: ``shape`` int64 tensor of category indices.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> logits = torch.log(torch.tensor([0.1, 0.2, 0.7]))
        >>> s = random.categorical(random.key(0), logits, shape=(5000,))
        >>> abs(float((s == 2).float().mean()) - 0.7) < 0.03
        True
    """
    k = _check_key(key, "categorical")
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        got = logits.dtype if isinstance(logits, Tensor) else type(logits).__name__
        raise TypeError(f"categorical: logits must be a float tensor, got {got}")
    if logits.dim() == 0:
        raise ValueError("categorical: logits must have at least 1 dim, got a 0-d tensor")
    if (
        isinstance(axis, bool)
        or not isinstance(axis, int)
        or not -logits.dim() <= axis < logits.dim()
    ):
        raise ValueError(
            f"categorical: axis must be an int in [-{logits.dim()}, {logits.dim()}), got {axis}"
        )
    axis = axis % logits.dim()
    batch = tuple(logits.shape[:axis]) + tuple(logits.shape[axis + 1 :])
    shape = batch if shape is None else _check_shape(shape, "categorical")
    if len(shape) < len(batch) or not _broadcasts_to(batch, shape):
        raise ValueError(f"categorical: shape must end with the batch shape {batch}, got {shape}")
    prefix = shape[: len(shape) - len(batch)]
    rest = list(shape[len(shape) - len(batch) :])
    rest.insert(axis, logits.shape[axis])
    g = gumbel(k, (*prefix, *rest), logits.dtype)
    logits = logits.to(k.device).reshape((1,) * len(prefix) + tuple(logits.shape))
    return torch.argmax(g + logits, dim=len(prefix) + axis)


def choice(
    key: Tensor,
    a: int | Tensor,
    shape: int | Sequence[int] = (),
    replace: bool = True,
    p: Tensor | None = None,
) -> Tensor:
    """Draw from ``arange(a)`` or from the rows of ``a`` (``jax.random.choice``, axis 0).

    Args:
      key: ``(2,)`` int32 key.
      a: an int ``n > 0`` or a tensor ``(n, ...)``.
      shape: number (shape) of draws.
      replace: draw with replacement (default) or without.
      p: optional ``(n,)`` float tensor of non-negative weights (normalized here).

    Returns:
      ``shape`` int64 indices, or ``(*shape, ...)`` rows of ``a``. Matches JAX's
      bits with its default int32 index draws.

    Example::

        >>> from torchfn import random
        >>> random.choice(random.key(0), 10, (3,), replace=False).unique().numel()
        3
    """
    k = _check_key(key, "choice")
    shape = _check_shape(shape, "choice")
    if isinstance(a, Tensor):
        if a.dim() == 0:
            raise ValueError("choice: a must be an int or a tensor with >= 1 dim, got a 0-d tensor")
        n = a.shape[0]
    elif isinstance(a, bool) or not isinstance(a, int):
        raise TypeError(f"choice: a must be an int or a tensor, got {type(a).__name__} {a!r}")
    else:
        n = a
    if not isinstance(replace, bool):
        raise TypeError(f"choice: replace must be a bool, got {type(replace).__name__}")
    draws = math.prod(shape)
    tail = tuple(a.shape[1:]) if isinstance(a, Tensor) else ()
    if draws == 0:
        dtype = a.dtype if isinstance(a, Tensor) else torch.int64
        return torch.zeros(shape + tail, dtype=dtype, device=k.device)
    if n <= 0:
        raise ValueError(f"choice: a must be > 0 (or have rows) to draw from, got {n}")
    if not replace and draws > n:
        raise ValueError(f"choice: cannot draw {draws} samples without replacement from {n}")
    if p is None:
        if replace:
            ind = randint(k, shape, 0, n, torch.int32).long()
        else:
            ind = _shuffle_index(k, n)[:draws]
    else:
        if not isinstance(p, Tensor) or not p.is_floating_point():
            got = p.dtype if isinstance(p, Tensor) else type(p).__name__
            raise TypeError(f"choice: p must be a float tensor, got {got}")
        if tuple(p.shape) != (n,):
            raise ValueError(f"choice: p must have shape ({n},), got {tuple(p.shape)}")
        if _eager_tensor(p) and not bool((p >= 0).all() & (p.sum() > 0)):
            raise ValueError(f"choice: p must be non-negative with a positive sum, got {p}")
        p = p.to(k.device)
        if replace:
            cum = torch.cumsum(p, 0)
            r = cum[-1] * (1 - uniform(k, shape, p.dtype))
            ind = torch.searchsorted(cum, r.reshape(-1)).reshape(shape)
        else:
            g = gumbel(k, (n,), p.dtype) + torch.log(p)
            ind = torch.topk(g, draws).indices
    if isinstance(a, Tensor):
        return a.index_select(0, ind.reshape(-1).to(a.device)).reshape(shape + tail)
    return ind.reshape(shape)
