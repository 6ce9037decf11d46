"""Explicit, counter-based PRNG keys: ``torchfn.random``.

A JAX-style functional random number generator on plain torch integer ops.
Randomness is a pure function of a *key*: nothing reads or advances torch's
global generator, the same key always gives the same numbers, on any device,
under ``vmap``, ``grad`` and ``torch.compile``.

The generator is Threefry-2x32 (20 rounds) with ``jax.random``'s default
*partitionable* scheme (``jax_threefry_partitionable=True``), so ``key``,
``split``, ``fold_in``, ``bits``, ``uniform``, ``bernoulli``, ``gumbel``,
``randint``, ``categorical`` and ``permutation`` give exactly JAX's bits for
the same seed; ``normal`` and ``truncated_normal`` reproduce XLA's float32
``erf_inv`` polynomial and agree with JAX to a few ulp (torch's ``log1p`` is not
XLA's); float64 follows JAX with ``jax_enable_x64`` (64 random bits per sample).

**Key format.** A key is a ``torch.int32`` tensor of shape ``(2,)`` holding the
bit patterns of JAX's two ``uint32`` key words (``key.view(torch.uint32)`` shows
``jax.random.key_data``). int32 is what the hash computes in (torch has no uint32
arithmetic), every bit pattern is a valid key, so a key never needs a value
check (no device sync). A batch of keys is ``(..., 2)``, e.g. ``split(key, n)``
is ``(n, 2)``; map over it with ``torch.func.vmap``. Treat keys as opaque.

Example::

    >>> import torch
    >>> from torchfn import random
    >>> k = random.key(0)
    >>> k_init, k_drop = random.split(k)
    >>> w = random.normal(k_init, (3, 4))            # (3, 4) float32
    >>> mask = random.bernoulli(k_drop, 0.9, (3, 4))  # (3, 4) bool
    >>> keys = random.split(k, 8)                     # (8, 2)
    >>> noise = torch.func.vmap(lambda kk: random.normal(kk, (5,)))(keys)  # (8, 5)
    >>> bool((noise[0] == random.normal(keys[0], (5,))).all())
    True
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from torchfn.core import _threefry as _tf
from torchfn.core._eager import plain as _plain  # only then: out= buffers, dynamic shapes

__all__ = [
    "key",
    "split",
    "fold_in",
    "bits",
    "uniform",
    "normal",
    "bernoulli",
    "randint",
    "permutation",
    "categorical",
    "truncated_normal",
    "gumbel",
    "choice",
    "KEY_DTYPE",
]

KEY_DTYPE = torch.int32
"""dtype of a key: two uint32 words as int32 bit patterns, shape ``(2,)``."""

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_SQRT2 = math.sqrt(2.0)
# Over several chunks the chunked eager path pays from here on (normal's finish runs per
# chunk); a draw that fits one chunk hashes in numpy (``_threefry.one_chunk``).
_FAST_MIN = 1 << 17


# --------------------------------------------------------------------------- checks


def _check_key(k: object, fn: str, name: str = "key") -> Tensor:
    if not isinstance(k, Tensor):
        raise TypeError(
            f"{fn}: {name} must be a key tensor from torchfn.random.key(seed) "
            f"(int32, shape (2,)), got {type(k).__name__}"
        )
    if k.dtype != KEY_DTYPE:
        raise TypeError(
            f"{fn}: {name} must have dtype torch.int32 (a key from torchfn.random.key), "
            f"got {k.dtype}"
        )
    if tuple(k.shape) != (2,):
        raise ValueError(
            f"{fn}: {name} must have shape (2,), got {tuple(k.shape)}; "
            "for a batch of keys use torch.func.vmap"
        )
    return k


def _check_shape(shape: object, fn: str, name: str = "shape") -> tuple[int, ...]:
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, (tuple, list, torch.Size)):
        raise TypeError(f"{fn}: {name} must be a tuple of ints, got {type(shape).__name__}")
    out = []
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, int):
            raise TypeError(f"{fn}: {name} must contain ints, got {shape!r}")
        if d < 0:
            raise ValueError(f"{fn}: {name} must be non-negative, got {tuple(shape)}")
        out.append(int(d))
    return tuple(out)


def _check_float_dtype(dtype: object, fn: str) -> torch.dtype:
    if dtype not in _FLOATS:
        raise TypeError(
            f"{fn}: dtype must be one of float32, float64, float16, bfloat16, got {dtype}"
        )
    return dtype  # type: ignore[return-value]



# a split of a CPU key into up to this many keys hashes in Python (13 us for one, ~5 us
# more per key); above, up to one chunk, in numpy (66 us for any number up to 256)
_PY_MAX = 10


def _small_cpu(t: Tensor) -> bool:
    """A plain eager CPU tensor whose few values can be read without a device sync."""
    return _plain(t) and t.device.type == "cpu" and not t.requires_grad


def _eager_tensor(t: object) -> bool:
    """A tensor whose values may be inspected here (eager, not traced, not batched)."""
    return isinstance(t, Tensor) and _plain(t) and t.device.type != "meta"


def _param(value: object, fn: str, name: str, dtype: torch.dtype, device) -> Tensor | float:
    """A float parameter (Python number or tensor), checked to be finite."""
    if isinstance(value, bool) or not isinstance(value, (int, float, Tensor)):
        raise TypeError(f"{fn}: {name} must be a float or a tensor, got {type(value).__name__}")
    if isinstance(value, Tensor):
        if not value.is_floating_point() and value.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{fn}: {name} must be a floating tensor, got {value.dtype}")
        if _eager_tensor(value) and not bool(torch.isfinite(value).all()):
            raise ValueError(f"{fn}: {name} must be finite, got {value}")
        return value.to(dtype=dtype, device=device)
    if not math.isfinite(value):
        raise ValueError(f"{fn}: {name} must be finite, got {value}")
    return float(value)


def _broadcasts_to(src: Sequence[int], dst: Sequence[int]) -> bool:
    try:
        return torch.broadcast_shapes(tuple(dst), tuple(src)) == torch.Size(dst)
    except RuntimeError:
        return False


def _check_broadcast(shape: tuple[int, ...], fn: str, **params) -> None:
    for name, p in params.items():
        if isinstance(p, Tensor):
            if not _broadcasts_to(p.shape, shape):
                raise ValueError(
                    f"{fn}: {name} of shape {tuple(p.shape)} does not broadcast to shape {shape}"
                )


# --------------------------------------------------------------------------- keys


def key(seed: int | Tensor, *, device: torch.device | str | None = None) -> Tensor:
    """A PRNG key from an integer seed, equal to ``jax.random.key_data(jax.random.key(seed))``.

    Args:
      seed: a Python int in ``[-2**63, 2**64)`` or a 0-d integer tensor. A seed
        that fits int32 gives ``[0, seed mod 2**32]`` (JAX's default 32-bit
        mode, negative seeds included); a larger one is split into its high and
        low 32-bit words, like JAX with ``jax_enable_x64`` (int64/uint64).
        int64 tensors are split the same way, smaller integer tensors give
        ``[0, seed mod 2**32]``.
      device: where the key lives (default: the seed tensor's device, else CPU).
        Every sampler computes on its key's device and gives the same bits on
        any device.

    Returns:
      key: ``(2,)`` int32.

    Example::

        >>> from torchfn import random
        >>> random.key(42)
        tensor([ 0, 42], dtype=torch.int32)
        >>> random.key(2**32 + 7).tolist()
        [1, 7]
    """
    if isinstance(seed, Tensor):
        if seed.dtype == torch.bool or seed.is_floating_point() or seed.is_complex():
            raise TypeError(f"key: seed must be an integer, got a tensor of dtype {seed.dtype}")
        if seed.dim() != 0:
            raise ValueError(
                f"key: seed must be a scalar, got shape {tuple(seed.shape)}; use torch.func.vmap"
            )
        if seed.dtype in (torch.int64, torch.uint64):
            s = seed.view(torch.int64) if seed.dtype == torch.uint64 else seed
            hi = (s >> 32).to(torch.int32)
            lo = s.to(torch.int32)
        else:
            hi = torch.zeros((), dtype=torch.int32, device=seed.device)
            lo = seed.to(torch.int64).to(torch.int32)
        return torch.stack([hi, lo]).to(device if device is not None else seed.device)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"key: seed must be an int, got {type(seed).__name__} {seed!r}")
    if not -(1 << 63) <= seed < (1 << 64):
        raise ValueError(f"key: seed must be in [-2**63, 2**64), got {seed}")
    if -(1 << 31) <= seed < (1 << 31):
        words = [0, _tf.as_i32(seed)]
    else:
        seed &= (1 << 64) - 1
        words = [_tf.as_i32(seed >> 32), _tf.as_i32(seed)]
    return torch.tensor(words, dtype=KEY_DTYPE, device=device)


def split(key: Tensor, num: int | Sequence[int] = 2) -> Tensor:
    """Split a key into ``num`` new independent keys (``jax.random.split``).

    Args:
      key: ``(2,)`` int32 key.
      num: number of keys (>= 1), or a tuple for a shaped batch of keys.

    Returns:
      keys: ``(num, 2)`` (or ``(*num, 2)``) int32. Map over it with ``vmap``.

    Example::

        >>> from torchfn import random
        >>> k1, k2 = random.split(random.key(0))
        >>> random.split(random.key(0), 3).shape
        torch.Size([3, 2])
    """
    key = _check_key(key, "split")
    if isinstance(num, bool) or not isinstance(num, (int, tuple, list, torch.Size)):
        raise TypeError(f"split: num must be an int >= 1, got {type(num).__name__} {num!r}")
    shape = _check_shape(num, "split", "num")
    if isinstance(num, int) and num < 1:
        raise ValueError(f"split: num must be >= 1, got {num}")
    n = math.prod(shape)
    if _small_cpu(key) and _tf.one_chunk(n):  # same bits as tensor ops, 5-25x faster
        k0, k1 = key.tolist()
        if n > _PY_MAX:
            y0, y1 = _tf.counter_words_np(k0, k1, n)
            return torch.stack([y0, y1], dim=-1).reshape(*shape, 2)
        words = [_tf.threefry2x32_py(k0, k1, 0, i) for i in range(n)]
        out = torch.tensor([[_tf.as_i32(a), _tf.as_i32(b)] for a, b in words], dtype=KEY_DTYPE)
        return out.reshape(*shape, 2)
    y0, y1 = _tf.counter_words(key[0], key[1], n)
    return torch.stack([y0, y1], dim=-1).reshape(*shape, 2)


def fold_in(key: Tensor, data: int | Tensor) -> Tensor:
    """A new key from ``key`` and an integer ``data`` (``jax.random.fold_in``).

    ``fold_in(key, step)`` gives one key per step of a loop, the same in a
    resumed run.

    Args:
      key: ``(2,)`` int32 key.
      data: a Python int in ``[-2**31, 2**32)`` or a 0-d integer tensor; it is
        taken modulo ``2**32`` (as ``jnp.asarray(data, 'uint32')``).

    Returns:
      key: ``(2,)`` int32.

    Example::

        >>> from torchfn import random
        >>> k = random.key(0)
        >>> ks = [random.fold_in(k, step) for step in range(3)]
        >>> bool((ks[1] == random.fold_in(k, 1)).all())
        True
    """
    key = _check_key(key, "fold_in")
    if _small_cpu(key) and (not isinstance(data, Tensor) or _small_cpu(data)):
        if isinstance(data, Tensor) and data.dim() == 0 and not (
            data.dtype == torch.bool or data.is_floating_point() or data.is_complex()
        ):
            data = int(data) & 0xFFFFFFFF  # as the tensor path's int32 cast: modulo 2**32
        if isinstance(data, int) and not isinstance(data, bool) and -(1 << 31) <= data < (1 << 32):
            k0, k1 = key.tolist()
            y0, y1 = _tf.threefry2x32_py(k0, k1, 0, data)
            return torch.tensor([_tf.as_i32(y0), _tf.as_i32(y1)], dtype=KEY_DTYPE)
    if isinstance(data, Tensor):
        if data.dtype == torch.bool or data.is_floating_point() or data.is_complex():
            raise TypeError(f"fold_in: data must be an integer, got a tensor of dtype {data.dtype}")
        if data.dim() != 0:
            raise ValueError(
                f"fold_in: data must be a scalar, got shape {tuple(data.shape)}; "
                "use torch.func.vmap for a batch"
            )
        d = data.to(device=key.device, dtype=torch.int64).to(torch.int32)
    else:
        if isinstance(data, bool) or not isinstance(data, int):
            raise TypeError(f"fold_in: data must be an int, got {type(data).__name__} {data!r}")
        if not -(1 << 31) <= data < (1 << 32):
            raise ValueError(f"fold_in: data must be in [-2**31, 2**32), got {data}")
        d = torch.tensor(_tf.as_i32(data), dtype=torch.int32, device=key.device)
    zero = torch.zeros((), dtype=torch.int32, device=key.device)
    y0, y1 = _tf.threefry2x32(key[0], key[1], zero, d)
    return torch.stack([y0, y1])


# --------------------------------------------------------------------------- bits


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


# --------------------------------------------------------------------------- floats


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


def _scalar(value: float, dtype: torch.dtype, device) -> Tensor:
    return torch.tensor(value, dtype=dtype, device=device)


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


def _check_less(lo, hi, fn: str, lo_name: str, hi_name: str) -> None:
    if isinstance(lo, (int, float)) and isinstance(hi, (int, float)):
        bad = not lo < hi
    elif all(isinstance(v, (int, float)) or _eager_tensor(v) for v in (lo, hi)):
        bad = not bool((torch.as_tensor(lo) < torch.as_tensor(hi)).all())
    else:
        return  # traced or batched values: cannot inspect without breaking the trace
    if bad:
        raise ValueError(f"{fn}: {lo_name} must be < {hi_name}, got {lo_name}={lo}, {hi_name}={hi}")


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
    lo = _scalar(_NORMAL_LO[dtype], dtype, k.device)
    # (1 - lo) rounds to 2 in every float format: u = 2 * f + lo, exactly as JAX
    scale = _scalar(1.0, dtype, k.device) - lo
    sqrt2 = _scalar(_SQRT2, dtype, k.device)

    def finish(y0, y1):
        u = _unit(y0, y1, dtype).mul_(scale).add_(lo)
        if dtype == torch.float64:
            return u.erfinv_().mul_(sqrt2)
        if dtype == torch.float32:
            return _erfinv_xla(u).mul_(sqrt2)
        return _erfinv_xla(u.float()).to(dtype).mul_(sqrt2)  # XLA upcasts f16/bf16

    return _generate(k, shape, dtype, finish)


# XLA's ErfInv32 (M. Giles, "Approximating the erfinv function", 2010), the
# float32 erf_inv behind jax.random.normal; torch.erfinv differs from it by up to
# ~60 ulp in the tails (and is ~4x slower compiled). Evaluated with FMAs as XLA.
_ERFINV_CENTRAL = (
    2.81022636e-08,
    3.43273939e-07,
    -3.5233877e-06,
    -4.39150654e-06,
    0.00021858087,
    -0.00125372503,
    -0.00417768164,
    0.246640727,
    1.50140941,
)
_ERFINV_TAIL = (
    -0.000200214257,
    0.000100950558,
    0.00134934322,
    -0.00367342844,
    0.00573950773,
    -0.0076224613,
    0.00943887047,
    1.00167406,
    2.83297682,
)


_CONSTANTS: dict[tuple, tuple[Tensor, ...]] = {}  # eager: (coeffs, dtype, device) -> 0-d


def _horner_(coeffs: tuple[float, ...], w: Tensor) -> Tensor:
    """``c0 * w**8 + ... + c8`` in float32, each step ``c + p * w`` a fused
    multiply-add (``addcmul``) like XLA's, computed in a new tensor ``p``."""
    if _plain(w):  # 0-d coefficients made once: indexing one tensor costs an op each
        at = (coeffs, w.dtype, w.device)
        if at not in _CONSTANTS:
            _CONSTANTS[at] = tuple(torch.tensor(c, dtype=w.dtype, device=w.device)
                                   for c in coeffs)
        cs = _CONSTANTS[at]
        p = torch.addcmul(cs[1], w, cs[0])
        for i in range(2, len(coeffs)):
            torch.addcmul(cs[i], p, w, out=p)
        return p
    cs = torch.tensor(coeffs, dtype=w.dtype, device=w.device)  # traced / batched / GPU
    p = torch.addcmul(cs[1], w, cs[0])
    for i in range(2, len(coeffs)):
        p = torch.addcmul(cs[i], p, w)
    return p


def _sqrt(x: Tensor) -> Tensor:
    """Correctly rounded float32 sqrt, as XLA's. torch.sqrt on CPU goes through MKL
    VML, which is not correctly rounded (~15% of inputs off by an ulp) and whose
    threading can stall for milliseconds per call; rsqrt plus a Newton step in
    float64 is exact. Compiled and GPU code have an exact sqrt already."""
    if torch.compiler.is_compiling() or x.device.type != "cpu":
        return torch.sqrt(x)
    xd = x.double().clamp_min_(1e-300)
    s = xd * torch.rsqrt(xd)
    return s.add_(xd / s).mul_(0.5).float()


def _erfinv_xla(x: Tensor) -> Tensor:
    """erfinv of float32 ``x`` in (-1, 1) as XLA computes it (new tensor; ``x`` is kept)."""
    w = (x * x).neg_()
    if _plain(x) and x.device.type == "cpu":
        if _tf.serial_chunks():  # keep log1p on this thread too (see _threefry)
            for part in w.split(_tf.VML_GRAIN - 1):
                part.log1p_()
        else:
            w.log1p_()
        w.neg_()  # -log(1 - x^2) >= 0
        tail = w >= 5.0  # |x| > 0.9966: ~0.3% of normal samples
        w_tail = w[tail]
        p = _horner_(_ERFINV_CENTRAL, w.sub_(2.5))
        if w_tail.numel():
            p[tail] = _horner_(_ERFINV_TAIL, _sqrt(w_tail).sub_(3.0))
    else:  # traced / batched / GPU: no data-dependent shapes
        w = w.log1p().neg()
        p = torch.where(
            w < 5.0, _horner_(_ERFINV_CENTRAL, w - 2.5), _horner_(_ERFINV_TAIL, _sqrt(w) - 3.0)
        )
    return p.mul_(x)


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


# --------------------------------------------------------------------------- discrete


def bernoulli(
    key: Tensor, p: float | Tensor = 0.5, shape: int | Sequence[int] | None = None
) -> Tensor:
    """Boolean samples that are True with probability ``p`` (``jax.random.bernoulli``).

    Args:
      key: ``(2,)`` int32 key.
      p: probability in ``[0, 1]``, a float (drawn in float32) or a float tensor
        (drawn in its dtype) broadcastable to ``shape``.
      shape: output shape; default ``p.shape`` (``()`` for a float).

    Returns:
      mask: ``shape`` bool tensor, ``uniform(key, shape, p.dtype) < p``.

    Example::

        >>> from torchfn import random
        >>> m = random.bernoulli(random.key(0), 0.25, (10_000,))
        >>> abs(float(m.float().mean()) - 0.25) < 0.02
        True
    """
    k = _check_key(key, "bernoulli")
    if isinstance(p, bool) or not isinstance(p, (int, float, Tensor)):
        raise TypeError(f"bernoulli: p must be a float or a float tensor, got {type(p).__name__}")
    if isinstance(p, Tensor):
        if not p.is_floating_point():
            raise TypeError(f"bernoulli: p must be a floating tensor, got {p.dtype}")
        if _eager_tensor(p) and not bool(((p >= 0) & (p <= 1)).all()):
            raise ValueError(f"bernoulli: p must be in [0, 1], got {p}")
        dtype = p.dtype
        p = p.to(k.device)
        if shape is None:
            shape = tuple(p.shape)
    else:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"bernoulli: p must be in [0, 1], got {p}")
        dtype = torch.float32
        if shape is None:
            shape = ()
    shape = _check_shape(shape, "bernoulli")
    _check_broadcast(shape, "bernoulli", p=p)
    if isinstance(p, Tensor):
        return _generate(k, shape, dtype, lambda y0, y1: _unit(y0, y1, dtype)) < p
    p_t = _scalar(p, dtype, k.device)
    return _generate(k, shape, torch.bool, lambda y0, y1: _unit(y0, y1, dtype) < p_t)


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


