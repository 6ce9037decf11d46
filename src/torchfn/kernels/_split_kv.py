"""Split-KV (FlashDecoding): how many key splits a Triton forward or dQ gets; the merge.

The forward (and the backward's dQ kernel) runs one program per (query block, batch,
head). With few query blocks (decoding: Nq = 1, or a few latents reading a long
context) that is fewer programs than the GPU has SMs, and each streams every key alone.
Splitting the keys into S runs gives S times the programs; each writes a partial ``o``
and ``lse`` and :func:`merge` combines them exactly (the identity ring attention uses;
dQ's partials are simply summed):

    lse = logsumexp_s lse_s,    o = sum_s exp(lse_s - lse) o_s

``TORCHFN_TRITON_SPLIT_KV``: "auto" (default: :func:`num_splits`), "0" (never split) or
a positive integer (that many splits where the keys allow, also in the interpreter,
which otherwise never splits).

>>> num_splits(programs=32, n_sms=132, n_blocks=256)  # B*H = 32, Nq = 1, Nk = 32k
4
>>> num_splits(programs=512, n_sms=132, n_blocks=256)  # a training shape: no split
1
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

_MAX_SPLITS = 64
_MIN_BLOCKS = 2  # key blocks per split at least: each split pays a fixed overhead


def mode() -> str | int:
    """``TORCHFN_TRITON_SPLIT_KV`` parsed: "auto", or a forced split count (0: never)."""
    value = os.environ.get("TORCHFN_TRITON_SPLIT_KV", "auto").strip() or "auto"
    if value == "auto":
        return value
    if value.isdigit():
        return int(value)
    raise ValueError("TORCHFN_TRITON_SPLIT_KV must be 'auto', '0' (never split) or a "
                     f"positive number of splits, got {value!r}")


def num_splits(programs: int, n_sms: int, n_blocks: int) -> int:
    """The number of key splits for ``programs`` (query blocks x batch x heads) on
    ``n_sms`` SMs, with ``n_blocks`` key blocks per head.

    FlashAttention-2's rule: no split once the programs fill 80% of the SMs; else the
    smallest split count whose wave efficiency (the last wave's fill) is within 85% of
    the best reachable, skipping counts that give the same run length as one fewer.
    Each split keeps at least ``_MIN_BLOCKS`` key blocks.
    """
    if programs >= 0.8 * n_sms:
        return 1
    top = min(_MAX_SPLITS, n_sms, n_blocks // _MIN_BLOCKS)
    if top <= 1:
        return 1

    def efficiency(s: int) -> float:
        waves = programs * s / n_sms
        return waves / math.ceil(waves)

    def distinct(s: int) -> bool:  # s splits give shorter runs than s - 1 do
        return s == 1 or math.ceil(n_blocks / s) != math.ceil(n_blocks / (s - 1))

    best = max(efficiency(s) for s in range(1, top + 1) if distinct(s))
    return next(s for s in range(1, top + 1) if distinct(s) and efficiency(s) >= 0.85 * best)


def split_len(nk: int, splits: int, align: int) -> tuple[int, int]:
    """(keys per split, a multiple of ``align``; the splits that leaves, <= ``splits``)."""
    blocks = math.ceil(nk / align)
    length = math.ceil(blocks / max(1, splits)) * align
    return length, math.ceil(nk / length)


def merge(o: Tensor, lse: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(B, H, S, Nq, D) float32 partial outputs and (B, H, S, Nq) lse -> o (B, H, Nq, D)
    in ``dtype`` and lse (B, H, Nq); rows no split saw give o = 0, lse = -inf.

    >>> o = torch.tensor([1.0, 3.0]).view(1, 1, 2, 1, 1)
    >>> merge(o, torch.zeros(1, 1, 2, 1), torch.float32)[0].item()  # equal weights
    2.0
    """
    total = torch.logsumexp(lse, dim=2)  # (B, H, Nq); -inf where every split is empty
    w = torch.exp(lse - total.unsqueeze(2)).nan_to_num_(0.0)  # (B, H, S, Nq)
    out = torch.einsum("bhsq,bhsqd->bhqd", w, o)
    return out.to(dtype), total
