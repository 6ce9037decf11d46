"""Find a batch size that fits: halve on out-of-memory and retry."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["find_batch_size", "is_out_of_memory"]

T = TypeVar("T")


def is_out_of_memory(error: BaseException) -> bool:
    """True for ``torch.OutOfMemoryError`` and allocator ``RuntimeError``s
    ("out of memory", "CUDA error: out of memory", "can't allocate memory").

    Example::

        >>> import torch
        >>> from torchfn.train import is_out_of_memory
        >>> is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
        True
        >>> is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory"))
        True
        >>> is_out_of_memory(RuntimeError("shape mismatch")), is_out_of_memory(ValueError("oom"))
        (False, False)
    """
    if isinstance(error, torch.OutOfMemoryError):
        return True
    if isinstance(error, RuntimeError):
        msg = str(error).lower()
        return "out of memory" in msg or "can't allocate memory" in msg
    return False


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def find_batch_size(
    fn: Callable[[int], T], start: int, *, min_size: int = 1
) -> tuple[int, T]:
    """Call ``fn(batch_size)``, halving ``batch_size`` after each out-of-memory.

    Starts at ``start`` and returns ``(batch_size, fn(batch_size))`` for the
    first size that ran. Other errors propagate at once; an out-of-memory at
    ``min_size`` is re-raised. Between tries, garbage is collected and the
    CUDA cache emptied so the next try sees the freed memory.

    ``fn`` should be a trial (one train step on a batch of that size, say);
    use the returned size for the run.

    Example::

        >>> def trial(b):
        ...     if b > 64:
        ...         raise torch.OutOfMemoryError("simulated")
        ...     return b * 2
        >>> find_batch_size(trial, 256)
        (64, 128)
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    for name, value in (("start", start), ("min_size", min_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if min_size > start:
        raise ValueError(f"min_size must be <= start={start}, got {min_size}")
    size = start
    while True:
        try:
            return size, fn(size)
        except Exception as error:  # noqa: BLE001 - filtered right below
            if not is_out_of_memory(error) or size <= min_size:
                raise
        _release()
        size = max(min_size, size // 2)

