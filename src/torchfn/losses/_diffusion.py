"""The DDPM training loss for eps, x0 and v prediction, with optional min-SNR-gamma weighting."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from torchfn import random

if TYPE_CHECKING:
    from torchfn.transforms.diffusion import Schedule

__all__ = ["diffusion_loss", "min_snr_weight"]

_PREDICTIONS = ("eps", "x0", "v")


def min_snr_weight(snr: Tensor, gamma: float | None, prediction: str = "eps") -> Tensor:
    """Per-timestep loss weight of min-SNR-gamma (Hang et al. 2023), elementwise in ``snr``.

    The weight that turns each parameterisation's plain MSE into the x0-MSE weighted by
    ``min(snr, gamma)``:

    * ``"eps"``: ``min(snr, gamma) / snr``
    * ``"x0"``:  ``min(snr, gamma)``
    * ``"v"``:   ``min(snr, gamma) / (snr + 1)``

    ``gamma=None`` gives weight 1 (the plain loss).

    Example::

        >>> min_snr_weight(torch.tensor([0.5, 5.0, 50.0], dtype=torch.float64), 5.0).tolist()
        [1.0, 1.0, 0.1]
    """
    if prediction not in _PREDICTIONS:
        raise ValueError(f"prediction must be one of {_PREDICTIONS}, got {prediction!r}")
    if gamma is None:
        return torch.ones_like(snr)
    if not gamma > 0:
        raise ValueError(f"min_snr_gamma must be None or > 0, got {gamma}")
    clipped = snr.clamp(max=gamma)
    if prediction == "eps":
        return clipped / snr
    if prediction == "x0":
        return clipped
    return clipped / (snr + 1.0)


def diffusion_loss(
    model_fn: Callable[[Tensor, Tensor], Tensor],
    schedule: Schedule,
    x0: Tensor,
    key: Tensor,
    *,
    prediction: str = "eps",
    min_snr_gamma: float | None = None,
) -> Tensor:
    """Denoising loss of Ho et al. (2020): ``mean_b w_b * mean_d (model(x_t, t) - target)^2``.

    For each example ``t ~ U{0, .., T-1}`` and ``noise ~ N(0, I)`` are drawn from ``key``,
    ``x_t = q_sample(schedule, x0, t, noise)``, and the target is ``noise`` (``"eps"``),
    ``x0`` (``"x0"``) or ``velocity(x0, t, noise)`` (``"v"``). ``w_b`` is 1, or the
    min-SNR-gamma weight (:func:`min_snr_weight`) when ``min_snr_gamma`` is given.

    Args:
        model_fn: ``model_fn(x_t, t) -> (B, ...)`` with ``x_t: (B, ...)`` and ``t: (B,)`` int64;
            close over the parameters (``lambda x, t: model.apply(params, x, t)``) and take
            ``grad`` of this loss with respect to them.
        schedule: a :class:`~torchfn.transforms.diffusion.Schedule`.
        x0: ``(B, ...)`` clean data.
        key: PRNG key for the timesteps and the noise.

    Returns:
        The scalar loss, in ``x0``'s dtype.

    Example::

        >>> from torchfn.transforms.diffusion import linear_schedule
        >>> s = linear_schedule(100)
        >>> loss = diffusion_loss(lambda x, t: 0.5 * x, s, torch.ones(8, 2), random.key(0))
    """
    from torchfn.transforms.diffusion import Schedule, q_sample, velocity

    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a Schedule, got {type(schedule).__name__}")
    if prediction not in _PREDICTIONS:
        raise ValueError(f"prediction must be one of {_PREDICTIONS}, got {prediction!r}")
    if not isinstance(x0, Tensor) or not x0.dtype.is_floating_point or x0.dim() < 1:
        raise TypeError(
            "x0 must be a floating-point Tensor of shape (B, ...), got "
            f"{getattr(x0, 'dtype', type(x0).__name__)}"
        )
    if min_snr_gamma is not None and not min_snr_gamma > 0:
        raise ValueError(f"min_snr_gamma must be None or > 0, got {min_snr_gamma}")

    B = x0.shape[0]
    k_t, k_noise = random.split(key)
    t = random.randint(k_t, (B,), 0, schedule.num_timesteps).to(x0.device, torch.int64)  # (B,)
    noise = random.normal(k_noise, tuple(x0.shape), dtype=x0.dtype).to(x0.device)  # (B, ...)
    x_t = q_sample(schedule, x0, t, noise)  # (B, ...)
    if prediction == "eps":
        target = noise
    elif prediction == "x0":
        target = x0
    else:
        target = velocity(schedule, x0, t, noise)

    out = model_fn(x_t, t)
    if not isinstance(out, Tensor) or out.shape != x0.shape:
        got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(f"model_fn(x_t, t) must return x0's shape {tuple(x0.shape)}, got {got}")
    per_example = (out - target).pow(2).reshape(B, -1).mean(dim=1)  # (B,)
    if min_snr_gamma is None:
        return per_example.mean()
    snr = schedule.snr.to(x0.device)[t]  # (B,) float64
    w = min_snr_weight(snr, min_snr_gamma, prediction).to(x0.dtype)  # (B,)
    return (w * per_example).mean()
