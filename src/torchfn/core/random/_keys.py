"""Keys: ``key`` from a seed, ``split`` into many, ``fold_in`` an integer."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from torchfn.core import _threefry as _tf
from torchfn.core.random._checks import KEY_DTYPE, _check_key, _check_shape, _small_cpu

# a split of a CPU key into up to this many keys hashes in Python (13 us for one, ~5 us
# more per key); above, up to one chunk, in numpy (66 us for any number up to 256)
_PY_MAX = 10


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
