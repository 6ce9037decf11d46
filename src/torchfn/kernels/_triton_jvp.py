"""Triton fused forward-mode (JVP) FlashAttention kernel.

With ``S = scale * q k^T (+ mask)``, ``tS = scale * (tq k^T + q tk^T)`` and
``P = softmax(S)``, the tangent of ``o = P v`` is

    to_i = sum_j P_ij (tS_ij v_j + tv_j) - o_i * sum_j P_ij tS_ij

One pass with the forward's online softmax: the accumulators ``acc_o = sum p v``,
``acc_t = sum (p * tS) v + p tv`` and ``acc_s = rowsum(p * tS)`` are rescaled
together, then normalised by ``l`` at the end. Returns ``o``, ``lse``, ``to`` and
``tlse = acc_s / l = sum_j P_ij tS_ij``, the tangent of lse.
Absent tangents (``HAS_T* = False``) are zero and cost nothing.

``DROPOUT``: with ``Z`` the forward's keep decisions times ``drop_scale``, ``o = (P Z) v``
and ``to_i = sum_j P_ij Z_ij (tS_ij v_j + tv_j) - o_i * sum_j P_ij tS_ij``: ``acc_o`` and
``acc_t`` take the dropped P (scaled at the end), ``acc_s`` the whole one.

``ALIBI``: the forward's bias on every tile; it is a constant, so the tangents are as
without it.
"""

import triton
import triton.language as tl

from torchfn.kernels._triton_dropout import _head_seed, _keep
from torchfn.kernels._triton_fwd import (
    _head_slope,
    _key_bounds,
    _load_rows,
    _mask_tile,
    _row_max,
    _row_segments,
    _soft_cap,
    _store_rows,
)