def _shuffle_index(k: Tensor, n: int) -> Tensor:
    """JAX's ``_shuffle`` of ``arange(n)``: sorts by fresh 32-bit keys, 1 round per
    ~1600 elements' worth of collision risk (ceil(3 ln n / ln(2**32 - 1)) rounds)."""
    rounds = math.ceil(3 * math.log(max(1, n)) / math.log(2**32 - 1))
    idx = torch.arange(n, device=k.device)
    for _ in range(rounds):
        k, sub = split(k)
        sort_keys = _random_bits(sub, 32, (n,)) ^ (-(1 << 31))  # unsigned order as signed
        perm = torch.sort(sort_keys, stable=True).indices
        idx = idx.index_select(0, perm)
    return idx


def permutation(key: Tensor, x: int | Tensor) -> Tensor:
    """A random permutation of ``arange(x)``, or of ``x``'s rows (``jax.random.permutation``).

    Args:
      key: ``(2,)`` int32 key.
      x: an int ``n >= 0`` or a tensor with at least one dimension.

    Returns:
      ``(n,)`` int64 permutation, or ``x`` with its rows shuffled.

    Example::

        >>> from torchfn import random
        >>> p = random.permutation(random.key(0), 5)
        >>> sorted(p.tolist())
        [0, 1, 2, 3, 4]
    """
    k = _check_key(key, "permutation")
    if isinstance(x, Tensor):
        if x.dim() == 0:
            raise ValueError(
                "permutation: x must be an int or a tensor with >= 1 dim, got a 0-d tensor"
            )
        return x.index_select(0, _shuffle_index(k, x.shape[0]).to(x.device))
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"permutation: x must be an int or a tensor, got {type(x).__name__} {x!r}")
    if x < 0:
        raise ValueError(f"permutation: x must be >= 0, got {x}")
    return _shuffle_index(k, x)


