"""Argument checks and small helpers shared by the samplers (messages name the
function and the argument, and say what was expected and what came)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from torchfn.core._eager import plain as _plain  # only then: out= buffers, dynamic shapes

KEY_DTYPE = torch.int32
"""dtype of a key: two uint32 words as int32 bit patterns, shape ``(2,)``."""

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


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


def _check_less(lo, hi, fn: str, lo_name: str, hi_name: str) -> None:
    if isinstance(lo, (int, float)) and isinstance(hi, (int, float)):
        bad = not lo < hi
    elif all(isinstance(v, (int, float)) or _eager_tensor(v) for v in (lo, hi)):
        bad = not bool((torch.as_tensor(lo) < torch.as_tensor(hi)).all())
    else:
        return  # traced or batched values: cannot inspect without breaking the trace
    if bad:
        raise ValueError(f"{fn}: {lo_name} must be < {hi_name}, got {lo_name}={lo}, {hi_name}={hi}")


def _scalar(value: float, dtype: torch.dtype, device) -> Tensor:
    return torch.tensor(value, dtype=dtype, device=device)


def _params_shape(fn: str, shape, dtype, device, **params) -> tuple[tuple[int, ...], dict]:
    """Params (numbers or tensors) as ``dtype`` tensors, and the output shape: ``shape``, or the
    params' broadcast shape when it is None (JAX's ``_check_broadcast_shapes``)."""
    out = {n: _param(v, fn, n, dtype, device) for n, v in params.items()}
    if shape is None:
        shape = tuple(torch.broadcast_shapes(*[v.shape for v in out.values()
                                                 if isinstance(v, Tensor)]))
    shape = _check_shape(shape, fn)
    _check_broadcast(shape, fn, **out)
    return shape, {n: v if isinstance(v, Tensor) else _scalar(v, dtype, device)
                   for n, v in out.items()}
