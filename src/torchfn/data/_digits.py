"""The 8x8 handwritten digits (UCI "Optical Recognition of Handwritten Digits").

1797 images of 8x8 pixels with integer intensities 0..16 and labels 0..9, the
copy shipped by scikit-learn as ``sklearn/datasets/data/digits.csv.gz``
(BSD-3-Clause; data by E. Alpaydin and C. Kaynak, UCI ML repository),
embedded here unchanged (57 kB) so examples and tests run offline::

    >>> from torchfn import random
    >>> from torchfn.data import load_digits, train_test_split
    >>> x, y = load_digits()                  # x: (1797, 64) in [0, 1], y: (1797,)
    >>> (x_tr, y_tr), (x_te, y_te) = train_test_split(random.key(0), x, y, test_fraction=0.2)
    >>> x_tr.shape, x_te.shape
    (torch.Size([1438, 64]), torch.Size([359, 64]))
"""

from __future__ import annotations

import functools
import gzip
from importlib import resources

import numpy as np
import torch

from torchfn import random

__all__ = ["load_digits", "train_test_split"]

_N, _D = 1797, 64


@functools.lru_cache(maxsize=1)
def _raw() -> np.ndarray:
    with resources.files("torchfn.data").joinpath("digits.csv.gz").open("rb") as f:
        text = gzip.decompress(f.read()).decode("ascii")
    table = np.loadtxt(text.splitlines(), delimiter=",", dtype=np.int64)  # (1797, 65)
    if table.shape != (_N, _D + 1):
        raise RuntimeError(f"digits.csv.gz is corrupt: expected shape {(_N, _D + 1)}, "
                           f"got {table.shape}")
    table.setflags(write=False)
    return table


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1797 digits, in the file's order.

    Returns:
        ``x: (1797, 64)`` float32 in [0, 1] (pixel / 16, row-major 8x8) and
        ``y: (1797,)`` int64 labels 0..9. Fresh tensors on every call.

    Example::

        >>> from torchfn.data import load_digits
        >>> x, y = load_digits()                       # x: (N, 64), y: (N,)
        >>> x.shape, x.dtype, y.shape, y.dtype
        (torch.Size([1797, 64]), torch.float32, torch.Size([1797]), torch.int64)
        >>> float(x.min()), float(x.max()), sorted(set(y.tolist())) == list(range(10))
        (0.0, 1.0, True)
        >>> x[0].reshape(8, 8).shape                   # one 8x8 image, row-major
        torch.Size([8, 8])
    """
    table = _raw()
    x = torch.from_numpy(table[:, :_D].astype(np.float32) / 16.0)  # (N, 64)
    y = torch.from_numpy(table[:, _D].copy())  # (N,)
    return x, y


def train_test_split(
    key: torch.Tensor, *arrays: torch.Tensor, test_fraction: float = 0.2
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Split arrays with the same leading size into train and test parts by a keyed shuffle.

    Args:
        key: PRNG key; the same key gives the same split.
        *arrays: tensors ``(N, ...)``.
        test_fraction: fraction in (0, 1) for the test part, ``round(N * f)``
            examples (at least 1, and at least 1 left for training).

    Returns:
        ``(train, test)``, each a tuple with one tensor per input array.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> from torchfn.data import train_test_split
        >>> x, y = torch.arange(20.0).reshape(10, 2), torch.arange(10)   # (N, 2), (N,)
        >>> (x_tr, y_tr), (x_te, y_te) = train_test_split(random.key(0), x, y, test_fraction=0.3)
        >>> x_tr.shape, x_te.shape
        (torch.Size([7, 2]), torch.Size([3, 2]))
        >>> sorted(y_tr.tolist() + y_te.tolist()) == list(range(10))     # a partition
        True
        >>> bool(torch.equal(x_te[:, 0], 2.0 * y_te))                    # rows stay paired
        True
    """
    if not arrays:
        raise ValueError("train_test_split needs at least one array")
    if not isinstance(test_fraction, float) or not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be a float in (0, 1), got {test_fraction!r}")
    n = arrays[0].shape[0] if arrays[0].ndim else 0
    for i, a in enumerate(arrays):
        if a.ndim == 0 or a.shape[0] != n:
            raise ValueError(
                f"all arrays must share the leading size {n}: array {i} has shape {tuple(a.shape)}"
            )
    if n < 2:
        raise ValueError(f"need at least 2 examples to split, got {n}")
    n_test = min(max(1, round(n * test_fraction)), n - 1)
    perm = random.permutation(key, n).to(arrays[0].device)  # (N,)
    test_idx, train_idx = perm[:n_test], perm[n_test:]
    return tuple(a[train_idx] for a in arrays), tuple(a[test_idx] for a in arrays)
