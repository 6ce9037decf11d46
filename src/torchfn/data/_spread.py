"""``class_spread``: how much a conditional generator's samples vary within each class,
against the data (a mode-collapse check beside a classifier's accuracy on the samples)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["class_spread"]


def _check(name: str, x: object, labels_name: str, labels: object) -> None:
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() < 2:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"class_spread: {name} must be a float tensor (n, ...), got {got}")
    if (not isinstance(labels, Tensor) or labels.shape != x.shape[:1]
            or labels.dtype not in (torch.int64, torch.int32)):
        got = (f"{labels.dtype} tensor of shape {tuple(labels.shape)}"
               if isinstance(labels, Tensor) else type(labels).__name__)
        raise ValueError(f"class_spread: {labels_name} must be an int tensor ({x.shape[0]},), "
                         f"one label per row of {name}, got {got}")


def class_spread(samples: Tensor, labels: Tensor, data: Tensor, data_labels: Tensor) -> Tensor:
    """Mean pairwise distance between the samples of a class over that between the data
    of the class, averaged over the classes the samples have.

    About 1 when the samples vary as much as the data, near 0 when a class collapses to
    a few images (which a classifier's accuracy on the samples does not see).

    Args:
        samples: ``(n, ...)`` generated examples; ``labels: (n,)`` the class each was
            drawn for (at least two per class).
        data: ``(m, ...)`` real examples of the same shape; ``data_labels: (m,)``.

    Returns:
        A float64 scalar.

    Example::

        >>> from torchfn.data import load_digits
        >>> x, y = load_digits()                                     # (1797, 64), (1797,)
        >>> round(float(class_spread(x, y, x, y)), 6)                # the data itself
        1.0
        >>> firsts = torch.stack([x[y == c][0] for c in range(10)]).repeat_interleave(3, 0)
        >>> float(class_spread(firsts, torch.arange(10).repeat_interleave(3), x, y))
        0.0
    """
    _check("samples", samples, "labels", labels)
    _check("data", data, "data_labels", data_labels)
    if samples.shape[1:] != data.shape[1:]:
        raise ValueError(f"class_spread: samples {tuple(samples.shape)} and data "
                         f"{tuple(data.shape)} must share the shape of one example")
    ratios = []
    for c in labels.unique().tolist():
        s = samples[labels == c].flatten(1).to(torch.float64)  # (n_c, d)
        r = data[data_labels == c].flatten(1).to(torch.float64)  # (m_c, d)
        if len(s) < 2 or len(r) < 2:
            raise ValueError(f"class_spread: class {c} has {len(s)} samples and {len(r)} data "
                             f"rows; each class needs two of each")
        ratios.append(torch.pdist(s).mean() / torch.pdist(r).mean())
    return torch.stack(ratios).mean()
