"""Focal losses (Lin et al., 2017): cross entropy down-weighted by ``(1 - p_t)^gamma`` on
examples the model already gets right, for dense detection and heavy class imbalance."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from torchfn.losses._classification import (
    _check_class_labels,
    _check_float,
    _check_reduction,
    _reduce,
)

__all__ = ["sigmoid_focal_loss", "focal_loss"]


def _gamma(gamma: float) -> None:
    if not isinstance(gamma, (int, float)) or isinstance(gamma, bool) or gamma < 0:
        raise ValueError(f"gamma must be a float >= 0, got {gamma!r}")


def sigmoid_focal_loss(
    logits: Tensor,
    targets: Tensor,
    *,
    alpha: float | None = 0.25,
    gamma: float = 2.0,
    reduction: str = "mean",
) -> Tensor:
    """RetinaNet's focal loss on independent sigmoid outputs, equal to
    ``torchvision.ops.sigmoid_focal_loss`` (which defaults to ``reduction="none"``).

    With ``p = sigmoid(logits)``, ``p_t = p y + (1 - p)(1 - y)`` and
    ``alpha_t = alpha y + (1 - alpha)(1 - y)``:
    ``loss = alpha_t (1 - p_t)^gamma BCE(logits, y)``. ``gamma = 0`` and ``alpha = None``
    give plain binary cross entropy.

    Args:
        logits: ``(...)`` any shape, e.g. ``(B, anchors, classes)``.
        targets: ``(...)`` same shape, in ``[0, 1]``.
        alpha: weight of the positives in ``[0, 1]`` (negatives get ``1 - alpha``), or
            None for no weighting.
        gamma: focusing exponent ``>= 0``.
        reduction: ``"mean"`` (over all elements), ``"sum"`` or ``"none"``. RetinaNet
            divides the ``"sum"`` by the number of positive anchors.

    Example::

        >>> import torch
        >>> x, y = torch.tensor([3.0, -2.0, 0.5]), torch.tensor([1.0, 0.0, 1.0])
        >>> loss = sigmoid_focal_loss(x, y, alpha=None, gamma=0.0)
        >>> bool(torch.isclose(loss, torch.nn.functional.binary_cross_entropy_with_logits(x, y)))
        True
    """
    _check_float("logits", logits)
    _check_float("targets", targets)
    if targets.shape != logits.shape:
        raise ValueError(f"targets must have logits' shape {tuple(logits.shape)}, got "
                         f"{tuple(targets.shape)}")
    if alpha is not None and not (isinstance(alpha, (int, float)) and 0 <= alpha <= 1):
        raise ValueError(f"alpha must be in [0, 1] or None, got {alpha!r}")
    _gamma(gamma)
    _check_reduction(reduction)
    # BCE = y softplus(-x) + (1 - y) softplus(x) and 1 - p_t = y sigmoid(-x) +
    # (1 - y) sigmoid(x): no cancellation where p_t is near 1 (torch's forms cancel there)
    bce = targets * F.softplus(-logits) + (1 - targets) * F.softplus(logits)
    miss = targets * torch.sigmoid(-logits) + (1 - targets) * torch.sigmoid(logits)
    loss = bce * miss ** gamma
    if alpha is not None:
        loss = (alpha * targets + (1 - alpha) * (1 - targets)) * loss
    return _reduce(loss, reduction)


def focal_loss(
    logits: Tensor,
    labels: Tensor,
    *,
    gamma: float = 2.0,
    alpha: Tensor | None = None,
    reduction: str = "mean",
) -> Tensor:
    """Multi-class (softmax) focal loss: ``-alpha_y (1 - p_y)^gamma log p_y``.

    ``gamma = 0`` is :func:`cross_entropy` (weighted by ``alpha`` if given). Classes live
    on the last dim, as in :func:`cross_entropy`, so one example ``(C,)`` works under
    ``vmap``.

    Args:
        logits: ``(..., C)`` unnormalised scores.
        labels: ``(...)`` integer class indices in ``[0, C)``.
        gamma: focusing exponent ``>= 0``.
        alpha: ``(C,)`` per-class weights, or None.
        reduction: ``"mean"`` (over ``...``, unweighted by ``alpha``), ``"sum"`` or
            ``"none"``.

    Example::

        >>> import torch
        >>> logits, labels = torch.tensor([[4.0, 0.0], [0.0, 0.5]]), torch.tensor([0, 1])
        >>> easy, hard = focal_loss(logits, labels, reduction="none")   # the easy one shrinks
        >>> bool(easy < 1e-3 < hard)
        True
    """
    _check_float("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape (..., C) with C >= 1, got "
                         f"{tuple(logits.shape)}")
    _check_class_labels(logits, labels)
    _gamma(gamma)
    _check_reduction(reduction)
    if alpha is not None:
        _check_float("alpha", alpha)
        if alpha.shape != logits.shape[-1:]:
            raise ValueError(f"alpha must have shape ({logits.shape[-1]},) (one weight per "
                             f"class), got {tuple(alpha.shape)}")
    if logits.shape[-1] == 1:  # one class: always right (no others to logsumexp)
        return _reduce(logits.sum(-1) * 0.0, reduction)
    y = labels.long().unsqueeze(-1)  # (..., 1)
    # z = logsumexp over the other classes - the label's logit: -log p_y = softplus(z) and
    # 1 - p_y = sigmoid(z), both accurate where p_y is close to 1 (1 - p_y would cancel)
    others = logits.scatter(-1, y, float("-inf")).logsumexp(-1)  # (...)
    z = others - logits.gather(-1, y).squeeze(-1)
    loss = torch.sigmoid(z) ** gamma * F.softplus(z)
    if alpha is not None:
        loss = alpha[labels.long()] * loss
    return _reduce(loss, reduction)
