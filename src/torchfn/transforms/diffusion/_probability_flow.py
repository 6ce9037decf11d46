"""The probability-flow ODE of the VP SDE: deterministic sampling and exact likelihoods.

DDPM's forward process is, in continuous time (Song et al. 2021), the VP SDE

    dx = -1/2 beta(t) x dt + sqrt(beta(t)) dW,   beta(t) = beta_min + t (beta_max - beta_min)

on t in [0, 1], with ``x_t = sqrt(abar(t)) x_0 + sigma(t) eps``,
``abar(t) = exp(-beta_min t - (beta_max - beta_min) t^2 / 2)`` and
``sigma(t) = sqrt(1 - abar(t))``. Its probability-flow ODE has the same marginals:

    dx/dt = -1/2 beta(t) (x - eps(x, t) / sigma(t))

where ``eps`` is the noise-prediction model (the score is ``-eps / sigma``).
Integrating it from N(0, I) at t = 1 down to t = ``t_min`` samples the model
deterministically; integrating a data point up to t = 1, with the change of variables
``d log p / dt = -tr(df/dx)``, gives its exact log-likelihood under the model. Both run
``transforms.odeint`` (adaptive), so they differentiate and take their noise from keys.

With the defaults (beta_min 0.1, beta_max 20) this is the continuous limit of
``linear_schedule(1000)``; ``model_fn`` gets the time as ``t * time_scale`` (float),
so a model trained on that schedule's integer timesteps is queried between them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.func import vjp

from torchfn import random
from torchfn.transforms._odeint import odeint

__all__ = ["vp_alpha_bar", "probability_flow_sample", "probability_flow_log_likelihood",
           "reverse_sde_sample"]


def vp_alpha_bar(t: Tensor, beta_min: float = 0.1, beta_max: float = 20.0) -> Tensor:
    """``abar(t) = exp(-beta_min t - (beta_max - beta_min) t^2 / 2)`` of the VP SDE.

    Example::

        >>> import torch
        >>> from torchfn.transforms import diffusion
        >>> ab = diffusion.vp_alpha_bar(torch.tensor([0.0, 1.0], dtype=torch.float64))
        >>> [f"{v:.4e}" for v in ab.tolist()]              # exp(-0.1 - 9.95) at t = 1
        ['1.0000e+00', '4.3186e-05']
    """
    return torch.exp(-beta_min * t - 0.5 * (beta_max - beta_min) * t * t)


def _field(model_fn, beta_min, beta_max, time_scale):
    def f(x: Tensor, t: Tensor, *model_args) -> Tensor:  # x: (B, ...), t: ()
        beta = beta_min + t * (beta_max - beta_min)
        sigma = torch.sqrt(-torch.expm1(-beta_min * t - 0.5 * (beta_max - beta_min) * t * t))
        labels = (t * time_scale).expand(x.shape[0]).to(x.dtype)
        eps = model_fn(x, labels, *model_args)
        if not isinstance(eps, Tensor) or eps.shape != x.shape:
            got = tuple(eps.shape) if isinstance(eps, Tensor) else type(eps).__name__
            raise ValueError(f"probability flow: model_fn(x, t) must return x's shape "
                             f"{tuple(x.shape)}, got {got}")
        return -0.5 * beta * (x - eps / sigma)

    return f


def probability_flow_sample(model_fn: Callable[..., Tensor], shape: Sequence[int],
                            key: Tensor, *model_args, beta_min: float = 0.1, beta_max: float = 20.0,
                            time_scale: float = 999.0, t_min: float = 1e-3,
                            rtol: float = 1e-5, atol: float = 1e-5,
                            dtype: torch.dtype = torch.float32) -> Tensor:
    """Samples by the probability-flow ODE, from ``x(1) ~ N(0, I)`` (drawn from ``key``).

    Args:
        model_fn: ``model_fn(x, t, *model_args) -> eps``, ``x: (B, ...)``, ``t: (B,)``
            float in ``[0, time_scale]``.
        shape: ``(B, ...)``.
        *model_args: the model's parameters (differentiated through the ODE's adjoint;
            a model that closes over parameters being differentiated is refused).
        t_min: where the integration stops (the ODE is stiff at 0).

    Returns:
        ``x(t_min)``: (B, ...), deterministic given ``key``.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> from torchfn.transforms import diffusion
        >>> eps_fn = lambda x, t: torch.zeros_like(x)      # a model of N(0, I) data
        >>> diffusion.probability_flow_sample(eps_fn, (4, 2), random.key(0)).shape
        torch.Size([4, 2])
    """
    f = _field(model_fn, beta_min, beta_max, time_scale)
    x1 = random.normal(key, tuple(shape), dtype=dtype)
    s = torch.tensor([0.0, 1.0 - t_min], dtype=dtype)  # s = 1 - t runs forward
    return odeint(lambda x, s, *a: -f(x, 1.0 - s, *a), x1, s, *model_args, rtol=rtol,
                  atol=atol)[-1]


def reverse_sde_sample(model_fn: Callable[..., Tensor], shape: Sequence[int], key: Tensor,
                       *model_args, dt: float = 1e-3, beta_min: float = 0.1,
                       beta_max: float = 20.0, time_scale: float = 999.0, t_min: float = 1e-3,
                       dtype: torch.dtype = torch.float32) -> Tensor:
    """Samples by the reverse-time VP SDE (Song et al. 2021), Euler-Maruyama steps of ``dt``.

    ``dx = [1/2 beta x - beta eps / sigma] ds + sqrt(beta) dW`` in ``s = 1 - t``, from
    ``x(1) ~ N(0, I)`` to ``t_min``, on ``transforms.sdeint``: the start and the Brownian
    path both come from ``key`` (so ``vmap`` over keys gives independent samplers).

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> from torchfn.transforms import diffusion
        >>> eps_fn = lambda x, t: torch.zeros_like(x)      # a model of N(0, I) data
        >>> diffusion.reverse_sde_sample(eps_fn, (4, 2), random.key(0), dt=0.01).shape
        torch.Size([4, 2])
    """
    from torchfn.transforms._sdeint import sdeint

    k_start, k_path = random.split(key)
    x1 = random.normal(k_start, tuple(shape), dtype=dtype)

    def coefficients(s):
        t = 1.0 - s
        beta = beta_min + t * (beta_max - beta_min)
        sigma = torch.sqrt(-torch.expm1(-beta_min * t - 0.5 * (beta_max - beta_min) * t * t))
        return t, beta, sigma

    def drift(x, s, *model_args):
        t, beta, sigma = coefficients(s)
        eps = model_fn(x, (t * time_scale).expand(x.shape[0]).to(x.dtype), *model_args)
        return 0.5 * beta * x - beta * eps / sigma  # the score is -eps / sigma

    def diffusion(x, s, *model_args):
        return torch.sqrt(coefficients(s)[1]) * torch.ones_like(x)

    s = torch.tensor([0.0, 1.0 - t_min], dtype=dtype)
    return sdeint(drift, diffusion, x1, s, k_path, *model_args, dt=dt)[-1]


def probability_flow_log_likelihood(model_fn: Callable[..., Tensor], x: Tensor, *model_args,
                                    key: Tensor | None = None, samples: int = 1,
                                    beta_min: float = 0.1, beta_max: float = 20.0,
                                    time_scale: float = 999.0, t_min: float = 1e-3,
                                    rtol: float = 1e-5, atol: float = 1e-5) -> Tensor:
    """``log p(x)`` under the model, per example, by the probability-flow ODE (nats).

    ``log p(x) = log N(x(1); 0, I) + int_{t_min}^1 tr(df/dx) dt`` along the ODE from
    ``x`` at ``t_min``. The trace is exact with ``key=None`` (one vector-Jacobian
    product of the batched model per data dimension: small data) or Hutchinson's
    estimate from ``samples`` Rademacher probes drawn from ``key``, fixed along the
    path as FFJORD does (images). Divide by ``D log 2`` for bits per dimension (and
    correct for the data's dequantisation, which this does not do).

    Args:
        model_fn, model_args: as for :func:`probability_flow_sample`; the result
            differentiates in ``model_args`` (maximum-likelihood training).
        x: (B, ...) data.

    Returns:
        (B,) log-likelihoods.
    """
    f = _field(model_fn, beta_min, beta_max, time_scale)
    return ode_log_likelihood(f, x, model_args, key, samples, t_min, 1.0, rtol, atol)


def ode_log_likelihood(f: Callable[..., Tensor], x: Tensor, model_args: tuple,
                       key: Tensor | None, samples: int, t0: float, t1: float,
                       rtol: float, atol: float) -> Tensor:
    """``log N(x(t1); 0, I) + int_t0^t1 tr(df/dx) dt`` along ``dx/dt = f(x, t, *args)``
    from ``x(t0) = x``: (B,). The trace exact (``key=None``) or Hutchinson's, with
    ``samples`` Rademacher probes from ``key`` fixed along the path."""
    batch, dims = x.shape[0], math.prod(x.shape[1:])
    if key is None:  # every basis direction, the same for every example
        probes = torch.eye(dims, dtype=x.dtype, device=x.device).reshape(dims, 1, *x.shape[1:])
        probes = probes.expand(dims, *x.shape)
        scale = 1.0
    else:
        probes = random.rademacher(key, (samples, *x.shape), dtype=x.dtype)
        scale = 1.0 / samples

    def augmented(state: Tensor, t: Tensor, *model_args) -> Tensor:  # state: (B, D + 1)
        y = state[:, :dims].reshape(x.shape)
        fy, pull = vjp(lambda y: f(y, t, *model_args), y)
        # the model treats examples independently: its Jacobian is block diagonal, so
        # one batched product per probe gives every example's v^T J_b v at once. (A loop:
        # vmap over this pull inside odeint's forward under grad trips a functorch assert.)
        div = sum((pull(v)[0] * v).reshape(batch, -1).sum(-1) for v in probes)  # (B,)
        div = scale * div
        return torch.cat([fy.reshape(batch, dims), div[:, None]], -1)

    state0 = torch.cat([x.reshape(batch, dims), torch.zeros(batch, 1, dtype=x.dtype,
                                                            device=x.device)], -1)
    t = torch.tensor([t0, t1], dtype=x.dtype)
    state1 = odeint(augmented, state0, t, *model_args, rtol=rtol, atol=atol)[-1]
    z, delta = state1[:, :dims], state1[:, dims]
    prior = -0.5 * (z * z).sum(-1) - 0.5 * dims * math.log(2 * math.pi)
    return prior + delta
