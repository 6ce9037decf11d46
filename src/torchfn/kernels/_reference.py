"""Materialised attention: the float64 oracle, and the math of second-order derivatives.

Plain torch ops, differentiable by autograd and every ``torch.func`` transform.
Memory is O(B * H * Nq * Nk): use it for checking, not for long sequences.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _dropout

NO_WINDOW = (-1, -1)


def band(nq: int, nk: int, causal: bool, window: tuple[int, int], device=None,
         shift: int | None = None) -> Tensor | None:
    """The (Nq, Nk) bool matrix of allowed (query, key) pairs set by ``causal`` and
    ``window``, or None when they allow every pair.

    Query ``i`` sits at position ``i + shift``, by default ``i + Nk - Nq`` (bottom-right
    aligned; a block of rows passes its own); it sees key ``j`` iff ``j <= pos``
    (causal), ``j >= pos - left`` and ``j <= pos + right`` (``window = (left, right)``,
    -1 = unbounded).

    >>> band(3, 3, False, (1, 0)).int()
    tensor([[1, 0, 0],
            [1, 1, 0],
            [0, 1, 1]], dtype=torch.int32)
    """
    left, right = window
    if causal:  # (a window's right side is >= 0: causal is the tighter bound)
        right = 0
    if left < 0 and right < 0:
        return None
    pos = torch.arange(nq, device=device)[:, None] + (nk - nq if shift is None else shift)
    j = torch.arange(nk, device=device)  # (Nk,)
    ok = torch.ones(nq, nk, dtype=torch.bool, device=device)
    if left >= 0:
        ok &= j >= pos - left
    if right >= 0:
        ok &= j <= pos + right
    return ok


def segment_mask(segments: tuple[Tensor, Tensor] | None) -> Tensor | None:
    """(B, 1, Nq, Nk) bool: query i sees key j iff ``q_ids[b, i] == kv_ids[b, j]``."""
    if segments is None:
        return None
    q_ids, kv_ids = segments
    return (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]


def segment_ranges(rows: Tensor, cols: Tensor) -> tuple[Tensor, Tensor]:
    """For each row id, the column range [lo, hi) from the first to one past the last
    column with the same id (lo = C, hi = 0 where there is none, so that a min / max
    over rows skips it): (B, R) int32 each.

    rows: (B, R) ids, cols: (B, C) ids (any integer dtype). With contiguous segments
    (packed sequences) the range holds exactly the row's segment; otherwise it is a
    superset, and the kernels still test equality. Sort-based, so no device sync.

    >>> lo, hi = segment_ranges(torch.tensor([[0, 0, 1, 7]]), torch.tensor([[0, 0, 0, 1, 1]]))
    >>> lo.tolist(), hi.tolist()
    ([[0, 0, 3, 5]], [[3, 3, 5, 0]])
    """
    cols = cols.to(torch.int64)
    rows = rows.to(torch.int64).contiguous()
    vals, idx = torch.sort(cols, dim=-1, stable=True)  # equal ids: original order kept
    left = torch.searchsorted(vals, rows, side="left")
    right = torch.searchsorted(vals, rows, side="right")
    n = cols.shape[-1]
    first = idx.gather(-1, left.clamp(max=n - 1))
    last = idx.gather(-1, (right - 1).clamp(min=0))
    has = right > left
    lo = torch.where(has, first, n).to(torch.int32)
    hi = torch.where(has, last + 1, 0).to(torch.int32)
    return lo, hi


def alibi_bias(slopes: Tensor, nq: int, nk: int, shift: int | None = None) -> Tensor:
    """(B, H, Nq, Nk) ALiBi bias ``-slope * |i + Nk - Nq - j|`` from (B, H) ``slopes``
    (FlashAttention's ``alibi_slopes``; distances from the bottom-right aligned diagonal;
    ``shift`` replaces ``Nk - Nq`` for a block of rows, as in :func:`band`).

    >>> alibi_bias(torch.tensor([[0.5]]), 2, 3)
    tensor([[[[-0.5000, -0.0000, -0.5000],
              [-1.0000, -0.5000, -0.0000]]]])
    """
    pos = torch.arange(nq, device=slopes.device)[:, None] + (nk - nq if shift is None else shift)
    dist = (pos - torch.arange(nk, device=slopes.device)).abs().to(slopes.dtype)  # (Nq, Nk)
    return -slopes[:, :, None, None] * dist


def _probs(
    q: Tensor, k: Tensor, mask: Tensor | None, causal: bool, scale: float,
    window: tuple[int, int] = NO_WINDOW, segments: tuple[Tensor, Tensor] | None = None,
    softcap: float = 0.0, slopes: Tensor | None = None, shift: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Softmax probabilities (B, H, Nq, Nk) and logsumexp (B, H, Nq); k: (B, H, Nk, D).
    ``shift``: the position of query 0 (default Nk - Nq; see :func:`band`).

    ``mask`` is bool (True = attend) or additive, broadcastable to (B, H, Nq, Nk).
    ``softcap`` > 0: the scaled scores become ``softcap * tanh(s / softcap)`` before the
    mask is added (Gemma 2); ``slopes`` (B, H): the ALiBi bias is added with the mask.
    Fully masked rows give P = 0 and lse = -inf, with finite (zero) gradients.
    """
    s = scale * (q @ k.transpose(-1, -2))  # (B, H, Nq, Nk)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    if slopes is not None:
        s = s + alibi_bias(slopes.to(s.dtype), s.shape[-2], s.shape[-1], shift)
    allowed = band(s.shape[-2], s.shape[-1], causal, window, s.device, shift)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    if segments is not None:
        s = s.masked_fill(~segment_mask(segments), float("-inf"))
    dead = (s == float("-inf")).all(-1, keepdim=True)  # (B, H, Nq, 1): no key allowed
    s = s.masked_fill(dead, 0.0)
    lse = torch.logsumexp(s, -1, keepdim=True)
    # exp(s - lse) rather than torch.softmax, which stalls on tiny inputs on a busy machine
    p = (s - lse).exp().masked_fill(dead, 0.0)
    return p, lse.squeeze(-1).masked_fill(dead.squeeze(-1), float("-inf"))


