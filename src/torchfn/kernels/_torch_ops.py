"""PyTorch backend: the raw ``fwd`` / ``bwd`` / ``jvp`` of the attention contract.

Plain torch ops, no autograd (called from the ``torchfn::attention_*`` custom ops,
which give them their vmap rules and derivatives).

On CPU, ``fwd`` and ``bwd`` run SDPA's fused flash kernels
(``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward) where their
semantics can be made ours: bottom-right causal needs Nq == Nk there, a bool mask
becomes an additive one, GQA repeats k / v, and the lse of a fully masked row is
set to -inf. Everything else (CUDA without Triton, causal with Nq != Nk, an fp32
mask on fp16 / bf16 inputs, and every ``jvp``) runs the blockwise path below.

For fp32 / fp64 inputs the blockwise path still runs SDPA's fused kernels, one query
block at a time, where its extras fit in an additive mask and the blocks are wide
(ALiBi, causal with Nq != Nk: ``_sdpa_blocks``): each block's bias (mask, causal band,
ALiBi) is made for that block alone, over the key range the block sees.

Blockwise path: the queries are processed in row blocks; each block materialises
its scores against every key its band reaches (causal, sliding window), so the
softmax of a block is exact and memory is bounded by ``_SCORE_BUDGET`` scores per
block. A window or segment ids always take this path (SDPA would score every key);
with segment ids each query block visits only its documents' key range. Short
sequences run as one block. fp16 / bf16 are computed in fp32, fp64 in fp64.
GQA: the ``G = H // Hkv`` query heads of one kv head are stacked along the rows,
``(B, Hkv, G * rows, D)``, so k / v are never repeated.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _dropout, _reference

# scores materialised per query block (elements); ~16 MiB in fp32
_SCORE_BUDGET = 1 << 22
# SDPA's fused CPU kernels (private aten ops: absent -> blockwise everywhere)
_SDPA_FWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_SDPA_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_USE_SDPA = True  # tests switch it off to check the blockwise path


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _compact(mask: Tensor) -> Tensor:
    """Undo ``.expand``: dims with stride 0 shrink back to size 1 (a view)."""
    for d in range(mask.dim()):
        if mask.size(d) > 1 and mask.stride(d) == 0:
            mask = mask.narrow(d, 0, 1)
    return mask


class _Layout:
    """Shapes, the compact mask and the query blocks shared by fwd / bwd / jvp.

    The band of ``causal`` and ``window``: query ``i`` (at position ``i + offset``) sees
    keys ``i + offset - left ..= i + offset + right`` (a side < 0: unbounded; causal sets
    ``right = 0``); each query block visits only the key range its band reaches.
    """

    def __init__(self, q: Tensor, k: Tensor, mask: Tensor | None, causal: bool, scale: float,
                 window: tuple[int, int] = (-1, -1),
                 segments: tuple[Tensor, Tensor] | None = None, softcap: float = 0.0,
                 dropout: float = 0.0, seeds: Tensor | None = None,
                 slopes: Tensor | None = None):
        self.B, self.H, self.Nq, self.D = q.shape
        self.Hkv, self.Nk = k.shape[1], k.shape[2]
        self.G = self.H // self.Hkv
        self.acc, self.device = _acc_dtype(q.dtype), q.device
        self.offset = self.Nk - self.Nq  # bottom-right causal: key j <= i + offset
        self.left, self.right = window
        if causal:
            self.right = 0
        banded = self.left >= 0 or self.right >= 0
        self.segments, self.softcap = segments, softcap
        # minus the ALiBi slopes (B, Hkv, G, 1, 1), in the rows' head order
        self.neg_slopes = None if slopes is None else slopes.to(self.acc).neg().view(
            self.B, self.Hkv, self.G, 1, 1)
        self.seeds = None  # dropout keys (B, Hkv, G, 1, 1, 2), in the rows' head order
        if seeds is not None:
            self.seeds = seeds.view(self.B, self.Hkv, self.G, 1, 1, 2)
            self.thresh, self.keep_scale = _dropout.threshold(dropout), _dropout.keep_scale(dropout)
        if segments is not None:  # each query row's key range [lo, hi) (host lists)
            lo, hi = _reference.segment_ranges(*segments)
            self.seg_lo, self.seg_hi = lo.amin(0).tolist(), hi.amax(0).tolist()
        self.mask = None
        if mask is not None:
            m = _compact(mask)  # (b, h, nq, nk), each 1 or full
            m = m.unflatten(1, (self.Hkv, self.G)) if m.size(1) > 1 else m.unsqueeze(1)
            self.is_bool = m.dtype == torch.bool
            self.mask = m.logical_not() if self.is_bool else m  # bool: True = blocked
        rows = max(1, _SCORE_BUDGET // max(1, self.B * self.H * self.Nk))
        if segments is not None and self.Nq >= 128:  # blocks of ~a segment: skip the others
            rows = min(rows, max(64, -(-self.Nq // 16)))
        elif banded and self.Nq >= 128:  # several blocks, so keys outside the band are skipped
            if self.left < 0:  # causal or right-bounded: 4 blocks
                rows = min(rows, -(-self.Nq // 4))
            else:  # blocks about as tall as the band is wide
                rows = min(rows, max(64, min(self.left + max(self.right, 0) + 1, 1024)))
        self.rows = min(self.Nq, rows)

    def blocks(self):
        """Yield ``(i0, i1, k0, k1)``: query rows ``[i0, i1)`` see keys in ``[k0, k1)``
        (an empty range: none)."""
        for i0 in range(0, self.Nq, self.rows):
            i1 = min(self.Nq, i0 + self.rows)
            k1 = self.Nk if self.right < 0 else min(self.Nk, i1 + self.offset + self.right)
            k0 = 0 if self.left < 0 else max(0, i0 + self.offset - self.left)
            if self.segments is not None:
                k0 = max(k0, min(self.seg_lo[i0:i1]))
                k1 = min(k1, max(self.seg_hi[i0:i1]))
            yield i0, i1, k0, max(k0, k1)

    def rows_of(self, x: Tensor, i0: int, i1: int) -> Tensor:
        """(B, H, Nq, *) -> rows [i0, i1) stacked per kv head: (B, Hkv, G * n, *)."""
        x = x[:, :, i0:i1].unflatten(1, (self.Hkv, self.G))
        return x.reshape(self.B, self.Hkv, self.G * (i1 - i0), *x.shape[4:])

    def scores(self, qs: Tensor, k: Tensor, i0: int, i1: int, k0: int, k1: int,
               want_dcap: bool = False):
        """Masked scores of rows [i0, i1) against keys [k0, k1): (B, Hkv, G * n, k1 - k0);
        ``qs`` is pre-scaled. With ``want_dcap``: (scores, the cap's derivative
        ``1 - tanh^2`` (None without softcap))."""
        s = qs @ k[:, :, k0:k1].transpose(-1, -2)
        dcap = None
        if self.softcap > 0:  # s -> c tanh(s / c), before the mask (Gemma 2)
            t = s.div_(self.softcap).tanh_()
            if want_dcap:
                dcap = 1 - t.square()
            s = t.mul_(self.softcap)
        self.mask_(s.view(self.B, self.Hkv, self.G, i1 - i0, k1 - k0), i0, i1, k0, k1)
        return (s, dcap) if want_dcap else s

    def mask_(self, s5: Tensor, i0: int, i1: int, k0: int, k1: int) -> None:
        """Add the mask, ALiBi, band and segments of rows [i0, i1) and keys [k0, k1) to
        ``s5`` (B, Hkv, G, n, k1 - k0) in place (-inf where a key is not seen)."""
        if self.mask is not None:
            m = self.mask
            m = m[..., i0:i1, :] if m.size(3) > 1 else m
            m = m[..., k0:k1] if m.size(4) > 1 else m
            if self.is_bool:
                s5.masked_fill_(m, float("-inf"))
            else:
                s5.add_(m)
        dev = s5.device
        if self.neg_slopes is not None:  # ALiBi: - slope * |i + offset - j|, in one pass
            rows = torch.arange(i0, i1, device=dev)[:, None] + self.offset
            dist = (rows - torch.arange(k0, k1, device=dev)).abs().to(s5.dtype)
            s5.addcmul_(self.neg_slopes, dist)
        pos = torch.arange(i0, i1, device=dev)[:, None] + self.offset  # (n, 1)
        # keys in [kb, k1) may be right of some row's band, keys in [k0, ka) left of it
        kb = max(k0, i0 + self.offset + self.right + 1)
        if self.right >= 0 and kb < k1:
            blocked = torch.arange(kb, k1, device=dev) > pos + self.right
            s5[..., kb - k0:].masked_fill_(blocked, float("-inf"))
        ka = min(k1, i1 - 1 + self.offset - self.left)
        if self.left >= 0 and k0 < ka:
            blocked = torch.arange(k0, ka, device=dev) < pos - self.left
            s5[..., :ka - k0].masked_fill_(blocked, float("-inf"))
        if self.segments is not None:
            q_ids, kv_ids = self.segments
            other = q_ids[:, i0:i1, None] != kv_ids[:, None, k0:k1]  # (B, n, k1 - k0)
            s5.masked_fill_(other[:, None, None], float("-inf"))

    def bias(self, i0: int, i1: int, k0: int, k1: int) -> Tensor:
        """(b, h, n, k1 - k0) additive bias of rows [i0, i1) and keys [k0, k1): everything
        ``mask_`` adds, as SDPA's ``attn_mask`` (in the accumulation dtype). b is 1 or B and
        h is 1 or H: only what the mask and ALiBi vary over is materialised (a causal band
        alone is one (n, k1 - k0) matrix for every head)."""
        n, kk = i1 - i0, k1 - k0
        shape = [1, 1, 1, n, kk]
        if self.mask is not None:
            shape[:3] = [max(a, b) for a, b in zip(shape[:3], self.mask.shape[:3])]
        if self.neg_slopes is not None:
            shape[:3] = [self.B, self.Hkv, self.G]
        if self.segments is not None:
            shape[0] = self.B
        b = torch.zeros(shape, dtype=self.acc, device=self.device)
        self.mask_(b, i0, i1, k0, k1)
        return b.view(shape[0], shape[1] * shape[2], n, kk)

    def dropout(self, i0: int, i1: int, k0: int, k1: int) -> Tensor | None:
        """(B, Hkv, G * n, k1 - k0): the keyed dropout factor of rows [i0, i1) and keys
        [k0, k1), 0 (dropped) or 1 / keep rate; None without dropout."""
        if self.seeds is None:
            return None
        rows = torch.arange(i0, i1, device=self.seeds.device)[:, None]
        kept = _dropout.keep(self.seeds, rows, k0, k1, self.thresh)  # (B, Hkv, G, n, k1 - k0)
        z = kept.reshape(self.B, self.Hkv, self.G * (i1 - i0), k1 - k0).to(self.acc)
        return z.mul_(self.keep_scale)

    def unrows(self, x: Tensor, n: int) -> Tensor:
        """(B, Hkv, G * n, *) -> (B, H, n, *)."""
        return x.reshape(self.B, self.H, n, *x.shape[3:])


def _safe(x: Tensor) -> Tensor:
    """-inf (a fully masked row) -> 0, so ``exp(s - x)`` is 0 instead of NaN."""
    return x.masked_fill(x == float("-inf"), 0.0)


def _exp_scores(s: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """In place ``s -> exp(s - rowmax)``; returns (P unnormalised, 1 / rowsum, lse).

    Plain elementwise ops and reductions rather than ``torch.softmax``, which opens a
    parallel region even for tiny inputs (it stalls for milliseconds on a loaded machine).
    A fully masked row (all -inf) gives P = 0, 1 / rowsum = 1 and lse = -inf.
    """
    m = _safe(s.amax(-1, keepdim=True))
    p = s.sub_(m).exp_()
    l = p.sum(-1, keepdim=True)
    lse = l.log().add_(m)  # (*, n, 1)
    return p, l.masked_fill_(l == 0, 1.0).reciprocal_(), lse


def _sdpa_args(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
               window: tuple[int, int], segments, softcap: float = 0.0, seeds=None,
               dlse=None, slopes=None):
    """(k, v, additive mask) for SDPA's fused CPU kernels, or None where they do not apply
    (a window or segments: the blockwise path skips the keys outside them; keyed dropout:
    SDPA's draws from the global RNG; a cotangent for lse on fp16 / bf16 inputs: SDPA's
    backward takes none, and ``_fold_dlse``'s way in is exact only in float32 / float64;
    ALiBi: the bias would have to be materialised)."""
    if (not _USE_SDPA or _SDPA_BWD is None or q.device.type != "cpu" or max(window) >= 0
            or segments is not None or softcap > 0 or seeds is not None or dlse is not None
            or slopes is not None):
        return None
    if causal and q.shape[2] != k.shape[2]:  # SDPA's is_causal aligns top-left
        return None
    if mask is not None:
        mask = _compact(mask)
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
        elif mask.dtype != q.dtype:  # keep an fp32 bias on fp16 / bf16 inputs exact
            return None
    groups = q.shape[1] // k.shape[1]
    return _reference._repeat_kv(k, groups), _reference._repeat_kv(v, groups), mask


def _sdpa_blocks(q: Tensor, mask: Tensor | None, window: tuple[int, int], segments,
                 softcap: float, seeds, dlse=None) -> bool:
    """Whether the blockwise path runs each query block through SDPA's fused CPU kernels,
    with the block's mask, causal band and ALiBi as one additive bias (its key range
    still cut to what the block sees): for ALiBi and bottom-right causal with Nq != Nk.
    Not for softcap, keyed dropout or a cotangent for lse (SDPA has none of them), nor
    fp16 / bf16, whose bias would have to be rounded to the inputs' dtype. Not for a
    window or segments either: their blocks are narrow, and on 2 cores the plain
    blockwise path was as fast (window) or 1.16x faster (packed documents)."""
    return (_USE_SDPA and _SDPA_BWD is not None and q.device.type == "cpu"
            and q.dtype in (torch.float32, torch.float64) and softcap <= 0
            and seeds is None and dlse is None and max(window) < 0 and segments is None
            and (mask is None or mask.dtype in (torch.bool, q.dtype, torch.float32)))


def _sdpa_layout(L: _Layout) -> _Layout:
    """Query blocks for the fused kernels: a bias of at most ``_SCORE_BUDGET`` elements
    per block (on 2 cores 256-row blocks ran 1.4x faster than 512-row ones at N=2048)."""
    L.rows = min(L.rows, max(16, _SCORE_BUDGET // max(1, L.B * L.H * L.Nk)))
    return L


def _fwd_sdpa_blocks(L: _Layout, q: Tensor, k: Tensor, v: Tensor, scale: float):
    """``fwd`` through SDPA's fused kernel, one query block at a time (``_sdpa_blocks``)."""
    o = torch.zeros_like(q, memory_format=torch.contiguous_format)
    lse = torch.full((L.B, L.H, L.Nq), float("-inf"), dtype=L.acc, device=q.device)
    for i0, i1, k0, k1 in L.blocks():
        if k1 <= k0:  # every row of the block is fully masked
            continue
        bias = L.bias(i0, i1, k0, k1)  # (B, H, n, k1 - k0)
        kr, vr = (_reference._repeat_kv(x[:, :, k0:k1], L.G) for x in (k, v))
        ob, lb = _SDPA_FWD(q[:, :, i0:i1], kr, vr, 0.0, False, attn_mask=bias, scale=scale)
        dead = bias.isneginf().all(-1)  # (B, H, n): rows that see no key
        o[:, :, i0:i1] = ob.masked_fill_(dead[..., None], 0.0)
        lse[:, :, i0:i1] = lb.masked_fill_(dead, float("-inf"))
    return o, lse


