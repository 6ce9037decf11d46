"""Triton FlashAttention-2 backward: deterministic, no atomics.

Three launches:

* ``_bwd_preprocess``: ``delta = rowsum(dO * O)`` and ``lse2 = lse * log2(e)``
  (``+inf`` for fully masked rows, so the recomputed ``P`` is exactly 0 there).
* ``_attn_bwd_dkdv``: one program per (key block, batch, kv head); loops over the
  query heads of its GQA group and over query blocks, recomputing ``P^T`` and
  accumulating ``dK``, ``dV`` in registers, so they come out summed over the group.
* ``_attn_bwd_dq``: one program per (query block, batch, head); loops over key blocks.
  With ``SPLIT`` (few query blocks: split-KV, as the forward's) a third grid axis splits
  the key blocks into runs, and each program writes a partial float32 dQ that the host
  sums.

That is 7 matmuls per (query block, key block) pair: dK/dV take 4, dQ recomputes ``S``
and ``dP`` for 3. With ``deterministic=False`` the dK/dV kernel also adds each
``dS K`` into a float32 ``dQ`` buffer with ``atomic_add`` (``DQ_ATOMIC``; FlashAttention-2's
5-matmul scheme) and the dQ launch is skipped. The sum order then varies from run to
run, so ``dq`` differs in the last bits between runs.

With ``USE_TMA`` (sm_90+, where the tuner picks it) the tiles streamed in the loops
(q and dO for dK/dV, k and v for dQ) come through tensor descriptors, as in the
forward.

Both loops are split into a masked stage (causal diagonal / ragged end) and an
unmasked stage, as in the forward.

``EARLY_DP`` (a dK/dV variant the GPU tuner tries) issues ``dP^T = V dO^T`` right after
``S^T`` instead of after the ``dV`` update. Neither depends on ``P^T``, so on sm_90 the
tensor cores compute it while the same warps exponentiate ``P^T`` (FlashAttention-3's
intra-warpgroup overlap, without warp specialisation). The sm_90 SASS shows the exp
and the softmax arithmetic issued while that wgmma is in flight; the cost is one more
(N, M) float32 tile live in registers. The same operations on the same values.

``WARP_SPEC`` (dK/dV and dQ variants the GPU tuner tries with ``TORCHFN_TRITON_WS=1``;
no user mask) is the forward's: one ``warp_specialize`` loop, every tile through
descriptors made in the kernel, the causal / bounds mask on every block, split by Triton
on sm_90 into a TMA producer and two consumer warpgroups. dK/dV flattens its GQA group
loop into the one loop (so with GQA it needs each group's heads as consecutive rows:
head stride = Nq row strides) and takes no atomic dQ; dQ splits only with BLOCK_M = 64.

``WINDOW`` (sliding window, see ``_triton_fwd``): dK/dV visits only the query rows whose
band reaches its key block, dQ only the key blocks in its rows' band, all masked; with
``SEGMENTS``, also only those of the same documents (dK/dV's ``RLO`` / ``RHI``: each
key's query range).

``DROPOUT``: the forward's keep decisions, recomputed per tile (``_keep``; dK/dV
transposes them): ``dV += (P * Z)^T dO`` and ``dS = P * (dP * Z - delta)`` with ``Z`` = 0
where dropped, ``drop_scale`` where kept (``delta = rowsum(dO * O)`` already holds Z).

``DQ_ORDERED`` = 1 (deterministic, sm_90+; ``_triton_ordered_dq``): dK/dV also adds each
``scale dS K`` into a float32 dQ with a TMA bulk reduce, in an order that per-(head, query
block) locks fix, and the dQ launch is skipped: 5 matmuls, bitwise reproducible
(FlashAttention-3's deterministic mode). ``DQ_ORDERED`` = 2 (``deterministic=False``):
the same bulk reduces without the locks, in any order (FlashAttention-3's default). A
program takes its key block from a ticket (causal: the highest first, so the key blocks
add from the diagonal down); its causal query range starts at a whole query block;
non-causal, it starts at query block ``a``, its place in the wave, and wraps around.

``ALIBI``: the forward's bias (``_alibi``) on every recomputed tile, dK/dV's transposed.
A cotangent for lse (``return_lse``) needs no kernel change: the launcher subtracts it
from ``delta``.
"""

