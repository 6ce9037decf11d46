"""Classification losses: cross entropy (hard or soft labels, label smoothing), binary
cross entropy on logits, accuracy. Classes live on the LAST dim, so the same call works
on one example ``(C,)`` (batch it with ``vmap``) and on a batch ``(B, C)``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["cross_entropy", "binary_cross_entropy_with_logits", "accuracy"]

_REDUCTIONS = ("mean", "sum", "none")


def _check_reduction(reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")


def _reduce(x: Tensor, reduction: str) -> Tensor:
    if reduction == "mean":
        return x.mean()
    if reduction == "sum":
        return x.sum()
    return x


def _check_float(name: str, x: object) -> Tensor:
    if not isinstance(x, Tensor) or not x.dtype.is_floating_point:
        got = x.dtype if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"{name} must be a floating-point Tensor, got {got}")
    return x


def _inspectable(t: Tensor) -> bool:
    """Eager, not inside a torch.func transform or torch.compile: values may be read."""
    return not (
        torch.compiler.is_compiling() or torch._C._functorch.is_functorch_wrapped_tensor(t)
    )


def _check_class_labels(logits: Tensor, labels: Tensor,
                        want: str = "integer class indices") -> None:
    """``labels`` are integer class indices ``(...)`` in ``[0, C)`` for ``logits (..., C)``
    (``want`` says what the caller accepts, for the error)."""
    if not isinstance(labels, Tensor):
        raise TypeError(f"labels must be a Tensor, got {type(labels).__name__}")
    if labels.dtype in (torch.bool, torch.complex64, torch.complex128) or \
            labels.dtype.is_floating_point:
        raise TypeError(f"labels must be {want}, got {labels.dtype}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels: integer labels must have shape logits.shape[:-1] = "
            f"{tuple(logits.shape[:-1])}, got {tuple(labels.shape)}"
        )
    num_classes = logits.shape[-1]
    if _inspectable(labels) and labels.numel():
        lo, hi = int(labels.min()), int(labels.max())
        if lo < 0 or hi >= num_classes:
            raise ValueError(f"labels must be in [0, {num_classes}), got values in [{lo}, {hi}]")


def cross_entropy(
    logits: Tensor,
    labels: Tensor,
    *,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> Tensor:
    """Softmax cross entropy, equal to ``F.cross_entropy`` with classes moved last.

    ``loss = (1 - s) * (-log p[y]) + s * mean_c(-log p[c])`` for integer labels
    (torch's label-smoothing convention); for soft labels ``q`` (probabilities over
    the classes) ``loss = -sum_c q'_c log p[c]`` with ``q' = (1 - s) q + s / C``.

    Args:
        logits: ``(..., C)`` unnormalised scores, e.g. ``(B, C)`` or one example ``(C,)``.
        labels: ``(...)`` integer class indices in ``[0, C)``, or ``(..., C)`` float
            probabilities (soft labels).
        label_smoothing: ``s`` in ``[0, 1]``.
        reduction: ``"mean"`` (over ``...``), ``"sum"`` or ``"none"`` (shape ``(...)``).

    Example::

        >>> logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0]])   # (B=2, C=3)
        >>> loss = cross_entropy(logits, torch.tensor([0, 1]), label_smoothing=0.1)
        >>> bool(torch.isclose(loss, F.cross_entropy(logits, torch.tensor([0, 1]),
        ...                                          label_smoothing=0.1)))
        True
    """
    _check_float("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape (..., C) with C >= 1, got {tuple(logits.shape)}")
    if not isinstance(labels, Tensor):
        raise TypeError(f"labels must be a Tensor, got {type(labels).__name__}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    _check_reduction(reduction)
    num_classes = logits.shape[-1]
    logp = F.log_softmax(logits, dim=-1)  # (..., C)
    if labels.dtype.is_floating_point:
        if labels.shape != logits.shape:
            raise ValueError(
                "labels: soft (float) labels must have logits' shape "
                f"{tuple(logits.shape)}, got {tuple(labels.shape)}"
            )
        target = labels.to(logp.dtype)
        if label_smoothing:
            target = (1 - label_smoothing) * target + label_smoothing / num_classes
        return _reduce(-(target * logp).sum(-1), reduction)
    _check_class_labels(logits, labels, "integer class indices or float probabilities")
    nll = -logp.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)  # (...)
    if label_smoothing:
        nll = (1 - label_smoothing) * nll - label_smoothing * logp.mean(-1)
    return _reduce(nll, reduction)


def binary_cross_entropy_with_logits(
    logits: Tensor,
    targets: Tensor,
    *,
    pos_weight: Tensor | float | None = None,
    reduction: str = "mean",
) -> Tensor:
    """Sigmoid cross entropy on logits, equal to ``F.binary_cross_entropy_with_logits``.

    ``loss = -(w_pos * y * log sigmoid(x) + (1 - y) * log(1 - sigmoid(x)))``, computed
    stably as ``(1 - y) x + (1 + (w_pos - 1) y) softplus(-x)``.

    Args:
        logits: ``(...)`` any shape.
        targets: ``(...)`` same shape, values in ``[0, 1]``.
        pos_weight: weight of the positive term, broadcast over the last dim(s).
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.

    Example::

        >>> x, y = torch.tensor([1.5, -0.3]), torch.tensor([1.0, 0.0])
        >>> bool(torch.isclose(binary_cross_entropy_with_logits(x, y),
        ...                    F.binary_cross_entropy_with_logits(x, y)))
        True
    """
    _check_float("logits", logits)
    _check_float("targets", targets)
    if targets.shape != logits.shape:
        raise ValueError(
            f"targets must have logits' shape {tuple(logits.shape)}, got {tuple(targets.shape)}"
        )
    _check_reduction(reduction)
    softplus_neg = F.softplus(-logits)  # -log sigmoid(x)
    if pos_weight is None:
        loss = (1 - targets) * logits + softplus_neg
    else:
        loss = (1 - targets) * logits + (1 + (pos_weight - 1) * targets) * softplus_neg
    return _reduce(loss, reduction)


def accuracy(logits: Tensor, labels: Tensor) -> Tensor:
    """Fraction of correct predictions, a 0-d float tensor (no gradient).

    * multiclass: ``logits (..., C)``, integer ``labels (...)``: ``argmax == label``;
    * binary: ``logits (...)`` and ``labels`` of the same shape (0/1 or bool):
      ``(logits > 0) == label``.

    Example::

        >>> accuracy(torch.tensor([[2.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 0]))
        tensor(0.5000)
    """
    _check_float("logits", logits)
    if not isinstance(labels, Tensor):
        raise TypeError(f"labels must be a Tensor, got {type(labels).__name__}")
    with torch.no_grad():
        if labels.shape == logits.shape:
            correct = (logits > 0) == (labels > 0.5)
        elif labels.shape == logits.shape[:-1] and not labels.dtype.is_floating_point:
            correct = logits.argmax(-1) == labels
        else:
            raise ValueError(
                "labels must have shape logits.shape[:-1] (integer classes) or logits' shape "
                f"(binary), got labels {tuple(labels.shape)} for logits {tuple(logits.shape)}"
            )
        return correct.to(logits.dtype).mean()