def categorical(
    key: Tensor,
    logits: Tensor,
    axis: int = -1,
    shape: int | Sequence[int] | None = None,
) -> Tensor:
    """Sample category indices from unnormalized log-probabilities (Gumbel-max, as JAX).

    Args:
      key: ``(2,)`` int32 key.
      logits: ``(..., K, ...)`` float tensor; ``axis`` indexes the categories.
        ``-inf`` marks impossible categories.
      axis: the category axis.
      shape: output shape, ``(*prefix, *batch)`` where ``batch`` is
        ``logits.shape`` without ``axis``; default ``batch``.

    Returns:
      idx: ``shape`` int64 tensor of category indices.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> logits = torch.log(torch.tensor([0.1, 0.2, 0.7]))
        >>> s = random.categorical(random.key(0), logits, shape=(5000,))
        >>> abs(float((s == 2).float().mean()) - 0.7) < 0.03
        True
    """
    k = _check_key(key, "categorical")
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        got = logits.dtype if isinstance(logits, Tensor) else type(logits).__name__
        raise TypeError(f"categorical: logits must be a float tensor, got {got}")
    if logits.dim() == 0:
        raise ValueError("categorical: logits must have at least 1 dim, got a 0-d tensor")
    if (
        isinstance(axis, bool)
        or not isinstance(axis, int)
        or not -logits.dim() <= axis < logits.dim()
    ):
        raise ValueError(
            f"categorical: axis must be an int in [-{logits.dim()}, {logits.dim()}), got {axis}"
        )
    axis = axis % logits.dim()
    batch = tuple(logits.shape[:axis]) + tuple(logits.shape[axis + 1 :])
    shape = batch if shape is None else _check_shape(shape, "categorical")
    if len(shape) < len(batch) or not _broadcasts_to(batch, shape):
        raise ValueError(f"categorical: shape must end with the batch shape {batch}, got {shape}")
    prefix = shape[: len(shape) - len(batch)]
    rest = list(shape[len(shape) - len(batch) :])
    rest.insert(axis, logits.shape[axis])
    g = gumbel(k, (*prefix, *rest), logits.dtype)
    logits = logits.to(k.device).reshape((1,) * len(prefix) + tuple(logits.shape))
    return torch.argmax(g + logits, dim=len(prefix) + axis)


