"""Learning-rate schedules: pure functions ``step -> lr``.

Each equals the matching ``torch.optim.lr_scheduler`` value after ``step`` calls
of ``scheduler.step()`` (step 0 is the first optimizer step). A Python int step
gives a Python float; a tensor step (the optimizer's counter) gives a float64
0-d tensor computed with tensor ops only, so schedules run inside
``torch.compile`` and ``vmap`` without host syncs.

    tx = adam(lr=warmup_cosine(1e-3, warmup_steps=100, total_steps=10_000))
"""

from __future__ import annotations

import bisect
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from torchfn.optim import _checks

__all__ = [
    "constant",
    "step_lr",
    "multistep_lr",
    "exponential_lr",
    "cosine_annealing",
    "cosine_warm_restarts",
    "linear_warmup",
    "warmup_cosine",
    "one_cycle",
    "scale_lr",
]

Schedule = Callable[[Any], Any]


def _step(step: Any) -> float | Tensor:
    """The step as float64 (tensor) or a Python float; rejects bad Python steps."""
    if isinstance(step, Tensor):
        return step.to(torch.float64)
    if isinstance(step, bool) or not isinstance(step, numbers.Real):
        raise TypeError(f"step must be an int or a 0-d tensor, got {step!r}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return float(step)


def _cos(x: Any) -> Any:
    return torch.cos(x) if isinstance(x, Tensor) else math.cos(x)


def _where(cond: Any, a: Any, b: Any) -> Any:
    if isinstance(cond, Tensor):
        return torch.where(cond, a, b)
    return a if cond else b


def _clamp(x: Any, lo: float, hi: float) -> Any:
    return torch.clamp(x, lo, hi) if isinstance(x, Tensor) else min(max(x, lo), hi)


def _floor_div(t: Any, d: int) -> Any:
    return torch.div(t, d, rounding_mode="floor") if isinstance(t, Tensor) else float(t // d)


def _int(name: str, value: Any, minimum: int) -> None:
    _checks.positive_int(name, value, minimum)


def constant(lr: float) -> Schedule:
    """``lr`` at every step (``LambdaLR(lambda s: 1.0)``).

    Example:
        >>> from torchfn.optim import constant
        >>> constant(0.1)(7)
        0.1
    """
    _checks.nonneg("lr", lr)

    def schedule(step: Any) -> Any:
        t = _step(step)
        return torch.full_like(t, lr) if isinstance(t, Tensor) else float(lr)

    return schedule


def step_lr(base_lr: float, step_size: int, gamma: float = 0.1) -> Schedule:
    """``base_lr * gamma ** (step // step_size)`` (``StepLR``).

    Example:
        >>> from torchfn.optim import step_lr
        >>> [step_lr(1.0, 2, 0.5)(s) for s in range(5)]
        [1.0, 1.0, 0.5, 0.5, 0.25]
    """
    _checks.nonneg("base_lr", base_lr)
    _int("step_size", step_size, 1)
    _checks.nonneg("gamma", gamma)

    def schedule(step: Any) -> Any:
        return base_lr * gamma ** _floor_div(_step(step), step_size)

    return schedule


def multistep_lr(base_lr: float, milestones: Sequence[int], gamma: float = 0.1) -> Schedule:
    """``base_lr * gamma ** (number of milestones <= step)`` (``MultiStepLR``).

    Example:
        >>> from torchfn.optim import multistep_lr
        >>> [multistep_lr(1.0, [1, 3], 0.5)(s) for s in range(4)]
        [1.0, 0.5, 0.5, 0.25]
    """
    _checks.nonneg("base_lr", base_lr)
    _checks.nonneg("gamma", gamma)
    ms = list(milestones)
    for m in ms:
        _int("milestones[i]", m, 0)
    ms.sort()

    def schedule(step: Any) -> Any:
        t = _step(step)
        if isinstance(t, Tensor):
            n = torch.zeros_like(t)
            for m in ms:
                n = n + (t >= m).to(t.dtype)
            return base_lr * gamma**n
        return base_lr * gamma ** bisect.bisect_right(ms, t)

    return schedule


def exponential_lr(base_lr: float, gamma: float) -> Schedule:
    """``base_lr * gamma ** step`` (``ExponentialLR``).

    Example:
        >>> from torchfn.optim import exponential_lr
        >>> exponential_lr(1.0, 0.5)(3)
        0.125
    """
    _checks.nonneg("base_lr", base_lr)
    _checks.nonneg("gamma", gamma)

    def schedule(step: Any) -> Any:
        return base_lr * gamma ** _step(step)

    return schedule


def cosine_annealing(base_lr: float, t_max: int, eta_min: float = 0.0) -> Schedule:
    """``eta_min + (base_lr - eta_min) (1 + cos(pi step / t_max)) / 2`` (``CosineAnnealingLR``).

    This is torch's closed form; its ``step()`` uses a recursive form that drifts
    by float rounding (about 1e-15 relative per step). Past ``t_max`` the cosine
    continues periodically, as torch.

    Example:
        >>> from torchfn.optim import cosine_annealing
        >>> cosine_annealing(1.0, 10)(5)
        0.5
    """
    _checks.nonneg("base_lr", base_lr)
    _int("t_max", t_max, 1)
    _checks.nonneg("eta_min", eta_min)

    def schedule(step: Any) -> Any:
        t = _step(step)
        return eta_min + (base_lr - eta_min) * (1 + _cos(math.pi * t / t_max)) / 2

    return schedule


def cosine_warm_restarts(
    base_lr: float, t_0: int, t_mult: int = 1, eta_min: float = 0.0
) -> Schedule:
    """Cosine annealing restarted after ``t_0``, ``t_0 t_mult``, ... steps (SGDR,
    ``CosineAnnealingWarmRestarts``).

    Example:
        >>> from torchfn.optim import cosine_warm_restarts
        >>> [round(cosine_warm_restarts(1.0, 2)(s), 3) for s in range(4)]
        [1.0, 0.5, 1.0, 0.5]
    """
    _checks.nonneg("base_lr", base_lr)
    _int("t_0", t_0, 1)
    _int("t_mult", t_mult, 1)
    _checks.nonneg("eta_min", eta_min)

    def cycle_start(n: Any) -> Any:  # first step of cycle n (t_mult > 1)
        return t_0 * (t_mult**n - 1) / (t_mult - 1)

    def schedule(step: Any) -> Any:
        t = _step(step)
        if t_mult == 1:
            t_cur = t - t_0 * _floor_div(t, t_0)
            t_i: Any = float(t_0)
        elif isinstance(t, Tensor):
            n = torch.floor(torch.log(t / t_0 * (t_mult - 1) + 1) / math.log(t_mult))
            n = torch.where(cycle_start(n) > t, n - 1, n)  # guard float log at boundaries
            n = torch.where(cycle_start(n + 1) <= t, n + 1, n)
            t_cur, t_i = t - cycle_start(n), t_0 * t_mult**n
        else:
            t_cur, t_i = t, float(t_0)
            while t_cur >= t_i:
                t_cur, t_i = t_cur - t_i, t_i * t_mult
        return eta_min + (base_lr - eta_min) * (1 + _cos(math.pi * t_cur / t_i)) / 2

    return schedule


def linear_warmup(base_lr: float, warmup_steps: int, start_lr: float = 0.0) -> Schedule:
    """Linear from ``start_lr`` at step 0 to ``base_lr`` at ``warmup_steps``, then flat
    (``LinearLR(start_factor=start_lr / base_lr, total_iters=warmup_steps)``).

    Example:
        >>> from torchfn.optim import linear_warmup
        >>> [linear_warmup(1.0, 4)(s) for s in range(6)]
        [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    """
    _checks.nonneg("base_lr", base_lr)
    _int("warmup_steps", warmup_steps, 0)
    _checks.nonneg("start_lr", start_lr)

    def schedule(step: Any) -> Any:
        frac = _clamp(_step(step) / max(warmup_steps, 1), 0.0, 1.0)
        return start_lr + (base_lr - start_lr) * frac

    return schedule


def warmup_cosine(
    base_lr: float, warmup_steps: int, total_steps: int, min_lr: float = 0.0
) -> Schedule:
    """Linear warmup from 0 to ``base_lr`` over ``warmup_steps``, then cosine decay to
    ``min_lr`` at ``total_steps`` (flat after). With ``min_lr=0`` this is the common
    ``get_cosine_schedule_with_warmup`` (transformers/diffusers).

    Example:
        >>> from torchfn.optim import warmup_cosine
        >>> [warmup_cosine(1.0, 2, 6)(s) for s in (0, 1, 2, 4, 6, 9)]
        [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    """
    _checks.nonneg("base_lr", base_lr)
    _int("warmup_steps", warmup_steps, 0)
    _int("total_steps", total_steps, 1)
    _checks.nonneg("min_lr", min_lr)
    if warmup_steps > total_steps:
        raise ValueError(
            f"warmup_steps must be <= total_steps, got warmup_steps={warmup_steps} "
            f"> total_steps={total_steps}"
        )
    decay_steps = max(total_steps - warmup_steps, 1)

    def schedule(step: Any) -> Any:
        t = _step(step)
        warm = base_lr * t / max(warmup_steps, 1)
        progress = _clamp((t - warmup_steps) / decay_steps, 0.0, 1.0)
        cos = min_lr + (base_lr - min_lr) * 0.5 * (1 + _cos(math.pi * progress))
        return _where(t < warmup_steps, warm, cos)

    return schedule


def one_cycle(
    max_lr: float,
    total_steps: int,
    pct_start: float = 0.3,
    anneal_strategy: str = "cos",
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
    three_phase: bool = False,
) -> Schedule:
    """The 1cycle policy (Smith & Topin), equal to ``OneCycleLR``'s learning rate.

    From ``max_lr / div_factor`` up to ``max_lr`` over ``pct_start`` of the steps,
    then down to ``max_lr / div_factor / final_div_factor`` (``three_phase``: down
    to the initial lr symmetrically, then to the minimum). Defined for steps
    0..total_steps, as torch.

    Example:
        >>> from torchfn.optim import one_cycle
        >>> s = one_cycle(1.0, 100)
        >>> round(s(0), 6), s(29), s(99) < 1e-4
        (0.04, 1.0, True)
    """
    _checks.nonneg("max_lr", max_lr)
    _int("total_steps", total_steps, 1)
    if not isinstance(pct_start, numbers.Real) or not 0 <= pct_start <= 1:
        raise ValueError(f"pct_start must be a float in [0, 1], got {pct_start!r}")
    if anneal_strategy not in ("cos", "linear"):
        raise ValueError(f"anneal_strategy must be 'cos' or 'linear', got {anneal_strategy!r}")
    _checks.positive("div_factor", div_factor)
    _checks.positive("final_div_factor", final_div_factor)
    initial = max_lr / div_factor
    min_lr = initial / final_div_factor
    end_up = float(pct_start * total_steps) - 1
    if three_phase:
        phases = [
            (end_up, initial, max_lr),
            (float(2 * pct_start * total_steps) - 2, max_lr, initial),
            (total_steps - 1, initial, min_lr),
        ]
    else:
        phases = [(end_up, initial, max_lr), (total_steps - 1, max_lr, min_lr)]

    def anneal(start: float, end: float, pct: Any) -> Any:
        if anneal_strategy == "cos":
            return end + (start - end) / 2.0 * (_cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def schedule(step: Any) -> Any:
        t = _step(step)
        if not isinstance(t, Tensor):
            if t > total_steps:
                raise ValueError(f"step must be <= total_steps={total_steps}, got {step}")
            start_step = 0.0
            for i, (end_step, lo, hi) in enumerate(phases):
                if t <= end_step or i == len(phases) - 1:
                    return anneal(lo, hi, (t - start_step) / (end_step - start_step))
                start_step = end_step
        starts = [0.0] + [p[0] for p in phases[:-1]]
        values = [anneal(lo, hi, (t - s) / (e - s)) for s, (e, lo, hi) in zip(starts, phases)]
        out = values[-1]
        for (end_step, _, _), v in zip(reversed(phases[:-1]), reversed(values[:-1])):
            out = torch.where(t <= end_step, v, out)  # the first phase containing t wins
        return out

    return schedule


def scale_lr(lr: float, batch_size: int, base_batch_size: int) -> float:
    """Linear scaling rule (Goyal et al.): ``lr * batch_size / base_batch_size``.

    Example:
        >>> from torchfn.optim import scale_lr
        >>> scale_lr(0.1, batch_size=1024, base_batch_size=256)
        0.4
    """
    _checks.nonneg("lr", lr)
    _int("batch_size", batch_size, 1)
    _int("base_batch_size", base_batch_size, 1)
    return lr * batch_size / base_batch_size
