"""Latent consistency model (LCM, Luo et al. 2023) and trajectory consistency (TCD,
Zheng et al. 2024) sampling: few-step sampling of a discrete VP model distilled for
consistency (LCM / LCM-LoRA, TCD-LoRA), as diffusers' ``LCMScheduler`` and
``TCDScheduler``.

At each timestep ``t`` the model's output gives ``x0_hat`` (eps, v or x0 prediction);
the consistency function is ``f = c_skip x_t + c_out x0_hat`` with the boundary
scalings of the scaled timestep ``s = t * timestep_scaling``,
``c_skip = sd^2 / (s^2 + sd^2)``, ``c_out = s / sqrt(s^2 + sd^2)``. Between steps ``f``
is noised again to the next timestep by the forward process, ``sqrt(abar) f + sqrt(1 -
abar) z``; the last step returns ``f``.

TCD's model predicts along the trajectory instead: from ``t`` it steps (DDIM, with the
predicted x0 and eps) to ``s = floor((1 - gamma) t')`` before the next timestep ``t'``,
and, for ``gamma > 0``, noises forward from ``s`` to ``t'`` with fresh noise
(``gamma = 0``: deterministic, DDIM on LCM's timesteps).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from torchfn.transforms._noise import NoiseStream
from torchfn.transforms.diffusion._edm import _positive
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

__all__ = ["lcm_sample", "lcm_timesteps", "tcd_sample"]


def lcm_timesteps(T: int, steps: int, original_steps: int = 50) -> list[int]:
    """LCM's ``steps`` timesteps, decreasing: evenly spaced indices into the
    ``original_steps`` distillation timesteps ``k - 1, 2k - 1, ..., T - 1`` (``k = T //
    original_steps``), as diffusers' ``LCMScheduler.set_timesteps``.

    Example::

        >>> lcm_timesteps(1000, 4)
        [999, 759, 499, 259]
    """
    for name, value in (("T", T), ("original_steps", original_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if original_steps > T:
        raise ValueError(f"original_steps must be <= T = {T}, got {original_steps}")
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= original_steps:
        raise ValueError(f"steps must be an int in [1, original_steps] = [1, {original_steps}], "
                         f"got {steps!r}")
    k = T // original_steps
    origin = (np.arange(1, original_steps + 1) * k - 1)[::-1]
    index = np.floor(np.linspace(0, original_steps, num=steps, endpoint=False)).astype(np.int64)
    return [int(t) for t in origin[index]]


def lcm_sample(
    model_fn: ModelFn,
    schedule: Schedule,
    shape: Sequence[int],
    key: Tensor,
    *,
    steps: int = 4,
    original_steps: int = 50,
    timesteps: Sequence[int] | None = None,
    prediction: str = "eps",
    timestep_scaling: float = 10.0,
    sigma_data: float = 0.5,
    clip_x0: float | DynamicThreshold | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    return_chain: bool = False,
    progress: bool = False,
) -> Tensor:
    """Multistep LCM sampling: from ``x ~ N(0, I)``, per timestep ``f = c_skip x + c_out
    x0_hat`` and then ``x = sqrt(abar') f + sqrt(1 - abar') z`` at the next timestep; one
    model call per step. Equal to diffusers' ``LCMScheduler`` loop given the same noise.

    Args:
        model_fn: ``model_fn(x, t) -> (B, ...)``, ``t: (B,)`` int64.
        schedule: the model's training schedule (LCMs of Stable Diffusion: its
            "scaled_linear" betas, ``schedule_from_betas(linspace(0.00085**0.5,
            0.012**0.5, 1000)**2)``).
        shape: ``(B, ...)``.
        key: PRNG key (the start from ``split(key)[0]``, the re-noising from
            ``split(key)[1]``).
        steps: model calls; the timesteps are :func:`lcm_timesteps`.
        original_steps: the distillation's timestep grid (LCM: 50).
        timesteps: decreasing timesteps given by hand, instead of ``steps``.
        prediction: the model's output: ``"eps"``, ``"v"`` or ``"x0"``.
        timestep_scaling, sigma_data: the boundary scalings' (diffusers' defaults).
        clip_x0: clamp (float) or threshold (:class:`DynamicThreshold`) ``x0_hat``.
        return_chain: also return each step's ``f``.

    Returns:
        ``(B, ...)``, or ``(steps, B, ...)`` with ``return_chain``.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> from torchfn.transforms.diffusion import linear_schedule
        >>> x0_model = lambda x, t: torch.full_like(x, 0.5)       # data at 0.5
        >>> x = lcm_sample(x0_model, linear_schedule(1000), (2, 3), random.key(0),
        ...                prediction="x0")
        >>> bool((x - 0.5).abs().max() < 1e-3)
        True
    """
    if not callable(model_fn):
        raise TypeError(f"model_fn must be callable, got {type(model_fn).__name__}")
    T = _check_schedule(schedule)
    shape = _check_shape(shape)
    _check_common(prediction, clip_x0)
    scaling, sd = _positive("timestep_scaling", timestep_scaling), _positive("sigma_data",
                                                                               sigma_data)
    ts = _check_timesteps(T, steps, original_steps, timesteps)
    abar = schedule.alphas_cumprod.double().tolist()
    x, k_noise = _init(key, shape, dtype, device)  # (B, ...)
    stream = NoiseStream(k_noise, shape, max(1, len(ts) - 1), dtype, x.device)
    chain = [] if return_chain else None
    for i in _progress(range(len(ts)), len(ts), progress, "lcm"):
        t = ts[i]
        out = model_fn(x, torch.full((shape[0],), t, dtype=torch.int64, device=x.device))
        _check_out(out, x)
        x0, _ = _x0_eps(x, out, abar[t], prediction)
        x0 = clip(x0, clip_x0)
        s = t * scaling
        c_skip, c_out = sd * sd / (s * s + sd * sd), s / (s * s + sd * sd) ** 0.5
        x = c_out * x0 + c_skip * x  # f: the consistency function's estimate
        if chain is not None:
            chain.append(x)
        if i + 1 < len(ts):
            a = abar[ts[i + 1]]
            x = a**0.5 * x + (1 - a) ** 0.5 * stream(i)
    return torch.stack(chain) if chain is not None else x


def _check_timesteps(T: int, steps: int, original_steps: int,
                     timesteps: Sequence[int] | None) -> list[int]:
    if timesteps is None:
        return lcm_timesteps(T, steps, original_steps)
    ts = list(timesteps.tolist() if isinstance(timesteps, Tensor) else timesteps)
    if not ts or any(isinstance(t, bool) or int(t) != t for t in ts):
        raise ValueError(f"timesteps must be decreasing integers in [0, T) = [0, {T}), "
                         f"got {ts[:8]}")
    ts = [int(t) for t in ts]
    if any(b >= a for a, b in zip(ts, ts[1:])) or not 0 <= ts[-1] <= ts[0] < T:
        raise ValueError(f"timesteps must be decreasing integers in [0, T) = [0, {T}), "
                         f"got {ts[:8]}")
    return ts


def tcd_sample(
    model_fn: ModelFn,
    schedule: Schedule,
    shape: Sequence[int],
    key: Tensor,
    *,
    steps: int = 4,
    gamma: float = 0.3,
    original_steps: int = 50,
    timesteps: Sequence[int] | None = None,
    prediction: str = "eps",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    return_chain: bool = False,
    progress: bool = False,
) -> Tensor:
    """TCD's strategic stochastic sampling: per timestep ``t`` (next ``t'``, 0 after the
    last), ``x_s = sqrt(abar_s) x0_hat + sqrt(1 - abar_s) eps_hat`` at ``s = floor((1 -
    gamma) t')``, then ``x = sqrt(abar_t' / abar_s) x_s + sqrt(1 - abar_t' / abar_s) z``
    (not after the last step). One model call per step. Equal to diffusers'
    ``TCDScheduler`` loop (its ``eta`` is ``gamma``) given the same noise.

    Args:
        model_fn: ``model_fn(x, t) -> (B, ...)``, ``t: (B,)`` int64.
        schedule: the model's training schedule (see :func:`lcm_sample`).
        shape: ``(B, ...)``.
        key: PRNG key (the start from ``split(key)[0]``, the noise from ``split(key)[1]``).
        steps, original_steps, timesteps: as :func:`lcm_sample` (the same timesteps).
        gamma: in [0, 1], the stochasticity: 0 is deterministic (the paper's
            default for sampling is 0.3).
        prediction: ``"eps"``, ``"v"`` or ``"x0"``.
        return_chain: also return each step's ``x_s``.

    Returns:
        ``(B, ...)``, or ``(steps, B, ...)`` with ``return_chain``.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> from torchfn.transforms.diffusion import linear_schedule
        >>> s = linear_schedule(1000)
        >>> x0_model = lambda x, t: torch.full_like(x, 0.5)       # data at 0.5
        >>> x = tcd_sample(x0_model, s, (2, 3), random.key(0), prediction="x0", gamma=0.0)
        >>> bool((x - 0.5).abs().max() < 0.05)
        True
    """
    if not callable(model_fn):
        raise TypeError(f"model_fn must be callable, got {type(model_fn).__name__}")
    T = _check_schedule(schedule)
    shape = _check_shape(shape)
    _check_common(prediction, None)
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 <= gamma <= 1:
        raise ValueError(f"gamma must be a float in [0, 1], got {gamma!r}")
    ts = _check_timesteps(T, steps, original_steps, timesteps)
    abar = schedule.alphas_cumprod.double().tolist()
    x, k_noise = _init(key, shape, dtype, device)  # (B, ...)
    stream = NoiseStream(k_noise, shape, max(1, len(ts) - 1), dtype, x.device)
    chain = [] if return_chain else None
    for i in _progress(range(len(ts)), len(ts), progress, "tcd"):
        t, t_next = ts[i], (ts[i + 1] if i + 1 < len(ts) else 0)
        out = model_fn(x, torch.full((shape[0],), t, dtype=torch.int64, device=x.device))
        _check_out(out, x)
        x0, eps = _x0_eps(x, out, abar[t], prediction)
        a_s = abar[int(np.floor((1 - gamma) * t_next))]
        x = a_s**0.5 * x0 + (1 - a_s) ** 0.5 * eps  # DDIM to s
        if chain is not None:
            chain.append(x)
        if gamma > 0 and i + 1 < len(ts):  # forward from s to t'
            ratio = abar[t_next] / a_s
            x = ratio**0.5 * x + (1 - ratio) ** 0.5 * stream(i)
    return torch.stack(chain) if chain is not None else x
