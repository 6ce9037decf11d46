"""Continuous samplers: ``uniform``, ``normal``, ``truncated_normal``, ``gumbel``."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from torchfn.core.random._bits import _generate, _unit
from torchfn.core.random._checks import (
    _check_broadcast,
    _check_float_dtype,
    _check_key,
    _check_less,
    _check_shape,
    _param,
    _scalar,
)
from torchfn.core.random._erfinv import _erfinv_xla

_SQRT2 = math.sqrt(2.0)


def uniform(
    key: Tensor,
    shape: int | Sequence[int] = (),
    dtype: torch.dtype = torch.float32,
    minval: float | Tensor = 0.0,
    maxval: float | Tensor = 1.0,
) -> Tensor:
    """Uniform floats in ``[minval, maxval)``, bit-exact with ``jax.random.uniform``.

    Args:
      key: ``(2,)`` int32 key.
      shape: output shape.
      dtype: float32 (default), float64 (53-bit, from 64 random bits as JAX
        with x64), float16 or bfloat16.
      minval, maxval: floats or tensors broadcastable to ``shape``,
        ``minval < maxval``. Gradients flow to tensor bounds, never to the noise.

    Returns:
      u: ``shape`` tensor of ``dtype``.

    Example::

        >>> from torchfn import random
        >>> u = random.uniform(random.key(0), (2, 3), minval=-1.0, maxval=1.0)
        >>> bool(((u >= -1) & (u < 1)).all())
        True
    """
    k = _check_key(key, "uniform")
    shape = _check_shape(shape, "uniform")
    dtype = _check_float_dtype(dtype, "uniform")
    lo = _param(minval, "uniform", "minval", dtype, k.device)
    hi = _param(maxval, "uniform", "maxval", dtype, k.device)
    _check_broadcast(shape, "uniform", minval=lo, maxval=hi)
    _check_less(lo, hi, "uniform", "minval", "maxval")
    f = _generate(k, shape, dtype, lambda y0, y1: _unit(y0, y1, dtype))  # [0, 1)
    if isinstance(lo, float) and isinstance(hi, float) and lo == 0.0 and hi == 1.0:
        return f
    lo_t = lo if isinstance(lo, Tensor) else _scalar(lo, dtype, k.device)
    hi_t = hi if isinstance(hi, Tensor) else _scalar(hi, dtype, k.device)
    return torch.maximum(_fma(f, hi_t - lo_t, lo_t), lo_t)  # as JAX: max(minval, f*span+minval)


def _fma(f: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    """``f * scale + shift`` rounded once, as XLA's fused multiply-add (JAX on CPU/GPU).

    The product of two float32 (float16) numbers is exact in float64 (float32), so
    computing there and rounding back matches a true FMA except in double-rounding
    ties (probability about 2**-29 per float32 sample). float64 uses plain ops.
    """
    wide = {
        torch.float32: torch.float64,
        torch.float16: torch.float32,
        torch.bfloat16: torch.float32,
    }.get(f.dtype)
    if wide is None or (wide == torch.float64 and f.device.type == "mps"):  # MPS: no float64
        return f * scale + shift
    return (f.to(wide) * scale.to(wide) + shift.to(wide)).to(f.dtype)


_NORMAL_LO = {
    torch.float32: -1.0 + 2.0**-24,
    torch.float64: -1.0 + 2.0**-53,
    torch.float16: -1.0 + 2.0**-11,
    torch.bfloat16: -1.0 + 2.0**-8,
}


def normal(
    key: Tensor, shape: int | Sequence[int] = (), dtype: torch.dtype = torch.float32
) -> Tensor:
    """Standard normal samples, as ``jax.random.normal``.

    ``sqrt(2) * erfinv(u)`` with ``u`` uniform in ``(-1, 1)`` from JAX's bits and
    XLA's float32 ``erf_inv`` polynomial: within 3 ulp of JAX, ~99% bit-identical
    (the gap is torch's ``log1p`` vs XLA's). float64 uses ``torch.erfinv``.

    Args:
      key: ``(2,)`` int32 key.
      shape: output shape.
      dtype: float32 (default), float64, float16 or bfloat16 (the last two
        computed in float32 from ``u`` drawn in ``dtype``).

    Returns:
      z: ``shape`` tensor of ``dtype``.

    Example::

        >>> from torchfn import random
        >>> z = random.normal(random.key(0), (10_000,))
        >>> abs(float(z.mean())) < 0.05 and abs(float(z.std()) - 1) < 0.05
        True
    """
    k = _check_key(key, "normal")
    shape = _check_shape(shape, "normal")
    dtype = _check_float_dtype(dtype, "normal")
    return _generate(k, shape, dtype, _normal_finish(dtype, k.device))


def _normal_finish(dtype: torch.dtype, device):
    """``(y0, y1) -> normals``: the hash words to JAX's normal samples (in place)."""
    lo = _scalar(_NORMAL_LO[dtype], dtype, device)
    # (1 - lo) rounds to 2 in every float format: u = 2 * f + lo, exactly as JAX
    scale = _scalar(1.0, dtype, device) - lo
    sqrt2 = _scalar(_SQRT2, dtype, device)

    def finish(y0, y1):
        u = _unit(y0, y1, dtype).mul_(scale).add_(lo)
        if dtype == torch.float64:
            return u.erfinv_().mul_(sqrt2)
        if dtype == torch.float32:
            return _erfinv_xla(u).mul_(sqrt2)
        return _erfinv_xla(u.float()).to(dtype).mul_(sqrt2)  # XLA upcasts f16/bf16

    return finish