def _bwd_sdpa_blocks(L: _Layout, q, k, v, o, lse, do, scale: float):
    """``bwd`` through SDPA's fused backward, one query block at a time."""
    dq = torch.zeros_like(q, memory_format=torch.contiguous_format)
    dk = torch.zeros(L.B, L.Hkv, L.Nk, L.D, dtype=k.dtype, device=k.device)
    dv = torch.zeros_like(dk)
    lse = lse.masked_fill(lse == float("-inf"), 0.0)  # SDPA's convention; P is 0 there
    for i0, i1, k0, k1 in L.blocks():
        if k1 <= k0:
            continue
        kr, vr = (_reference._repeat_kv(x[:, :, k0:k1], L.G) for x in (k, v))
        dqb, dkb, dvb = _SDPA_BWD(do[:, :, i0:i1], q[:, :, i0:i1], kr, vr, o[:, :, i0:i1],
                                  lse[:, :, i0:i1], 0.0, False, attn_mask=L.bias(i0, i1, k0, k1),
                                  scale=scale)
        dq[:, :, i0:i1] = dqb
        dk[:, :, k0:k1] += _sum_groups(dkb, L.Hkv)
        dv[:, :, k0:k1] += _sum_groups(dvb, L.Hkv)
    return dq, dk, dv


