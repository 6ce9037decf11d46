"""Threefry-2x32 (20 rounds) on int32 tensors, bit-compatible with ``jax.random``.

Every word is a torch.int32 holding the bit pattern of a uint32 (torch has no
uint32 arithmetic). Addition wraps modulo 2**32 in two's complement, so it is
the uint32 addition; right shifts are arithmetic, so a logical shift is an
arithmetic shift plus a mask.

Three code paths compute the same bits:

* ``threefry2x32``: out-of-place ops. Used under ``torch.compile`` (Inductor
  fuses the whole hash into one kernel), under ``vmap``/functorch wrappers and
  for small inputs (keys).
* ``counter_bits_chunked``: plain eager CPU tensors. Works on cache-sized
  chunks of the counter with in-place ops on three private buffers (5 ops per
  round), so each of the ~110 elementwise ops touches L2 instead of main memory
  and nothing is allocated per round: several times faster than the
  out-of-place path in eager.
* ``counter_words_np``: plain eager CPU draws that fit one chunk (up to 32767 words),
  in numpy, whose elementwise ops cost ~4x less to call than torch's: such draws are
  all call overhead (4096 words: 0.29x the time of the out-of-place path).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# rotation constants of Threefry-2x32 (Salmon et al. 2011), as in jax.random
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA
# Eager chunk sizes. ATen runs an elementwise op on one thread below 32768
# elements (its grain size): with few threads, serial chunks that fit L2 avoid
# ~130 OpenMP fork/joins per chunk, which stall badly when the cores are shared.
# With many threads, larger chunks let each op use them all.
_CHUNK_SERIAL = (1 << 15) - 1
_CHUNK = 1 << 18
_SERIAL_MAX_THREADS = 2
VML_GRAIN = 2048  # ATen's grain for its vectorized math kernels (log1p, ...)


def one_chunk(n: int) -> bool:
    """Whether ``n`` counters fit in one chunk of the eager path at any thread count
    (below ATen's grain size, where one thread runs every op anyway): such plain CPU
    draws take :func:`counter_words_np`."""
    return 0 < n <= _CHUNK_SERIAL


def serial_chunks() -> bool:
    """Whether eager CPU sampling runs in single-threaded, L2-sized chunks."""
    return torch.get_num_threads() <= _SERIAL_MAX_THREADS


def as_i32(value: int) -> int:
    """The int32 bit pattern of the uint32 ``value mod 2**32``, as a Python int."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= (1 << 31) else value


def _rotl(x: Tensor, r: int) -> Tensor:
    # logical right shift = arithmetic shift + mask of the r low bits
    return (x << r) | ((x >> (32 - r)) & ((1 << r) - 1))


def _schedule(k0: Tensor, k1: Tensor) -> list[tuple[Tensor, Tensor]]:
    """Key injections after each group of 4 rounds: (add to x0, add to x1)."""
    ks = (k0, k1, k0 ^ k1 ^ _PARITY)
    return [(ks[(i + 1) % 3], ks[(i + 2) % 3] + (i + 1)) for i in range(5)]


def threefry2x32(k0: Tensor, k1: Tensor, x0: Tensor, x1: Tensor) -> tuple[Tensor, Tensor]:
    """Threefry-2x32 hash of the counter words ``(x0, x1)`` under key ``(k0, k1)``.

    All arguments are int32 tensors that broadcast together (``k0``/``k1``
    usually 0-d). Returns the two output words, out-of-place.
    """
    x0 = x0 + k0
    x1 = x1 + k1
    for i, (a, b) in enumerate(_schedule(k0, k1)):
        for r in _ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = _rotl(x1, r) ^ x0
        x0 = x0 + a
        x1 = x1 + b
    return x0, x1


def threefry2x32_py(k0: int, k1: int, x0: int, x1: int) -> tuple[int, int]:
    """:func:`threefry2x32` on Python ints (uint32 values): the same bits without
    ~100 tensor ops, for the handful of words of a ``split``/``fold_in`` of a CPU key."""
    m = 0xFFFFFFFF
    k0, k1, x0, x1 = k0 & m, k1 & m, x0 & m, x1 & m
    ks = (k0, k1, k0 ^ k1 ^ _PARITY)
    x0, x1 = (x0 + k0) & m, (x1 + k1) & m
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = (x0 + x1) & m
            x1 = (((x1 << r) | (x1 >> (32 - r))) & m) ^ x0
        x0 = (x0 + ks[(i + 1) % 3]) & m
        x1 = (x1 + ks[(i + 2) % 3] + i + 1) & m
    return x0, x1


def counter_words_np(k0: int, k1: int, n: int) -> tuple[Tensor, Tensor]:
    """Both output words of threefry over the counters ``0..n-1`` (n < 2**32), computed
    in numpy: the same bits as :func:`counter_words`. For plain CPU draws of one chunk,
    where the ~110 elementwise ops' fixed cost is the whole price: numpy's is ~4x lower
    than torch's. Returns int32 CPU tensors over fresh numpy buffers (the caller's to
    overwrite)."""
    import numpy as np  # here: torchfn.kernels imports this module and needs only torch

    u32 = np.uint32
    k0, k1 = k0 & 0xFFFFFFFF, k1 & 0xFFFFFFFF
    ks = (k0, k1, k0 ^ k1 ^ _PARITY)
    x1 = np.arange(n, dtype=u32)
    x1 += u32(k1)
    x0 = x1 + u32(k0)  # x0 = hi + k0 = k0, then round 1's x0 += x1 folded in
    t = np.empty_like(x1)
    first = True
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            if not first:
                x0 += x1
            first = False
            np.right_shift(x1, u32(32 - r), out=t)
            np.left_shift(x1, u32(r), out=x1)  # wraps: the high bits fall off
            x1 |= t
            x1 ^= x0
        x0 += u32(ks[(i + 1) % 3])
        x1 += u32((ks[(i + 2) % 3] + i + 1) & 0xFFFFFFFF)
    return torch.from_numpy(x0.view(np.int32)), torch.from_numpy(x1.view(np.int32))


def counters(n: int, device: torch.device) -> tuple[Tensor | int, Tensor]:
    """High and low int32 words of the uint64 iota ``0..n-1`` (``hi`` is 0 when n <= 2**32)."""
    if n <= (1 << 31):
        return 0, torch.arange(n, dtype=torch.int32, device=device)
    idx = torch.arange(n, dtype=torch.int64, device=device)
    lo = idx.to(torch.int32)  # wraps: keeps the low 32 bits
    if n <= (1 << 32):
        return 0, lo
    return (idx >> 32).to(torch.int32), lo


def counter_words(k0: Tensor, k1: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Both output words of threefry over the counters ``0..n-1`` (out-of-place)."""
    hi, lo = counters(n, k0.device)
    if isinstance(hi, int):
        hi = torch.zeros((), dtype=torch.int32, device=k0.device)
    return threefry2x32(k0, k1, hi, lo)


def chunk_schedule(k0: Tensor, k1: Tensor):
    """Key injections and, per rotation, 0-d (shift, mask) tensors and the multiplier
    (tensor operands skip ATen's per-call wrapping of Python scalars: ~2 us/op)."""

    def const(v: int) -> Tensor:
        return torch.tensor(v, dtype=torch.int32, device=k0.device)

    rots = tuple(
        tuple((const(32 - r), const((1 << r) - 1), 1 << r) for r in rs) for rs in _ROTATIONS
    )
    return _schedule(k0, k1), rots


def _hash_chunk_(
    k0: Tensor, k1: Tensor, sched, base: Tensor, start: int, x0: Tensor, x1: Tensor, t: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """In place: threefry of the counters ``start + base``; returns ``(y0, y1, scratch)``.

    The three buffers are permuted, not copied. ``len(base) + start % 2**32 <= 2**32``.
    5 elementwise ops per round: ``x0 += x1``, then ``rotl(x1, r) ^ x0`` as
    ``t = (x1 >> (32 - r)) & (2**r - 1); t += x1 * 2**r; t ^= x0`` (the wrapping
    multiply is the left shift; the two parts have disjoint bits, so + is |).
    """
    injections, rot_consts = sched
    # x1 = lo + k1 ; x0 = (hi + k0) + x1 (the first add of round 1 folded in)
    torch.add(base, k1 + as_i32(start), out=x1)
    torch.add(x1, k0 + as_i32(start >> 32), out=x0)
    first = True
    for i, (a, b) in enumerate(injections):
        for shift, mask, alpha in rot_consts[i % 2]:
            if not first:
                x0.add_(x1)
            first = False
            torch.bitwise_right_shift(x1, shift, out=t)
            t.bitwise_and_(mask)
            t.add_(x1, alpha=alpha)
            t.bitwise_xor_(x0)
            x1, t = t, x1
        x0.add_(a)
        x1.add_(b)
    return x0, x1, t


def counter_bits_chunked(
    k0: Tensor,
    k1: Tensor,
    n: int,
    finish: Callable[[Tensor, Tensor, Tensor], Tensor],
    out: Tensor,
) -> Tensor:
    """Eager fast path: per chunk, hash the counters and write ``finish(x0, x1, t)`` to ``out``.

    ``out`` is flat with ``n`` elements; ``finish`` may use its arguments as scratch
    space and returns a tensor of ``out``'s dtype and the chunk's length.
    """
    device = k0.device
    size = min(_CHUNK_SERIAL if serial_chunks() else _CHUNK, n)
    base = torch.arange(size, dtype=torch.int32, device=device)
    x0 = torch.empty(size, dtype=torch.int32, device=device)
    x1 = torch.empty_like(x0)
    t = torch.empty_like(x0)
    sched = chunk_schedule(k0, k1)
    start = 0
    while start < n:
        # a chunk never straddles a multiple of 2**32 (the counter's high word is per chunk)
        m = min(size, n - start, (1 << 32) - (start & 0xFFFFFFFF))
        bufs = (x0, x1, t) if m == size else (x0[:m], x1[:m], t[:m])
        y0, y1, scratch = _hash_chunk_(k0, k1, sched, base[:m], start, *bufs)
        out[start : start + m] = finish(y0, y1, scratch)
        start += m
    return out


def threefry2x32_keyed_(k0: Tensor, k1: Tensor, x0: Tensor, x1: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`threefry2x32` with a key per element, in place on the caller's fresh
    counter words ``x0``, ``x1`` (plain eager tensors of the output's shape, which the
    keys broadcast to). One temporary for the rotations instead of ~100 allocations:
    the gamma sampler hashes every element's own key several times per draw."""
    ks2 = k0 ^ k1 ^ _PARITY
    ks = (k0, k1, ks2)
    x0.add_(k0)
    x1.add_(k1)
    t = torch.empty_like(x1)
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0.add_(x1)
            torch.bitwise_right_shift(x1, 32 - r, out=t)
            t.bitwise_and_((1 << r) - 1)
            x1.bitwise_left_shift_(r).bitwise_or_(t).bitwise_xor_(x0)
        x0.add_(ks[(i + 1) % 3])
        x1.add_(ks[(i + 2) % 3]).add_(i + 1)
    return x0, x1
