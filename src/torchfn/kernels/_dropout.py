"""Attention dropout keyed by ``torchfn.random``: which probabilities are kept.

The keep mask is a pure function of the key, so the backward and the JVP recompute it
instead of storing an (Nq, Nk) mask, every backend draws the same bits, and ``vmap``
over keys gives each example its own mask:

* each (batch, query head) gets the key ``fold_in(key, b * H + h)`` -- its ``seeds``,
  a (B, H, 2) int32 tensor made once per call;
* one Philox-4x32-10 hash (Salmon et al. 2011, as cuRAND's and Triton's ``tl.rand``) of
  the counter ``(j // 8, i, 0, 0)`` under that key gives 128 bits, eight 16-bit words for
  the scores ``(i, 8c .. 8c + 7)``: word ``r`` is the low (r even) or high (r odd) half
  of output ``r // 2``;
* score ``(i, j)`` is kept iff its word is ``>= threshold(p) = round(p * 2**16)``, and
  kept probabilities are scaled by ``2**16 / (2**16 - threshold)``, the inverse of the
  exact keep rate, so the output stays unbiased.

So the rate is ``p`` rounded to a multiple of ``2**-16`` (FlashAttention-2 rounds to
``2**-8``), for about 15 sm_90 instructions per score in a Triton kernel. The Triton kernels
compute the same bits (``_triton_dropout``).

>>> import torch
>>> from torchfn import random
>>> s = seeds(random.key(0), 1, 2)
>>> s.shape, s.dtype
(torch.Size([1, 2, 2]), torch.int32)
>>> keep(s[..., None, None, :], torch.arange(3)[:, None], 0, 5, threshold(0.5)).shape
torch.Size([1, 2, 3, 5])
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchfn.core import _threefry as _tf

WORD = 1 << 16  # the resolution of a keep decision


def threshold(p: float) -> int:
    """The 16-bit keep threshold of dropout rate ``p`` in [0, 1): words below it drop."""
    return min(round(p * WORD), WORD - 1)


def keep_scale(p: float) -> float:
    """What a kept probability is multiplied by: 1 / (the exact keep rate)."""
    return WORD / (WORD - threshold(p))


def seeds(key: Tensor, batch: int, heads: int) -> Tensor:
    """(B, H, 2) int32: ``fold_in(key, b * H + h)``, on ``key``'s device. Plain tensor
    ops, so a batched ``key`` (``vmap`` over keys) gives batched seeds."""
    zero = torch.zeros((), dtype=torch.int32, device=key.device)
    idx = torch.arange(batch * heads, dtype=torch.int32, device=key.device)
    y0, y1 = _tf.threefry2x32(key[0], key[1], zero, idx)
    return torch.stack([y0, y1], dim=-1).reshape(batch, heads, 2)


_M32 = 0xFFFFFFFF
# Philox-4x32 round multipliers and Weyl key increments (Random123)
_MUL = (0xD2511F53, 0xCD9E8D57)
_WEYL = (0x9E3779B9, 0xBB67AE85)
ROUNDS = 10


def _mulhilo(a: Tensor, b: int) -> tuple[Tensor, Tensor]:
    """High and low 32-bit words of ``a * b`` (a: int64 tensor of uint32 values, b: a
    uint32 constant), from b's 16-bit halves so that no int64 product overflows."""
    x = a * (b & 0xFFFF)  # < 2**48
    y = a * (b >> 16) + (x >> 16)  # a * b = y * 2**16 + (x mod 2**16)
    return y >> 16, ((y & 0xFFFF) << 16) | (x & 0xFFFF)


def philox4x32(k0: Tensor, k1: Tensor, c0: Tensor, c1: Tensor) -> tuple[Tensor, ...]:
    """Philox-4x32-10 of the counter ``(c0, c1, 0, 0)`` under key ``(k0, k1)``: four
    uint32 words as int64 tensors (the arguments broadcast; any integer dtype, read as
    uint32)."""
    k0, k1, c0, c1 = (x.to(torch.int64) & _M32 for x in (k0, k1, c0, c1))
    # round 1 with c2 = c3 = 0: their products vanish
    hi0, lo0 = _mulhilo(c0, _MUL[0])
    c0, c1, c2, c3 = c1 ^ k0, torch.zeros_like(k0), hi0 ^ k1, lo0
    for _ in range(1, ROUNDS):
        k0, k1 = (k0 + _WEYL[0]) & _M32, (k1 + _WEYL[1]) & _M32
        hi0, lo0 = _mulhilo(c0, _MUL[0])
        hi1, lo1 = _mulhilo(c2, _MUL[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def keep(seed: Tensor, rows: Tensor, k0: int, k1: int, thresh: int) -> Tensor:
    """Bool keep mask of the scores (``rows``, keys ``k0 .. k1 - 1``).

    ``seed``: (..., 2) int32 per-head keys, with ``...`` broadcasting against ``rows``
    (e.g. (B, H, 1, 1, 2) with rows (n, 1)); ``rows``: the query indices as a column.
    Returns ``(..., n, k1 - k0)`` where ``...`` is the broadcast of the two.
    """
    g0, g1 = k0 // 8, -(-k1 // 8)  # the column groups that cover [k0, k1)
    groups = torch.arange(g0, g1, device=rows.device)
    kept = []
    for r in philox4x32(seed[..., 0], seed[..., 1], groups, rows):  # (..., n, g1 - g0)
        kept += [(r & 0xFFFF) >= thresh, (r >> 16) >= thresh]
    return torch.stack(kept, -1).flatten(-2)[..., k0 - 8 * g0 : k1 - 8 * g0]