def dropped(p: Tensor, dropout: float, seeds: Tensor | None, row0: int = 0) -> Tensor:
    """Probabilities (B, H, Nq, Nk) after keyed dropout (``seeds``: (B, H, 2), or None
    for none): dropped ones are 0, kept ones scaled by 1 / keep rate (``_dropout``).
    ``row0``: the index of p's first row among all queries (a block of rows)."""
    if seeds is None:
        return p
    rows = torch.arange(row0, row0 + p.shape[-2], device=p.device)[:, None]
    kept = _dropout.keep(seeds[:, :, None, None, :], rows, 0, p.shape[-1],
                         _dropout.threshold(dropout))
    return p * kept.to(p.dtype) * _dropout.keep_scale(dropout)


def _repeat_kv(x: Tensor, groups: int) -> Tensor:
    """(B, Hkv, N, D) -> (B, Hkv * groups, N, D): query head h reads kv head h // groups."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float,
    window: tuple[int, int] = NO_WINDOW, segments: tuple[Tensor, Tensor] | None = None,
    softcap: float = 0.0,
    dropout: float = 0.0,
    seeds: Tensor | None = None,
    slopes: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Unchecked materialised attention: (o, lse)."""
    g = q.shape[1] // k.shape[1]
    p, lse = _probs(q, _repeat_kv(k, g), mask, causal, scale, window, segments, softcap,
                    slopes)
    return dropped(p, dropout, seeds).to(v.dtype) @ _repeat_kv(v, g), lse