import triton
import triton.language as tl

from torchfn.kernels._triton_dropout import _head_seed, _keep
from torchfn.kernels._triton_fwd import (
    _alibi,
    _bounds_mask,
    _head_desc,
    _head_slope,
    _in_band,
    _key_bounds,
    _load_kv,
    _load_rows,
    _load_tile,
    _mask_scores,
    _mask_tile,
    _row_segments,
    _same_segment,
    _segment_bounds,
    _soft_cap,
    _split_bounds,
    _store_rows,
)
from torchfn.kernels._triton_ordered_dq import (
    _add_tile,
    _dq_turn,
    _poll,
    _release,
    _wait_turn,
    _wave_slot,
)

LN2 = tl.constexpr(0.6931471805599453)  # qk_scale * LN2 = the softmax scale


@triton.jit
def _bwd_preprocess(
    O, DO, LSE, DELTA, LSE2,
    sob, soh, som, sdb, sdh, sdm,
    H, Nq,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    off_bh = tl.program_id(1)
    off_b = (off_bh // H).to(tl.int64)
    off_h = (off_bh % H).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    o = _load_rows(O + off_b * sob + off_h * soh, offs_m, offs_d, som, Nq, HEAD_DIM, BLOCK_D, True)
    do = _load_rows(DO + off_b * sdb + off_h * sdh, offs_m, offs_d, sdm, Nq, HEAD_DIM, BLOCK_D,
                    True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    row = off_bh.to(tl.int64) * Nq + offs_m
    lse = tl.load(LSE + row, mask=offs_m < Nq, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    tl.store(DELTA + row, delta, mask=offs_m < Nq)
    tl.store(LSE2 + row, lse2, mask=offs_m < Nq)


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, m_base, lse2_base, delta_base, dq_base,
                offs_n, offs_d, lo, hi, sqm, sdm, smm, smn, Nq, Nk, qk_scale,
                desc_q, desc_do, off_b, off_h,
                BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                CAUSAL_STAGE: tl.constexpr, MASK_KIND: tl.constexpr,
                DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, ELEM: tl.constexpr,
                DQ_ATOMIC: tl.constexpr, USE_TMA: tl.constexpr, EARLY_DP: tl.constexpr,
                win_l=0, win_r=0, WINDOW: tl.constexpr = False,
                seg_n=0, qseg_base=None, SEGMENTS: tl.constexpr = False,
                cap2=1.0, SOFTCAP: tl.constexpr = False, seed0=0, seed1=0, drop_thresh=0,
                drop_scale=1.0, start_n=0, BLOCK_N: tl.constexpr = 16,
                DROPOUT: tl.constexpr = False, slope2=0.0, ALIBI: tl.constexpr = False,
                pend=0, has_pend=0, DQ_ORDERED: tl.constexpr = 0,
                TMA_REDUCE: tl.constexpr = True, ORDER_CAUSAL: tl.constexpr = False,
                order=None, desc_dq=None):
    """dK, dV += the query blocks [lo, hi) of one head. ``DQ_ORDERED``: also add each
    ``dS K`` into dQ, in turn (1, ``_triton_ordered_dq``) or in any order (2);
    ``order`` = (LOCKS, this head's first lock, key block, key blocks, Nk - Nq, R, F, a,
    spin limit), ``pend`` /
    ``has_pend``: the lock whose tile is still to be released (carried across calls).
    Returns (dk, dv, pend, has_pend)."""
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        if DQ_ORDERED:
            lock = order[1] + start_m // BLOCK_M
        if USE_TMA:
            q = _load_tile(desc_q, off_b, off_h, start_m, BLOCK_M, BLOCK_D)  # (M, D)
            do = _load_tile(desc_do, off_b, off_h, start_m, BLOCK_M, BLOCK_D)
        else:
            q = _load_rows(q_base, offs_m, offs_d, sqm, Nq, HEAD_DIM, BLOCK_D, True)  # (M, D)
            do = _load_rows(do_base, offs_m, offs_d, sdm, Nq, HEAD_DIM, BLOCK_D, True)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        lse2 = tl.load(lse2_base + offs_m, mask=offs_m < Nq, other=float("inf"))
        delta = tl.load(delta_base + offs_m, mask=offs_m < Nq, other=0.0)
        qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale  # (N, M)
        if SOFTCAP:
            qkT, dcapT = _soft_cap(qkT, cap2)
        if EARLY_DP:  # issued before the exp: the tensor cores run it while P^T is computed
            dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)  # (N, M)
        if MASK_KIND != 0:
            qkT = _mask_scores(qkT, m_base, offs_m[None, :], offs_n[:, None], smm, smn, Nq, Nk,
                               MASK_KIND)
        if ALIBI:  # (the transposed tile: rows are keys)
            qkT = _alibi(qkT, offs_m[None, :], offs_n[:, None], Nq, Nk, slope2)
        if CAUSAL_STAGE:
            qkT = tl.where(offs_n[:, None] <= offs_m[None, :] + (Nk - Nq), qkT, float("-inf"))
        if WINDOW:
            qkT = tl.where(_in_band(offs_m[None, :], offs_n[:, None], Nq, Nk, win_l, win_r), qkT,
                           float("-inf"))
        if SEGMENTS:  # (the transposed tile: rows are keys)
            qkT = tl.where(_same_segment(seg_n, offs_m, qseg_base, Nq), qkT, float("-inf"))
        pT = tl.math.exp2(qkT - lse2[None, :])  # rows past Nq / empty rows: lse2 = +inf -> 0
        if DROPOUT:  # Z^T: the forward's keep decisions, transposed
            keepT = tl.trans(_keep(seed0, seed1, offs_m, start_n, drop_thresh, BLOCK_N))
            pT_drop = tl.where(keepT, pT * drop_scale, 0.0)
        else:
            pT_drop = pT
        if UPCAST:
            pT_lo = pT_drop
        else:
            pT_lo = pT_drop.to(ELEM)
        dv = tl.dot(pT_lo, do, dv, input_precision=DOT_PREC)
        if DQ_ORDERED == 1:  # the previous tile's reduce has had two matmuls' time to land
            done = _release(order[0], pend, has_pend, TMA_REDUCE)
        if not EARLY_DP:
            dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)  # (N, M)
        if DQ_ORDERED == 1:  # polled now (after the release), read after two more matmuls
            seen = _poll(order[0], lock + done, TMA_REDUCE)
        if DROPOUT:
            dpT = tl.where(keepT, dpT * drop_scale, 0.0)
        dsT = pT * (dpT - delta[None, :])
        if SOFTCAP:  # through the cap
            dsT = dsT * dcapT
        if not UPCAST:
            dsT = dsT.to(ELEM)
        dk = tl.dot(dsT, q, dk, input_precision=DOT_PREC)
        if DQ_ATOMIC:  # dQ[m] += dS K, unscaled; dq_base: float32 (Nq, HEAD_DIM) rows
            dq = tl.dot(tl.trans(dsT), k, input_precision=DOT_PREC)  # (M, D)
            dq_ptrs = dq_base + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
            if HEAD_DIM == BLOCK_D:
                tl.atomic_add(dq_ptrs, dq, mask=offs_m[:, None] < Nq, sem="relaxed")
            else:
                tl.atomic_add(dq_ptrs, dq, sem="relaxed",
                              mask=(offs_m[:, None] < Nq) & (offs_d[None, :] < HEAD_DIM))
        if DQ_ORDERED:  # dQ[m] += scale dS K, when this key block's turn comes
            dq = tl.dot(tl.trans(dsT), k, input_precision=DOT_PREC) * (qk_scale * LN2)  # (M, D)
            turn = _dq_turn(start_m // BLOCK_M, order[2], order[3], order[4], order[5],
                            order[6], order[7], ORDER_CAUSAL, BLOCK_M, BLOCK_N)
            if DQ_ORDERED == 1:
                seen, ready = _wait_turn(order[0], lock, seen, turn, order[8], TMA_REDUCE)
            else:  # 2: in any order (the bulk reduce is atomic)
                ready = tl.full([], 0, tl.int32)
            _add_tile(desc_dq, off_b, off_h, start_m + ready, dq, BLOCK_M, BLOCK_D, TMA_REDUCE)
            pend = lock + ready
            has_pend = 1 + ready
    return dk, dv, pend, has_pend


@triton.jit
def _dkdv_inner_ws(dk, dv, k, v, desc_q, desc_do, lse2_base, delta_base, offs_n, lo, Nq, Nk,
                   GROUP, qk_scale, BLOCK_M: tl.constexpr, IS_CAUSAL: tl.constexpr,
                   DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, ELEM: tl.constexpr):
    """Query blocks [lo, Nq) of the GROUP query heads of one kv head, in one
    warp-specialized loop (no user mask): a TMA producer warpgroup and two consumer
    warpgroups of BLOCK_N / 2 keys each. ``desc_q`` / ``desc_do``: the group's rows,
    head after head (GROUP Nq rows; a block past a head's Nq rows reads the next head's
    rows, which its +inf ``lse2`` zeroes out). Causal: the diagonal mask is applied to
    every block (a second loop stops the pass)."""
    offs_m0 = tl.arange(0, BLOCK_M)
    n_m = tl.cdiv(Nq - lo, BLOCK_M)  # query blocks per head
    for it in tl.range(0, GROUP * n_m, warp_specialize=True):
        g = it // n_m
        start_m = lo + (it - g * n_m) * BLOCK_M
        offs_m = start_m + offs_m0
        q = desc_q.load([g * Nq + start_m, 0])  # (M, D)
        do = desc_do.load([g * Nq + start_m, 0])
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        lse2 = tl.load(lse2_base + g * Nq + offs_m, mask=offs_m < Nq, other=float("inf"))
        delta = tl.load(delta_base + g * Nq + offs_m, mask=offs_m < Nq, other=0.0)
        qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale  # (N, M)
        if IS_CAUSAL:  # (the transposed tile: rows are keys)
            qkT = tl.trans(_bounds_mask(tl.trans(qkT), offs_m, offs_n, Nq, Nk, True))
        pT = tl.math.exp2(qkT - lse2[None, :])  # rows past Nq: lse2 = +inf -> 0
        if UPCAST:
            pT_lo = pT
        else:
            pT_lo = pT.to(ELEM)
        dv = tl.dot(pT_lo, do, dv, input_precision=DOT_PREC)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)  # (N, M)
        dsT = pT * (dpT - delta[None, :])
        if not UPCAST:
            dsT = dsT.to(ELEM)
        dk = tl.dot(dsT, q, dk, input_precision=DOT_PREC)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(
    Q, K, V, MASK, DO, LSE2, DELTA, DK, DV, DQACC,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
    smb, smh, smm, smn, sdb, sdh, sdm,
    sdkb, sdkh, sdkn, sdvb, sdvh, sdvn,
    H, HKV, GROUP, Nq, Nk, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, DQ_ATOMIC: tl.constexpr = False,
    desc_q=None, desc_do=None, USE_TMA: tl.constexpr = False, EARLY_DP: tl.constexpr = False,
    WARP_SPEC: tl.constexpr = False,
    win_l=0, win_r=0, WINDOW: tl.constexpr = False,
    QSEG=None, KSEG=None, RLO=None, RHI=None, SEGMENTS: tl.constexpr = False,
    cap2=1.0, SOFTCAP: tl.constexpr = False,
    SEED=None, drop_thresh=0, drop_scale=1.0, DROPOUT: tl.constexpr = False,
    SLOPES=None, ALIBI: tl.constexpr = False,
    LOCKS=None, desc_dq=None, DQ_ORDERED: tl.constexpr = 0,
    TMA_REDUCE: tl.constexpr = True, wave=1, spin_limit=1,
):
    tl.static_assert(not ((SOFTCAP or DROPOUT or ALIBI) and WARP_SPEC), "no warp spec.")
    tl.static_assert(not (DQ_ORDERED and (WARP_SPEC or WINDOW or DQ_ATOMIC)),
                     "DQ_ORDERED: no warp spec., window or atomics")
    if DQ_ORDERED:  # which key block: a ticket, in the order programs start
        n_kb = tl.cdiv(Nk, BLOCK_N)
        ticket = tl.atomic_add(LOCKS, 1)
        off_bhk = ticket // n_kb
        j = ticket - off_bhk * n_kb
        if IS_CAUSAL:  # the highest key block first: it adds first
            j = n_kb - 1 - j
        start_n = j * BLOCK_N
    else:
        start_n = tl.program_id(0) * BLOCK_N
        off_bhk = tl.program_id(1)
    off_b = (off_bhk // HKV).to(tl.int64)
    off_hk = (off_bhk % HKV).to(tl.int64)
    ELEM = K.dtype.element_ty

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k_base = K + off_b * skb + off_hk * skh
    v_base = V + off_b * svb + off_hk * svh
    if WARP_SPEC:  # through descriptors too: pointer loads here stop the pass
        k = _head_desc(k_base, Nk, skn, BLOCK_N, HEAD_DIM, BLOCK_D).load([start_n, 0])
        v = _head_desc(v_base, Nk, svn, BLOCK_N, HEAD_DIM, BLOCK_D).load([start_n, 0])
    else:
        k = _load_rows(k_base, offs_n, offs_d, skn, Nk, HEAD_DIM, BLOCK_D, True)
        v = _load_rows(v_base, offs_n, offs_d, svn, Nk, HEAD_DIM, BLOCK_D, True)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    seg_n, qseg_base = _row_segments(KSEG, QSEG, off_b, offs_n, Nk, Nq, SEGMENTS)  # (keys')
    if WINDOW:  # (the launcher folds causal into win_r = 0): the queries whose band
        # reaches this key block, all masked
        shift = Nk - Nq
        m_lo = tl.maximum(start_n - shift - win_r, 0)
        m_mid = tl.minimum(start_n + BLOCK_N - shift + win_l, Nq)
        if SEGMENTS:  # and the queries of the keys' segments (RLO / RHI: per key)
            m_lo, m_mid = _segment_bounds(m_lo, m_mid, RLO + off_b * Nk, RHI + off_b * Nk,
                                          offs_n, Nk, 1)
    elif IS_CAUSAL:
        shift = Nk - Nq
        m_lo = tl.maximum(start_n - shift, 0)  # first query that sees a key of this block
        if DQ_ORDERED:  # whole query blocks, so that every key block's dQ tiles line up
            m_lo = m_lo // BLOCK_M * BLOCK_M
        # queries from m_full on see every key of the block: no mask needed
        m_full = tl.maximum(tl.minimum(start_n + BLOCK_N - 1 - shift, Nq), m_lo)
        m_mid = m_lo + ((m_full - m_lo + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    else:
        m_lo = 0
        m_mid = 0
    pend = tl.full([], 0, tl.int64)  # the ordered dQ's lock still to release, if has_pend
    has_pend = tl.full([], 0, tl.int32)
    if DQ_ORDERED:
        n_m = tl.cdiv(Nq, BLOCK_M)
        R, F, a = _wave_slot(ticket, off_bhk * n_kb, n_kb, wave)
        if not IS_CAUSAL:  # the a-th of its wave starts at query block a, then wraps
            m_mid = a * BLOCK_M

    if WARP_SPEC:  # the launcher sets it only with no user mask, no atomics, and with GQA
        # only where a group's heads are consecutive rows (head stride = Nq row strides)
        tl.static_assert(MASK_KIND == 0 and not DQ_ATOMIC, "WARP_SPEC: no mask, no atomics")
        h0 = off_hk * GROUP  # the group's first query head
        row0 = (off_b * H + h0) * Nq
        dk, dv = _dkdv_inner_ws(
            dk, dv, k, v,
            _head_desc(Q + off_b * sqb + h0 * sqh, GROUP * Nq, sqm, BLOCK_M, HEAD_DIM, BLOCK_D),
            _head_desc(DO + off_b * sdb + h0 * sdh, GROUP * Nq, sdm, BLOCK_M, HEAD_DIM,
                       BLOCK_D),
            LSE2 + row0, DELTA + row0, offs_n, m_lo, Nq, Nk, GROUP, qk_scale, BLOCK_M,
            IS_CAUSAL, DOT_PREC, UPCAST, ELEM)
    else:
        for g in range(0, GROUP):
            off_h = off_hk * GROUP + g
            row0 = (off_b * H + off_h) * Nq
            q_base = Q + off_b * sqb + off_h * sqh
            do_base = DO + off_b * sdb + off_h * sdh
            m_base = MASK + off_b * smb + off_h * smh
            dq_base = DQACC + row0 * HEAD_DIM
            seed0, seed1 = _head_seed(SEED, off_b * H + off_h, DROPOUT)
            slope2 = _head_slope(SLOPES, off_b * H + off_h, ALIBI)
            if DQ_ORDERED:
                order = (LOCKS, (off_b * H + off_h) * n_m, j, n_kb, Nk - Nq, R, F, a, spin_limit)
            else:
                order = None
            if WINDOW:
                dk, dv, pend, has_pend = _dkdv_inner(
                    dk, dv, k, v, q_base, do_base, m_base, LSE2 + row0, DELTA + row0, dq_base,
                    offs_n, offs_d, m_lo, m_mid, sqm, sdm, smm, smn, Nq, Nk, qk_scale, desc_q,
                    desc_do, off_b, off_h, BLOCK_M, HEAD_DIM, BLOCK_D, False, MASK_KIND, DOT_PREC,
                    UPCAST, ELEM, DQ_ATOMIC, USE_TMA, EARLY_DP, win_l, win_r, True, seg_n,
                    qseg_base, SEGMENTS, cap2, SOFTCAP, seed0, seed1, drop_thresh, drop_scale,
                    start_n, BLOCK_N, DROPOUT, slope2, ALIBI, pend=pend, has_pend=has_pend,
                    DQ_ORDERED=DQ_ORDERED, TMA_REDUCE=TMA_REDUCE, ORDER_CAUSAL=IS_CAUSAL,
                    order=order, desc_dq=desc_dq)
            # stage 0: causal, the masked diagonal rows [m_lo, m_mid); 1: the unmasked rows
            # [m_mid, Nq); 2: a rotated (non-causal) ordered dQ wraps round to [0, m_mid)
            for r in tl.static_range(3):
                if not WINDOW and ((r == 0 and IS_CAUSAL) or r == 1
                                   or (r == 2 and DQ_ORDERED and not IS_CAUSAL)):
                    if r == 0:
                        lo = m_lo
                        hi = m_mid
                    elif r == 1:
                        lo = m_mid
                        hi = Nq
                    else:
                        lo = 0
                        hi = m_mid
                    dk, dv, pend, has_pend = _dkdv_inner(
                        dk, dv, k, v, q_base, do_base, m_base, LSE2 + row0, DELTA + row0,
                        dq_base, offs_n, offs_d, lo, hi, sqm, sdm, smm, smn, Nq, Nk, qk_scale,
                        desc_q, desc_do, off_b, off_h, BLOCK_M, HEAD_DIM, BLOCK_D, r == 0,
                        MASK_KIND, DOT_PREC, UPCAST, ELEM, DQ_ATOMIC, USE_TMA, EARLY_DP,
                        cap2=cap2, SOFTCAP=SOFTCAP, seed0=seed0, seed1=seed1,
                        drop_thresh=drop_thresh, drop_scale=drop_scale, start_n=start_n,
                        BLOCK_N=BLOCK_N, DROPOUT=DROPOUT, slope2=slope2, ALIBI=ALIBI, pend=pend,
                        has_pend=has_pend, DQ_ORDERED=DQ_ORDERED, TMA_REDUCE=TMA_REDUCE,
                        ORDER_CAUSAL=IS_CAUSAL, order=order, desc_dq=desc_dq)

        if DQ_ORDERED == 1:
            _release(LOCKS, pend, has_pend, TMA_REDUCE)

    dk = dk * sm_scale
    _store_rows(DK + off_b * sdkb + off_hk * sdkh, dk.to(DK.dtype.element_ty), offs_n, offs_d,
                sdkn, Nk, HEAD_DIM, BLOCK_D)
    _store_rows(DV + off_b * sdvb + off_hk * sdvh, dv.to(DV.dtype.element_ty), offs_n, offs_d,
                sdvn, Nk, HEAD_DIM, BLOCK_D)


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, k_base, v_base, m_base, offs_m, offs_d, lo, hi,
              skn, svn, smm, smn, Nq, Nk, qk_scale, desc_k, desc_v, off_b, off_hk,
              BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              BOUNDARY: tl.constexpr, IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
              DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, ELEM: tl.constexpr,
              USE_TMA: tl.constexpr, win_l=0, win_r=0, WINDOW: tl.constexpr = False,
              seg_m=0, kseg_base=None, SEGMENTS: tl.constexpr = False,
              cap2=1.0, SOFTCAP: tl.constexpr = False, seed0=0, seed1=0, drop_thresh=0,
              drop_scale=1.0, DROPOUT: tl.constexpr = False, slope2=0.0,
              ALIBI: tl.constexpr = False):
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + offs_n0
        k, v = _load_kv(k_base, v_base, desc_k, desc_v, off_b, off_hk, start_n, offs_n, offs_d,
                        skn, svn, Nk, HEAD_DIM, BLOCK_N, BLOCK_D, BOUNDARY, USE_TMA)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # (M, N)
        dcap = 1.0
        if SOFTCAP:
            qk, dcap = _soft_cap(qk, cap2)
        qk = _mask_tile(qk, m_base, offs_m, offs_n, smm, smn, Nq, Nk, BOUNDARY, IS_CAUSAL,
                        MASK_KIND, win_l, win_r, WINDOW, seg_m, kseg_base, SEGMENTS, slope2,
                        ALIBI)
        keep = False
        if DROPOUT:
            keep = _keep(seed0, seed1, offs_m, start_n, drop_thresh, BLOCK_N)
        dq = _dq_step(dq, qk, do, k, v, lse2, delta, DOT_PREC, UPCAST, ELEM, dcap, SOFTCAP,
                      keep, drop_scale, DROPOUT)
    return dq


@triton.jit
def _dq_step(dq, qk, do, k, v, lse2, delta, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
             ELEM: tl.constexpr, dcap=1.0, SOFTCAP: tl.constexpr = False, keep=False,
             drop_scale=1.0, DROPOUT: tl.constexpr = False):
    """``dq += dS K`` for one key block, from its masked log2-unit scores ``qk`` (M, N)
    (``SOFTCAP``: capped, and ``dcap`` the cap's derivative; ``DROPOUT``: ``keep`` the
    tile's keep decisions)."""
    p = tl.math.exp2(qk - lse2[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)  # (M, N)
    if DROPOUT:
        dp = tl.where(keep, dp * drop_scale, 0.0)
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        ds = ds * dcap
    if not UPCAST:
        ds = ds.to(ELEM)
    return tl.dot(ds, k, dq, input_precision=DOT_PREC)


@triton.jit
def _dq_inner_ws(dq, q, do, lse2, delta, desc_k, desc_v, offs_m, hi, Nq, Nk, qk_scale,
                 BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, MASKED: tl.constexpr,
                 DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, ELEM: tl.constexpr):
    """Key blocks [0, hi) of one query block in one warp-specialized loop (no user mask):
    a TMA producer warpgroup and two consumer warpgroups, each with all three matmuls
    (sm_90 TTGIR; with BLOCK_M = 64, the only size the pass splits here).
    ``MASKED``: the bounds / causal mask on every block (a second loop stops the pass)."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in tl.range(0, hi, BLOCK_N, warp_specialize=True):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = desc_k.load([start_n, 0])  # (N, D); rows past Nk read 0
        v = desc_v.load([start_n, 0])
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # (M, N)
        if MASKED:
            qk = _bounds_mask(qk, offs_m, start_n + offs_n0, Nq, Nk, IS_CAUSAL)
        dq = _dq_step(dq, qk, do, k, v, lse2, delta, DOT_PREC, UPCAST, ELEM)
    return dq


@triton.jit
def _attn_bwd_dq(
    Q, K, V, MASK, DO, LSE2, DELTA, DQ,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
    smb, smh, smm, smn, sdb, sdh, sdm, sdqb, sdqh, sdqm,
    H, GROUP, Nq, Nk, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    desc_k=None, desc_v=None, USE_TMA: tl.constexpr = False,
    WARP_SPEC: tl.constexpr = False, WS_MASKED: tl.constexpr = True,
    win_l=0, win_r=0, WINDOW: tl.constexpr = False,
    QSEG=None, KSEG=None, RLO=None, RHI=None, SEGMENTS: tl.constexpr = False,
    cap2=1.0, SOFTCAP: tl.constexpr = False,
    SEED=None, drop_thresh=0, drop_scale=1.0, DROPOUT: tl.constexpr = False,
    SLOPES=None, ALIBI: tl.constexpr = False,
    split_len=0, sdqs=0, SPLIT: tl.constexpr = False,
):
    tl.static_assert(not ((SOFTCAP or DROPOUT or ALIBI or SPLIT) and WARP_SPEC),
                     "no warp spec.")
    if IS_CAUSAL:  # the longest query blocks (last rows) first: better tail balance
        start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    else:
        start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b = (off_bh // H).to(tl.int64)
    off_h = (off_bh % H).to(tl.int64)
    off_hk = off_h // GROUP
    ELEM = Q.dtype.element_ty

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_base = Q + off_b * sqb + off_h * sqh
    do_base = DO + off_b * sdb + off_h * sdh
    if WARP_SPEC:  # through descriptors too: pointer loads here stop the pass
        q = _head_desc(q_base, Nq, sqm, BLOCK_M, HEAD_DIM, BLOCK_D).load([start_m, 0])
        do = _head_desc(do_base, Nq, sdm, BLOCK_M, HEAD_DIM, BLOCK_D).load([start_m, 0])
    else:
        q = _load_rows(q_base, offs_m, offs_d, sqm, Nq, HEAD_DIM, BLOCK_D, True)
        do = _load_rows(do_base, offs_m, offs_d, sdm, Nq, HEAD_DIM, BLOCK_D, True)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    row = off_bh.to(tl.int64) * Nq + offs_m
    lse2 = tl.load(LSE2 + row, mask=offs_m < Nq, other=float("inf"))
    delta = tl.load(DELTA + row, mask=offs_m < Nq, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    k_base = K + off_b * skb + off_hk * skh
    v_base = V + off_b * svb + off_hk * svh
    m_base = MASK + off_b * smb + off_h * smh
    seg_m, kseg_base = _row_segments(QSEG, KSEG, off_b, offs_m, Nq, Nk, SEGMENTS)
    lo, hi = _key_bounds(start_m, Nq, Nk, win_l, win_r, RLO, RHI, off_b, offs_m, BLOCK_M,
                         BLOCK_N, IS_CAUSAL, WINDOW, SEGMENTS)
    seed0, seed1 = _head_seed(SEED, off_bh, DROPOUT)
    slope2 = _head_slope(SLOPES, off_bh, ALIBI)
    lo1, hi1, lo, hi = _split_bounds(lo, hi, split_len, SPLIT)
    if WARP_SPEC:  # the launcher sets it only with no user mask and no window
        tl.static_assert(MASK_KIND == 0, "WARP_SPEC: no mask")
        dq = _dq_inner_ws(dq, q, do, lse2, delta,
                          _head_desc(k_base, Nk, skn, BLOCK_N, HEAD_DIM, BLOCK_D),
                          _head_desc(v_base, Nk, svn, BLOCK_N, HEAD_DIM, BLOCK_D),
                          offs_m, hi, Nq, Nk, qk_scale, BLOCK_N, IS_CAUSAL, WS_MASKED, DOT_PREC,
                          UPCAST, ELEM)
    else:
        if not WINDOW:
            dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, m_base, offs_m, offs_d, lo1,
                           hi1, skn, svn, smm, smn, Nq, Nk, qk_scale, desc_k, desc_v, off_b,
                           off_hk, BLOCK_N, HEAD_DIM, BLOCK_D, False, IS_CAUSAL, MASK_KIND,
                           DOT_PREC, UPCAST, ELEM, USE_TMA, cap2=cap2, SOFTCAP=SOFTCAP,
                           seed0=seed0, seed1=seed1, drop_thresh=drop_thresh,
                           drop_scale=drop_scale, DROPOUT=DROPOUT, slope2=slope2, ALIBI=ALIBI)
        dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, m_base, offs_m, offs_d, lo, hi,
                       skn, svn, smm, smn, Nq, Nk, qk_scale, desc_k, desc_v, off_b, off_hk,
                       BLOCK_N, HEAD_DIM, BLOCK_D, True, IS_CAUSAL, MASK_KIND, DOT_PREC, UPCAST,
                       ELEM, USE_TMA, win_l, win_r, WINDOW, seg_m, kseg_base, SEGMENTS, cap2,
                       SOFTCAP, seed0, seed1, drop_thresh, drop_scale, DROPOUT, slope2, ALIBI)
    dq = dq * sm_scale
    dq_base = DQ + off_b * sdqb + off_h * sdqh
    if SPLIT:  # a partial dQ (B, H, S, Nq, D), summed over S on the host
        dq_base += tl.program_id(2).to(tl.int64) * sdqs
    _store_rows(dq_base, dq.to(DQ.dtype.element_ty), offs_m, offs_d, sdqm, Nq, HEAD_DIM,
                BLOCK_D)
