"""``randint``: JAX's two-draw modulo algorithm on int64 bit patterns."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from torchfn.core.random._bits import _random_bits
from torchfn.core.random._checks import _check_broadcast, _check_key, _check_shape, _eager_tensor
from torchfn.core.random._keys import split

_INT_DTYPES = {torch.int8: 8, torch.uint8: 8, torch.int16: 16, torch.int32: 32, torch.int64: 64}
_I64_MIN = -(1 << 63)


def _ult(a: Tensor, b: Tensor) -> Tensor:
    """Unsigned less-than of int64 bit patterns."""
    return (a ^ _I64_MIN) < (b ^ _I64_MIN)


def _urem(a: Tensor, s: Tensor, nbits: int) -> Tensor:
    """``a mod s`` for unsigned ``nbits``-wide values (int64 bit patterns); ``a mod 0 = a``."""
    zero = s == 0
    if nbits < 64:  # values are non-negative int64
        return torch.where(zero, a, torch.remainder(a, torch.where(zero, 1, s)))
    big = s < 0  # s >= 2**63: a mod s is a or a - s
    r_big = torch.where(_ult(a, s), a, a - s)
    s_small = torch.where(big | zero, 1, s)
    h = (a >> 1) & ((1 << 63) - 1)  # logical shift: a = 2h + (a & 1)
    r2 = torch.remainder(h, s_small) * 2 + (a & 1)  # < 2s, exact as uint64
    r_small = torch.where(_ult(r2, s_small), r2, r2 - s_small)
    return torch.where(zero, a, torch.where(big, r_big, r_small))


def _int_bound(value: object, fn: str, name: str, device) -> Tensor:
    if isinstance(value, Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{fn}: {name} must be an int or an integer tensor, got {value.dtype}")
        return value.to(device=device, dtype=torch.int64)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{fn}: {name} must be an int or an integer tensor, "
            f"got {type(value).__name__} {value!r}"
        )
    if not -(1 << 63) <= value < (1 << 63):
        raise ValueError(f"{fn}: {name} must fit int64, got {value}")
    return torch.tensor(value, dtype=torch.int64, device=device)


def randint(
    key: Tensor,
    shape: int | Sequence[int],
    minval: int | Tensor,
    maxval: int | Tensor,
    dtype: torch.dtype = torch.int64,
) -> Tensor:
    """Uniform integers in ``[minval, maxval)``, bit-exact with ``jax.random.randint``.

    JAX's algorithm: two draws of ``nbits`` (the dtype's width) combined modulo
    the span, so int32 matches default JAX and int64 matches JAX with x64.
    Bounds are clipped to the dtype's range.

    Args:
      key: ``(2,)`` int32 key.
      shape: output shape.
      minval, maxval: ints or integer tensors broadcastable to ``shape``,
        ``minval < maxval``.
      dtype: int64 (default), int32, int16, int8 or uint8.

    Returns:
      x: ``shape`` tensor of ``dtype``.

    Example::

        >>> from torchfn import random
        >>> x = random.randint(random.key(0), (1000,), 0, 10)
        >>> int(x.min()) >= 0 and int(x.max()) <= 9
        True
    """
    k = _check_key(key, "randint")
    shape = _check_shape(shape, "randint")
    if dtype not in _INT_DTYPES:
        raise TypeError(
            f"randint: dtype must be one of int8, uint8, int16, int32, int64, got {dtype}"
        )
    nbits = _INT_DTYPES[dtype]
    if (
        isinstance(minval, int)
        and isinstance(maxval, int)
        and not isinstance(minval, bool)
        and not isinstance(maxval, bool)
        and minval >= maxval
    ):
        raise ValueError(f"randint: minval must be < maxval, got minval={minval}, maxval={maxval}")
    lo = _int_bound(minval, "randint", "minval", k.device)
    hi = _int_bound(maxval, "randint", "maxval", k.device)
    _check_broadcast(shape, "randint", minval=lo, maxval=hi)
    if _eager_tensor(lo) and _eager_tensor(hi) and not bool((lo < hi).all()):
        raise ValueError(f"randint: minval must be < maxval, got minval={minval}, maxval={maxval}")
    info = torch.iinfo(dtype)
    if nbits < 32:  # JAX samples 8/16-bit dtypes as int32 (less modulo bias), then casts
        lo = lo.clamp(info.min, info.max)
        hi = hi.clamp(info.min, info.max + 1)
        nbits, info = 32, torch.iinfo(torch.int32)
    out_of_range = hi > info.max
    lo = lo.clamp(info.min, info.max)
    hi = hi.clamp(info.min, info.max)
    umask = -1 if nbits == 64 else (1 << nbits) - 1

    k1, k2 = split(k)
    hb = _random_bits(k1, nbits, shape)
    lb = _random_bits(k2, nbits, shape)
    if nbits < 64:
        hb = hb.to(torch.int64) & umask
        lb = lb.to(torch.int64) & umask
    span = (hi - lo) & umask
    span = torch.where(hi <= lo, 1, span)
    span = torch.where(out_of_range & (hi > lo), (span + 1) & umask, span)
    mult = _urem(torch.full_like(span, 1 << (nbits // 2)), span, nbits)
    mult = _urem((mult * mult) & umask, span, nbits)
    off = ((_urem(hb, span, nbits) * mult) & umask) + _urem(lb, span, nbits)
    off = _urem(off & umask, span, nbits)
    return (lo + off).to(dtype)
