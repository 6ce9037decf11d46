"""Segment reductions: ``segment_sum``, ``segment_mean``, ``segment_max``, ``segment_min``,
``segment_softmax``.

A segment reduction combines the rows of ``data: (E, ...)`` that share a segment id,
``segment_ids: (E,)`` in ``[0, num_segments)``, into ``(num_segments, ...)``: what
``jax.ops.segment_sum`` and jraph's ``segment_softmax`` do, and what message passing on
a graph's edge list needs (the segment of an edge is its target node). Rows may come in
any order; a segment without rows gets the reduction's identity (0 for sums and means,
-inf for maxima, +inf for minima, nothing to normalise for softmax).

All are plain torch ops (``index_add``, ``scatter_reduce``, ``index_select``) with
a static output shape, so they work under ``grad``, ``vmap`` (over data, ids or both),
``jvp``, ``jacrev`` and ``torch.compile``. In plain eager mode the ids are checked to
lie in range; under a transform or while tracing they are not (reading their values
would break the trace), and an id out of range is then torch's indexing error.

On CUDA, ``index_add`` adds with atomics, so float sums may differ in the last bits
from run to run (as ``jax.ops.segment_sum`` on a GPU);
``torch.use_deterministic_algorithms(True)`` makes them repeatable.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchfn.core._eager import plain

__all__ = ["segment_sum", "segment_mean", "segment_max", "segment_min", "segment_softmax"]


def _check(name: str, data: object, segment_ids: object, num_segments: object) -> None:
    if not isinstance(data, Tensor) or data.dim() == 0:
        got = "a 0-d tensor" if isinstance(data, Tensor) else type(data).__name__
        raise ValueError(f"{name}: data must be a tensor (E, ...), got {got}")
    if isinstance(num_segments, bool) or not isinstance(num_segments, int) or num_segments < 0:
        raise ValueError(f"{name}: num_segments must be an int >= 0, got {num_segments!r}")
    if (not isinstance(segment_ids, Tensor) or segment_ids.dim() != 1
            or segment_ids.dtype not in (torch.int64, torch.int32)):
        got = (f"{segment_ids.dtype} tensor of shape {tuple(segment_ids.shape)}"
               if isinstance(segment_ids, Tensor) else type(segment_ids).__name__)
        raise ValueError(f"{name}: segment_ids must be an int64 or int32 tensor (E,), got {got}")
    if segment_ids.shape[0] != data.shape[0]:
        raise ValueError(f"{name}: segment_ids has {segment_ids.shape[0]} ids for "
                         f"{data.shape[0]} rows of data (shape {tuple(data.shape)})")
    if segment_ids.device != data.device:
        raise ValueError(f"{name}: segment_ids is on {segment_ids.device}, data on {data.device}")
    if plain(segment_ids) and segment_ids.numel():
        lo, hi = segment_ids.min().item(), segment_ids.max().item()
        if lo < 0 or hi >= num_segments:
            raise ValueError(f"{name}: segment_ids must lie in [0, {num_segments}) "
                             f"(num_segments={num_segments}), got ids from {lo} to {hi}")


def segment_sum(data: Tensor, segment_ids: Tensor, num_segments: int) -> Tensor:
    """Sum the rows of ``data`` per segment.

    Args:
        data: ``(E, ...)``.
        segment_ids: ``(E,)`` int64/int32 in ``[0, num_segments)``, any order.
        num_segments: the number of segments ``S``.

    Returns:
        ``(S, ...)``: ``out[s] = sum of data[e] for e with segment_ids[e] == s``
        (0 for an empty segment).

    Example::

        >>> import torch
        >>> data = torch.tensor([1.0, 2.0, 3.0, 4.0])
        >>> segment_sum(data, torch.tensor([0, 2, 0, 2]), num_segments=3)
        tensor([4., 0., 6.])
    """
    _check("segment_sum", data, segment_ids, num_segments)
    return _sum(data, segment_ids, num_segments)


def _sum(data: Tensor, segment_ids: Tensor, num_segments: int) -> Tensor:
    out = data.new_zeros((num_segments, *data.shape[1:]))  # (S, ...)
    return out.index_add(0, segment_ids, data)


def segment_mean(data: Tensor, segment_ids: Tensor, num_segments: int) -> Tensor:
    """The mean of the rows of ``data`` per segment (a graph read-out: nodes -> graphs).

    Args:
        data: ``(E, ...)`` floating point.
        segment_ids: ``(E,)`` int64/int32 in ``[0, num_segments)``, any order.
        num_segments: the number of segments ``S``.

    Returns:
        ``(S, ...)``; 0 for an empty segment.

    Example::

        >>> import torch
        >>> data = torch.tensor([1.0, 2.0, 3.0, 4.0])
        >>> segment_mean(data, torch.tensor([0, 2, 0, 0]), num_segments=3)
        tensor([2.6667, 0.0000, 2.0000])
    """
    _check("segment_mean", data, segment_ids, num_segments)
    if not data.is_floating_point():
        raise ValueError(f"segment_mean: data must be floating point, got {data.dtype}")
    count = _sum(torch.ones_like(segment_ids, dtype=data.dtype), segment_ids, num_segments)
    count = count.clamp_min(1).reshape(-1, *([1] * (data.dim() - 1)))  # (S, 1, ...)
    return _sum(data, segment_ids, num_segments) / count


def segment_max(data: Tensor, segment_ids: Tensor, num_segments: int) -> Tensor:
    """The largest row of ``data`` per segment, elementwise.

    Args:
        data: ``(E, ...)`` floating point.
        segment_ids: ``(E,)`` int64/int32 in ``[0, num_segments)``, any order.
        num_segments: the number of segments ``S``.

    Returns:
        ``(S, ...)``; ``-inf`` for an empty segment. Its gradient goes to the rows that
        reach the maximum (split evenly between ties).

    Example::

        >>> import torch
        >>> data = torch.tensor([1.0, 5.0, 3.0, 4.0])
        >>> segment_max(data, torch.tensor([0, 2, 0, 2]), num_segments=3)
        tensor([3., -inf, 5.])
    """
    _check("segment_max", data, segment_ids, num_segments)
    if not data.is_floating_point():
        raise ValueError(f"segment_max: data must be floating point, got {data.dtype}")
    return _extreme(data, segment_ids, num_segments, "amax")


def _extreme(data: Tensor, segment_ids: Tensor, num_segments: int, how: str) -> Tensor:
    """``how`` = "amax" or "amin" per segment, starting from its identity (-inf, +inf)."""
    identity = -torch.inf if how == "amax" else torch.inf
    out = data.new_full((num_segments, *data.shape[1:]), identity)  # (S, ...)
    index = segment_ids.reshape(-1, *([1] * (data.dim() - 1))).expand_as(data)  # (E, ...)
    return out.scatter_reduce(0, index, data, how, include_self=True)


def segment_min(data: Tensor, segment_ids: Tensor, num_segments: int) -> Tensor:
    """The smallest row of ``data`` per segment, elementwise.

    Args:
        data: ``(E, ...)`` floating point.
        segment_ids: ``(E,)`` int64/int32 in ``[0, num_segments)``, any order.
        num_segments: the number of segments ``S``.

    Returns:
        ``(S, ...)``; ``+inf`` for an empty segment.

    Example::

        >>> import torch
        >>> data = torch.tensor([1.0, 5.0, 3.0, 4.0])
        >>> segment_min(data, torch.tensor([0, 2, 0, 2]), num_segments=3)
        tensor([1., inf, 4.])
    """
    _check("segment_min", data, segment_ids, num_segments)
    if not data.is_floating_point():
        raise ValueError(f"segment_min: data must be floating point, got {data.dtype}")
    return _extreme(data, segment_ids, num_segments, "amin")


def segment_softmax(logits: Tensor, segment_ids: Tensor, num_segments: int) -> Tensor:
    """Softmax of ``logits`` over the rows that share a segment.

    Message passing's attention weights: with ``segment_ids`` an edge list's targets,
    each node's incoming edges get weights that sum to 1. Computed with each segment's
    maximum subtracted first (no overflow), that maximum held constant (the softmax
    does not depend on it, so its gradient is exact).

    Args:
        logits: ``(E, ...)`` floating point; ``-inf`` drops a row from its segment.
        segment_ids: ``(E,)`` int64/int32 in ``[0, num_segments)``, any order.
        num_segments: the number of segments ``S``.

    Returns:
        ``(E, ...)``: ``exp(logits[e]) / sum of exp(logits[f]) over f in e's segment``.
        A segment whose every logit is ``-inf`` gets 0 weights, not NaN.

    Example::

        >>> import torch
        >>> logits = torch.tensor([0.0, 1.0, 0.0, 2.0])
        >>> segment_softmax(logits, torch.tensor([0, 1, 0, 1]), num_segments=2)
        tensor([0.5000, 0.2689, 0.5000, 0.7311])
    """
    _check("segment_softmax", logits, segment_ids, num_segments)
    if not logits.is_floating_point():
        raise ValueError(f"segment_softmax: logits must be floating point, got {logits.dtype}")
    return _softmax(logits, segment_ids, num_segments)


def _softmax(logits: Tensor, segment_ids: Tensor, num_segments: int) -> Tensor:
    m = _extreme(logits.detach(), segment_ids, num_segments, "amax")  # (S, ...)
    m = m.nan_to_num(neginf=0.0).index_select(0, segment_ids)  # (E, ...); all -inf -> 0
    e = (logits - m).exp()  # (E, ...)
    total = _sum(e, segment_ids, num_segments).index_select(0, segment_ids)  # (E, ...)
    return e / total.clamp_min(torch.finfo(e.dtype).tiny)
