"""Triton FlashAttention-2 forward kernel and the tile helpers shared by all kernels.

One program owns a block of ``BLOCK_M`` queries of one (batch, head) and streams
over key blocks with an online softmax in base 2 (scores are pre-multiplied by
``scale * log2(e)``, so ``exp2`` replaces ``exp``). It writes ``o`` and the
natural-log ``lse`` that the backward recomputes ``P`` from.

The key loop has two stages: blocks that need no masking at all (inside the
causal band and inside ``Nk``) and the few blocks on the causal diagonal or at
the ragged end, which apply the causal / bounds mask. Causal is bottom-right
aligned: query ``i`` sees key ``j`` iff ``j <= i + (Nk - Nq)``; key blocks past
the diagonal are never visited.

``USE_TMA`` (sm_90+, tuned against pointer loads, see ``_triton_launch``) reads q, k and v
through 4-D tensor descriptors, i.e. the Hopper TMA engine, instead of per-thread
pointer loads; the descriptor's bounds zero-fill rows past N and dims past D, as the
masked loads do.

``FOLD_SCALE`` (scale > 0, no additive mask) takes the row max over raw scores and
applies the scale inside ``exp2``'s FMA: one multiply per score less.

``PIPELINE`` (a variant the GPU tuner tries; used with FOLD_SCALE and no user mask)
software-pipelines the unmasked stage: each step issues the next block's ``S = q K^T``
together with the previous block's ``acc += P V``, then computes the next P while
``P V`` is in flight, and rescales ``acc`` after. On sm_90 the SASS then issues the
exp beside a wgmma, as FlashAttention-3's intra-warpgroup pipelining does, at the
cost of P and S both live in registers. The sums are the same, in the same order.

``WARP_SPEC`` (a variant the GPU tuner tries with ``TORCHFN_TRITON_WS=1``; scale > 0, no
user mask) runs every key block in one ``tl.range(..., warp_specialize=True)`` loop,
reading q, k and v through 2-D descriptors made in the kernel for its (batch, head). On
sm_90 Triton then splits the program into a TMA producer warpgroup and two consumer
warpgroups of BLOCK_M / 2 rows (FlashAttention-3's structure): one consumer's softmax
runs beside the other's matmuls. The pass accepts only this shape of code (README,
traps), so the causal / bounds mask is applied to every block (``WS_MASKED``) instead of
in a second loop. The same sums in the same order as the plain kernel.

``WINDOW`` (sliding-window / local attention; the launcher folds ``causal`` into
``win_r = 0``): query ``i`` at position ``p = i + Nk - Nq`` sees keys
``p - win_l ..= p + win_r``. The key loop visits only the blocks the band of its query
block reaches (``_window_bounds``), all masked (``_in_band``), so the work is
O(Nq * band width). No warp-specialized or pipelined variant takes a window.

``SEGMENTS`` (document masking, always with ``WINDOW``'s band loop): query ``i`` sees key
``j`` only if their segment labels match (int32 labels in key space, made on the host by
``_triton_ops._segment_labels``); ``RLO`` / ``RHI`` give each row's key range, and a
program visits only the union of its rows' ranges (``_segment_bounds``).

``SOFTCAP`` (logit soft-capping): the log2-unit scores become ``cap2 * tanh(s / cap2)``
(``cap2`` = softcap * log2(e)) before the mask; the backward and the JVP multiply by the
cap's derivative ``1 - tanh^2``. No scale fold, pipelining or warp specialization with it.

``DROPOUT`` (keyed attention dropout, ``_triton_dropout``): after the online softmax's
row sum, each score tile's P is zeroed where ``_keep`` drops it (from the head's key in
``SEED``, no stored mask); ``o`` is scaled by ``drop_scale`` (1 / keep rate) at the end.
No pipelining or warp specialization with it.

``ALIBI``: the head's slope (``SLOPES``, (B, H)) times the distance from the bottom-right
diagonal, ``-slope * |i + Nk - Nq - j|``, is added to every tile's log2-unit scores with
the user mask (``_alibi``), in every stage; no scale fold, pipelining or warp
specialization with it.

``SPLIT`` (split-KV, FlashDecoding; the launcher picks it when there are too few query
blocks to fill the GPU, e.g. decoding with Nq = 1): a third grid axis splits the keys
into runs of ``split_len`` (a multiple of BLOCK_N); each program covers only its run's
share of both stages and writes its partial ``o`` (float32, normalised by its own row
sum) and ``lse`` to (B, H, S, Nq, *) buffers, which the host merges by lse
(``_triton_merge._merge_splits``). An empty share writes o = 0, lse = -inf.

Import this module only through ``_triton_ops`` (Triton is optional; under
``TRITON_INTERPRET=1`` the kernels run on CPU).
"""

