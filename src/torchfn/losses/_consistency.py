"""The discrete consistency loss: consistency training as iCT (Song & Dhariwal 2023,
"Improved techniques for training consistency models") and consistency distillation
(Song et al. 2023) from an EDM teacher."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from torchfn import random
from torchfn.losses._flow_matching import _check_x0

__all__ = ["consistency_loss"]

LEVEL_SAMPLINGS = ("lognormal", "uniform")
DISTANCES = ("pseudo_huber", "squared")
SOLVERS = ("heun", "euler")


def _level_logits(levels: Tensor, sampling: str, p_mean: float, p_std: float) -> Tensor:
    """(N - 1,) log-probabilities of each adjacent pair: iCT's discretised log-normal
    ``erf((log s_{i+1} - m) / (sqrt 2 s)) - erf((log s_i - m) / (sqrt 2 s))``, or uniform."""
    if sampling == "uniform":
        return torch.zeros(len(levels) - 1, dtype=torch.float64)
    cdf = torch.erf((levels.log() - p_mean) / (math.sqrt(2) * p_std))  # (N,)
    return (cdf[1:] - cdf[:-1]).clamp_min(1e-300).log()


def _check_levels(levels) -> Tensor:
    ok = isinstance(levels, Tensor) and levels.dim() == 1 and len(levels) >= 2
    ok = ok and levels.dtype.is_floating_point and bool((levels[1:] > levels[:-1]).all())
    if not ok or not float(levels[0]) > 0:
        got = tuple(levels.shape) if isinstance(levels, Tensor) else type(levels).__name__
        raise ValueError("levels must be a 1-D float Tensor of at least 2 increasing levels "
                         f"> 0 (consistency_levels(step, total_steps)), got {got}")
    return levels.detach().to(torch.float64).cpu()


def consistency_loss(
    consistency_fn: Callable[[Tensor, Tensor], Tensor],
    x0: Tensor,
    key: Tensor,
    levels: Tensor,
    *,
    level_sampling: str = "lognormal",
    p_mean: float = -1.1,
    p_std: float = 2.0,
    distance: str = "pseudo_huber",
    huber_c: float | None = None,
    weighting: bool = True,
    teacher_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
    solver: str = "heun",
    target_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
) -> Tensor:
    """``mean_b lambda_i d(f(x0 + s_{i+1} z, s_{i+1}), sg f(x_i, s_i))`` over adjacent
    levels ``s_i < s_{i+1}`` drawn per example.

    Consistency training (``teacher_fn=None``, iCT): ``x_i = x0 + s_i z`` with the same
    ``z``. Distillation (``teacher_fn`` = an EDM denoiser ``D(x, sigma)``): ``x_i`` is one
    Euler or Heun step of the teacher's probability-flow ODE ``dx/dsigma = (x - D) /
    sigma`` from ``x0 + s_{i+1} z`` down to ``s_i``. The target's gradient is stopped
    (iCT's ``theta^- = theta``); pass ``target_fn`` (an EMA copy) for CM's EMA target.
    For data at one point ``c`` the exact consistency function ``c + (x - c) sigma_min /
    sigma`` has loss 0 in both modes (tested).

    Args:
        consistency_fn: ``f(x, sigma) -> (B, ...)``, ``sigma: (B,)``; a raw network goes
            through :func:`torchfn.transforms.diffusion.consistency_function`.
        x0: ``(B, ...)`` data.
        key: PRNG key for the levels and the noise.
        levels: ``(N,)`` increasing levels, usually
            ``diffusion.consistency_levels(step, total_steps)`` (iCT's curriculum).
        level_sampling: ``"lognormal"`` (iCT: pair ``i`` with the log-normal mass of
            ``[log s_i, log s_{i+1}]``, mean ``p_mean``, std ``p_std``) or ``"uniform"``
            (CM).
        distance: ``"pseudo_huber"`` (iCT: ``sqrt(|a - b|^2 + c^2) - c`` with ``c =
            huber_c``, default ``0.00054 sqrt(d)`` for ``d`` coordinates) or
            ``"squared"`` (``|a - b|^2``, summed over coordinates).
        weighting: iCT's ``lambda_i = 1 / (s_{i+1} - s_i)``; False: 1.
        teacher_fn: an EDM denoiser ``D(x, sigma)`` for distillation, or None.
        solver: the teacher's ODE step, ``"heun"`` or ``"euler"``.
        target_fn: the target's consistency function (default ``consistency_fn``).

    Returns:
        The scalar loss, in ``x0``'s dtype.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> from torchfn.transforms.diffusion import consistency_levels
        >>> x0 = torch.full((64, 2), 3.0, dtype=torch.float64)       # data at one point
        >>> exact = lambda x, s: 3.0 + (x - 3.0) * (0.002 / s)[:, None]
        >>> loss = consistency_loss(exact, x0, random.key(0), consistency_levels(0, 1000))
        >>> float(loss) < 1e-9
        True
    """
    if not callable(consistency_fn):
        raise TypeError(f"consistency_fn must be callable, got {type(consistency_fn).__name__}")
    _check_x0(x0)
    levels = _check_levels(levels)
    for name, value, allowed in (("level_sampling", level_sampling, LEVEL_SAMPLINGS),
                                 ("distance", distance, DISTANCES), ("solver", solver, SOLVERS)):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    if isinstance(p_std, bool) or not isinstance(p_std, (int, float)) or not p_std > 0:
        raise ValueError(f"p_std must be a float > 0, got {p_std!r}")
    if huber_c is not None and not (isinstance(huber_c, (int, float)) and huber_c > 0):
        raise ValueError(f"huber_c must be None or a float > 0, got {huber_c!r}")
    for name, fn in (("teacher_fn", teacher_fn), ("target_fn", target_fn)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable or None, got {type(fn).__name__}")

    B, dtype, device = x0.shape[0], x0.dtype, x0.device
    k_level, k_noise = random.split(key)
    i = random.categorical(k_level, _level_logits(levels, level_sampling, p_mean, p_std),
                           shape=(B,))  # (B,) pair index
    lo = levels[i].to(dtype=dtype, device=device)  # (B,)
    hi = levels[i + 1].to(dtype=dtype, device=device)  # (B,)
    view = (B,) + (1,) * (x0.dim() - 1)
    z = random.normal(k_noise, tuple(x0.shape), dtype=dtype).to(device)  # (B, ...)
    x_hi = x0 + hi.view(view) * z
    if teacher_fn is None:
        x_lo = x0 + lo.view(view) * z
    else:
        x_lo = _teacher_step(teacher_fn, x_hi, hi, lo, view, solver)

    def call(fn, x: Tensor, sigma: Tensor) -> Tensor:
        out = fn(x, sigma)
        if not isinstance(out, Tensor) or out.shape != x0.shape:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(f"consistency_fn(x, sigma) must return x0's shape "
                             f"{tuple(x0.shape)}, got {got}")
        return out

    online = call(consistency_fn, x_hi, hi)
    target = call(target_fn or consistency_fn, x_lo, lo).detach()
    sq = (online - target).pow(2).reshape(B, -1).sum(dim=1)  # (B,)
    if distance == "pseudo_huber":
        c = huber_c if huber_c is not None else 0.00054 * math.sqrt(x0[0].numel())
        sq = (sq + c * c).sqrt() - c
    if weighting:
        sq = sq / (hi - lo)
    return sq.mean()


def _teacher_step(teacher_fn, x: Tensor, hi: Tensor, lo: Tensor, view: tuple,
                  solver: str) -> Tensor:
    """One Euler or Heun step of ``dx/dsigma = (x - D(x, sigma)) / sigma`` from ``hi`` to
    ``lo`` (each (B,)), with the teacher's output detached."""

    def slope(x: Tensor, sigma: Tensor) -> Tensor:
        out = teacher_fn(x, sigma)
        if not isinstance(out, Tensor) or out.shape != x.shape:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(f"teacher_fn(x, sigma) must return x's shape {tuple(x.shape)}, "
                             f"got {got}")
        return ((x - out.detach()) / sigma.view(view)).detach()

    step = (lo - hi).view(view)
    d = slope(x, hi)
    x_lo = x + step * d
    if solver == "heun":
        x_lo = x + step * 0.5 * (d + slope(x_lo, lo))
    return x_lo.detach()