@triton.jit
def _jvp_inner(acc_o, acc_t, acc_s, l_i, m_i, q, tq,
               k_base, v_base, tk_base, tv_base, m_base, offs_m, offs_d, lo, hi,
               skn, svn, stkn, stvn, smm, smn, Nq, Nk, qk_scale, sm_scale,
               BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               BOUNDARY: tl.constexpr, IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
               HAS_TQ: tl.constexpr, HAS_TK: tl.constexpr, HAS_TV: tl.constexpr,
               DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
               win_l=0, win_r=0, WINDOW: tl.constexpr = False,
               seg_m=0, kseg_base=None, SEGMENTS: tl.constexpr = False,
               cap2=1.0, SOFTCAP: tl.constexpr = False,
               seed0=0, seed1=0, drop_thresh=0, DROPOUT: tl.constexpr = False,
               slope2=0.0, ALIBI: tl.constexpr = False):
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + offs_n0
        k = _load_rows(k_base, offs_n, offs_d, skn, Nk, HEAD_DIM, BLOCK_D, BOUNDARY)
        v = _load_rows(v_base, offs_n, offs_d, svn, Nk, HEAD_DIM, BLOCK_D, BOUNDARY)
        elem = v.dtype
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # (M, N) log2 units
        ts = tl.zeros_like(qk)  # tangent of the natural-unit scores
        if HAS_TQ:
            ts = tl.dot(tq, tl.trans(k), ts, input_precision=DOT_PREC)
        if HAS_TK:
            tk = _load_rows(tk_base, offs_n, offs_d, stkn, Nk, HEAD_DIM, BLOCK_D, BOUNDARY)
            if UPCAST:
                tk = tk.to(tl.float32)
            ts = tl.dot(q, tl.trans(tk), ts, input_precision=DOT_PREC)
        ts = ts * sm_scale
        if SOFTCAP:  # the scores and their tangent through the cap
            qk, dcap = _soft_cap(qk, cap2)
            ts = ts * dcap
        qk = _mask_tile(qk, m_base, offs_m, offs_n, smm, smn, Nq, Nk, BOUNDARY, IS_CAUSAL,
                        MASK_KIND, win_l, win_r, WINDOW, seg_m, kseg_base, SEGMENTS, slope2,
                        ALIBI)
        m_new, m_new_safe = _row_max(m_i, tl.max(qk, 1), BOUNDARY or MASK_KIND != 0)
        p = tl.math.exp2(qk - m_new_safe[:, None])
        alpha = tl.math.exp2(m_i - m_new_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        pts = p * ts  # masked entries: p = 0
        acc_s = acc_s * alpha + tl.sum(pts, 1)
        if DROPOUT:  # o and its tangent see the dropped P (acc_s: the softmax's, whole)
            keep = _keep(seed0, seed1, offs_m, start_n, drop_thresh, BLOCK_N)
            p = tl.where(keep, p, 0.0)
            pts = tl.where(keep, pts, 0.0)
        acc_o = acc_o * alpha[:, None]
        acc_t = acc_t * alpha[:, None]
        if UPCAST:  # interpreter: fp32 throughout
            p_lo = p
            pts_lo = pts
        else:
            p_lo = p.to(elem)
            pts_lo = pts.to(elem)
        acc_o = tl.dot(p_lo, v, acc_o, input_precision=DOT_PREC)
        acc_t = tl.dot(pts_lo, v, acc_t, input_precision=DOT_PREC)
        if HAS_TV:
            tv = _load_rows(tv_base, offs_n, offs_d, stvn, Nk, HEAD_DIM, BLOCK_D, BOUNDARY)
            if UPCAST:
                tv = tv.to(tl.float32)
            acc_t = tl.dot(p_lo, tv, acc_t, input_precision=DOT_PREC)
        m_i = m_new
    return acc_o, acc_t, acc_s, l_i, m_i


@triton.jit
def _attn_jvp(
    Q, K, V, TQ, TK, TV, MASK, O, LSE, TO, TLSE,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
    stqb, stqh, stqm, stkb, stkh, stkn, stvb, stvh, stvn,
    smb, smh, smm, smn, sob, soh, som, stob, stoh, stom,
    H, GROUP, Nq, Nk, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_TQ: tl.constexpr, HAS_TK: tl.constexpr, HAS_TV: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    win_l=0, win_r=0, WINDOW: tl.constexpr = False,
    QSEG=None, KSEG=None, RLO=None, RHI=None, SEGMENTS: tl.constexpr = False,
    cap2=1.0, SOFTCAP: tl.constexpr = False,
    SEED=None, drop_thresh=0, drop_scale=1.0, DROPOUT: tl.constexpr = False,
    SLOPES=None, ALIBI: tl.constexpr = False,
):
    if IS_CAUSAL:  # the longest query blocks (last rows) first: better tail balance
        start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    else:
        start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b = (off_bh // H).to(tl.int64)
    off_h = (off_bh % H).to(tl.int64)
    off_hk = off_h // GROUP

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(Q + off_b * sqb + off_h * sqh, offs_m, offs_d, sqm, Nq, HEAD_DIM, BLOCK_D, True)
    if HAS_TQ:
        tq = _load_rows(TQ + off_b * stqb + off_h * stqh, offs_m, offs_d, stqm, Nq, HEAD_DIM,
                        BLOCK_D, True)
    else:
        tq = q
    if UPCAST:
        q = q.to(tl.float32)
        tq = tq.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_s = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_o = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    acc_t = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    k_base = K + off_b * skb + off_hk * skh
    v_base = V + off_b * svb + off_hk * svh
    tk_base = TK + off_b * stkb + off_hk * stkh
    tv_base = TV + off_b * stvb + off_hk * stvh
    m_base = MASK + off_b * smb + off_h * smh
    seg_m, kseg_base = _row_segments(QSEG, KSEG, off_b, offs_m, Nq, Nk, SEGMENTS)
    lo, hi = _key_bounds(start_m, Nq, Nk, win_l, win_r, RLO, RHI, off_b, offs_m, BLOCK_M,
                         BLOCK_N, IS_CAUSAL, WINDOW, SEGMENTS)
    seed0, seed1 = _head_seed(SEED, off_bh, DROPOUT)
    slope2 = _head_slope(SLOPES, off_bh, ALIBI)
    if not WINDOW:  # the unmasked stage (the band's blocks are all masked)
        acc_o, acc_t, acc_s, l_i, m_i = _jvp_inner(
            acc_o, acc_t, acc_s, l_i, m_i, q, tq, k_base, v_base, tk_base, tv_base, m_base,
            offs_m, offs_d, 0, lo, skn, svn, stkn, stvn, smm, smn, Nq, Nk, qk_scale, sm_scale,
            BLOCK_N, HEAD_DIM, BLOCK_D, False, IS_CAUSAL, MASK_KIND, HAS_TQ, HAS_TK, HAS_TV,
            DOT_PREC, UPCAST, cap2=cap2, SOFTCAP=SOFTCAP, seed0=seed0, seed1=seed1,
            drop_thresh=drop_thresh, DROPOUT=DROPOUT, slope2=slope2, ALIBI=ALIBI)
    acc_o, acc_t, acc_s, l_i, m_i = _jvp_inner(
        acc_o, acc_t, acc_s, l_i, m_i, q, tq, k_base, v_base, tk_base, tv_base, m_base,
        offs_m, offs_d, lo, hi, skn, svn, stkn, stvn, smm, smn, Nq, Nk, qk_scale, sm_scale,
        BLOCK_N, HEAD_DIM, BLOCK_D, True, IS_CAUSAL, MASK_KIND, HAS_TQ, HAS_TK, HAS_TV,
        DOT_PREC, UPCAST, win_l, win_r, WINDOW, seg_m, kseg_base, SEGMENTS, cap2, SOFTCAP,
        seed0, seed1, drop_thresh, DROPOUT, slope2, ALIBI)

    empty = l_i == 0.0
    inv_l = 1.0 / tl.where(empty, 1.0, l_i)
    inv_lz = inv_l
    if DROPOUT:  # the kept probabilities' scale
        inv_lz = inv_l * drop_scale
    o = acc_o * inv_lz[:, None]
    to = acc_t * inv_lz[:, None] - o * (acc_s * inv_l)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
                   * 0.6931471805599453)
    _store_rows(O + off_b * sob + off_h * soh, o.to(O.dtype.element_ty), offs_m, offs_d, som, Nq,
                HEAD_DIM, BLOCK_D)
    _store_rows(TO + off_b * stob + off_h * stoh, to.to(TO.dtype.element_ty), offs_m, offs_d,
                stom, Nq, HEAD_DIM, BLOCK_D)
    tl.store(LSE + off_bh.to(tl.int64) * Nq + offs_m, lse, mask=offs_m < Nq)
    tl.store(TLSE + off_bh.to(tl.int64) * Nq + offs_m, acc_s * inv_l, mask=offs_m < Nq)