import triton
import triton.language as tl

from torchfn.kernels._triton_dropout import _head_seed, _keep


@triton.jit
def _load_rows(base, offs_r, offs_d, stride_r, n_rows,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """Load a (R, BLOCK_D) tile of rows ``offs_r``; padded dims and rows >= ``n_rows`` read 0."""
    ptrs = base + offs_r[:, None] * stride_r + offs_d[None, :]
    if CHECK_ROWS:
        if HEAD_DIM == BLOCK_D:
            t = tl.load(ptrs, mask=offs_r[:, None] < n_rows, other=0.0)
        else:
            t = tl.load(ptrs, mask=(offs_r[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM),
                        other=0.0)
    else:
        if HEAD_DIM == BLOCK_D:
            t = tl.load(ptrs)
        else:
            t = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return t


@triton.jit
def _store_rows(base, val, offs_r, offs_d, stride_r, n_rows,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    ptrs = base + offs_r[:, None] * stride_r + offs_d[None, :]
    if HEAD_DIM == BLOCK_D:
        tl.store(ptrs, val, mask=offs_r[:, None] < n_rows)
    else:
        tl.store(ptrs, val, mask=(offs_r[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _mask_scores(s, m_base, rows, cols, smm, smn, Nq, Nk, MASK_KIND: tl.constexpr):
    """Apply a user mask to log2-unit scores ``s``; ``rows``/``cols`` broadcast to ``s``'s shape.

    MASK_KIND: 0 none, 1 boolean (stored as uint8, nonzero = attend), 2 additive (natural units).
    """
    if MASK_KIND == 1:
        inb = (rows < Nq) & (cols < Nk)
        mv = tl.load(m_base + rows.to(tl.int64) * smm + cols.to(tl.int64) * smn, mask=inb, other=0)
        s = tl.where(mv != 0, s, float("-inf"))
    elif MASK_KIND == 2:
        inb = (rows < Nq) & (cols < Nk)
        mv = tl.load(m_base + rows.to(tl.int64) * smm + cols.to(tl.int64) * smn, mask=inb,
                     other=0.0)
        s = s + mv.to(tl.float32) * 1.4426950408889634
    return s


@triton.jit
def _alibi(s, rows, cols, Nq, Nk, slope2):
    """ALiBi on log2-unit scores: ``s - slope2 * |rows + Nk - Nq - cols|`` (``slope2`` =
    slope * log2(e); rows / cols broadcast to s, in either orientation)."""
    return s - slope2 * tl.abs(rows + (Nk - Nq) - cols).to(tl.float32)


@triton.jit
def _head_slope(SLOPES, off_bh, ALIBI: tl.constexpr):
    """The (batch, head)'s ALiBi slope in log2 units (0.0 without ALiBi)."""
    if ALIBI:
        slope2 = tl.load(SLOPES + off_bh) * 1.4426950408889634
    else:
        slope2 = 0.0
    return slope2


@triton.jit
def _mask_tile(s, m_base, offs_m, offs_n, smm, smn, Nq, Nk, BOUNDARY: tl.constexpr,
               IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
               win_l=0, win_r=0, WINDOW: tl.constexpr = False,
               seg_m=0, kseg_base=None, SEGMENTS: tl.constexpr = False,
               slope2=0.0, ALIBI: tl.constexpr = False):
    """(M, N) log2-unit scores with the user mask (and ``ALIBI``'s bias) applied and, on a
    boundary tile, keys past ``Nk`` (and, causal, past the bottom-right diagonal;
    ``WINDOW``, outside the band; ``SEGMENTS``, of another segment than the row's
    ``seg_m``) at -inf."""
    if MASK_KIND != 0:
        s = _mask_scores(s, m_base, offs_m[:, None], offs_n[None, :], smm, smn, Nq, Nk,
                         MASK_KIND)
    if ALIBI:
        s = _alibi(s, offs_m[:, None], offs_n[None, :], Nq, Nk, slope2)
    if BOUNDARY:
        s = _bounds_mask(s, offs_m, offs_n, Nq, Nk, IS_CAUSAL)
        if WINDOW:
            s = tl.where(_in_band(offs_m[:, None], offs_n[None, :], Nq, Nk, win_l, win_r), s,
                         float("-inf"))
        if SEGMENTS:
            s = tl.where(_same_segment(seg_m, offs_n, kseg_base, Nk), s, float("-inf"))
    return s


@triton.jit
def _same_segment(seg_rows, cols, seg_base, n_cols):
    """(R, C): whether each row's segment id (``seg_rows``, (R,)) is column ``cols``'s."""
    seg_cols = tl.load(seg_base + cols, mask=cols < n_cols, other=-1)
    return seg_rows[:, None] == seg_cols[None, :]


@triton.jit
def _segment_bounds(lo, hi, rlo_base, rhi_base, offs, n, ALIGN: tl.constexpr):
    """[lo, hi) narrowed to the union of rows ``offs``'s segment ranges (``RLO`` / ``RHI``:
    each row's first and one-past-last column of its segment; lo rounded down to ALIGN)."""
    r_lo = tl.min(tl.load(rlo_base + offs, mask=offs < n, other=2**30), 0)
    r_hi = tl.max(tl.load(rhi_base + offs, mask=offs < n, other=0), 0)
    lo = tl.maximum(lo, (r_lo // ALIGN) * ALIGN)
    hi = tl.minimum(hi, r_hi)
    return lo, tl.maximum(hi, lo)


@triton.jit
def _in_band(rows, cols, Nq, Nk, win_l, win_r):
    """Whether query ``rows`` (at positions ``rows + Nk - Nq``) see key ``cols`` through the
    window: ``pos - win_l <= col <= pos + win_r`` (broadcast; both sides >= 0 here)."""
    pos = rows + (Nk - Nq)
    return (cols >= pos - win_l) & (cols <= pos + win_r)


@triton.jit
def _key_bounds(start_m, Nq, Nk, win_l, win_r, RLO, RHI, off_b, offs_m,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
                WINDOW: tl.constexpr, SEGMENTS: tl.constexpr):
    """The key range of a query block (forward, JVP, dQ). Plain: [0, lo) needs no mask,
    [lo, hi) is the causal diagonal / ragged end (``_causal_bounds``). ``WINDOW`` (causal
    folded into ``win_r`` by the launcher): only the band's blocks, and with ``SEGMENTS``
    only those of the rows' segments, all of [lo, hi) masked."""
    if WINDOW:
        lo, hi = _window_bounds(start_m, Nq, Nk, win_l, win_r, BLOCK_M, BLOCK_N)
        if SEGMENTS:
            lo, hi = _segment_bounds(lo, hi, RLO + off_b * Nq, RHI + off_b * Nq, offs_m, Nq,
                                     BLOCK_N)
    else:
        lo, hi = _causal_bounds(start_m, Nq, Nk, BLOCK_M, BLOCK_N, IS_CAUSAL)
    return lo, hi


@triton.jit
def _row_segments(QSEG, KSEG, off_b, offs_m, Nq, Nk, SEGMENTS: tl.constexpr):
    """(segment labels of rows ``offs_m``, this batch's column labels) with ``SEGMENTS``;
    else placeholders (0, 0: a jitted function cannot return None)."""
    if SEGMENTS:
        seg_m = tl.load(QSEG + off_b * Nq + offs_m, mask=offs_m < Nq, other=-2)
        kseg_base = KSEG + off_b * Nk
    else:
        seg_m = 0
        kseg_base = 0
    return seg_m, kseg_base


@triton.jit
def _window_bounds(start_m, Nq, Nk, win_l, win_r, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """Key range [lo, hi) of a query block through the window (lo a multiple of
    BLOCK_N); every block of it is masked."""
    shift = Nk - Nq
    lo = tl.maximum(start_m + shift - win_l, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.minimum(start_m + BLOCK_M + shift + win_r, Nk)
    return lo, tl.maximum(hi, lo)


@triton.jit
def _split_bounds(lo, hi, split_len, SPLIT: tl.constexpr):
    """(lo1, hi1, lo, hi): the unmasked stage's keys [lo1, hi1) = [0, lo) and the masked
    stage's [lo, hi); with ``SPLIT`` (split-KV) both cut to this program's run of keys,
    [k0, k0 + split_len) with k0 = program_id(2) * split_len."""
    if SPLIT:
        k0 = tl.program_id(2) * split_len
        return (tl.minimum(k0, lo), tl.minimum(k0 + split_len, lo), tl.maximum(lo, k0),
                tl.minimum(hi, k0 + split_len))
    else:
        return 0, lo, lo, hi


@triton.jit
def _bounds_mask(s, offs_m, offs_n, Nq, Nk, IS_CAUSAL: tl.constexpr):
    """(M, N) scores with keys past ``Nk`` (and, causal, past the bottom-right diagonal)
    at -inf."""
    ok = offs_n[None, :] < Nk
    if IS_CAUSAL:
        ok = ok & (offs_n[None, :] <= offs_m[:, None] + (Nk - Nq))
    return tl.where(ok, s, float("-inf"))


@triton.jit
def _tanh(x):
    """tanh in float32 to ~1e-7 relative (Triton has none that the interpreter runs too):
    an odd Taylor polynomial near 0, ``(1 - e) / (1 + e)`` with ``e = exp(-2|x|)``
    elsewhere."""
    ax = tl.abs(x)
    e = tl.math.exp2(ax * -2.8853900817779268)  # exp(-2|x|)
    big = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = ax * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
        -0.05396825396825397 + x2 * 0.021869488536155203))))
    t = tl.where(ax < 0.3, small, big)
    return tl.where(x < 0, -t, t)


@triton.jit
def _soft_cap(qk, cap2):
    """(capped log2-unit scores, the cap's derivative 1 - tanh^2): ``cap2 * tanh(qk /
    cap2)``, with ``cap2`` = softcap * log2(e) (the cap in log2 units)."""
    t = _tanh(qk / cap2)
    return cap2 * t, 1.0 - t * t


@triton.jit
def _row_max(m_i, tile_max, MAY_BE_EMPTY: tl.constexpr):
    """The new running row max of the online softmax (from the tile's row max, log2
    units), and a copy safe to subtract in ``exp2`` (0 where a row has seen no key yet,
    so -inf - -inf never happens)."""
    m_new = tl.maximum(m_i, tile_max)
    if MAY_BE_EMPTY:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_safe = m_new
    return m_new, m_safe


@triton.jit
def _causal_bounds(start_m, Nq, Nk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   IS_CAUSAL: tl.constexpr):
    """Key range of a query block: [0, lo) needs no mask, [lo, hi) is diagonal / ragged end."""
    if IS_CAUSAL:
        shift = Nk - Nq
        hi = tl.minimum(Nk, start_m + BLOCK_M + shift)
        full = tl.maximum(tl.minimum(start_m + shift + 1, Nk), 0)
        lo = (full // BLOCK_N) * BLOCK_N
        hi = tl.maximum(hi, lo)
    else:
        lo = (Nk // BLOCK_N) * BLOCK_N
        hi = Nk
    return lo, hi


@triton.jit
def _load_tile(desc, off_b, off_h, start, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """A (ROWS, BLOCK_D) tile through a 4-D (B, H, N, D) tensor descriptor (TMA on sm_90+);
    rows past N and dims past D read 0 (the descriptor's bounds)."""
    t = desc.load([off_b.to(tl.int32), off_h.to(tl.int32), start, 0])
    return tl.reshape(t, [ROWS, BLOCK_D])


@triton.jit
def _load_block(base, desc, off_b, off_hk, start_n, offs_n, offs_d, stride, Nk,
                HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                BOUNDARY: tl.constexpr, USE_TMA: tl.constexpr):
    """The (BLOCK_N, BLOCK_D) k or v tile at key ``start_n`` (rows ``offs_n``), stored dtype."""
    if USE_TMA:
        t = _load_tile(desc, off_b, off_hk, start_n, BLOCK_N, BLOCK_D)
    else:
        t = _load_rows(base, offs_n, offs_d, stride, Nk, HEAD_DIM, BLOCK_D, BOUNDARY)
    return t


@triton.jit
def _load_kv(k_base, v_base, desc_k, desc_v, off_b, off_hk, start_n, offs_n, offs_d, skn, svn,
             Nk, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
             BOUNDARY: tl.constexpr, USE_TMA: tl.constexpr):
    """The (BLOCK_N, BLOCK_D) k and v tiles at key ``start_n``, in their stored dtype."""
    k = _load_block(k_base, desc_k, off_b, off_hk, start_n, offs_n, offs_d, skn, Nk, HEAD_DIM,
                    BLOCK_N, BLOCK_D, BOUNDARY, USE_TMA)
    v = _load_block(v_base, desc_v, off_b, off_hk, start_n, offs_n, offs_d, svn, Nk, HEAD_DIM,
                    BLOCK_N, BLOCK_D, BOUNDARY, USE_TMA)
    return k, v


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, m_base, offs_m, offs_d, lo, hi,
               skn, svn, smm, smn, Nq, Nk, qk_scale, desc_k, desc_v, off_b, off_hk,
               BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               BOUNDARY: tl.constexpr, IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
               DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
               FOLD_SCALE: tl.constexpr, win_l=0, win_r=0, WINDOW: tl.constexpr = False,
               seg_m=0, kseg_base=None, SEGMENTS: tl.constexpr = False,
               cap2=1.0, SOFTCAP: tl.constexpr = False,
               seed0=0, seed1=0, drop_thresh=0, DROPOUT: tl.constexpr = False,
               slope2=0.0, ALIBI: tl.constexpr = False):
    tl.static_assert(not (ALIBI and FOLD_SCALE), "ALiBi: no scale fold")
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + offs_n0
        k, v = _load_kv(k_base, v_base, desc_k, desc_v, off_b, off_hk, start_n, offs_n, offs_d,
                        skn, svn, Nk, HEAD_DIM, BLOCK_N, BLOCK_D, BOUNDARY, USE_TMA)
        p_dtype = v.dtype
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # (M, N) raw scores
        if FOLD_SCALE:  # scale > 0, no additive mask, no softcap: the max commutes with
            # the scale, so mask and reduce the raw scores and scale inside exp2's FMA (one
            # FMUL less per score on sm_90)
            qk = _mask_tile(qk, m_base, offs_m, offs_n, smm, smn, Nq, Nk, BOUNDARY,
                            IS_CAUSAL, MASK_KIND, win_l, win_r, WINDOW, seg_m, kseg_base,
                            SEGMENTS)
            m_new, m_new_safe = _row_max(m_i, tl.max(qk, 1) * qk_scale,
                                         BOUNDARY or MASK_KIND != 0)
            p = tl.math.exp2(qk * qk_scale - m_new_safe[:, None])
        else:
            qk = qk * qk_scale  # log2 units
            if SOFTCAP:
                qk, _ = _soft_cap(qk, cap2)
            qk = _mask_tile(qk, m_base, offs_m, offs_n, smm, smn, Nq, Nk, BOUNDARY,
                            IS_CAUSAL, MASK_KIND, win_l, win_r, WINDOW, seg_m, kseg_base,
                            SEGMENTS, slope2, ALIBI)
            m_new, m_new_safe = _row_max(m_i, tl.max(qk, 1), BOUNDARY or MASK_KIND != 0)
            p = tl.math.exp2(qk - m_new_safe[:, None])
        alpha = tl.math.exp2(m_i - m_new_safe)
        l_i = l_i * alpha + tl.sum(p, 1)  # the softmax's sum: before dropout
        acc = acc * alpha[:, None]
        if DROPOUT:  # (the kept ones are scaled once, at the end)
            p = tl.where(_keep(seed0, seed1, offs_m, start_n, drop_thresh, BLOCK_N), p, 0.0)
        if not UPCAST:  # interpreter: keep P in fp32 (its CPU peers do not round it)
            p = p.to(p_dtype)
        acc = tl.dot(p, v, acc, input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _softmax_block(acc, l_i, m_i, qk, qk_scale):
    """One online-softmax step on raw scores ``qk`` (M, N) of an unmasked block (scale > 0):
    rescales ``acc`` and ``l_i`` and returns P (float32) and the new row max."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    return acc * alpha[:, None], l_i * alpha + tl.sum(p, 1), m_new, p


@triton.jit
def _fwd_inner_pipe(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, off_b, off_hk, offs_d,
                    lo, hi, skn, svn, Nk, qk_scale,
                    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr):
    """The unmasked key blocks [lo, hi) (hi > lo, no user mask, scale > 0), pipelined:
    ``S_j = q K_j^T`` and ``acc += P_{j-1} V_{j-1}`` are issued together, and P_j's
    softmax runs while the second is in flight (``acc`` is rescaled once it lands)."""
    offs_n0 = tl.arange(0, BLOCK_N)
    k = _load_block(k_base, desc_k, off_b, off_hk, lo, lo + offs_n0, offs_d, skn, Nk, HEAD_DIM,
                    BLOCK_N, BLOCK_D, False, USE_TMA)
    p_dtype = k.dtype
    if UPCAST:
        k = k.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # (M, N) raw scores of block lo
    acc, l_i, m_i, p = _softmax_block(acc, l_i, m_i, qk, qk_scale)
    for start_n in range(lo + BLOCK_N, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = _load_block(k_base, desc_k, off_b, off_hk, start_n, start_n + offs_n0, offs_d, skn,
                        Nk, HEAD_DIM, BLOCK_N, BLOCK_D, False, USE_TMA)
        v = _load_block(v_base, desc_v, off_b, off_hk, start_n - BLOCK_N,
                        start_n - BLOCK_N + offs_n0, offs_d, svn, Nk, HEAD_DIM, BLOCK_N, BLOCK_D,
                        False, USE_TMA)
        if UPCAST:  # interpreter: P stays fp32, as in the plain loop
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        else:
            p = p.to(p_dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # S_j
        acc = tl.dot(p, v, acc, input_precision=DOT_PREC)  # + P_{j-1} V_{j-1}
        acc, l_i, m_i, p = _softmax_block(acc, l_i, m_i, qk, qk_scale)
    last = lo + ((hi - lo - 1) // BLOCK_N) * BLOCK_N
    v = _load_block(v_base, desc_v, off_b, off_hk, last, last + offs_n0, offs_d, svn, Nk,
                    HEAD_DIM, BLOCK_N, BLOCK_D, False, USE_TMA)
    if UPCAST:
        v = v.to(tl.float32)
    else:
        p = p.to(p_dtype)
    acc = tl.dot(p, v, acc, input_precision=DOT_PREC)
    return acc, l_i, m_i


@triton.jit
def _head_desc(base, n_rows, stride, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """A 2-D (n_rows, HEAD_DIM) tensor descriptor over one head, made in the kernel
    (``WARP_SPEC``): rows past ``n_rows`` and dims past ``HEAD_DIM`` read 0."""
    return tl.make_tensor_descriptor(base, shape=[n_rows, HEAD_DIM], strides=[stride, 1],
                                     block_shape=[ROWS, BLOCK_D])


@triton.jit
def _fwd_inner_ws(acc, l_i, m_i, q, desc_k, desc_v, offs_m, hi, Nq, Nk, qk_scale,
                  BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, MASKED: tl.constexpr,
                  DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Every key block [0, hi) in one warp-specialized loop (scale > 0, no user mask):
    Triton splits it into a TMA producer warpgroup and two consumer warpgroups of
    BLOCK_M / 2 rows each. ``MASKED``: apply the bounds / causal mask to every block
    (a second loop for the few masked blocks stops the pass from specializing)."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in tl.range(0, hi, BLOCK_N, warp_specialize=True):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = desc_k.load([start_n, 0])  # (N, D)
        v = desc_v.load([start_n, 0])
        p_dtype = v.dtype
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # (M, N) raw scores
        if MASKED:
            qk = _bounds_mask(qk, offs_m, start_n + offs_n0, Nq, Nk, IS_CAUSAL)
        m_new, m_safe = _row_max(m_i, tl.max(qk, 1) * qk_scale, MASKED)
        p = tl.math.exp2(qk * qk_scale - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if not UPCAST:
            p = p.to(p_dtype)
        acc = tl.dot(p, v, acc, input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(
    Q, K, V, MASK, O, LSE,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
    smb, smh, smm, smn, sob, soh, som,
    H, GROUP, Nq, Nk, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    desc_q=None, desc_k=None, desc_v=None, USE_TMA: tl.constexpr = False,
    FOLD_SCALE: tl.constexpr = True, PIPELINE: tl.constexpr = False,
    WARP_SPEC: tl.constexpr = False, WS_MASKED: tl.constexpr = True,
    win_l=0, win_r=0, WINDOW: tl.constexpr = False,
    QSEG=None, KSEG=None, RLO=None, RHI=None, SEGMENTS: tl.constexpr = False,
    cap2=1.0, SOFTCAP: tl.constexpr = False,
    SEED=None, drop_thresh=0, drop_scale=1.0, DROPOUT: tl.constexpr = False,
    SLOPES=None, ALIBI: tl.constexpr = False,
    split_len=0, sos=0, SPLIT: tl.constexpr = False,
):
    tl.static_assert(not (SOFTCAP and (FOLD_SCALE or WARP_SPEC)), "softcap: no scale fold")
    tl.static_assert(not (SPLIT and WARP_SPEC), "split keys: no warp specialization")
    tl.static_assert(not (ALIBI and (FOLD_SCALE or WARP_SPEC)), "ALiBi: no scale fold")
    tl.static_assert(not (DROPOUT and WARP_SPEC), "dropout: no warp specialization")
    if IS_CAUSAL:  # the longest query blocks (last rows) first: better tail balance
        start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    else:
        start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b = (off_bh // H).to(tl.int64)
    off_h = (off_bh % H).to(tl.int64)
    off_hk = off_h // GROUP
    q_base = Q + off_b * sqb + off_h * sqh
    k_base = K + off_b * skb + off_hk * skh
    v_base = V + off_b * svb + off_hk * svh
    m_base = MASK + off_b * smb + off_h * smh

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    if WARP_SPEC:
        q = _head_desc(q_base, Nq, sqm, BLOCK_M, HEAD_DIM, BLOCK_D).load([start_m, 0])
    elif USE_TMA:
        q = _load_tile(desc_q, off_b, off_h, start_m, BLOCK_M, BLOCK_D)  # (M, D)
    else:
        q = _load_rows(q_base, offs_m, offs_d, sqm, Nq, HEAD_DIM, BLOCK_D, True)  # (M, D)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    seg_m, kseg_base = _row_segments(QSEG, KSEG, off_b, offs_m, Nq, Nk, SEGMENTS)
    lo, hi = _key_bounds(start_m, Nq, Nk, win_l, win_r, RLO, RHI, off_b, offs_m, BLOCK_M,
                         BLOCK_N, IS_CAUSAL, WINDOW, SEGMENTS)
    seed0, seed1 = _head_seed(SEED, off_bh, DROPOUT)
    slope2 = _head_slope(SLOPES, off_bh, ALIBI)
    lo1, hi1, lo, hi = _split_bounds(lo, hi, split_len, SPLIT)
    if WARP_SPEC:  # the launcher sets it only with FOLD_SCALE, no user mask and no window
        tl.static_assert(FOLD_SCALE and MASK_KIND == 0, "WARP_SPEC: scale > 0, no mask")
        acc, l_i, m_i = _fwd_inner_ws(acc, l_i, m_i, q,
                                      _head_desc(k_base, Nk, skn, BLOCK_N, HEAD_DIM, BLOCK_D),
                                      _head_desc(v_base, Nk, svn, BLOCK_N, HEAD_DIM, BLOCK_D),
                                      offs_m, hi, Nq, Nk, qk_scale, BLOCK_N, IS_CAUSAL,
                                      WS_MASKED, DOT_PREC, UPCAST)
    elif WINDOW:
        pass  # nothing unmasked: the band's blocks come below
    elif PIPELINE and FOLD_SCALE and MASK_KIND == 0 and not DROPOUT:  # else the plain loop
        if hi1 > lo1:
            acc, l_i, m_i = _fwd_inner_pipe(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v,
                                            off_b, off_hk, offs_d, lo1, hi1, skn, svn, Nk,
                                            qk_scale, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PREC,
                                            UPCAST, USE_TMA)
    else:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, m_base, offs_m, offs_d,
                                   lo1, hi1, skn, svn, smm, smn, Nq, Nk, qk_scale, desc_k, desc_v,
                                   off_b, off_hk, BLOCK_N, HEAD_DIM, BLOCK_D, False, IS_CAUSAL,
                                   MASK_KIND, DOT_PREC, UPCAST, USE_TMA, FOLD_SCALE,
                                   cap2=cap2, SOFTCAP=SOFTCAP, seed0=seed0, seed1=seed1,
                                   drop_thresh=drop_thresh, DROPOUT=DROPOUT, slope2=slope2,
                                   ALIBI=ALIBI)
    if not WARP_SPEC:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, m_base, offs_m, offs_d,
                                   lo, hi, skn, svn, smm, smn, Nq, Nk, qk_scale, desc_k, desc_v,
                                   off_b, off_hk, BLOCK_N, HEAD_DIM, BLOCK_D, True, IS_CAUSAL,
                                   MASK_KIND, DOT_PREC, UPCAST, USE_TMA, FOLD_SCALE, win_l,
                                   win_r, WINDOW, seg_m, kseg_base, SEGMENTS, cap2, SOFTCAP,
                                   seed0, seed1, drop_thresh, DROPOUT, slope2, ALIBI)

    # fully masked rows: l = 0 -> o = 0, lse = -inf
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    if DROPOUT:  # the kept probabilities' scale, 1 / keep rate
        acc = acc * (drop_scale / l_safe)[:, None]
    else:
        acc = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    o_base = O + off_b * sob + off_h * soh
    lse_row = off_bh.to(tl.int64)
    if SPLIT:  # partial results (B, H, S, Nq, *), merged by lse on the host
        o_base += tl.program_id(2).to(tl.int64) * sos
        lse_row = lse_row * tl.num_programs(2) + tl.program_id(2)
    _store_rows(o_base, acc.to(O.dtype.element_ty), offs_m, offs_d, som, Nq, HEAD_DIM, BLOCK_D)
    tl.store(LSE + lse_row * Nq + offs_m, lse, mask=offs_m < Nq)
