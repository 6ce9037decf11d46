"""Regression losses: mean squared error, Huber, L1. Shapes must match exactly (no
silent broadcasting, unlike ``F.mse_loss`` which only warns)."""

from __future__ import annotations

from torch import Tensor

from torchfn.losses._classification import _check_float, _check_reduction, _reduce

__all__ = ["mse", "huber", "l1"]


def _check_pair(pred: Tensor, target: Tensor, reduction: str) -> None:
    _check_float("pred", pred)
    _check_float("target", target)
    if pred.shape != target.shape:
        raise ValueError(
            f"target must have pred's shape {tuple(pred.shape)}, got {tuple(target.shape)}"
        )
    _check_reduction(reduction)


def mse(pred: Tensor, target: Tensor, *, reduction: str = "mean") -> Tensor:
    """``(pred - target)^2``, reduced; equals ``F.mse_loss``.

    Args:
        pred, target: ``(...)`` the same shape.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.

    Example::

        >>> import torch
        >>> mse(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0]))
        tensor(2.5000)
    """
    _check_pair(pred, target, reduction)
    return _reduce((pred - target).square(), reduction)


def huber(pred: Tensor, target: Tensor, *, delta: float = 1.0, reduction: str = "mean") -> Tensor:
    """Huber loss, equal to ``F.huber_loss``: ``0.5 r^2`` for ``|r| <= delta``, else
    ``delta (|r| - 0.5 delta)``, with ``r = pred - target``.

    Args:
        pred, target: ``(...)`` the same shape.
        delta: the quadratic-to-linear threshold, ``> 0``.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.

    Example::

        >>> import torch
        >>> huber(torch.tensor([0.5, 3.0]), torch.zeros(2))     # (0.125 + 2.5) / 2
        tensor(1.3125)
    """
    _check_pair(pred, target, reduction)
    if not delta > 0:
        raise ValueError(f"delta must be > 0, got {delta}")
    r = (pred - target).abs()
    quad = r.clamp(max=delta)  # |r| below delta, delta above
    return _reduce(0.5 * quad.square() + delta * (r - quad), reduction)


def l1(pred: Tensor, target: Tensor, *, reduction: str = "mean") -> Tensor:
    """``|pred - target|``, reduced; equals ``F.l1_loss``.

    Example::

        >>> import torch
        >>> l1(torch.tensor([1.0, -3.0]), torch.zeros(2))
        tensor(2.)
    """
    _check_pair(pred, target, reduction)
    return _reduce((pred - target).abs(), reduction)
