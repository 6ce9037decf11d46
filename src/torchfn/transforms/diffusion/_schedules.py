"""Noise schedules for discrete-time diffusion (DDPM), computed in float64.

A :class:`Schedule` is a NamedTuple of ``(T,)`` float64 tensors, so it is a
pytree: move it with ``torchfn.tree.map(lambda a: a.to(device), schedule)``.
Indices follow the DDPM convention ``t = 0 .. T-1`` (diffusers' convention), where
``t = 0`` is the first (least noisy) step.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "Schedule",
    "schedule_from_betas",
    "linear_schedule",
    "cosine_schedule",
    "sigmoid_schedule",
]


class Schedule(NamedTuple):
    """Every per-timestep coefficient DDPM/DDIM need, each a ``(T,)`` float64 tensor.

    With ``abar_t = prod_{s<=t} (1 - beta_s)``:

    * ``q(x_t | x_0) = N(sqrt(abar_t) x_0, (1 - abar_t) I)``
    * ``q(x_{t-1} | x_t, x_0) = N(coef1_t x_0 + coef2_t x_t, posterior_variance_t I)``
    * ``snr_t = abar_t / (1 - abar_t)``
    """

    betas: Tensor
    alphas: Tensor
    alphas_cumprod: Tensor
    alphas_cumprod_prev: Tensor  # abar_{t-1}, with abar_{-1} = 1
    sqrt_alphas_cumprod: Tensor
    sqrt_one_minus_alphas_cumprod: Tensor
    sqrt_recip_alphas_cumprod: Tensor  # 1 / sqrt(abar_t)
    sqrt_recipm1_alphas_cumprod: Tensor  # sqrt(1 / abar_t - 1)
    posterior_variance: Tensor  # beta_t (1 - abar_{t-1}) / (1 - abar_t); 0 at t = 0
    posterior_log_variance_clipped: Tensor  # log posterior variance, t = 0 entry uses t = 1
    posterior_mean_coef1: Tensor  # multiplies x_0
    posterior_mean_coef2: Tensor  # multiplies x_t
    snr: Tensor

    @property
    def num_timesteps(self) -> int:
        """``T``, the number of diffusion steps."""
        return self.betas.shape[0]


def _check_T(T: int) -> None:
    if isinstance(T, bool) or not isinstance(T, int):
        raise TypeError(f"T must be an int, got {type(T).__name__}")
    if T < 1:
        raise ValueError(f"T must be >= 1, got {T}")


def schedule_from_betas(betas: Tensor) -> Schedule:
    """Build a :class:`Schedule` from a ``(T,)`` tensor of betas in ``(0, 1)``.

    All coefficients are computed in float64, whatever the input dtype.

    Example::

        >>> s = schedule_from_betas(torch.full((10,), 0.1))
        >>> round(float(s.alphas_cumprod[-1]), 4)
        0.3487
    """
    if not isinstance(betas, Tensor):
        raise TypeError(f"betas must be a Tensor, got {type(betas).__name__}")
    if betas.dim() != 1 or betas.shape[0] < 1:
        raise ValueError(f"betas must have shape (T,) with T >= 1, got {tuple(betas.shape)}")
    betas = betas.detach().to(torch.float64)
    if not torch.isfinite(betas).all() or (betas <= 0).any() or (betas >= 1).any():
        lo, hi = float(betas.min()), float(betas.max())
        raise ValueError(f"betas must lie in the open interval (0, 1), got values in [{lo}, {hi}]")

    alphas = 1.0 - betas
    abar = torch.cumprod(alphas, dim=0)
    abar_prev = torch.cat([abar.new_ones(1), abar[:-1]])
    post_var = betas * (1.0 - abar_prev) / (1.0 - abar)
    # log of the posterior variance, which is 0 at t = 0: reuse the t = 1 value there
    # (Ho et al.'s reference code); with T = 1 there is no t = 1, keep a tiny floor.
    floor = post_var[1] if post_var.shape[0] > 1 else post_var.new_tensor(1e-20)
    post_log_var = torch.log(torch.cat([floor.reshape(1), post_var[1:]]))
    return Schedule(
        betas=betas,
        alphas=alphas,
        alphas_cumprod=abar,
        alphas_cumprod_prev=abar_prev,
        sqrt_alphas_cumprod=abar.sqrt(),
        sqrt_one_minus_alphas_cumprod=(1.0 - abar).sqrt(),
        sqrt_recip_alphas_cumprod=abar.rsqrt(),
        sqrt_recipm1_alphas_cumprod=(1.0 / abar - 1.0).sqrt(),
        posterior_variance=post_var,
        posterior_log_variance_clipped=post_log_var,
        posterior_mean_coef1=betas * abar_prev.sqrt() / (1.0 - abar),
        posterior_mean_coef2=(1.0 - abar_prev) * alphas.sqrt() / (1.0 - abar),
        snr=abar / (1.0 - abar),
    )


def linear_schedule(T: int, beta_start: float = 1e-4, beta_end: float = 0.02) -> Schedule:
    """Ho et al. (2020): ``beta_t`` linear from ``beta_start`` to ``beta_end`` over ``T`` steps.

    Equals diffusers' ``DDPMScheduler(beta_schedule="linear")`` (computed there in float32).

    Example::

        >>> s = linear_schedule(1000)
        >>> s.betas.shape, s.betas.dtype
        (torch.Size([1000]), torch.float64)
    """
    _check_T(T)
    for name, b in (("beta_start", beta_start), ("beta_end", beta_end)):
        if not 0.0 < float(b) < 1.0:
            raise ValueError(f"{name} must lie in (0, 1), got {b}")
    return schedule_from_betas(torch.linspace(beta_start, beta_end, T, dtype=torch.float64))


def cosine_schedule(T: int, s: float = 0.008, max_beta: float = 0.999) -> Schedule:
    """Nichol & Dhariwal (2021): ``abar(u) = cos((u + s) / (1 + s) * pi / 2)^2``, ``u = t / T``.

    ``beta_t = min(1 - abar((t + 1) / T) / abar(t / T), max_beta)``; with the defaults this
    equals diffusers' ``beta_schedule="squaredcos_cap_v2"``.

    Example::

        >>> s = cosine_schedule(1000)
        >>> float(s.betas.max())
        0.999
    """
    _check_T(T)
    if not s >= 0.0:
        raise ValueError(f"s must be >= 0, got {s}")
    if not 0.0 < max_beta < 1.0:
        raise ValueError(f"max_beta must lie in (0, 1), got {max_beta}")
    u = torch.arange(T + 1, dtype=torch.float64) / T
    abar = torch.cos((u + s) / (1.0 + s) * math.pi / 2) ** 2
    betas = (1.0 - abar[1:] / abar[:-1]).clamp(max=max_beta)
    return schedule_from_betas(betas)


def sigmoid_schedule(
    T: int, start: float = -3.0, end: float = 3.0, tau: float = 1.0, max_beta: float = 0.999
) -> Schedule:
    """Chen (2023), "On the importance of noise scheduling": a sigmoid-shaped ``abar``.

    With ``u = t / T`` for ``t = 0 .. T`` and ``sig`` the logistic function::

        f(u)    = sig(((end - start) * u + start) / tau)
        abar(u) = (sig(end / tau) - f(u)) / (sig(end / tau) - sig(start / tau))
        beta_t  = min(1 - abar((t + 1) / T) / abar(t / T), max_beta)

    ``abar`` falls from 1 to 0; a larger ``tau`` makes it closer to linear in ``u``.
    (This is the ``abar``-sigmoid of Chen and of lucidrains' ``sigmoid_beta_schedule``, not
    diffusers' ``"sigmoid"`` beta schedule, which puts a sigmoid on the betas.)

    Example::

        >>> s = sigmoid_schedule(1000)
        >>> bool((s.alphas_cumprod[1:] < s.alphas_cumprod[:-1]).all())
        True
    """
    _check_T(T)
    if not tau > 0.0:
        raise ValueError(f"tau must be > 0, got {tau}")
    if not start < end:
        raise ValueError(f"start must be < end, got start={start}, end={end}")
    if not 0.0 < max_beta < 1.0:
        raise ValueError(f"max_beta must lie in (0, 1), got {max_beta}")
    u = torch.arange(T + 1, dtype=torch.float64) / T
    v_start = torch.sigmoid(torch.tensor(start / tau, dtype=torch.float64))
    v_end = torch.sigmoid(torch.tensor(end / tau, dtype=torch.float64))
    abar = (v_end - torch.sigmoid(((end - start) * u + start) / tau)) / (v_end - v_start)
    betas = (1.0 - abar[1:] / abar[:-1]).clamp(min=1e-12, max=max_beta)
    return schedule_from_betas(betas)
