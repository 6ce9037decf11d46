"""DPM-Solver++ multistep (Lu et al. 2022): diffusers' default fast sampler.

The probability-flow ODE of a VP diffusion, written in ``lambda = log(alpha / sigma)``
(``alpha = sqrt(abar)``, ``sigma = sqrt(1 - abar)``) and the model's prediction of
``x0``, has an exact linear part; DPM-Solver++ integrates it exactly and the ``x0``
prediction by a polynomial through the last ``order`` predictions (multistep: one model
call per step). Step ``s -> t``, ``h = lambda_t - lambda_s``, ``D`` the differences of
past predictions::

    order 1 (DDIM):  x_t = (sigma_t / sigma_s) x - alpha_t (e^-h - 1) x0_s
    order 2:         ... - alpha_t (e^-h - 1) D1 / 2           ("midpoint")
    order 3:         ... + alpha_t ((e^-h - 1) / h + 1) D1 - alpha_t ((e^-h - 1 + h) / h^2 - 1/2) D2

as diffusers' ``DPMSolverMultistepScheduler(algorithm_type="dpmsolver++")`` with its
defaults: the first steps warm up at lower order, the last step is first order down to
``sigma = 0`` (``final_sigmas_type="zero"``), and with fewer than 15 steps the one
before it is at most second order (``lower_order_final``).

``stochastic=True`` is the SDE variant (``"sde-dpmsolver++"``, orders 1 and 2): each
step also injects fresh noise, ``x_t = (sigma_t / sigma_s) e^-h x + alpha_t (1 - e^-2h)
(x0 + D1 / 2) + sigma_t sqrt(1 - e^-2h) z``. ``karras=True`` places the steps at
Karras et al.'s noise levels (``use_karras_sigmas``; "DPM++ 2M Karras").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from torchfn.transforms._noise import NoiseStream
from torchfn.transforms.diffusion._samplers import (
    DynamicThreshold,
    ModelFn,
    _check_common,
    _check_out,
    _check_schedule,
    _check_shape,
    _init,
    _progress,
    _x0_eps,
    clip,
)
from torchfn.transforms.diffusion._schedules import Schedule

__all__ = ["dpm_solver_sample", "dpm_solver_timesteps"]

SPACINGS = ("linspace", "leading", "trailing")


def dpm_solver_timesteps(T: int, steps: int, spacing: str = "linspace") -> Tensor:
    """The ``(steps,)`` int64 descending timesteps DPM-Solver visits, as diffusers'
    ``DPMSolverMultistepScheduler.set_timesteps`` (its ``"linspace"`` differs from DDIM's).

    * ``"linspace"``: ``round(linspace(0, T - 1, steps + 1))`` reversed, without the 0;
    * ``"leading"``: ``i * (T // (steps + 1))`` for i = steps .. 1;
    * ``"trailing"``: ``round(T - i T / steps) - 1`` for i = 0 .. steps - 1.

    Example::

        >>> dpm_solver_timesteps(1000, 4).tolist()
        [999, 749, 500, 250]
    """
    if isinstance(T, bool) or not isinstance(T, int) or T < 2:
        raise ValueError(f"T must be an int >= 2, got {T!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps < T:
        raise ValueError(f"steps must be an int in [1, T - 1] = [1, {T - 1}], got {steps!r}")
    if spacing == "linspace":
        ts = np.linspace(0, T - 1, steps + 1).round()[::-1][:-1]
    elif spacing == "leading":
        ts = (np.arange(0, steps + 1) * (T // (steps + 1))).round()[::-1][:-1]
    elif spacing == "trailing":
        ts = np.arange(T, 0, -T / steps).round() - 1
    else:
        raise ValueError(f"spacing must be one of {SPACINGS}, got {spacing!r}")
    return torch.from_numpy(ts.astype(np.int64).copy())


def _karras(levels_all: Tensor, steps: int) -> tuple[list[int], list[float]]:
    """Karras et al.'s ``steps`` noise levels between the schedule's extremes, and the
    timesteps whose levels they fall between, interpolated in log level and rounded
    (diffusers' ``_convert_to_karras`` and ``_sigma_to_t``)."""
    lo, hi = float(levels_all[0]), float(levels_all[-1])
    ramp = np.linspace(0, 1, steps)
    levels = (hi ** (1 / 7) + ramp * (lo ** (1 / 7) - hi ** (1 / 7))) ** 7  # descending
    log_all = np.log(levels_all.numpy())
    log_l = np.log(np.maximum(levels, 1e-10))
    low = np.clip(np.searchsorted(log_all, log_l, side="right") - 1, 0, len(log_all) - 2)
    w = np.clip((log_all[low] - log_l) / (log_all[low] - log_all[low + 1]), 0, 1)
    ts = np.round((1 - w) * low + w * (low + 1)).astype(np.int64)
    return ts.tolist(), levels.tolist()


def order_at(i: int, steps: int, order: int) -> int:
    """The order of step ``i`` of ``steps``, by diffusers' rules: warm up from order 1;
    the last step first order (to sigma 0), and with fewer than 15 steps the one before
    it at most second order."""
    k = min(order, i + 1)
    if i == steps - 1:
        return 1
    if i == steps - 2 and steps < 15:
        return min(k, 2)
    return k


def log_snr(alpha: float, sigma: float) -> float:
    """``lambda = log(alpha / sigma)``, infinite at either end."""
    if sigma == 0:
        return math.inf
    if alpha == 0:
        return -math.inf
    return math.log(alpha) - math.log(sigma)


def update(x: Tensor, x0s: list[Tensor], lams: list[float], alpha_t: float, sigma_t: float,
            sigma_s: float, lam_t: float, order: int, noise: Tensor | None) -> Tensor:
    """One DPM-Solver++ step of ``order`` from the last predictions ``x0s`` (newest last)
    made at ``lams``; with ``noise``, the SDE variant's step."""
    lam_s = lams[-1]
    h = lam_t - lam_s
    if noise is not None:  # sde-dpmsolver++: (1 - e^-2h) in place of -(e^-h - 1)
        decay = math.exp(-h)
        gain = -math.expm1(-2.0 * h)
        x_t = (sigma_t / sigma_s * decay) * x + (alpha_t * gain) * x0s[-1]
        if order == 2:
            d1_0 = (x0s[-1] - x0s[-2]) * (h / (lam_s - lams[-2]))
            x_t = x_t + (0.5 * alpha_t * gain) * d1_0
        return x_t + (sigma_t * gain**0.5) * noise
    phi = math.expm1(-h)  # e^-h - 1 (-1 at the last step, where lambda_t = inf)
    ratio = sigma_t / sigma_s
    x_t = ratio * x - (alpha_t * phi) * x0s[-1]  # (B, ...)
    if order == 1:
        return x_t
    r0 = (lam_s - lams[-2]) / h
    d1_0 = (x0s[-1] - x0s[-2]) / r0
    if order == 2:
        return x_t - (0.5 * alpha_t * phi) * d1_0
    r1 = (lams[-2] - lams[-3]) / h
    d1_1 = (x0s[-2] - x0s[-3]) / r1
    d1 = d1_0 + (r0 / (r0 + r1)) * (d1_0 - d1_1)
    d2 = (d1_0 - d1_1) / (r0 + r1)
    return x_t + (alpha_t * (phi / h + 1.0)) * d1 - (alpha_t * ((phi + h) / h**2 - 0.5)) * d2


def vp_levels(schedule: Schedule, steps: int, spacing: str, karras: bool
              ) -> tuple[list[int], list[float], list[float], list[float]]:
    """The int timesteps a multistep solver visits and, with a final level 0 appended,
    each level's ``alpha = sqrt(abar)``, ``sigma = sqrt(1 - abar)`` and
    ``lambda = log(alpha / sigma)`` (diffusers' DPM-Solver and UniPC schedulers)."""
    T = _check_schedule(schedule)
    ts = dpm_solver_timesteps(T, steps, spacing).tolist()
    # noise levels in diffusers' variance-exploding form, s = sqrt((1 - abar) / abar)
    abar_all = schedule.alphas_cumprod.double()
    levels_all = ((1 - abar_all) / abar_all).sqrt()  # (T,) increasing in t
    if karras:
        ts, levels = _karras(levels_all, steps)
    else:
        levels = [float(levels_all[t]) for t in ts]
    levels = [*levels, 0.0]  # the end: sigma = 0
    alphas = [1.0 / (v * v + 1.0) ** 0.5 for v in levels]
    sigmas = [v * a for v, a in zip(levels, alphas)]
    return ts, alphas, sigmas, [log_snr(a, s) for a, s in zip(alphas, sigmas)]


def dpm_solver_sample(
    model_fn: ModelFn,
    schedule: Schedule,
    shape: Sequence[int],
    key: Tensor,
    *,
    steps: int = 20,
    order: int = 2,
    spacing: str = "linspace",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    prediction: str = "eps",
    clip_x0: float | DynamicThreshold | None = None,
    karras: bool = False,
    stochastic: bool = False,
    return_chain: bool = False,
    progress: bool = False,
) -> Tensor:
    """DPM-Solver++ multistep sampling (``order`` 1, 2 or 3), from ``x_T ~ N(0, I)``.

    Deterministic given ``key`` (only ``x_T`` is drawn, and with ``stochastic`` each
    step's noise). Equal to diffusers' ``DPMSolverMultistepScheduler(algorithm_type=
    "dpmsolver++", solver_order=order)`` with its other defaults. ``order=1`` is DDIM
    with ``eta = 0`` on these timesteps; ``order=2`` (DPM-Solver++(2M)) reaches in 10-20
    steps what DDIM needs 50-100 for.

    Args:
        model_fn: ``model_fn(x, t) -> (B, ...)``, ``x: (B, ...)``, ``t: (B,)`` int64.
        schedule: the noise schedule the model was trained with.
        shape: ``(B, ...)``, the shape of the samples.
        key: PRNG key.
        steps: model evaluations, in ``[1, T - 1]``.
        order: 1, 2 or 3.
        spacing: ``"linspace"`` | ``"leading"`` | ``"trailing"`` (diffusers'
            ``timestep_spacing``; see :func:`dpm_solver_timesteps`).
        prediction: what the model predicts: ``"eps"``, ``"x0"`` or ``"v"``.
        clip_x0: clamp each ``x0`` prediction to ``[-clip_x0, clip_x0]``, or threshold
            it with a :class:`DynamicThreshold` (diffusers' ``thresholding=True``).
        karras: step at Karras et al.'s noise levels, ``sigma_i`` from ``sigma_max`` to
            ``sigma_min`` evenly in ``sigma^(1/7)`` (diffusers' ``use_karras_sigmas``);
            the model sees each level's nearest integer timestep (diffusers keeps
            fractional ones for its cosine schedule).
        stochastic: the SDE variant (``"sde-dpmsolver++"``), orders 1 and 2.
        return_chain: also keep every intermediate ``x``.

    Returns:
        ``(B, ...)`` samples, or ``(steps + 1, B, ...)`` when ``return_chain``.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> from torchfn.transforms.diffusion import linear_schedule
        >>> s = linear_schedule(1000)
        >>> eps_fn = lambda x, t: torch.zeros_like(x)     # a trained model's noise
        >>> x = dpm_solver_sample(eps_fn, s, (8, 2), random.key(0), steps=10)
        >>> x.shape
        torch.Size([8, 2])
    """
    _check_schedule(schedule)
    shape = _check_shape(shape)
    _check_common(prediction, clip_x0)
    if order not in (1, 2, 3) or isinstance(order, bool):
        raise ValueError(f"order must be 1, 2 or 3, got {order!r}")
    if stochastic and order == 3:
        raise ValueError("order must be 1 or 2 with stochastic=True (diffusers' "
                         "sde-dpmsolver++ has no third order), got 3")
    ts, alphas, sigmas, lams = vp_levels(schedule, steps, spacing, karras)
    x, k_noise = _init(key, shape, dtype, device)  # (B, ...)
    stream = NoiseStream(k_noise, shape, steps, dtype, x.device) if stochastic else None
    chain = [x] if return_chain else None
    x0s: list[Tensor] = []
    for i in _progress(range(steps), steps, progress, "dpm-solver++"):
        tt = torch.full((shape[0],), ts[i], dtype=torch.int64, device=x.device)  # (B,)
        out = model_fn(x, tt)  # (B, ...)
        _check_out(out, x)
        x0, _ = _x0_eps(x, out, alphas[i] ** 2, prediction)
        x0 = clip(x0, clip_x0)
        x0s = [*x0s[-(order - 1):], x0] if order > 1 else [x0]
        k = order_at(i, steps, order)
        noise = stream(i) if stream is not None else None  # (B, ...)
        x = update(x, x0s, lams[max(0, i + 1 - len(x0s)):i + 1], alphas[i + 1], sigmas[i + 1],
                    sigmas[i], lams[i + 1], k, noise)
        if chain is not None:
            chain.append(x)
    return torch.stack(chain) if chain is not None else x
