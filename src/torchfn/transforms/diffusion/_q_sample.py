"""The forward process ``q(x_t | x_0)`` and conversions between eps / x0 / v predictions.

Every function takes integer timesteps ``t`` of shape ``(B,)`` (or ``()`` for one
example) and an ``x`` whose leading dims equal ``t.shape``; the ``(T,)`` float64
coefficient is gathered at ``t``, cast to ``x.dtype`` and broadcast over ``x``'s
trailing dims.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchfn.transforms.diffusion._schedules import Schedule

__all__ = [
    "q_sample",
    "q_posterior",
    "velocity",
    "predict_x0_from_eps",
    "predict_eps_from_x0",
    "predict_x0_from_v",
    "predict_eps_from_v",
    "PREDICTIONS",
]

PREDICTIONS = ("eps", "x0", "v")


def _tracing() -> bool:
    """True under a torch.func transform or torch.compile, where value checks cannot run."""
    return torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling()


def check_timesteps(schedule: Schedule, t: Tensor, x: Tensor, name: str = "x") -> None:
    """Validate ``t`` (integer, shape a prefix of ``x.shape``, values in ``[0, T-1]``)."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a Schedule, got {type(schedule).__name__}")
    if not isinstance(t, Tensor):
        raise TypeError(f"t must be an integer Tensor, got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"t must be an integer tensor (e.g. int64), got dtype {t.dtype}")
    if not isinstance(x, Tensor) or not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point Tensor, got {getattr(x, 'dtype', x)!r}")
    if t.dim() > x.dim() or tuple(x.shape[: t.dim()]) != tuple(t.shape):
        raise ValueError(
            f"t must have shape equal to the leading dims of {name}: {name} has shape "
            f"{tuple(x.shape)}, t has shape {tuple(t.shape)}"
        )
    if t.numel() and not _tracing():
        T = schedule.num_timesteps
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= T:
            raise ValueError(f"t must lie in [0, T-1] = [0, {T - 1}], got values in [{lo}, {hi}]")


def extract(coef: Tensor, t: Tensor, x: Tensor) -> Tensor:
    """``coef[t]`` cast to ``x``'s dtype/device and shaped to broadcast over ``x``."""
    c = coef.to(x.device)[t.to(x.device)].to(x.dtype)  # t.shape
    return c.reshape(tuple(t.shape) + (1,) * (x.dim() - t.dim()))


def q_sample(schedule: Schedule, x0: Tensor, t: Tensor, noise: Tensor) -> Tensor:
    """Sample ``x_t ~ q(x_t | x_0)``: ``sqrt(abar_t) x0 + sqrt(1 - abar_t) noise``.

    Args:
        schedule: the noise schedule.
        x0: ``(B, ...)`` clean data.
        t: ``(B,)`` integer timesteps in ``[0, T-1]``.
        noise: ``(B, ...)`` standard normal noise, same shape as ``x0``.

    Returns:
        ``x_t``: ``(B, ...)``, in ``x0``'s dtype. Equals diffusers' ``scheduler.add_noise``.

    Example::

        >>> from torchfn.transforms.diffusion import linear_schedule
        >>> s = linear_schedule(1000)
        >>> x0 = torch.ones(4, 2); eps = torch.zeros(4, 2)
        >>> q_sample(s, x0, torch.tensor([0, 1, 2, 999]), eps).shape
        torch.Size([4, 2])
    """
    check_timesteps(schedule, t, x0, "x0")
    if not isinstance(noise, Tensor) or noise.shape != x0.shape:
        raise ValueError(
            f"noise must have the shape of x0 {tuple(x0.shape)}, got "
            f"{tuple(noise.shape) if isinstance(noise, Tensor) else type(noise).__name__}"
        )
    return (
        extract(schedule.sqrt_alphas_cumprod, t, x0) * x0
        + extract(schedule.sqrt_one_minus_alphas_cumprod, t, x0) * noise
    )


def velocity(schedule: Schedule, x0: Tensor, t: Tensor, noise: Tensor) -> Tensor:
    """The v-prediction target (Salimans & Ho 2022): ``sqrt(abar_t) noise - sqrt(1-abar_t) x0``.

    Example::

        >>> from torchfn.transforms.diffusion import linear_schedule
        >>> v = velocity(linear_schedule(10), torch.ones(3, 2), torch.tensor([0, 5, 9]),
        ...              torch.ones(3, 2))
    """
    check_timesteps(schedule, t, x0, "x0")
    return (
        extract(schedule.sqrt_alphas_cumprod, t, x0) * noise
        - extract(schedule.sqrt_one_minus_alphas_cumprod, t, x0) * x0
    )


def predict_x0_from_eps(schedule: Schedule, x_t: Tensor, t: Tensor, eps: Tensor) -> Tensor:
    """``x0 = (x_t - sqrt(1 - abar_t) eps) / sqrt(abar_t)``.

    Example::

        >>> from torchfn.transforms.diffusion import linear_schedule
        >>> s = linear_schedule(10); t = torch.tensor([3])
        >>> x0 = predict_x0_from_eps(s, torch.ones(1, 2), t, torch.zeros(1, 2))
    """
    check_timesteps(schedule, t, x_t, "x_t")
    return (
        extract(schedule.sqrt_recip_alphas_cumprod, t, x_t) * x_t
        - extract(schedule.sqrt_recipm1_alphas_cumprod, t, x_t) * eps
    )


def predict_eps_from_x0(schedule: Schedule, x_t: Tensor, t: Tensor, x0: Tensor) -> Tensor:
    """``eps = (x_t - sqrt(abar_t) x0) / sqrt(1 - abar_t)``.

    Example::

        >>> from torchfn.transforms.diffusion import linear_schedule
        >>> s = linear_schedule(10); t = torch.tensor([3])
        >>> eps = predict_eps_from_x0(s, torch.ones(1, 2), t, torch.zeros(1, 2))
    """
    check_timesteps(schedule, t, x_t, "x_t")
    return (extract(schedule.sqrt_recip_alphas_cumprod, t, x_t) * x_t - x0) / extract(
        schedule.sqrt_recipm1_alphas_cumprod, t, x_t
    )


def predict_x0_from_v(schedule: Schedule, x_t: Tensor, t: Tensor, v: Tensor) -> Tensor:
    """``x0 = sqrt(abar_t) x_t - sqrt(1 - abar_t) v``.

    Example::

        >>> from torchfn.transforms.diffusion import linear_schedule
        >>> s = linear_schedule(10); t = torch.tensor([3])
        >>> x0 = predict_x0_from_v(s, torch.ones(1, 2), t, torch.zeros(1, 2))
    """
    check_timesteps(schedule, t, x_t, "x_t")
    return (
        extract(schedule.sqrt_alphas_cumprod, t, x_t) * x_t
        - extract(schedule.sqrt_one_minus_alphas_cumprod, t, x_t) * v
    )


def predict_eps_from_v(schedule: Schedule, x_t: Tensor, t: Tensor, v: Tensor) -> Tensor:
    """``eps = sqrt(1 - abar_t) x_t + sqrt(abar_t) v``.

    Example::

        >>> from torchfn.transforms.diffusion import linear_schedule
        >>> s = linear_schedule(10); t = torch.tensor([3])
        >>> eps = predict_eps_from_v(s, torch.ones(1, 2), t, torch.zeros(1, 2))
    """
    check_timesteps(schedule, t, x_t, "x_t")
    return (
        extract(schedule.sqrt_one_minus_alphas_cumprod, t, x_t) * x_t
        + extract(schedule.sqrt_alphas_cumprod, t, x_t) * v
    )


def q_posterior(
    schedule: Schedule, x0: Tensor, x_t: Tensor, t: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Mean, variance and clipped log-variance of ``q(x_{t-1} | x_t, x_0)``.

    Returns:
        ``(mean, variance, log_variance)``: mean ``(B, ...)``; variance and log-variance
        ``(B, 1, ..., 1)`` broadcastable against it.

    Example::

        >>> from torchfn.transforms.diffusion import linear_schedule
        >>> s = linear_schedule(10); t = torch.tensor([3, 4])
        >>> mean, var, logvar = q_posterior(s, torch.zeros(2, 5), torch.ones(2, 5), t)
    """
    check_timesteps(schedule, t, x_t, "x_t")
    mean = (
        extract(schedule.posterior_mean_coef1, t, x_t) * x0
        + extract(schedule.posterior_mean_coef2, t, x_t) * x_t
    )
    return (
        mean,
        extract(schedule.posterior_variance, t, x_t),
        extract(schedule.posterior_log_variance_clipped, t, x_t),
    )


def to_x0_eps(
    schedule: Schedule, x_t: Tensor, t: Tensor, out: Tensor, prediction: str
) -> tuple[Tensor, Tensor]:
    """Convert a model output of kind ``prediction`` to ``(x0_hat, eps_hat)``."""
    if prediction == "eps":
        return predict_x0_from_eps(schedule, x_t, t, out), out
    if prediction == "x0":
        return out, predict_eps_from_x0(schedule, x_t, t, out)
    if prediction == "v":
        return predict_x0_from_v(schedule, x_t, t, out), predict_eps_from_v(schedule, x_t, t, out)
    raise ValueError(f"prediction must be one of {PREDICTIONS}, got {prediction!r}")
