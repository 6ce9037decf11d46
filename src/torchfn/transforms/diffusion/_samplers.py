"""Ancestral DDPM and DDIM samplers, following diffusers' conventions.

A sampler calls ``model_fn(x, t)`` with ``x: (B, ...)`` in ``dtype`` and
``t: (B,)`` int64 (every entry the current timestep); by default the model predicts
the noise ``eps`` (``prediction="x0"`` or ``"v"`` for the other parameterisations).
All randomness comes from ``key``: the initial ``x_T`` from one half of
``split(key)``, the per-step noise from the other (drawn in blocks of steps, see
``torchfn.transforms._noise``).

The samplers do not touch grad mode: run them under ``torch.no_grad()`` when the
model's parameters require grad, unless you mean to differentiate through them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from torchfn import random
from torchfn.transforms._noise import NoiseStream
from torchfn.transforms.diffusion._q_sample import PREDICTIONS
from torchfn.transforms.diffusion._schedules import Schedule

__all__ = ["DynamicThreshold", "ddpm_sample", "ddpm_step", "ddim_sample", "ddim_step",
           "ddim_timesteps"]

VARIANCES = ("fixed_small", "fixed_large")
SPACINGS = ("trailing", "leading", "linspace")

ModelFn = Callable[[Tensor, Tensor], Tensor]


# ----------------------------------------------------------------------------- checks


def _check_schedule(schedule: Schedule) -> int:
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a Schedule, got {type(schedule).__name__}")
    return schedule.num_timesteps


def _check_t(t: int, T: int, name: str = "t", allow_minus_one: bool = False) -> int:
    if isinstance(t, Tensor) and t.numel() == 1 and not t.dtype.is_floating_point:
        t = int(t)
    if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
        raise TypeError(f"{name} must be an int timestep, got {type(t).__name__}")
    lo = -1 if allow_minus_one else 0
    if not lo <= t < T:
        raise ValueError(f"{name} must lie in [{lo}, T-1] = [{lo}, {T - 1}], got {int(t)}")
    return int(t)


class DynamicThreshold(NamedTuple):
    """Imagen's dynamic thresholding of the ``x0`` prediction (diffusers'
    ``thresholding=True``), given as ``clip_x0``: per example, ``s`` is the ``ratio``
    quantile of ``|x0|``, clamped to ``[1, max_value]``, and ``x0`` becomes
    ``clamp(x0, -s, s) / s``.

    Example::

        >>> x0 = torch.tensor([[0.5, -3.0, 2.0, 1.0]])
        >>> clip(x0, DynamicThreshold(ratio=1.0, max_value=2.0))
        tensor([[ 0.2500, -1.0000,  1.0000,  0.5000]])
    """

    ratio: float = 0.995
    max_value: float = 1.0


def _check_common(prediction: str, clip_x0: float | DynamicThreshold | None) -> None:
    if prediction not in PREDICTIONS:
        raise ValueError(f"prediction must be one of {PREDICTIONS}, got {prediction!r}")
    if isinstance(clip_x0, DynamicThreshold):
        if not (0 < clip_x0.ratio <= 1 and clip_x0.max_value >= 1):
            raise ValueError("clip_x0: a DynamicThreshold needs ratio in (0, 1] and "
                             f"max_value >= 1, got {clip_x0}")
    elif clip_x0 is not None and not (isinstance(clip_x0, (int, float)) and clip_x0 > 0):
        raise ValueError(f"clip_x0 must be None, a float > 0 or a DynamicThreshold, got "
                         f"{clip_x0!r}")


def clip(x0: Tensor, clip_x0: float | DynamicThreshold | None) -> Tensor:
    """``x0`` clamped to ``[-clip_x0, clip_x0]``, or dynamically thresholded."""
    if clip_x0 is None:
        return x0
    if not isinstance(clip_x0, DynamicThreshold):
        return x0.clamp(-clip_x0, clip_x0)
    flat = x0.reshape(x0.shape[0], -1)  # (B, D)
    work = flat if flat.dtype in (torch.float32, torch.float64) else flat.float()
    s = torch.quantile(work.abs(), clip_x0.ratio, dim=1)
    s = torch.clamp(s, min=1.0, max=clip_x0.max_value)[:, None].to(flat.dtype)  # (B, 1)
    return (torch.clamp(flat, -s, s) / s).reshape(x0.shape)


def _check_shape(shape: Sequence[int]) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in shape)
    except TypeError:
        raise TypeError(f"shape must be a sequence of ints (B, ...), got {shape!r}") from None
    if len(shape) < 1 or any(s < 1 for s in shape):
        raise ValueError(f"shape must be (B, ...) with every dim >= 1, got {shape}")
    return shape


def _check_levels(sigmas, at_most: float | None = None) -> list[float]:
    """Noise levels given by hand: decreasing, at least two, ending in 0."""
    s = torch.as_tensor(sigmas, dtype=torch.float64).flatten()
    ok = s.numel() >= 2 and bool((s[1:] < s[:-1]).all())
    ok = ok and (at_most is None or float(s[0]) <= at_most)
    if not ok or float(s[-1]) != 0.0:
        top = "" if at_most is None else f" from <= {at_most:g}"
        raise ValueError(f"sigmas must be a decreasing sequence of at least 2 levels{top} "
                         f"ending in 0, got {s.tolist()[:8]}")
    return s.tolist()


def _check_out(out: Tensor, x: Tensor) -> None:
    if not isinstance(out, Tensor) or out.shape != x.shape:
        got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(f"model_fn(x, t) must return x's shape {tuple(x.shape)}, got {got}")


# ----------------------------------------------------------------------------- one step


def _x0_eps(x: Tensor, out: Tensor, abar: float, prediction: str) -> tuple[Tensor, Tensor]:
    """(x0_hat, eps_hat) from a model output, with Python-float coefficients."""
    sa, s1 = abar**0.5, (1.0 - abar) ** 0.5
    if prediction == "eps":
        return (x - s1 * out) / sa, out
    if prediction == "x0":
        return out, (x - sa * out) / s1
    return sa * x - s1 * out, sa * out + s1 * x  # "v"


def ddpm_step(
    schedule: Schedule,
    x: Tensor,
    t: int,
    model_out: Tensor,
    noise: Tensor | None = None,
    *,
    prediction: str = "eps",
    variance: str = "fixed_small",
    clip_x0: float | DynamicThreshold | None = None,
) -> Tensor:
    """One ancestral step ``x_t -> x_{t-1}`` (Ho et al. 2020), as diffusers' ``DDPMScheduler.step``.

    ``x_{t-1} = coef1_t x0_hat + coef2_t x_t + sigma_t noise`` where ``x0_hat`` comes from the
    model output (clamped to ``[-clip_x0, clip_x0]`` if given, or thresholded by a
    :class:`DynamicThreshold`) and

    * ``variance="fixed_small"``: ``sigma_t^2 = beta_t (1 - abar_{t-1}) / (1 - abar_t)``
      (the posterior variance; diffusers clamps it at 1e-20),
    * ``variance="fixed_large"``: ``sigma_t^2 = beta_t``.

    No noise is added at the last step ``t = 0`` for either choice (diffusers' first-step
    handling; Ho et al.'s code uses ``posterior_variance[1]`` there only for likelihoods).

    Args:
        x: ``(B, ...)`` the current sample ``x_t``.
        t: the current timestep, an int in ``[0, T-1]``.
        model_out: ``(B, ...)`` the model's prediction at ``(x, t)``.
        noise: ``(B, ...)`` standard normal noise; required when ``t > 0``.

    Example::

        >>> from torchfn.transforms.diffusion import linear_schedule
        >>> s = linear_schedule(10); x = torch.ones(2, 3)
        >>> x_prev = ddpm_step(s, x, 5, torch.zeros(2, 3), torch.zeros(2, 3))
    """
    T = _check_schedule(schedule)
    t = _check_t(t, T)
    _check_common(prediction, clip_x0)
    if variance not in VARIANCES:
        raise ValueError(f"variance must be one of {VARIANCES}, got {variance!r}")
    _check_out(model_out, x)
    abar = float(schedule.alphas_cumprod[t])
    x0, _ = _x0_eps(x, model_out, abar, prediction)
    x0 = clip(x0, clip_x0)
    mean = (
        float(schedule.posterior_mean_coef1[t]) * x0 + float(schedule.posterior_mean_coef2[t]) * x
    )
    if t == 0:
        return mean
    if noise is None:
        raise ValueError(f"noise is required for t > 0, got None at t={t}")
    if noise.shape != x.shape:
        raise ValueError(f"noise must have x's shape {tuple(x.shape)}, got {tuple(noise.shape)}")
    if variance == "fixed_small":
        var = max(float(schedule.posterior_variance[t]), 1e-20)
    else:
        var = float(schedule.betas[t])
    return mean + var**0.5 * noise


def ddim_step(
    schedule: Schedule,
    x: Tensor,
    t: int,
    t_prev: int,
    model_out: Tensor,
    noise: Tensor | None = None,
    *,
    prediction: str = "eps",
    eta: float = 0.0,
    clip_x0: float | DynamicThreshold | None = None,
) -> Tensor:
    """One DDIM step ``x_t -> x_{t_prev}`` (Song et al. 2021), as diffusers' ``DDIMScheduler.step``.

    With ``a = abar_t``, ``a' = abar_{t_prev}`` (``a' = 1`` when ``t_prev = -1``)::

        sigma^2  = eta^2 (1 - a') / (1 - a) (1 - a / a')
        x_prev   = sqrt(a') x0_hat + sqrt(1 - a' - sigma^2) eps_hat + sigma noise

    ``x0_hat`` is clamped to ``[-clip_x0, clip_x0]`` if given; ``eps_hat`` stays the
    model's (diffusers' default ``use_clipped_model_output=False``). ``eta=0`` is the
    deterministic DDIM; ``eta=1`` matches DDPM's ``fixed_small`` variance.

    Example::

        >>> from torchfn.transforms.diffusion import linear_schedule
        >>> s = linear_schedule(10); x = torch.ones(2, 3)
        >>> x_prev = ddim_step(s, x, 9, 4, torch.zeros(2, 3))
    """
    T = _check_schedule(schedule)
    t = _check_t(t, T)
    t_prev = _check_t(t_prev, T, "t_prev", allow_minus_one=True)
    if t_prev >= t:
        raise ValueError(f"t_prev must be < t, got t_prev={t_prev}, t={t}")
    _check_common(prediction, clip_x0)
    if not eta >= 0.0:
        raise ValueError(f"eta must be >= 0, got {eta}")
    _check_out(model_out, x)
    a = float(schedule.alphas_cumprod[t])
    a_prev = float(schedule.alphas_cumprod[t_prev]) if t_prev >= 0 else 1.0
    x0, eps = _x0_eps(x, model_out, a, prediction)
    x0 = clip(x0, clip_x0)
    sigma = eta * ((1.0 - a_prev) / (1.0 - a) * (1.0 - a / a_prev)) ** 0.5
    x_prev = a_prev**0.5 * x0 + max(1.0 - a_prev - sigma**2, 0.0) ** 0.5 * eps
    if sigma > 0.0:
        if noise is None:
            raise ValueError(f"noise is required when eta > 0, got None at t={t}")
        if noise.shape != x.shape:
            raise ValueError(
                f"noise must have x's shape {tuple(x.shape)}, got {tuple(noise.shape)}"
            )
        x_prev = x_prev + sigma * noise
    return x_prev


def ddim_timesteps(T: int, steps: int, spacing: str = "trailing") -> Tensor:
    """The ``(steps,)`` int64 descending timesteps DDIM visits, as diffusers' ``set_timesteps``.

    * ``"trailing"``: ``round(T - i T / steps) - 1``, i.e. ends of equal intervals (starts at
      ``T - 1``; recommended by Lin et al. 2024).
    * ``"leading"``: ``i * (T // steps)`` (starts below ``T - 1``; diffusers' ``steps_offset=0``).
    * ``"linspace"``: ``round(linspace(0, T - 1, steps))``.

    Example::

        >>> ddim_timesteps(1000, 4).tolist()
        [999, 749, 499, 249]
    """
    if isinstance(T, bool) or not isinstance(T, int) or T < 1:
        raise ValueError(f"T must be an int >= 1, got {T!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= T:
        raise ValueError(f"steps must be an int in [1, T] = [1, {T}], got {steps!r}")
    if spacing == "trailing":
        ts = np.round(T - np.arange(steps) * (T / steps)).astype(np.int64) - 1
    elif spacing == "leading":
        ts = (np.arange(steps) * (T // steps))[::-1].astype(np.int64)
    elif spacing == "linspace":
        ts = np.linspace(0, T - 1, steps).round()[::-1].astype(np.int64)
    else:
        raise ValueError(f"spacing must be one of {SPACINGS}, got {spacing!r}")
    return torch.from_numpy(ts.copy())


# ----------------------------------------------------------------------------- samplers


def _init(key: Tensor, shape: tuple[int, ...], dtype: torch.dtype, device) -> tuple[Tensor, Tensor]:
    if not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating dtype, got {dtype}")
    k_init, k_noise = random.split(key)
    x = random.normal(k_init, shape, dtype=dtype)
    if device is not None:
        x = x.to(device)
    return x, k_noise


def _progress(it, total: int, progress: bool, desc: str):
    if not progress:
        return it
    from tqdm.auto import tqdm

    return tqdm(it, total=total, desc=desc, leave=False)


def ddpm_sample(
    model_fn: ModelFn,
    schedule: Schedule,
    shape: Sequence[int],
    key: Tensor,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    prediction: str = "eps",
    variance: str = "fixed_small",
    clip_x0: float | DynamicThreshold | None = None,
    return_chain: bool = False,
    progress: bool = False,
) -> Tensor:
    """Ancestral DDPM sampling over all ``T`` steps, from ``x_T ~ N(0, I)`` down to ``x_0``.

    Each step is :func:`ddpm_step` (see it for ``variance`` and ``clip_x0``, off by default).

    Args:
        model_fn: ``model_fn(x, t) -> (B, ...)``, ``x: (B, ...)``, ``t: (B,)`` int64.
        schedule: the noise schedule the model was trained with.
        shape: ``(B, ...)``, the shape of the samples.
        key: PRNG key.
        return_chain: also keep every intermediate ``x_t``.

    Returns:
        ``(B, ...)`` samples, or ``(T + 1, B, ...)`` with ``chain[0] = x_T`` and
        ``chain[-1] = x_0`` when ``return_chain``.

    Example::

        >>> from torchfn.transforms.diffusion import linear_schedule
        >>> s = linear_schedule(50)
        >>> x = ddpm_sample(lambda x, t: torch.zeros_like(x), s, (8, 2), random.key(0))
        >>> x.shape
        torch.Size([8, 2])
    """
    T = _check_schedule(schedule)
    shape = _check_shape(shape)
    _check_common(prediction, clip_x0)
    if variance not in VARIANCES:
        raise ValueError(f"variance must be one of {VARIANCES}, got {variance!r}")
    x, k_noise = _init(key, shape, dtype, device)  # (B, ...)
    stream = NoiseStream(k_noise, shape, T - 1, dtype, x.device)  # step i = T-1-t, t >= 1
    chain = [x] if return_chain else None
    for t in _progress(range(T - 1, -1, -1), T, progress, "ddpm"):
        tt = torch.full((shape[0],), t, dtype=torch.int64, device=x.device)  # (B,)
        out = model_fn(x, tt)  # (B, ...)
        noise = stream(T - 1 - t) if t > 0 else None  # (B, ...)
        x = ddpm_step(
            schedule, x, t, out, noise, prediction=prediction, variance=variance, clip_x0=clip_x0
        )
        if chain is not None:
            chain.append(x)
    return torch.stack(chain) if chain is not None else x


def ddim_sample(
    model_fn: ModelFn,
    schedule: Schedule,
    shape: Sequence[int],
    key: Tensor,
    *,
    steps: int = 50,
    eta: float = 0.0,
    spacing: str = "trailing",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    prediction: str = "eps",
    clip_x0: float | DynamicThreshold | None = None,
    return_chain: bool = False,
    progress: bool = False,
) -> Tensor:
    """DDIM sampling (Song et al. 2021) on ``steps`` timesteps from :func:`ddim_timesteps`.

    Each step is :func:`ddim_step` from the visited timestep ``t_i`` to the next visited one
    ``t_{i+1}`` (to ``abar = 1``, i.e. ``x_0``, after the last). diffusers' ``DDIMScheduler``
    instead always steps to ``t - T // steps``; the two agree whenever the visited
    timesteps are evenly spaced by ``T // steps`` ("leading", and "trailing" when ``steps``
    divides ``T``).

    Args:
        model_fn: ``model_fn(x, t) -> (B, ...)``, ``x: (B, ...)``, ``t: (B,)`` int64.
        steps: number of model evaluations, in ``[1, T]``.
        eta: 0 is deterministic DDIM (the noise key is used only for ``x_T``); 1 is
            DDPM-like.
        spacing: ``"trailing"`` | ``"leading"`` | ``"linspace"`` (diffusers' ``timestep_spacing``).

    Returns:
        ``(B, ...)`` samples, or ``(steps + 1, B, ...)`` when ``return_chain``.

    Example::

        >>> from torchfn.transforms.diffusion import linear_schedule
        >>> s = linear_schedule(100)
        >>> x = ddim_sample(lambda x, t: torch.zeros_like(x), s, (8, 2), random.key(0), steps=10)
        >>> x.shape
        torch.Size([8, 2])
    """
    T = _check_schedule(schedule)
    shape = _check_shape(shape)
    _check_common(prediction, clip_x0)
    if not eta >= 0.0:
        raise ValueError(f"eta must be >= 0, got {eta}")
    ts = ddim_timesteps(T, steps, spacing).tolist()
    x, k_noise = _init(key, shape, dtype, device)  # (B, ...)
    stream = NoiseStream(k_noise, shape, steps, dtype, x.device)
    chain = [x] if return_chain else None
    for i in _progress(range(steps), steps, progress, "ddim"):
        t, t_prev = ts[i], (ts[i + 1] if i + 1 < steps else -1)
        tt = torch.full((shape[0],), t, dtype=torch.int64, device=x.device)  # (B,)
        out = model_fn(x, tt)  # (B, ...)
        noise = stream(i) if eta > 0.0 else None  # (B, ...)
        x = ddim_step(
            schedule, x, t, t_prev, out, noise, prediction=prediction, eta=eta, clip_x0=clip_x0
        )
        if chain is not None:
            chain.append(x)
    return torch.stack(chain) if chain is not None else x
