"""EDM (Karras et al. 2022, "Elucidating the design space of diffusion models"):
preconditioning, noise levels and the stochastic Heun sampler.

EDM works with ``x_sigma = x0 + sigma eps`` (variance exploding) and a denoiser
``D(x, sigma) ~ E[x0 | x_sigma = x]``. The network ``F`` is wrapped so that its inputs
and targets have unit variance at every level (the "preconditioning"):

    D(x, sigma) = c_skip x + c_out F(c_in x, c_noise)
    c_skip = sd^2 / (sigma^2 + sd^2)      c_out = sigma sd / sqrt(sigma^2 + sd^2)
    c_in = 1 / sqrt(sigma^2 + sd^2)       c_noise = log(sigma) / 4

(``sd`` is ``sigma_data``, the data's standard deviation). Sampling integrates the
probability-flow ODE ``dx/dsigma = (x - D(x, sigma)) / sigma`` over levels spaced evenly in
``sigma^(1/rho)``, with Heun's method and optional "churn": at each level a little noise
is added to raise ``sigma`` to ``sigma (1 + gamma)`` before the step (Algorithm 2).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from torchfn.transforms._noise import NoiseStream
from torchfn.transforms.diffusion._dpm_solver import log_snr, order_at, update
from torchfn.transforms.diffusion._samplers import (
    _check_levels,
    _check_out,
    _check_shape,
    _init,
    _progress,
)

__all__ = ["edm_sigmas", "edm_scalings", "edm_denoiser", "edm_sample"]

METHODS = ("heun", "euler", "dpm_solver")


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a float > 0, got {value!r}")
    return float(value)


def edm_sigmas(steps: int, *, sigma_min: float = 0.002, sigma_max: float = 80.0,
               rho: float = 7.0) -> Tensor:
    """The ``(steps + 1,)`` float64 levels of Karras et al.: ``steps`` levels from
    ``sigma_max`` to ``sigma_min`` evenly spaced in ``sigma^(1/rho)``, then a final 0
    (diffusers' ``EDMEulerScheduler.set_timesteps(steps).sigmas``).

    Example::

        >>> [round(s, 3) for s in edm_sigmas(4).tolist()]
        [80.0, 9.723, 0.47, 0.002, 0.0]
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    lo, hi = _positive("sigma_min", sigma_min), _positive("sigma_max", sigma_max)
    rho = _positive("rho", rho)
    if not lo < hi:
        raise ValueError(f"sigma_min must be < sigma_max, got {lo} and {hi}")
    ramp = torch.linspace(0, 1, steps, dtype=torch.float64)
    levels = (hi ** (1 / rho) + ramp * (lo ** (1 / rho) - hi ** (1 / rho))) ** rho
    return torch.cat([levels, levels.new_zeros(1)])


def edm_scalings(sigma: Tensor, sigma_data: float = 0.5) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """EDM's preconditioning ``(c_skip, c_out, c_in, c_noise)`` at levels ``sigma``
    (any shape; each result has ``sigma``'s shape).

    Example::

        >>> c_skip, c_out, c_in, c_noise = edm_scalings(torch.tensor([0.5]))
        >>> [round(float(c), 4) for c in (c_skip, c_out, c_in, c_noise)]
        [0.5, 0.3536, 1.4142, -0.1733]
    """
    sd = _positive("sigma_data", sigma_data)
    if not isinstance(sigma, Tensor) or not sigma.dtype.is_floating_point:
        raise TypeError(f"sigma must be a floating-point Tensor, got {type(sigma).__name__}")
    total = sigma * sigma + sd * sd
    return sd * sd / total, sigma * sd * total.rsqrt(), total.rsqrt(), sigma.log() / 4


def edm_denoiser(net_fn: Callable[..., Tensor], sigma_data: float = 0.5
                 ) -> Callable[..., Tensor]:
    """Wraps a raw network ``F(x_in, c_noise, *args) -> (B, ...)`` into EDM's denoiser
    ``D(x, sigma, *args) = c_skip x + c_out F(c_in x, c_noise, *args)``, with ``x: (B, ...)``
    and ``sigma: (B,)``. This is what :func:`edm_sample` and
    :func:`torchfn.losses.edm_loss` call.

    Example::

        >>> D = edm_denoiser(lambda x_in, c_noise: torch.zeros_like(x_in))
        >>> D(torch.ones(2, 3), torch.full((2,), 0.5))       # c_skip * x
        tensor([[0.5000, 0.5000, 0.5000],
                [0.5000, 0.5000, 0.5000]])
    """
    if not callable(net_fn):
        raise TypeError(f"net_fn must be callable, got {type(net_fn).__name__}")
    _positive("sigma_data", sigma_data)

    def denoise(x: Tensor, sigma: Tensor, *args) -> Tensor:
        if sigma.shape != x.shape[:1]:
            raise ValueError(f"sigma must have shape (B,) = {tuple(x.shape[:1])}, got "
                             f"{tuple(sigma.shape)}")
        c_skip, c_out, c_in, c_noise = edm_scalings(sigma, sigma_data)  # each (B,)
        view = (-1,) + (1,) * (x.dim() - 1)
        out = net_fn(c_in.view(view) * x, c_noise, *args)
        _check_out(out, x)
        return c_skip.view(view) * x + c_out.view(view) * out

    return denoise


def edm_sample(
    denoiser_fn: Callable[[Tensor, Tensor], Tensor],
    shape: Sequence[int],
    key: Tensor,
    *,
    steps: int = 18,
    method: str = "heun",
    sigma_min: float = 0.002,
    sigma_max: float = 80.0,
    rho: float = 7.0,
    sigmas: Sequence[float] | Tensor | None = None,
    order: int = 2,
    churn: float = 0.0,
    churn_min: float = 0.0,
    churn_max: float = math.inf,
    noise_scale: float = 1.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    return_chain: bool = False,
    progress: bool = False,
) -> Tensor:
    """Karras et al.'s sampler (Algorithm 2): from ``x = sigma_0 z`` down the levels,
    each step (optionally) churned and then an Euler or Heun step of
    ``dx/dsigma = (x - D(x, sigma)) / sigma``.

    With ``churn > 0``, at levels in ``[churn_min, churn_max]`` the step first raises the
    level to ``sigma_hat = sigma (1 + gamma)``, ``gamma = min(churn / steps, sqrt(2) - 1)``,
    by adding ``sqrt(sigma_hat^2 - sigma^2) noise_scale z``, and then evaluates the
    denoiser there. The paper's ImageNet-64 settings are ``churn=40, churn_min=0.05,
    churn_max=50, noise_scale=1.003`` at 256 steps; ``churn=0`` (the default) is the
    deterministic ODE sampler, 2 ``steps`` - 1 denoiser calls with Heun.

    ``method="euler", churn=0`` equals diffusers' ``EDMEulerScheduler`` loop. With churn,
    diffusers evaluates the model before adding the noise (at ``sigma``, not
    ``sigma_hat``); this follows the paper. ``method="dpm_solver"`` is DPM-Solver++ of
    ``order`` 1-3 on these levels (``x = x0 + sigma eps``: alpha = 1, lambda = -log
    sigma), one call per step, equal to diffusers' ``EDMDPMSolverMultistepScheduler``.

    Args:
        denoiser_fn: ``D(x, sigma) -> (B, ...)``, ``sigma: (B,)`` float (every entry the
            same); a raw network goes through :func:`edm_denoiser` first.
        shape: ``(B, ...)``.
        key: PRNG key (the start from ``split(key)[0]``, the churn from ``split(key)[1]``).
        steps: levels before the final 0.
        method: ``"heun"`` (second order; Euler on the last step to 0), ``"euler"`` or
            ``"dpm_solver"`` (no churn).
        order: DPM-Solver's order, 1, 2 or 3.
        sigma_min, sigma_max, rho: the levels, see :func:`edm_sigmas`.
        sigmas: the levels themselves, decreasing, ending in 0.
        return_chain: also return every intermediate ``x``.

    Returns:
        ``(B, ...)`` samples, or ``(steps + 1, B, ...)`` with ``return_chain``.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> D = lambda x, sigma: torch.zeros_like(x)          # data at 0: D = 0
        >>> x = edm_sample(D, (4, 2), random.key(0), steps=6)
        >>> bool(x.abs().max() < 1e-5)
        True
    """
    if not callable(denoiser_fn):
        raise TypeError(f"denoiser_fn must be callable, got {type(denoiser_fn).__name__}")
    shape = _check_shape(shape)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if order not in (1, 2, 3) or isinstance(order, bool):
        raise ValueError(f"order must be 1, 2 or 3, got {order!r}")
    if method == "dpm_solver" and churn > 0:
        raise ValueError(f"churn is Algorithm 2's (heun / euler), not DPM-Solver's: got "
                         f"churn={churn!r} with method='dpm_solver'")
    for name, value in (("churn", churn), ("churn_min", churn_min), ("noise_scale", noise_scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{name} must be a float >= 0, got {value!r}")
    if sigmas is not None:
        levels = _check_levels(sigmas)
        steps = len(levels) - 1
    else:
        levels = edm_sigmas(steps, sigma_min=sigma_min, sigma_max=sigma_max, rho=rho).tolist()

    z, k_noise = _init(key, shape, dtype, device)  # (B, ...)
    x = levels[0] * z
    stream = NoiseStream(k_noise, shape, steps, dtype, x.device) if churn > 0 else None
    gamma_max = min(churn / steps, 2**0.5 - 1)
    B = shape[0]

    def slope(x: Tensor, level: float) -> Tensor:  # (x - D(x, sigma)) / sigma
        sigma = torch.full((B,), level, dtype=dtype, device=x.device)  # (B,)
        out = denoiser_fn(x, sigma)
        _check_out(out, x)
        return (x - out) / level

    if method == "dpm_solver":
        return _dpm_solver(denoiser_fn, x, levels, order, dtype, return_chain, progress)
    chain = [x] if return_chain else None
    for i in _progress(range(steps), steps, progress, f"edm ({method})"):
        s, s_next = levels[i], levels[i + 1]
        gamma = gamma_max if stream is not None and churn_min <= s <= churn_max else 0.0
        s_hat = s * (1.0 + gamma)
        if gamma > 0:
            x = x + (s_hat * s_hat - s * s) ** 0.5 * noise_scale * stream(i)
        d = slope(x, s_hat)
        x_next = x + (s_next - s_hat) * d
        if method == "heun" and s_next > 0:
            x_next = x + (s_next - s_hat) * 0.5 * (d + slope(x_next, s_next))
        x = x_next
        if chain is not None:
            chain.append(x)
    return torch.stack(chain) if chain is not None else x


def _dpm_solver(denoiser_fn: Callable[[Tensor, Tensor], Tensor], x: Tensor, levels: list[float],
                order: int, dtype: torch.dtype, return_chain: bool, progress: bool) -> Tensor:
    """DPM-Solver++ on ``x = x0 + sigma eps`` with the denoiser's ``x0``."""
    steps, B = len(levels) - 1, x.shape[0]
    lams = [log_snr(1.0, s) for s in levels]  # -log sigma
    chain = [x] if return_chain else None
    x0s: list[Tensor] = []
    for i in _progress(range(steps), steps, progress, "edm (dpm-solver++)"):
        sigma = torch.full((B,), levels[i], dtype=dtype, device=x.device)  # (B,)
        x0 = denoiser_fn(x, sigma)
        _check_out(x0, x)
        x0s = [*x0s[-(order - 1):], x0] if order > 1 else [x0]
        k = order_at(i, steps, order)
        x = update(x, x0s, lams[max(0, i + 1 - len(x0s)):i + 1], 1.0, levels[i + 1],
                   levels[i], lams[i + 1], k, None)
        if chain is not None:
            chain.append(x)
    return torch.stack(chain) if chain is not None else x
