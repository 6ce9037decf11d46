"""Keyed, resumable batches: the batch of step ``i`` is a pure function of ``i``."""

from __future__ import annotations

from typing import Any

import optree
import torch

__all__ = ["Batches"]


class Batches:
    """Shuffled mini-batches of in-memory arrays, addressed by step.

    ``batches(step)`` is the batch for global step ``step``: epoch
    ``e = step // len(batches)`` uses the permutation
    ``torchfn.random.permutation(fold_in(key, e), n)`` and the batch is its
    ``step % len(batches)``-th slice of ``batch_size`` rows. The position in
    the data is therefore the step number itself, so a run resumed from a
    checkpoint at step ``s`` continues with exactly the batches it would have
    seen (:func:`torchfn.fit` relies on this). The last ``n % batch_size`` rows
    of each epoch's permutation are dropped, so every batch has the same shape.

    Args:
        key: PRNG key for the shuffles.
        arrays: pytree of tensors sharing the leading dimension ``n``
            (e.g. ``(x, y)`` with ``x: (n, D)``, ``y: (n,)``).
        batch_size: rows per batch, ``1 <= batch_size <= n``.
        shuffle: ``False`` serves the rows in order every epoch.

    Example::

        >>> import torch, torchfn
        >>> data = torchfn.train.Batches(torchfn.random.key(0),
        ...                              (torch.arange(10.), torch.arange(10)), 4)
        >>> len(data), data(0)[0].shape
        (2, torch.Size([4]))
        >>> bool((data(3)[1] == data(3)[1]).all())   # same step, same batch
        True
    """

    def __init__(self, key: torch.Tensor, arrays: Any, batch_size: int, *, shuffle: bool = True):
        leaves, self._treedef = optree.tree_flatten(arrays)
        if not leaves or not all(isinstance(x, torch.Tensor) and x.ndim >= 1 for x in leaves):
            raise ValueError(
                "arrays must be a non-empty pytree of tensors with a leading dimension, got "
                f"{[type(x).__name__ for x in leaves]}"
            )
        sizes = {x.shape[0] for x in leaves}
        if len(sizes) != 1:
            raise ValueError(f"arrays must share the leading dimension, got sizes {sorted(sizes)}")
        (self.n,) = sizes
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not (
            1 <= batch_size <= self.n
        ):
            raise ValueError(f"batch_size must be an int in [1, {self.n}], got {batch_size!r}")
        if not isinstance(key, torch.Tensor):
            raise TypeError(f"key must be a torchfn.random key tensor, got {type(key).__name__}")
        self.key = key
        self.batch_size = batch_size
        self.shuffle = shuffle
        self._leaves = leaves
        self._cache: tuple[int, torch.Tensor] | None = None  # (epoch, permutation)

    def __len__(self) -> int:
        """Batches per epoch."""
        return self.n // self.batch_size

    def _order(self, epoch: int) -> torch.Tensor:
        if self._cache is None or self._cache[0] != epoch:
            from torchfn import random

            if self.shuffle:
                perm = random.permutation(random.fold_in(self.key, epoch), self.n)
            else:
                perm = torch.arange(self.n)
            self._cache = (epoch, perm.to(self._leaves[0].device))
        return self._cache[1]

    def __call__(self, step: int) -> Any:
        if isinstance(step, torch.Tensor):
            step = int(step)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        epoch, i = divmod(step, len(self))
        idx = self._order(epoch)[i * self.batch_size : (i + 1) * self.batch_size]  # (batch_size,)
        return optree.tree_unflatten(self._treedef, [x.index_select(0, idx) for x in self._leaves])

    def __repr__(self) -> str:
        return f"Batches(n={self.n}, batch_size={self.batch_size}, steps_per_epoch={len(self)})"
