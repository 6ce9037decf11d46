"""Second-order attention derivatives in O(B * H * rows * Nk) memory, not O(Nq * Nk).

The fused backward's own derivatives (grad-of-grad; its jvp, which Hessian-vector
products ``jvp(grad(f))`` and ``hessian`` run) differentiate ``_reference``'s
materialised vjp formula with ``torch.func``. That formula is row-separable: given all
keys, dq's rows are each query's own, and dk, dv are sums over the queries. So it runs
on blocks of query rows, each with its (B, H, rows, Nk) scores of at most ``_BUDGET``
elements (16x that on a GPU), and the derivatives of the sums are the sums of the
blocks' derivatives:

- ``vjp``: each block's pullback of ``(gq[rows], gk, gv)``; the cotangents of q and do
  are the blocks' rows, those of k and v the sum over blocks. Each pullback is a
  Function (``_BlockPullback``) that saves only its inputs: grad-of-grad's outer level
  records the pullbacks (functorch differentiates with ``create_graph``), and would
  otherwise keep every block's intermediates until its backward ends.
- ``jvp``: each block's pushforward of ``(tq[rows], tk, tv, tdo[rows])``; dq's tangent
  is the blocks' rows, dk's and dv's the sum. Forward mode frees each block before the
  next.

So an HVP's or grad-of-grad's peak holds one block's scores. Problems that fit the
budget run as one block, the materialised formula itself.

Example::

    >>> import torch
    >>> from torchfn import random
    >>> q = k = v = do = random.normal(random.key(1), (1, 2, 6, 4), torch.float64)
    >>> args = dict(mask=None, causal=True, scale=0.5, window=(-1, -1), segments=None,
    ...             softcap=0.0, dropout=0.0, seeds=None, slopes=None)
    >>> tangents = (torch.ones_like(q), None, None, None)
    >>> tdq, tdk, tdv = jvp((q, k, v, do), tangents, budget=2 * 2 * 6, **args)  # 3 blocks
    >>> tdq.shape, tdk.shape
    (torch.Size([1, 2, 6, 4]), torch.Size([1, 2, 6, 4]))
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from . import _reference

_BUDGET = 1 << 22  # score elements per block: 16 MiB of fp32 per (B, H, rows, Nk) tensor
# on a GPU 16x that (256 MiB a tensor, ~2.5 GiB at the peak): a block is ~20 kernel
# launches, and at 2^22 scores B * H = 32, N = 16k would take 2048 blocks (untimed)
_GPU_FACTOR = 16


def row_blocks(b: int, h: int, nq: int, nk: int, budget: int | None = None):
    """[(i0, i1), ...]: query rows in blocks of at most ``budget`` score elements each
    (at least one row a block).

    >>> row_blocks(1, 2, 5, 4, budget=16)
    [(0, 2), (2, 4), (4, 5)]
    """
    rows = max(1, (_BUDGET if budget is None else budget) // max(1, b * h * nk))
    return [(i0, min(nq, i0 + rows)) for i0 in range(0, nq, rows)]


def _row_options(i0: int, i1: int, nq: int, mask: Tensor | None, q_ids: Tensor | None,
                 kv_ids: Tensor | None) -> tuple[Tensor | None, tuple | None]:
    """The compact mask's and the query segment ids' rows [i0, i1), and the segments."""
    whole = (i0, i1) == (0, nq)
    if mask is not None and mask.shape[2] > 1 and not whole:
        mask = mask[:, :, i0:i1]
    segments = None
    if q_ids is not None:
        segments = (q_ids if whole else q_ids[:, i0:i1], kv_ids)
    return mask, segments


def _block_formula(i0: int, i1: int, nq: int, causal: bool, scale: float,
                   window: tuple[int, int], softcap: float, dropout: float) -> Callable:
    """The vjp formula of query rows [i0, i1), given the option tensors:
    ``(mask, q_ids, kv_ids, seeds, slopes) -> ((q[rows], k, v, do[rows][, dlse[rows]])
    -> (dq[rows], dk share, dv share))``. The tensors come in as arguments, never
    captured, so that a Function can take them as inputs (a tensor captured from an
    outer transform level must not reach a lower one)."""
    whole = (i0, i1) == (0, nq)

    def with_options(mask, q_ids, kv_ids, seeds, slopes):
        mask, segments = _row_options(i0, i1, nq, mask, q_ids, kv_ids)

        def formula(q, k, v, do, dlse=None):
            return _reference.attention_vjp(q, k, v, do, mask, causal, scale, window,
                                            segments, softcap, dropout, seeds, dlse, slopes,
                                            rows=None if whole else (i0, nq))

        return formula

    return with_options


def _split_args(args: dict) -> tuple[dict, tuple]:
    """The options as (non-tensor keywords for ``_block_formula``, option tensors)."""
    segments = args["segments"] or (None, None)
    statics = {n: args[n] for n in ("causal", "scale", "window", "softcap", "dropout")}
    return statics, (args["mask"], *segments, args["seeds"], args["slopes"])


def _blocks(primals: tuple, budget: int | None):
    q, k = primals[0], primals[1]
    if budget is None and q.device.type != "cpu":
        budget = _BUDGET * _GPU_FACTOR
    return row_blocks(q.shape[0], q.shape[1], q.shape[2], k.shape[2], budget)


def _rows(x: Tensor | None, i0: int, i1: int) -> Tensor | None:
    return None if x is None else x[:, :, i0:i1]


def _block_of(xs: tuple, i0: int, i1: int) -> tuple:
    """(q, k, v, do[, dlse])-shaped ``xs`` with the rows [i0, i1) of all but k and v."""
    return tuple(x if j in (1, 2) else _rows(x, i0, i1) for j, x in enumerate(xs))


_N_OPTIONS = 5  # mask, q_ids, kv_ids, seeds, slopes


def _pull(make: Callable, n: int, *xs) -> tuple:
    """The pullback of ``make(*options)`` at the primals ``xs[:n]`` of the cotangents
    after them; the last ``_N_OPTIONS`` of ``xs`` are the option tensors."""
    formula = make(*xs[-_N_OPTIONS:])
    return torch.func.vjp(formula, *xs[:n])[1](xs[n:-_N_OPTIONS])


class _BlockPullback(torch.autograd.Function):
    """One block's pullback, ``_pull``, saving only its inputs: a reverse pass over it
    (grad-of-grad's outer level) recomputes the block's scores instead of keeping the
    intermediates of every block until it ends."""

    generate_vmap_rule = True

    @staticmethod
    def forward(make, n, *xs):
        return _pull(make, n, *xs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.make, ctx.n = inputs[:2]
        ctx.save_for_backward(*inputs[2:])
        ctx.save_for_forward(*inputs[2:])

    @staticmethod
    def backward(ctx, *grads):
        xs, options = ctx.saved_tensors[:-_N_OPTIONS], ctx.saved_tensors[-_N_OPTIONS:]
        _, pullback = torch.func.vjp(lambda *xs: _pull(ctx.make, ctx.n, *xs, *options), *xs)
        return (None, None, *pullback(grads), *(None,) * _N_OPTIONS)

    @staticmethod
    def jvp(ctx, _make, _n, *tangents):
        from ._autograd import check_forward_levels  # _autograd imports this module

        check_forward_levels(1, "a jvp of attention's second-order backward")
        xs, options = ctx.saved_tensors[:-_N_OPTIONS], ctx.saved_tensors[-_N_OPTIONS:]
        # contiguous: an expanded tangent (jacfwd's basis) cannot make a dual tensor
        tangents = tuple(torch.zeros_like(x) if t is None else t.contiguous()
                         for x, t in zip(xs, tangents))
        xs = tuple(x.contiguous() for x in xs)
        return torch.func.jvp(lambda *xs: _pull(ctx.make, ctx.n, *xs, *options), xs,
                              tangents)[1]


def vjp(primals: tuple, cotangents: tuple, *, budget: int | None = None, **args) -> tuple:
    """The vjp of (q, k, v, do[, dlse]) -> (dq, dk, dv) at ``primals`` for the
    cotangents (gq, gk, gv): one cotangent per primal. ``args``: the attention options
    (mask compact 4-D, causal, scale, window, segments, softcap, dropout, seeds,
    slopes)."""
    gq, gk, gv = cotangents
    nq = primals[0].shape[2]
    statics, options = _split_args(args)
    per_row, shared = [], None
    for i0, i1 in _blocks(primals, budget):
        make = _block_formula(i0, i1, nq, **statics)
        block = (*_block_of(primals, i0, i1), _rows(gq, i0, i1), gk, gv)
        r = _BlockPullback.apply(make, len(primals), *block, *options)
        per_row.append([r[0], *r[3:]])  # q, do[, dlse]
        shared = r[1:3] if shared is None else (shared[0] + r[1], shared[1] + r[2])
    rq, *rest = (torch.cat(xs, dim=2) for xs in zip(*per_row))
    return (rq, *shared, *rest)


def jvp(primals: tuple, tangents: tuple, *, budget: int | None = None, **args) -> tuple:
    """The jvp of (q, k, v, do[, dlse]) -> (dq, dk, dv) at ``primals`` along
    ``tangents`` (one per primal; None: zero): (tdq, tdk, tdv)."""
    # contiguous: an expanded primal or tangent (jacfwd's basis) cannot make a dual tensor
    tangents = tuple(torch.zeros_like(p) if t is None else t.contiguous()
                     for p, t in zip(primals, tangents))
    primals = tuple(p.contiguous() for p in primals)
    nq = primals[0].shape[2]
    statics, options = _split_args(args)
    tdq, tdk, tdv = [], None, None
    for i0, i1 in _blocks(primals, budget):
        formula = _block_formula(i0, i1, nq, **statics)(*options)
        _, (tq, tk, tv) = torch.func.jvp(formula, _block_of(primals, i0, i1),
                                         _block_of(tangents, i0, i1))
        tdq.append(tq)
        tdk, tdv = (tk, tv) if tdk is None else (tdk + tk, tdv + tv)
    return torch.cat(tdq, dim=2), tdk, tdv


def _rows_forward(i0: int, i1: int, nq: int, causal: bool, scale: float,
                  window: tuple[int, int], softcap: float, dropout: float) -> Callable:
    """Materialised attention of the query rows [i0, i1): ``(mask, q_ids, kv_ids,
    seeds, slopes) -> ((q[rows], k, v) -> (o[rows], lse[rows]))``, in fp32 or fp64."""
    whole = (i0, i1) == (0, nq)

    def with_options(mask, q_ids, kv_ids, seeds, slopes):
        mask, segments = _row_options(i0, i1, nq, mask, q_ids, kv_ids)

        def forward(q, k, v):
            g = q.shape[1] // k.shape[1]
            kr, vr = _reference._repeat_kv(k, g), _reference._repeat_kv(v, g)
            shift = None if whole else i0 + k.shape[2] - nq
            p, lse = _reference._probs(q, kr, mask, causal, scale, window, segments, softcap,
                                       slopes, shift)
            return _reference.dropped(p, dropout, seeds, i0) @ vr, lse

        return forward

    return with_options


def second_jvp(primals: tuple, t: tuple, s: tuple, *, budget: int | None = None,
               **args) -> tuple[Tensor, Tensor]:
    """The second directional derivative of attention's (o, lse) at (q, k, v) along the
    tangents ``t`` and ``s`` (each (tq, tk, tv), None: zero), by blocks of query rows:
    (d2o (B, H, Nq, Dv), d2lse (B, H, Nq)). This is forward-over-forward's extra term
    (``jvp`` of a ``jvp``, ``jacfwd(jacfwd)``)."""
    q = primals[0]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    # contiguous: jacfwd's basis tangents are expanded, and a dual tensor cannot be one
    primals = tuple(x.to(acc).contiguous() for x in primals)
    t, s = ((torch.zeros_like(p) if x is None else x.to(acc).contiguous()
             for p, x in zip(primals, d)) for d in (t, s))
    t, s = tuple(t), tuple(s)
    nq = q.shape[2]
    statics, options = _split_args(args)
    d2o, d2lse = [], []
    for i0, i1 in _blocks(primals, budget):
        forward = _rows_forward(i0, i1, nq, **statics)(*options)
        tb, pb, sb = (_block_of(xs, i0, i1) for xs in (t, primals, s))  # q's rows only

        def along_t(*x, forward=forward, tb=tb):
            return torch.func.jvp(forward, x, tb)[1]

        _, (o2, lse2) = torch.func.jvp(along_t, pb, sb)
        d2o.append(o2)
        d2lse.append(lse2)
    return torch.cat(d2o, dim=2).to(q.dtype), torch.cat(d2lse, dim=2)