def truncated_normal(
    key: Tensor,
    lower: float | Tensor,
    upper: float | Tensor,
    shape: int | Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Standard normal samples truncated to ``(lower, upper)`` (``jax.random.truncated_normal``).

    Args:
      key: ``(2,)`` int32 key.
      lower, upper: floats or tensors, ``lower < upper``.
      shape: output shape; default the broadcast shape of ``lower`` and ``upper``.
      dtype: float dtype.

    Returns:
      z: ``shape`` tensor of ``dtype`` with ``lower < z < upper``.

    Example::

        >>> from torchfn import random
        >>> z = random.truncated_normal(random.key(0), -2.0, 2.0, (1000,))
        >>> bool(((z > -2) & (z < 2)).all())
        True
    """
    k = _check_key(key, "truncated_normal")
    dtype = _check_float_dtype(dtype, "truncated_normal")
    lower = _param(lower, "truncated_normal", "lower", dtype, k.device)
    upper = _param(upper, "truncated_normal", "upper", dtype, k.device)
    lo_t = lower if isinstance(lower, Tensor) else _scalar(lower, dtype, k.device)
    hi_t = upper if isinstance(upper, Tensor) else _scalar(upper, dtype, k.device)
    if shape is None:
        shape = tuple(torch.broadcast_shapes(lo_t.shape, hi_t.shape))
    shape = _check_shape(shape, "truncated_normal")
    _check_broadcast(shape, "truncated_normal", lower=lo_t, upper=hi_t)
    _check_less(lower, upper, "truncated_normal", "lower", "upper")
    sqrt2 = _scalar(_SQRT2, dtype, k.device)
    a = torch.erf(lo_t / sqrt2)
    b = torch.erf(hi_t / sqrt2)
    f = _generate(k, shape, dtype, lambda y0, y1: _unit(y0, y1, dtype))
    u = torch.maximum(_fma(f, b - a, a), a)
    if dtype == torch.float64:
        e = torch.erfinv(u)
    else:  # XLA: float32 Giles approximation, +-1 -> +-inf
        e = _erfinv_xla(u.float())
        e = torch.where(u.abs() == 1, u.float() * math.inf, e).to(dtype)
    z = sqrt2 * e
    inf = _scalar(math.inf, dtype, k.device)
    lo_c = torch.nextafter(lo_t.detach(), inf)
    hi_c = torch.nextafter(hi_t.detach(), -inf)
    return torch.minimum(torch.maximum(z, lo_c), hi_c)


def gumbel(
    key: Tensor, shape: int | Sequence[int] = (), dtype: torch.dtype = torch.float32
) -> Tensor:
    """Standard Gumbel samples ``-log(-log(u))`` (``jax.random.gumbel``, mode "low").

    Args:
      key: ``(2,)`` int32 key.
      shape: output shape.
      dtype: float dtype.

    Returns:
      g: ``shape`` tensor of ``dtype``.

    Example::

        >>> from torchfn import random
        >>> g = random.gumbel(random.key(0), (10_000,))
        >>> abs(float(g.mean()) - 0.5772) < 0.05
        True
    """
    k = _check_key(key, "gumbel")
    shape = _check_shape(shape, "gumbel")
    dtype = _check_float_dtype(dtype, "gumbel")
    tiny = _scalar(torch.finfo(dtype).tiny, dtype, k.device)
    scale = _scalar(1.0, dtype, k.device) - tiny

    def finish(y0, y1):
        u = _unit(y0, y1, dtype).mul_(scale).add_(tiny).clamp_min_(tiny)
        return u.log_().neg_().log_().neg_()

    return _generate(k, shape, dtype, finish)