def attention_vjp(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    do: Tensor,
    mask: Tensor | None,
    causal: bool,
    scale: float,
    window: tuple[int, int] = NO_WINDOW,
    segments: tuple[Tensor, Tensor] | None = None,
    softcap: float = 0.0,
    dropout: float = 0.0,
    seeds: Tensor | None = None,
    dlse: Tensor | None = None,
    slopes: Tensor | None = None,
    rows: tuple[int, int] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) = vjp of attention at (q, k, v) with cotangent ``do`` (and ``dlse``
    for the logsumexp, (B, H, Nq); None: zero), in plain torch ops.

    ``rows = (row0, nq)``: q, do, dlse (and mask, segments) are the rows ``row0 ..``
    of ``nq`` queries; then dq is those rows' and dk, dv their share of the sums.

    It is itself differentiable (forward and reverse), which is what grad-of-grad,
    ``hessian`` and ``jacfwd(jacrev(.))`` through the fused kernels use.
    fp16 / bf16 are computed in fp32.
    """
    dtype = q.dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v, do = (x.to(acc) for x in (q, k, v, do))
    hkv = k.shape[1]
    g = q.shape[1] // hkv
    kr, vr = _repeat_kv(k, g), _repeat_kv(v, g)
    row0, shift = 0, None
    if rows is not None:
        row0, shift = rows[0], rows[0] + k.shape[2] - rows[1]
    p, _ = _probs(q, kr, mask, causal, scale, window, segments, softcap, slopes, shift)
    dv = dropped(p, dropout, seeds, row0).transpose(-1, -2) @ do  # (B, H, Nk, D)
    dp = dropped(do @ vr.transpose(-1, -2), dropout, seeds, row0)  # o = dropped(P) v
    delta = (dp * p).sum(-1, keepdim=True)  # rowsum(do * o)
    if dlse is not None:  # d lse / d s = p
        delta = delta - dlse.to(acc).unsqueeze(-1)
    ds = p * (dp - delta)
    if softcap > 0:  # through the cap: d(c tanh(s / c)) / ds = 1 - tanh^2
        ds = ds * (1 - torch.tanh(scale * (q @ kr.transpose(-1, -2)) / softcap).square())
    dq = scale * (ds @ kr)
    dk = scale * (ds.transpose(-1, -2) @ q)
    if g > 1:  # GQA: sum the query heads of each kv head
        dk = dk.unflatten(1, (hkv, g)).sum(2)
        dv = dv.unflatten(1, (hkv, g)).sum(2)
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    *,
    key_padding_mask: Tensor | None = None,
    window: int | tuple[int | None, int | None] | None = None,
    segment_ids: Tensor | tuple[Tensor, Tensor] | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
    key: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Materialised attention with exactly the semantics of :func:`attention`.

    q: (B, H, Nq, D), k: (B, Hkv, Nk, D), v: (B, Hkv, Nk, Dv) -> o: (B, H, Nq, Dv) (Dv
    as it is, no padding), and lse: (B, H, Nq)
    (logsumexp of the scaled, masked scores; -inf for fully masked rows) when
    ``return_lse``. Arguments are validated as in :func:`attention`, and ``dropout``
    with ``key`` drops exactly the probabilities :func:`attention` drops. Any float
    dtype; pass float64 for an oracle. Differentiable by autograd and ``torch.func``.

    >>> import torch
    >>> q = k = v = torch.ones(1, 2, 3, 4, dtype=torch.float64)
    >>> reference_attention(q, k, v, causal=True).shape
    torch.Size([1, 2, 3, 4])
    """
    from ._dispatch import _prepare  # local: _dispatch imports the autograd wiring

    args = _prepare(q, k, v, mask, key_padding_mask, causal, scale, backend="reference",
                    window=window, segment_ids=segment_ids, softcap=softcap, dropout=dropout,
                    key=key, alibi_slopes=alibi_slopes)
    o, lse = _attention(q, k, v, args.mask, args.causal, args.scale, args.window, args.segments,
                        args.softcap, args.dropout, args.seeds, args.slopes)
    return (o, lse) if return_lse else o
