"""Keyed attention dropout inside the Triton kernels: the bits of ``_dropout``, per tile.

``_keep`` recomputes the keep decisions of a (BLOCK_M, BLOCK_N) score tile from its
head's key: one Philox-4x32-10 hash per eight scores (16 bits each), bit-identical to the
PyTorch path's ``_dropout.keep`` (tests compare them exactly). Nothing is stored between
the forward, the backward and the JVP. Per score that is about 15 sm_90 instructions
(10 Philox rounds of 2 ``umulhi``, 2 multiplies, 4 xors and 2 adds shared by 8 scores,
then the byte shuffles of ``interleave``, the compare and the select), on the ALUs the
softmax's arithmetic also uses.
"""

import triton
import triton.language as tl


@triton.jit
def _philox4x32(k0, k1, c0, c1):
    """Philox-4x32-10 (``_dropout.philox4x32``) of the counters ``(c0, c1, 0, 0)``,
    broadcast together, under the uint32 key ``(k0, k1)``: four uint32 words."""
    c0, c1 = tl.broadcast(c0, c1)
    c2 = tl.zeros_like(c0)
    c3 = tl.zeros_like(c0)
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, 0xD2511F53)
        lo0 = c0 * 0xD2511F53
        hi1 = tl.umulhi(c2, 0xCD9E8D57)
        lo1 = c2 * 0xCD9E8D57
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def _head_seed(SEED, off_bh, DROPOUT: tl.constexpr):
    """The (batch, head)'s dropout key as two uint32 words (0, 0 without dropout)."""
    if DROPOUT:
        k0 = tl.load(SEED + off_bh * 2).to(tl.uint32, bitcast=True)
        k1 = tl.load(SEED + off_bh * 2 + 1).to(tl.uint32, bitcast=True)
    else:
        k0 = 0
        k1 = 0
    return k0, k1


@triton.jit
def _keep(k0, k1, offs_m, start_n, thresh, BLOCK_N: tl.constexpr):
    """(M, BLOCK_N) bool: whether score (query ``offs_m``, key ``start_n + j``) is kept.
    ``start_n``: a multiple of 8. Hash (column // 8, row); its four words give eight
    16-bit draws, each word's low half, then its high half."""
    rows = offs_m.to(tl.uint32)[:, None]  # (M, 1)
    groups = (start_n // 8 + tl.arange(0, BLOCK_N // 8)).to(tl.uint32)[None, :]  # (1, N / 8)
    r0, r1, r2, r3 = _philox4x32(k0, k1, groups, rows)  # (M, N / 8) each
    # interleave(interleave(a, c), interleave(b, d)) = a, b, c, d, a, b, ...
    lo = tl.interleave(tl.interleave(r0 & 0xFFFF, r2 & 0xFFFF),
                       tl.interleave(r1 & 0xFFFF, r3 & 0xFFFF))
    hi = tl.interleave(tl.interleave(r0 >> 16, r2 >> 16), tl.interleave(r1 >> 16, r3 >> 16))
    return tl.interleave(lo, hi) >= thresh  # r0 low, r0 high, r1 low, ...
