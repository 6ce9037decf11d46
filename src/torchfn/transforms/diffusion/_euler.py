"""Euler and Euler-ancestral ("Euler a") sampling of a discrete VP model, as diffusers'
``EulerDiscreteScheduler`` and ``EulerAncestralDiscreteScheduler`` (k-diffusion's
``sample_euler`` / ``sample_euler_ancestral``).

The VP sample ``x_t = sqrt(abar) x0 + sqrt(1 - abar) eps`` is rescaled to the
variance-exploding ``x = x_t / sqrt(abar) = x0 + sigma eps`` with
``sigma = sqrt((1 - abar) / abar)``; the model sees ``x / sqrt(sigma^2 + 1)`` (its own
input) and the timestep of that level, fractional between the schedule's integers.
Euler steps ``dx/dsigma = (x - x0) / sigma`` down the levels to 0; the ancestral
variant steps down past the next level to ``sigma_down`` and adds fresh noise of
``sigma_up`` back up to it (``sigma_down^2 + sigma_up^2 = sigma_next^2``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from torchfn.transforms._noise import NoiseStream
from torchfn.transforms.diffusion._samplers import (
    ModelFn,
    _check_common,
    _check_out,
    _check_schedule,
    _check_shape,
    _init,
    _progress,
)
from torchfn.transforms.diffusion._schedules import Schedule

__all__ = ["euler_sample", "euler_levels"]

SPACINGS = ("linspace", "leading", "trailing")


def _sigma_to_t(sigma: np.ndarray, log_all: np.ndarray) -> np.ndarray:
    """The fractional timestep of each level, by linear interpolation in log sigma."""
    log_s = np.log(np.maximum(sigma, 1e-10))
    dists = log_s - log_all[:, None]  # (T, n)
    low = np.cumsum(dists >= 0, axis=0).argmax(axis=0).clip(max=len(log_all) - 2)
    w = np.clip((log_all[low] - log_s) / (log_all[low] - log_all[low + 1]), 0, 1)
    return (1 - w) * low + w * (low + 1)


def euler_levels(schedule: Schedule, steps: int, spacing: str = "linspace",
                 karras: bool = False) -> tuple[Tensor, Tensor]:
    """``(timesteps (steps,), sigmas (steps + 1,))`` float64, as diffusers'
    ``EulerDiscreteScheduler.set_timesteps(steps)``: the timesteps by ``spacing`` (the
    default ``"linspace"`` gives fractional ones), their levels interpolated, then 0;
    with ``karras``, Karras et al.'s levels between the same extremes and their
    interpolated timesteps.

    Example::

        >>> from torchfn.transforms.diffusion import linear_schedule
        >>> t, s = euler_levels(linear_schedule(1000), 3)
        >>> [round(x, 1) for x in t.tolist()], [round(x, 3) for x in s.tolist()]
        ([999.0, 499.5, 0.0], [157.407, 3.434, 0.01, 0.0])
    """
    T = _check_schedule(schedule)
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= T:
        raise ValueError(f"steps must be an int in [1, T] = [1, {T}], got {steps!r}")
    if spacing == "linspace":
        ts = np.linspace(0, T - 1, steps, dtype=np.float32)[::-1].copy()
    elif spacing == "leading":
        ts = (np.arange(0, steps) * (T // steps)).round()[::-1].astype(np.float32)
    elif spacing == "trailing":
        ts = np.arange(T, 0, -T / steps).round().astype(np.float32) - 1
    else:
        raise ValueError(f"spacing must be one of {SPACINGS}, got {spacing!r}")
    abar = schedule.alphas_cumprod.double().numpy()
    all_levels = ((1 - abar) / abar) ** 0.5  # (T,)
    levels = np.interp(ts, np.arange(T), all_levels)
    if karras:
        lo, hi, rho = levels[-1], levels[0], 7.0
        ramp = np.linspace(0, 1, steps)
        levels = (hi ** (1 / rho) + ramp * (lo ** (1 / rho) - hi ** (1 / rho))) ** rho
        ts = _sigma_to_t(levels, np.log(all_levels))
    # diffusers keeps float32 levels and timesteps; so do these values
    levels = np.append(levels, 0.0).astype(np.float32).astype(np.float64)
    return torch.from_numpy(ts.astype(np.float32).astype(np.float64)), torch.from_numpy(levels)


def euler_sample(
    model_fn: ModelFn,
    schedule: Schedule,
    shape: Sequence[int],
    key: Tensor,
    *,
    steps: int = 50,
    ancestral: bool = False,
    spacing: str = "linspace",
    karras: bool = False,
    prediction: str = "eps",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    return_chain: bool = False,
    progress: bool = False,
) -> Tensor:
    """Euler (or, with ``ancestral``, Euler-ancestral) sampling of a VP model in
    ``steps`` model calls, equal to diffusers' ``EulerDiscreteScheduler`` /
    ``EulerAncestralDiscreteScheduler`` loops (Stable Diffusion's "Euler" and
    "Euler a").

    Args:
        model_fn: ``model_fn(x, t) -> (B, ...)``, ``x: (B, ...)`` the VP sample, ``t: (B,)``
            float timesteps (fractional with ``"linspace"`` spacing, as diffusers').
        schedule: the noise schedule the model was trained with.
        shape: ``(B, ...)``.
        key: PRNG key (the start from ``split(key)[0]``, the ancestral noise from
            ``split(key)[1]``).
        spacing, karras: the levels, see :func:`euler_levels`.
        prediction: ``"eps"`` or ``"v"`` (diffusers' Euler schedulers take those two).
        return_chain: also return every intermediate sample, in the VP scale.

    Returns:
        ``(B, ...)`` samples, or ``(steps + 1, B, ...)`` with ``return_chain``.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> from torchfn.transforms.diffusion import linear_schedule
        >>> eps_fn = lambda x, t: torch.tanh(x)              # a trained model's noise
        >>> euler_sample(eps_fn, linear_schedule(1000), (4, 2), random.key(0), steps=10).shape
        torch.Size([4, 2])
    """
    _check_schedule(schedule)
    shape = _check_shape(shape)
    _check_common(prediction, None)
    if prediction not in ("eps", "v"):
        raise ValueError(f"prediction must be 'eps' or 'v' for the Euler samplers (as "
                         f"diffusers'), got {prediction!r}")
    ts, levels = euler_levels(schedule, steps, spacing, karras)
    ts, levels = ts.tolist(), levels.tolist()
    z, k_noise = _init(key, shape, dtype, device)  # (B, ...)
    # diffusers' init_noise_sigma: the largest level, or the VP sample's scale at it
    start = levels[0] if spacing in ("linspace", "trailing") else (levels[0] ** 2 + 1) ** 0.5
    x = start * z  # the VE sample x0 + sigma eps
    stream = NoiseStream(k_noise, shape, steps, dtype, x.device) if ancestral else None
    B = shape[0]
    chain = [x / (levels[0] ** 2 + 1) ** 0.5] if return_chain else None
    for i in _progress(range(steps), steps, progress, "euler" + (" a" if ancestral else "")):
        s, s_next = levels[i], levels[i + 1]
        scale = (s * s + 1) ** 0.5
        t = torch.full((B,), ts[i], dtype=dtype, device=x.device)  # (B,)
        out = model_fn(x / scale, t)
        _check_out(out, x)
        if prediction == "eps":
            x0 = x - s * out
        else:  # v: x0 = sqrt(abar) x_t - sqrt(1 - abar) v, in the VE scale
            x0 = out * (-s / scale) + x / (s * s + 1)
        d = (x - x0) / s
        if stream is None:
            x = x + (s_next - s) * d
        else:
            up = (s_next**2 * (s * s - s_next**2) / (s * s)) ** 0.5
            down = (s_next**2 - up * up) ** 0.5
            x = x + (down - s) * d + up * stream(i)
        if chain is not None:
            chain.append(x / (s_next**2 + 1) ** 0.5)
    return torch.stack(chain) if chain is not None else x