def _fold_dlse(q: Tensor, k: Tensor, v: Tensor, o: Tensor, do: Tensor,
               dlse: Tensor) -> tuple[Tensor, ...]:
    """Inputs for SDPA's fused backward that also carry lse's cotangent. With it, the
    backward's ``delta = rowsum(dO * O)`` must become ``delta - dlse`` (d lse_i / d s_ij
    = P_ij), and SDPA takes no dlse; but it reads O only for delta. So one more feature
    goes on every tensor: 1 on dO, ``-dlse`` on O, 0 on q, k and v (the scores, dP and
    the first D features of every gradient are unchanged), padded to a multiple of 8
    features with zeros. Exact, for float32 / float64 inputs (``-dlse`` is stored in
    O's dtype)."""
    d = q.shape[-1]
    pad = 8 - d % 8 if d % 8 else 8

    def widen(x: Tensor, first: Tensor | float = 0.0) -> Tensor:
        extra = x.new_zeros(*x.shape[:-1], pad)
        extra[..., 0] = first
        return torch.cat((x, extra), -1)  # (..., D + pad)

    return (widen(q), widen(k), widen(v), widen(o, -dlse.to(o.dtype)), widen(do, 1.0))


def _sum_groups(x: Tensor, hkv: int) -> Tensor:
    """(B, H, Nk, D) -> (B, Hkv, Nk, D), summing the query heads of each kv head."""
    if x.shape[1] == hkv:
        return x
    return x.unflatten(1, (hkv, x.shape[1] // hkv)).sum(2, dtype=_acc_dtype(x.dtype)).to(x.dtype)


def fwd(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float,
        window: tuple[int, int] = (-1, -1), segments: tuple[Tensor, Tensor] | None = None,
        softcap: float = 0.0, dropout: float = 0.0, seeds: Tensor | None = None,
        slopes: Tensor | None = None):
    """o: (B, H, Nq, D) in q's dtype, lse: (B, H, Nq) fp32 (fp64 for fp64 inputs)."""
    sdpa = _sdpa_args(q, k, v, mask, causal, window, segments, softcap, seeds, slopes=slopes)
    if sdpa is not None:
        kr, vr, bias = sdpa
        o, lse = _SDPA_FWD(q, kr, vr, 0.0, causal, attn_mask=bias, scale=scale)
        if bias is not None:  # SDPA: o = 0 and lse = 0 on a row without keys; ours: -inf
            lse = lse.masked_fill(lse.eq(0) & o.eq(0).all(-1), float("-inf"))
        return o.contiguous(), lse.contiguous()
    L = _Layout(q, k, mask, causal, scale, window, segments, softcap, dropout, seeds, slopes)
    if _sdpa_blocks(q, mask, window, segments, softcap, seeds):
        return _fwd_sdpa_blocks(_sdpa_layout(L), q, k, v, scale)
    kf, vf = k.to(L.acc), v.to(L.acc)
    o = lse = None
    for i0, i1, k0, k1 in L.blocks():
        n = i1 - i0
        if k1 > k0:
            s = L.scores(L.rows_of(q, i0, i1).to(L.acc) * scale, kf, i0, i1, k0, k1)
            p, inv, lsec = _exp_scores(s)
            z = L.dropout(i0, i1, k0, k1)
            oc = ((p if z is None else p * z) @ vf[:, :, k0:k1]).mul_(inv)
        else:  # every row of the block is fully masked
            oc = vf.new_zeros(L.B, L.Hkv, L.G * n, L.D)
            lsec = vf.new_full((L.B, L.Hkv, L.G * n, 1), float("-inf"))
        if n == L.Nq:  # one block
            return L.unrows(oc, n).to(q.dtype), L.unrows(lsec, n).squeeze(-1)
        if o is None:
            o = q.new_empty(L.B, L.H, L.Nq, L.D)
            lse = vf.new_empty(L.B, L.H, L.Nq)
        o[:, :, i0:i1] = L.unrows(oc, n)
        lse[:, :, i0:i1] = L.unrows(lsec, n).squeeze(-1)
    return o, lse


def bwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    do: Tensor,
    mask: Tensor | None,
    causal: bool,
    scale: float,
    deterministic: bool = True,
    window: tuple[int, int] = (-1, -1),
    segments: tuple[Tensor, Tensor] | None = None,
    softcap: float = 0.0,
    dropout: float = 0.0,
    seeds: Tensor | None = None,
    dlse: Tensor | None = None,
    slopes: Tensor | None = None,
):
    """dq: (B, H, Nq, D); dk, dv: (B, Hkv, Nk, D) summed over each kv head's query heads.
    ``dlse``: the cotangent of lse (B, H, Nq), or None.

    Always deterministic; ``deterministic`` is accepted for the shared backend contract.
    """
    wide = q.dtype in (torch.float32, torch.float64)  # dlse folds in exactly: below
    sdpa = _sdpa_args(q, k, v, mask, causal, window, segments, softcap, seeds,
                      None if wide else dlse, slopes)
    if sdpa is not None:
        kr, vr, bias = sdpa
        lse = lse.masked_fill(lse == float("-inf"), 0.0)  # back to SDPA's convention
        d = q.shape[-1]
        if dlse is not None:
            q, kr, vr, o, do = _fold_dlse(q, kr, vr, o, do, dlse)
        dq, dk, dv = _SDPA_BWD(do, q, kr, vr, o, lse, 0.0, causal, attn_mask=bias, scale=scale)
        hkv = k.shape[1]
        dq, dk, dv = dq[..., :d], dk[..., :d], dv[..., :d]
        return dq.contiguous(), _sum_groups(dk, hkv).contiguous(), _sum_groups(dv, hkv).contiguous()
    L = _Layout(q, k, mask, causal, scale, window, segments, softcap, dropout, seeds, slopes)
    if _sdpa_blocks(q, mask, window, segments, softcap, seeds, dlse):
        return _bwd_sdpa_blocks(_sdpa_layout(L), q, k, v, o, lse, do, scale)
    kf, vf = k.to(L.acc), v.to(L.acc)
    # delta = rowsum(dO * O) = rowsum(P * dP). From a fp16 / bf16 O it carries O's rounding,
    # which dP - delta can magnify many times (small D); a block holds every key its rows
    # see, so there it is summed exactly from P and dP instead
    exact_delta = q.dtype in (torch.float16, torch.bfloat16)
    delta = None if exact_delta else (do.to(L.acc) * o.to(L.acc)).sum(-1, keepdim=True)
    if dlse is not None:  # d lse_i / d s_ij = P_ij: dS = P (dP - delta + dlse)
        dlse = dlse.to(L.acc).unsqueeze(-1)  # (B, H, Nq, 1)
        delta = None if exact_delta else delta - dlse
    lse = _safe(lse.to(L.acc)).unsqueeze(-1)  # (B, H, Nq, 1)
    dq = torch.zeros(L.B, L.H, L.Nq, L.D, dtype=L.acc, device=q.device)
    dk = torch.zeros(L.B, L.Hkv, L.Nk, L.D, dtype=L.acc, device=q.device)
    dv = torch.zeros_like(dk)
    for i0, i1, k0, k1 in L.blocks():
        if k1 <= k0:
            continue
        n = i1 - i0
        qs = L.rows_of(q, i0, i1).to(L.acc) * scale
        s, dcap = L.scores(qs, kf, i0, i1, k0, k1, want_dcap=True)
        p = s.sub_(L.rows_of(lse, i0, i1)).exp_()
        doc = L.rows_of(do, i0, i1).to(L.acc)  # (B, Hkv, G*n, D)
        z = L.dropout(i0, i1, k0, k1)  # o = (P * z) v
        dv[:, :, k0:k1] += (p if z is None else p * z).transpose(-1, -2) @ doc
        dp = doc @ vf[:, :, k0:k1].transpose(-1, -2)
        if z is not None:
            dp.mul_(z)
        if exact_delta:
            d = (p * dp).sum(-1, keepdim=True)  # (B, Hkv, G*n, 1)
            if dlse is not None:
                d = d.sub_(L.rows_of(dlse, i0, i1))
        else:
            d = L.rows_of(delta, i0, i1)
        ds = dp.sub_(d).mul_(p)
        if dcap is not None:  # through the softcap
            ds.mul_(dcap)
        dq[:, :, i0:i1] = L.unrows((ds @ kf[:, :, k0:k1]).mul_(scale), n)
        dk[:, :, k0:k1] += ds.transpose(-1, -2) @ qs  # qs carries the scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def jvp(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    tq: Tensor | None,
    tk: Tensor | None,
    tv: Tensor | None,
    mask: Tensor | None,
    causal: bool,
    scale: float,
    window: tuple[int, int] = (-1, -1),
    segments: tuple[Tensor, Tensor] | None = None,
    softcap: float = 0.0,
    dropout: float = 0.0,
    seeds: Tensor | None = None,
    slopes: Tensor | None = None,
):
    """Forward-mode: (o, lse, to, tlse); a ``None`` tangent means zero.

    With ``S = scale q k^T + mask``, ``tS = scale (tq k^T + q tk^T)``, ``P = softmax(S)``,
    ``*`` elementwise and ``Z`` the dropout factor (1 without dropout), ``o = (P * Z) v``
    and ``to = (P * tS * Z) v + (P * Z) tv - o * rowsum(P * tS)``; ``tlse = rowsum(P * tS)``.
    """
    L = _Layout(q, k, mask, causal, scale, window, segments, softcap, dropout, seeds, slopes)
    kf, vf = k.to(L.acc), v.to(L.acc)
    tkf = tk.to(L.acc) if tk is not None else None
    tvf = tv.to(L.acc) if tv is not None else None
    o = torch.zeros(L.B, L.H, L.Nq, L.D, dtype=L.acc, device=q.device)
    to = torch.zeros_like(o)
    lse = torch.full((L.B, L.H, L.Nq), float("-inf"), dtype=L.acc, device=q.device)
    tlse = torch.zeros_like(lse)
    for i0, i1, k0, k1 in L.blocks():
        if k1 <= k0:
            continue
        n = i1 - i0
        qs = L.rows_of(q, i0, i1).to(L.acc) * scale
        s, dcap = L.scores(qs, kf, i0, i1, k0, k1, want_dcap=True)
        p, inv, lsec = _exp_scores(s)
        z = L.dropout(i0, i1, k0, k1)
        pz = p if z is None else p * z
        oc = (pz @ vf[:, :, k0:k1]).mul_(inv)
        toc = torch.zeros_like(oc)
        ts = None
        if tq is not None:
            ts = (L.rows_of(tq, i0, i1).to(L.acc) * scale) @ kf[:, :, k0:k1].transpose(-1, -2)
        if tkf is not None:
            tsk = qs @ tkf[:, :, k0:k1].transpose(-1, -2)
            ts = tsk if ts is None else ts.add_(tsk)
        if ts is not None:
            if dcap is not None:  # the tangent through the softcap
                ts.mul_(dcap)
            pts = ts.mul_(p)  # P * tS (unnormalised)
            toc += ((pts if z is None else pts * z) @ vf[:, :, k0:k1]).mul_(inv)
            tlsec = pts.sum(-1, keepdim=True).mul_(inv)  # (B, Hkv, G*n, 1)
            toc -= oc * tlsec
            tlse[:, :, i0:i1] = L.unrows(tlsec.squeeze(-1), n)
        if tvf is not None:
            toc += (pz @ tvf[:, :, k0:k1]).mul_(inv)
        o[:, :, i0:i1] = L.unrows(oc, n)
        to[:, :, i0:i1] = L.unrows(toc, n)
        lse[:, :, i0:i1] = L.unrows(lsec.squeeze(-1), n)
    return o.to(q.dtype), lse, to.to(q.dtype), tlse
