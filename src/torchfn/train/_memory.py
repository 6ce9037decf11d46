"""Peak tensor memory of a block of code, on any device (CPU included).

PyTorch exposes allocator statistics only for CUDA, and ``tracemalloc`` does
not see tensor allocations. ``PeakMemory`` is a ``TorchDispatchMode`` that
sees every tensor an op creates (autograd's backward included), counts each
new storage once and uncounts it when the storage is freed (a weak-reference
finalizer), so ``peak`` is the high-water mark of tensor bytes allocated inside
the block and still alive, on top of what existed before it.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["PeakMemory"]


class PeakMemory(TorchDispatchMode):
    """Context manager measuring tensor bytes allocated inside it.

    Attributes: ``peak`` (high-water mark, bytes) and ``current`` (bytes
    allocated inside the block and still alive); ``reset_peak()`` restarts the
    high-water mark from ``current``. Tensors that existed before
    the block are not counted; outputs that alias an input (views, in-place
    ops) are not new memory. Eager code only (not inside ``torch.compile``).

    Example::

        >>> import torch
        >>> from torchfn.train import PeakMemory
        >>> with PeakMemory() as mem:
        ...     x = torch.ones(1000)          # 4000 bytes
        ...     y = x * 2                     # 4000 more
        ...     del x
        >>> mem.peak, mem.current
        (8000, 4000)
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def reset_peak(self) -> None:
        """Restart the high-water mark from the bytes alive now."""
        self.peak = self.current

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {
            t.untyped_storage()._cdata
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue  # meta tensors hold no memory
            storage = t.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self._live:
                continue
            nbytes = storage.nbytes()
            self._live[key] = nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._free, key)
        return out
