"""Counter-mode hashing of a key into words, raw ``bits``, and floats in [0, 1)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from torchfn.core import _threefry as _tf
from torchfn.core._eager import plain as _plain
from torchfn.core.random._checks import _check_key, _check_shape, _small_cpu

# Over several chunks the chunked eager path pays from here on (normal's finish runs per
# chunk); a draw that fits one chunk hashes in numpy (``_threefry.one_chunk``).
_FAST_MIN = 1 << 17


def _generate(k: Tensor, shape: tuple[int, ...], out_dtype: torch.dtype, finish) -> Tensor:
    """Hash the counters ``0..prod(shape)-1`` and map the words with ``finish(y0, y1)``.

    Plain-eager CPU draws that fit one chunk hash in numpy (cheaper calls), large ones
    take the chunked in-place path (cache-sized passes); everything else (vmap, grad
    wrappers, torch.compile, GPU, where the allocator or the compiler makes
    temporaries cheap) the out-of-place one.

    ``finish`` may modify ``y0``/``y1`` in place (they are private temporaries)
    and returns a flat tensor of ``out_dtype``.
    """
    n = math.prod(shape)
    k0, k1 = k[0], k[1]
    if _tf.one_chunk(n) and _small_cpu(k):  # numpy's ops cost less to call than torch's
        k0, k1 = k.tolist()
        out = finish(*_tf.counter_words_np(k0, k1, n))
    elif n >= _FAST_MIN and k.device.type == "cpu" and _plain(k):
        out = torch.empty(n, dtype=out_dtype, device=k.device)
        _tf.counter_bits_chunked(k0, k1, n, lambda x0, x1, t: finish(x0, x1), out)
    else:
        y0, y1 = _tf.counter_words(k0, k1, n)
        out = finish(y0, y1)
    return out.reshape(shape)


def _xor(y0: Tensor, y1: Tensor) -> Tensor:
    return y0.bitwise_xor_(y1)


def _bits64(y0: Tensor, y1: Tensor) -> Tensor:
    return (y0.to(torch.int64) << 32) | (y1.to(torch.int64) & 0xFFFFFFFF)


def _random_bits(k: Tensor, width: int, shape: tuple[int, ...]) -> Tensor:
    """JAX's ``_random_bits``: int32 bit patterns (width 32, or the low 8/16 bits
    as non-negative values), int64 bit patterns for width 64."""
    if width == 64:
        return _generate(k, shape, torch.int64, _bits64)
    if width == 32:
        return _generate(k, shape, torch.int32, _xor)
    mask = (1 << width) - 1
    return _generate(k, shape, torch.int32, lambda y0, y1: _xor(y0, y1).bitwise_and_(mask))


_BITS_DTYPES = {
    torch.uint8: 8,
    torch.uint16: 16,
    torch.uint32: 32,
    torch.uint64: 64,
    torch.int32: 32,
    torch.int64: 64,
}


def bits(key: Tensor, shape: int | Sequence[int] = (), dtype: torch.dtype = torch.uint32) -> Tensor:
    """Uniform random bits, exactly ``jax.random.bits(key, shape, dtype)``.

    Args:
      key: ``(2,)`` int32 key.
      shape: output shape.
      dtype: ``torch.uint32`` (default), ``uint8``, ``uint16`` or ``uint64`` as in
        JAX; ``torch.int32`` / ``torch.int64`` give the 32 / 64 bits as signed bit
        patterns (torch's unsigned types above 8 bits support few ops; use
        ``.long()`` on a uint32 result for arithmetic).

    Returns:
      bits: ``shape`` tensor of ``dtype``.

    Example::

        >>> from torchfn import random
        >>> b = random.bits(random.key(0), (3,))
        >>> b.dtype, b.shape
        (torch.uint32, torch.Size([3]))
    """
    k = _check_key(key, "bits")
    shape = _check_shape(shape, "bits")
    if dtype not in _BITS_DTYPES:
        raise TypeError(
            f"bits: dtype must be one of uint8, uint16, uint32, uint64, int32, int64, got {dtype}"
        )
    width = _BITS_DTYPES[dtype]
    b = _random_bits(k, width, shape)
    if dtype in (torch.int32, torch.int64, torch.uint32, torch.uint64):
        return b.view(dtype)
    if dtype == torch.uint8:
        return b.to(torch.uint8)
    return b.to(torch.int16).view(torch.uint16)  # low 16 bits, bit pattern kept


def _unit(y0: Tensor, y1: Tensor, dtype: torch.dtype) -> Tensor:
    """Floats in [0, 1) from the hash words, JAX's mantissa trick (in place on y0)."""
    if dtype == torch.float32:
        b = _xor(y0, y1).bitwise_right_shift_(9).bitwise_and_(0x7FFFFF).bitwise_or_(0x3F800000)
        return b.view(torch.float32).sub_(1.0)
    if dtype == torch.float64:
        mant = y0.to(torch.int64).bitwise_and_(0xFFFFFFFF).bitwise_left_shift_(
            20
        ) | y1.bitwise_right_shift_(12).bitwise_and_(0xFFFFF).to(torch.int64)
        return mant.bitwise_or_(0x3FF0000000000000).view(torch.float64).sub_(1.0)
    if dtype == torch.float16:  # 16 random bits, 10 mantissa bits
        b = _xor(y0, y1).bitwise_and_(0xFFFF).bitwise_right_shift_(6).bitwise_or_(0x3C00)
        return b.to(torch.int16).view(torch.float16).sub_(1.0)
    # bfloat16: JAX draws 8 bits for its 7 mantissa bits
    b = _xor(y0, y1).bitwise_and_(0xFF).bitwise_right_shift_(1).bitwise_or_(0x3F80)
    return b.to(torch.int16).view(torch.bfloat16).sub_(1.0)
