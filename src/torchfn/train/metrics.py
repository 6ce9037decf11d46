"""Pure metric accumulators: ``init() -> state``, ``update(state, ...) -> state``,
``compute(state) -> value``.

The state is a dict of tensors (a pytree): it can be checkpointed, summed
across workers, and carried through a loop without hidden mutation.
Definitions (and the zero-division convention, 0) follow torchmetrics:

* binary: ``preds`` are probabilities (or logits with ``logits=True``) of shape
  ``(N,)``, or hard 0/1 labels; ``target`` is 0/1 of shape ``(N,)``.
* multiclass: ``preds`` are scores ``(N, C)`` (argmax, or top-k) or labels
  ``(N,)``; ``target`` is labels ``(N,)``. With ``top_k > 1`` a sample counts as
  predicting its target when the target is among its k best scores, otherwise
  its best score (torchmetrics' rule).
* ``average="micro"`` pools the counts of all classes; ``"macro"`` averages the
  per-class scores over the classes that occur (in ``preds`` or ``target``;
  in ``target`` only for accuracy/precision/recall with ``top_k > 1``).

Example::

    >>> import torch
    >>> from torchfn.train import metrics
    >>> acc = metrics.accuracy(num_classes=3)
    >>> s = acc.init()
    >>> s = acc.update(s, torch.tensor([[2., 1, 0], [0, 3, 1]]), torch.tensor([0, 2]))
    >>> float(acc.compute(s))
    0.5
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

__all__ = ["Metric", "mean", "accuracy", "precision", "recall", "f1_score"]

State = dict[str, torch.Tensor]


class Metric(NamedTuple):
    """A pure metric: ``init() -> state``, ``update(state, *args) -> state``,
    ``compute(state) -> Tensor``."""

    init: Callable[[], State]
    update: Callable[..., State]
    compute: Callable[[State], torch.Tensor]


def _safe_divide(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    num, den = num.double(), den.double()
    return torch.where(den == 0, torch.zeros_like(num), num / torch.where(den == 0, 1, den))


def mean() -> Metric:
    """Weighted running mean of all elements passed to ``update``.

    ``update(state, values, weight=1.)``: ``values`` any shape, ``weight``
    broadcastable to it. Accumulates in float64.
    """

    def init() -> State:
        z = torch.zeros((), dtype=torch.float64)
        return {"total": z, "weight": z.clone()}

    def update(state: State, values: Any, weight: Any = 1.0) -> State:
        values = torch.as_tensor(values).double()
        w = torch.as_tensor(weight, dtype=torch.float64, device=values.device)
        w = torch.broadcast_to(w, values.shape)
        total = state["total"].to(values.device)
        return {
            "total": total + (values * w).sum(),
            "weight": state["weight"].to(values.device) + w.sum(),
        }

    def compute(state: State) -> torch.Tensor:
        return state["total"] / state["weight"]

    return Metric(init, update, compute)


def _check_classes(num_classes: int | None, top_k: int, average: str) -> None:
    if num_classes is not None and (not isinstance(num_classes, int) or num_classes < 2):
        raise ValueError(f"num_classes must be an int >= 2 or None (binary), got {num_classes!r}")
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
    if num_classes is None and top_k != 1:
        raise ValueError(f"top_k needs num_classes (multiclass), got top_k={top_k}")
    if num_classes is not None and top_k > num_classes:
        raise ValueError(f"top_k must be <= num_classes={num_classes}, got {top_k}")
    if average not in ("micro", "macro"):
        raise ValueError(f"average must be 'micro' or 'macro', got {average!r}")


def _binary_labels(preds: torch.Tensor, threshold: float, logits: bool) -> torch.Tensor:
    if preds.is_floating_point():
        p = torch.sigmoid(preds) if logits else preds
        return (p > threshold).long()
    return preds.long()


def _multiclass_labels(preds: torch.Tensor, target: torch.Tensor, top_k: int) -> torch.Tensor:
    if preds.ndim == target.ndim:  # hard labels
        if top_k != 1:
            raise ValueError(f"top_k={top_k} needs scores preds of shape (N, C), got labels")
        return preds.long()
    if preds.ndim != target.ndim + 1:
        raise ValueError(
            f"preds must be labels (N,) or scores (N, C) for target (N,), "
            f"got preds {tuple(preds.shape)} and target {tuple(target.shape)}"
        )
    if top_k == 1:
        return preds.argmax(-1)
    top = preds.topk(top_k, dim=-1).indices  # (N, k)
    hit = (top == target.unsqueeze(-1)).any(-1)
    return torch.where(hit, target, top[..., 0])


def _stat_scores(num_classes: int | None, top_k: int, threshold: float, logits: bool):
    """init/update for per-class true-positive / false-positive / false-negative counts."""
    c = 1 if num_classes is None else num_classes

    def init() -> State:
        z = torch.zeros(c, dtype=torch.int64)
        return {"tp": z, "fp": z.clone(), "fn": z.clone(), "n": torch.zeros((), dtype=torch.int64)}

    def update(state: State, preds: torch.Tensor, target: torch.Tensor) -> State:
        if preds.shape[:1] != target.shape[:1]:
            raise ValueError(
                f"preds and target must have the same batch size, got preds "
                f"{tuple(preds.shape)} and target {tuple(target.shape)}"
            )
        target = target.long().reshape(-1)
        if num_classes is None:
            if preds.shape != target.shape:
                raise ValueError(f"binary preds must have shape {tuple(target.shape)}, got "
                                 f"{tuple(preds.shape)}")
            pred = _binary_labels(preds.reshape(-1), threshold, logits)
            tp = ((pred == 1) & (target == 1)).sum().reshape(1)
            fp = ((pred == 1) & (target == 0)).sum().reshape(1)
            fn = ((pred == 0) & (target == 1)).sum().reshape(1)
        else:
            pred = _multiclass_labels(preds.reshape(len(target), *preds.shape[1:]), target, top_k)
            hit = pred == target
            tp = torch.bincount(target[hit], minlength=c)
            fp = torch.bincount(pred[~hit], minlength=c)
            fn = torch.bincount(target[~hit], minlength=c)
        dev = tp.device
        return {
            "tp": state["tp"].to(dev) + tp,
            "fp": state["fp"].to(dev) + fp,
            "fn": state["fn"].to(dev) + fn,
            "n": state["n"].to(dev) + target.numel(),
        }

    return init, update


def _reduce(score_fn, state: State, binary: bool, average: str, exclude: str) -> torch.Tensor:
    tp, fp, fn = state["tp"], state["fp"], state["fn"]
    if binary:
        return score_fn(tp, fp, fn)[0]
    if average == "micro":
        return score_fn(tp.sum(), fp.sum(), fn.sum())
    score = score_fn(tp, fp, fn)  # (C,)
    present = (tp + fn) if exclude == "target" else (tp + fp + fn)
    weights = (present > 0).double()
    return _safe_divide((weights * score).sum(), weights.sum())


def _classification(name, score_fn, num_classes, top_k, average, threshold, logits, exclude):
    _check_classes(num_classes, top_k, average)
    init, update = _stat_scores(num_classes, top_k, threshold, logits)
    if exclude == "topk":
        exclude = "target" if top_k > 1 else "any"

    def compute(state: State) -> torch.Tensor:
        return _reduce(score_fn, state, num_classes is None, average, exclude)

    compute.__name__ = name
    return Metric(init, update, compute)


def accuracy(
    num_classes: int | None = None,
    *,
    top_k: int = 1,
    average: str = "micro",
    threshold: float = 0.5,
    logits: bool = False,
) -> Metric:
    """Accuracy (top-k with ``top_k > 1``). ``num_classes=None`` is binary.

    ``update(state, preds, target)``; shapes in the module docstring.
    """
    if num_classes is None:
        _check_classes(None, top_k, average)
        init, update = _stat_scores(None, 1, threshold, logits)

        def compute(state: State) -> torch.Tensor:
            wrong = state["fp"] + state["fn"]
            return _safe_divide(state["n"] - wrong.sum(), state["n"])

        return Metric(init, update, compute)
    return _classification(
        "accuracy", lambda tp, fp, fn: _safe_divide(tp, tp + fn),
        num_classes, top_k, average, threshold, logits, "topk",
    )


def precision(
    num_classes: int | None = None,
    *,
    top_k: int = 1,
    average: str = "macro",
    threshold: float = 0.5,
    logits: bool = False,
) -> Metric:
    """Precision ``tp / (tp + fp)`` (0 where undefined). ``num_classes=None`` is binary."""
    return _classification(
        "precision", lambda tp, fp, fn: _safe_divide(tp, tp + fp),
        num_classes, top_k, average, threshold, logits, "topk",
    )


def recall(
    num_classes: int | None = None,
    *,
    top_k: int = 1,
    average: str = "macro",
    threshold: float = 0.5,
    logits: bool = False,
) -> Metric:
    """Recall ``tp / (tp + fn)`` (0 where undefined). ``num_classes=None`` is binary."""
    return _classification(
        "recall", lambda tp, fp, fn: _safe_divide(tp, tp + fn),
        num_classes, top_k, average, threshold, logits, "topk",
    )


def f1_score(
    num_classes: int | None = None,
    *,
    top_k: int = 1,
    average: str = "macro",
    threshold: float = 0.5,
    logits: bool = False,
) -> Metric:
    """F1 ``2 tp / (2 tp + fp + fn)`` (0 where undefined). ``num_classes=None`` is binary."""
    return _classification(
        "f1_score", lambda tp, fp, fn: _safe_divide(2 * tp, 2 * tp + fp + fn),
        num_classes, top_k, average, threshold, logits, "any",
    )