def choice(
    key: Tensor,
    a: int | Tensor,
    shape: int | Sequence[int] = (),
    replace: bool = True,
    p: Tensor | None = None,
) -> Tensor:
    """Draw from ``arange(a)`` or from the rows of ``a`` (``jax.random.choice``, axis 0).

    Args:
      key: ``(2,)`` int32 key.
      a: an int ``n > 0`` or a tensor ``(n, ...)``.
      shape: number (shape) of draws.
      replace: draw with replacement (default) or without.
      p: optional ``(n,)`` float tensor of non-negative weights (normalized here).

    Returns:
      ``shape`` int64 indices, or ``(*shape, ...)`` rows of ``a``. Matches JAX's
      bits with its default int32 index draws.

    Example::

        >>> from torchfn import random
        >>> random.choice(random.key(0), 10, (3,), replace=False).unique().numel()
        3
    """
    k = _check_key(key, "choice")
    shape = _check_shape(shape, "choice")
    if isinstance(a, Tensor):
        if a.dim() == 0:
            raise ValueError("choice: a must be an int or a tensor with >= 1 dim, got a 0-d tensor")
        n = a.shape[0]
    elif isinstance(a, bool) or not isinstance(a, int):
        raise TypeError(f"choice: a must be an int or a tensor, got {type(a).__name__} {a!r}")
    else:
        n = a
    if not isinstance(replace, bool):
        raise TypeError(f"choice: replace must be a bool, got {type(replace).__name__}")
    draws = math.prod(shape)
    tail = tuple(a.shape[1:]) if isinstance(a, Tensor) else ()
    if draws == 0:
        dtype = a.dtype if isinstance(a, Tensor) else torch.int64
        return torch.zeros(shape + tail, dtype=dtype, device=k.device)
    if n <= 0:
        raise ValueError(f"choice: a must be > 0 (or have rows) to draw from, got {n}")
    if not replace and draws > n:
        raise ValueError(f"choice: cannot draw {draws} samples without replacement from {n}")
    if p is None:
        if replace:
            ind = randint(k, shape, 0, n, torch.int32).long()
        else:
            ind = _shuffle_index(k, n)[:draws]
    else:
        if not isinstance(p, Tensor) or not p.is_floating_point():
            got = p.dtype if isinstance(p, Tensor) else type(p).__name__
            raise TypeError(f"choice: p must be a float tensor, got {got}")
        if tuple(p.shape) != (n,):
            raise ValueError(f"choice: p must have shape ({n},), got {tuple(p.shape)}")
        if _eager_tensor(p) and not bool((p >= 0).all() & (p.sum() > 0)):
            raise ValueError(f"choice: p must be non-negative with a positive sum, got {p}")
        p = p.to(k.device)
        if replace:
            cum = torch.cumsum(p, 0)
            r = cum[-1] * (1 - uniform(k, shape, p.dtype))
            ind = torch.searchsorted(cum, r.reshape(-1)).reshape(shape)
        else:
            g = gumbel(k, (n,), p.dtype) + torch.log(p)
            ind = torch.topk(g, draws).indices
    if isinstance(a, Tensor):
        return a.index_select(0, ind.reshape(-1).to(a.device)).reshape(shape + tail)
    return ind.reshape(shape)
