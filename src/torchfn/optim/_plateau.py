"""``reduce_on_plateau``: ``ReduceLROnPlateau`` as a pure state machine.

    sched = reduce_on_plateau(1e-3, patience=5)
    plateau = sched.init()
    for epoch in ...:
        lr, plateau = sched.update(plateau, val_loss)

Feed ``lr`` to an optimizer built with ``inject_hyperparams`` (replace
``state.hyperparams["lr"]``). The state is float64/int64 0-d tensors and the
update uses ``torch.where`` only, so it compiles, vmaps and checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from torchfn.optim import _checks

__all__ = ["PlateauState", "PlateauSchedule", "reduce_on_plateau"]


class PlateauState(NamedTuple):
    lr: Tensor  # () float64, current learning rate
    best: Tensor  # () float64, best metric so far
    num_bad_epochs: Tensor  # () int64
    cooldown_counter: Tensor  # () int64


class PlateauSchedule(NamedTuple):
    init: Callable[[], PlateauState]
    update: Callable[[PlateauState, Any], tuple[Tensor, PlateauState]]


def reduce_on_plateau(
    base_lr: float,
    mode: str = "min",
    factor: float = 0.1,
    patience: int = 10,
    threshold: float = 1e-4,
    threshold_mode: str = "rel",
    cooldown: int = 0,
    min_lr: float = 0.0,
    eps: float = 1e-8,
) -> PlateauSchedule:
    """Multiply the lr by ``factor`` after ``patience`` epochs without improvement.

    Same arguments and decisions as ``torch.optim.lr_scheduler.ReduceLROnPlateau``;
    ``update(state, metric) -> (lr, state)`` returns the lr for the next epoch.

    Example:
        >>> from torchfn.optim import reduce_on_plateau
        >>> sched = reduce_on_plateau(1.0, patience=1, factor=0.5)
        >>> s = sched.init()
        >>> lrs = []
        >>> for metric in [3.0, 2.0, 2.0, 2.0]:
        ...     lr, s = sched.update(s, metric)
        ...     lrs.append(float(lr))
        >>> lrs
        [1.0, 1.0, 1.0, 0.5]
    """
    _checks.nonneg("base_lr", base_lr)
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    if threshold_mode not in ("rel", "abs"):
        raise ValueError(f"threshold_mode must be 'rel' or 'abs', got {threshold_mode!r}")
    if not 0 <= factor < 1:
        raise ValueError(f"factor must be in [0, 1), got {factor}")
    _checks.positive_int("patience", patience, 0)
    _checks.positive_int("cooldown", cooldown, 0)
    _checks.nonneg("threshold", threshold)
    _checks.nonneg("min_lr", min_lr)
    _checks.nonneg("eps", eps)

    def is_better(a: Tensor, best: Tensor) -> Tensor:
        if mode == "min" and threshold_mode == "rel":
            return a < best * (1.0 - threshold)
        if mode == "min":
            return a < best - threshold
        if threshold_mode == "rel":
            return a > best * (threshold + 1.0)
        return a > best + threshold

    def init() -> PlateauState:
        worse = float("inf") if mode == "min" else float("-inf")
        f64, i64 = torch.float64, torch.int64
        return PlateauState(
            torch.tensor(float(base_lr), dtype=f64),
            torch.tensor(worse, dtype=f64),
            torch.zeros((), dtype=i64),
            torch.zeros((), dtype=i64),
        )

    def update(state: PlateauState, metric: Any) -> tuple[Tensor, PlateauState]:
        if not isinstance(state, PlateauState):
            raise TypeError(f"state must be a PlateauState (from init), got {type(state).__name__}")
        current = torch.as_tensor(metric, dtype=torch.float64, device=state.best.device)
        if current.ndim != 0:
            raise ValueError(f"metric must be a scalar, got shape {tuple(current.shape)}")
        better = is_better(current, state.best)
        best = torch.where(better, current, state.best)
        bad = torch.where(better, 0, state.num_bad_epochs + 1)
        in_cooldown = state.cooldown_counter > 0
        cooldown_counter = state.cooldown_counter - in_cooldown.to(torch.int64)
        bad = torch.where(in_cooldown, 0, bad)
        reduce = bad > patience
        new_lr = torch.clamp(state.lr * factor, min=min_lr)
        lr = torch.where(reduce & (state.lr - new_lr > eps), new_lr, state.lr)
        cooldown_counter = torch.where(reduce, cooldown, cooldown_counter)
        bad = torch.where(reduce, 0, bad)
        return lr, PlateauState(lr, best, bad, cooldown_counter)

    return PlateauSchedule(init, update)
