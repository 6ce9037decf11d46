"""Per-step Gaussian noise for samplers, drawn from a key in blocks of steps.

One ``random.normal`` call costs far more in fixed overhead than per element at the
sizes samplers use, so the noise of ``block`` consecutive steps is drawn at once:
step ``i`` gets ``normal(fold_in(key, i // block), (n, *shape))[i % block]``. ``block``
depends only on ``shape`` (about ``2**22`` elements per draw), and a draw of ``n`` steps is
a prefix of a longer one, so a run of ``k`` steps reproduces the first ``k`` steps of a
longer run with the same key.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from torchfn import random

_BLOCK_ELEMS = 2**22


class NoiseStream:
    """``stream(i) -> (shape)``, standard normal noise of step ``i`` in ``[0, steps)``."""

    def __init__(
        self, key: Tensor, shape: tuple[int, ...], steps: int, dtype: torch.dtype, device
    ) -> None:
        self.key, self.shape, self.steps = key, tuple(shape), steps
        self.dtype, self.device = dtype, device
        self.block = max(1, _BLOCK_ELEMS // max(1, math.prod(self.shape)))
        self._index = -1
        self._buf: Tensor | None = None

    def __call__(self, i: int) -> Tensor:
        b, r = divmod(i, self.block)
        if b != self._index:
            n = min(self.block, self.steps - b * self.block)
            k = random.fold_in(self.key, b)
            buf = random.normal(k, (n, *self.shape), dtype=self.dtype)  # (n, *shape)
            self._buf = buf if self.device is None else buf.to(self.device)
            self._index = b
        return self._buf[r]
