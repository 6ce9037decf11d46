"""Rectified-flow / flow-matching sampling (Liu et al. 2022, Lipman et al. 2022), as
diffusers' ``FlowMatchEulerDiscreteScheduler`` and ``FlowMatchHeunDiscreteScheduler``
(Stable Diffusion 3, Flux).

Data ``x0`` and noise ``eps ~ N(0, I)`` are joined by straight lines,
``x_sigma = (1 - sigma) x0 + sigma eps`` for ``sigma`` in ``[0, 1]`` (``sigma = 1`` is
pure noise). A model trained with :func:`torchfn.losses.flow_matching_loss` predicts the
velocity ``v(x, sigma) ~ E[eps - x0 | x_sigma = x]``, and sampling integrates
``dx/dsigma = v`` from ``sigma = 1`` down to 0. The noise levels come from a
uniform grid bent toward the noisy end by ``shift`` (SD3 uses 3):
``sigma -> shift sigma / (1 + (shift - 1) sigma)``; Flux picks the shift from the image
size (``mu``, :func:`resolution_shift_mu`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
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
from torchfn.transforms.diffusion._unipc import unipc_run

__all__ = ["flow_sigmas", "flow_sample", "resolution_shift_mu"]

METHODS = ("euler", "heun", "dpm_solver", "unipc")


def _shifted(s: np.ndarray, shift: float) -> np.ndarray:
    return shift * s / (1.0 + (shift - 1.0) * s)


def resolution_shift_mu(seq_len: int, *, base_seq_len: int = 256, max_seq_len: int = 4096,
                        base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """Flux's ``mu`` for an image of ``seq_len`` latent tokens: linear in ``seq_len``
    from ``base_shift`` at ``base_seq_len`` to ``max_shift`` at ``max_seq_len`` (diffusers'
    ``calculate_shift``). Pass it to :func:`flow_sigmas` / :func:`flow_sample` as ``mu``;
    the shift is ``exp(mu)``.

    Example::

        >>> round(resolution_shift_mu(4096), 4)           # a 1024 x 1024 Flux image
        1.15
    """
    if max_seq_len == base_seq_len:
        raise ValueError(f"max_seq_len must differ from base_seq_len, both are {max_seq_len}")
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return float(seq_len * m + base_shift - m * base_seq_len)


def flow_sigmas(steps: int, *, shift: float = 1.0, mu: float | None = None,
                terminal: float | None = None, T: int = 1000) -> Tensor:
    """The ``(steps + 1,)`` float64 noise levels a flow sampler visits, from 1 down to 0.

    As diffusers' ``FlowMatchEulerDiscreteScheduler.set_timesteps(steps).sigmas`` (float64
    here, float32 there):

    * a uniform grid from 1 to ``sigma_min`` in ``steps`` points, bent by ``shift``:
      ``s -> shift s / (1 + (shift - 1) s)``. diffusers' ``sigma_min`` is the shifted
      ``1 / T`` (its training grid's smallest level), so the last level is shifted twice;
    * with ``mu`` (Flux's ``use_dynamic_shifting``), the grid runs to ``1 / T`` unshifted and
      is bent by ``exp(mu)`` once; ``shift`` must then stay 1;
    * with ``terminal`` (SD3.5's ``shift_terminal``), ``1 - sigma`` is stretched so that
      the last level before 0 is ``terminal``;
    * a final 0 is appended.

    Example::

        >>> [round(s, 4) for s in flow_sigmas(4, shift=3.0).tolist()]
        [1.0, 0.8577, 0.6022, 0.0089, 0.0]
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if isinstance(T, bool) or not isinstance(T, int) or T < 1:
        raise ValueError(f"T must be an int >= 1, got {T!r}")
    if not (isinstance(shift, (int, float)) and shift > 0):
        raise ValueError(f"shift must be a float > 0, got {shift!r}")
    if mu is not None and shift != 1.0:
        raise ValueError(f"give shift or mu (which sets shift = exp(mu)), not both: got "
                         f"shift={shift!r}, mu={mu!r}")
    if terminal is not None and not 0 < terminal < 1:
        raise ValueError(f"terminal must lie in (0, 1), got {terminal!r}")
    if terminal is not None and steps < 2:  # diffusers divides by zero here
        raise ValueError(f"terminal stretches the levels between 1 and the last: it needs "
                         f"steps >= 2, got {steps}")
    if mu is None:
        lo = float(_shifted(np.float64(1.0 / T), shift))
        s = _shifted(np.linspace(1.0, lo, steps), shift)
    else:
        s = _shifted(np.linspace(1.0, 1.0 / T, steps), math.exp(mu))
    if terminal is not None:
        one_minus = 1.0 - s
        s = 1.0 - one_minus / (one_minus[-1] / (1.0 - terminal))
    return torch.from_numpy(np.append(s, 0.0))


def flow_sample(
    velocity_fn: Callable[[Tensor, Tensor], Tensor],
    shape: Sequence[int],
    key: Tensor,
    *,
    steps: int = 28,
    method: str = "euler",
    shift: float = 1.0,
    mu: float | None = None,
    terminal: float | None = None,
    sigmas: Sequence[float] | Tensor | None = None,
    order: int = 2,
    stochastic: bool = False,
    time_scale: float = 1.0,
    T: int = 1000,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    return_chain: bool = False,
    progress: bool = False,
) -> Tensor:
    """Samples a flow-matching model by integrating ``dx/dsigma = v(x, sigma)`` from
    ``x ~ N(0, I)`` at ``sigma = 1`` down to ``sigma = 0``.

    * ``"euler"``: ``x <- x + (sigma_next - sigma) v(x, sigma)``, one model call per step;
      equal to diffusers' ``FlowMatchEulerDiscreteScheduler`` loop.
    * ``"heun"``: Heun's second-order step, two calls per step except the last (an Euler
      step to 0, where ``v`` is not needed twice); equal to
      ``FlowMatchHeunDiscreteScheduler``. On smooth fields its error falls as
      ``steps^-2`` against Euler's ``steps^-1``.
    * ``stochastic=True`` (Euler only): each step predicts ``x0 = x - sigma v`` and
      re-noises it to the next level with fresh noise,
      ``x <- (1 - sigma_next) x0 + sigma_next z`` (diffusers' ``stochastic_sampling``),
      the multistep sampling of distilled few-step models. It does not discretise a
      process with the model's marginals: with the exact field the predicted ``x0`` is a
      posterior mean, narrower than the posterior, and the samples come out narrower than
      the data at any number of steps (tested on Gaussian data).

    * ``"unipc"``: UniPC (bh2) of ``order`` 1-3 on diffusers' UniPC flow levels (a
      uniform grid from 1 to ``1 / T`` bent by the shift, the first moved to
      ``1 - 1e-6``, then 0), equal to ``UniPCMultistepScheduler(use_flow_sigmas=True,
      prediction_type="flow_prediction")``, as Wan samples.
    * ``"dpm_solver"``: DPM-Solver++ multistep of ``order`` 1-3 on the flow's Gaussian
      path (``alpha = 1 - sigma``), one call per step: diffusers'
      ``DPMSolverMultistepScheduler(use_flow_sigmas=True, flow_shift=shift,
      prediction_type="flow_prediction")`` step for step, on its levels (evenly down to
      0 from just below 1, not :func:`flow_sigmas`'), SANA's sampler. Order 1 is Euler's
      step.

    diffusers' levels stop at ``sigma_min`` (``1 / T``, shifted) before the final 0, and
    the step from there to 0 is an Euler step in both methods. That short last step
    makes Heun more accurate at usual step counts than a grid running to 0 (whose last,
    long step is Euler), but it leaves an error floor that more steps do not lower
    (about 3e-4 with shift 3 on Gaussian data; see bench/RESULTS.md). Pass ``sigmas``
    that run to 0 for a sampler that converges at order 2 without a floor.

    Deterministic given ``key``: the start from ``split(key)[0]``, the steps' noise from
    ``split(key)[1]``. The sampler does not touch grad mode, so it differentiates through
    ``velocity_fn``'s closed-over parameters, and it runs under ``vmap`` over keys.

    Args:
        velocity_fn: ``velocity_fn(x, t) -> (B, ...)`` with ``x: (B, ...)`` and
            ``t: (B,)`` float, ``t = sigma * time_scale`` (every entry the same).
        shape: ``(B, ...)``, the samples' shape.
        key: PRNG key.
        steps: levels before the final 0 (the number of Euler steps).
        method: ``"euler"``, ``"heun"``, ``"dpm_solver"`` or ``"unipc"``.
        order: the multistep solvers' order, 1, 2 or 3.
        shift, mu, terminal, T: the levels, see :func:`flow_sigmas`.
        sigmas: the levels themselves, decreasing from ``<= 1`` to a final 0 (``steps``
            is then ``len(sigmas) - 1``); not combined with the arguments above.
        time_scale: the model's time units per unit ``sigma``: 1 (the default, as
            :func:`torchfn.losses.flow_matching_loss` trains) or 1000 (diffusers' SD3
            transformer, which diffusers' pipelines call with ``sigma * 1000``).
        return_chain: also return every intermediate ``x``.

    Returns:
        ``(B, ...)`` samples, or ``(steps + 1, B, ...)`` with ``return_chain``.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> v = lambda x, t: (x - 2.0) / t[:, None]   # the exact field of data at x0 = 2
        >>> x = flow_sample(v, (4, 3), random.key(0), steps=8)
        >>> torch.allclose(x, torch.full((4, 3), 2.0), atol=1e-5)
        True
    """
    if not callable(velocity_fn):
        raise TypeError(f"velocity_fn must be callable, got {type(velocity_fn).__name__}")
    shape = _check_shape(shape)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if stochastic and method != "euler":
        raise ValueError("stochastic=True re-noises after an Euler step: method must be "
                         f"'euler', got {method!r}")
    if order not in (1, 2, 3) or isinstance(order, bool):
        raise ValueError(f"order must be 1, 2 or 3, got {order!r}")
    if order != 2 and method not in ("dpm_solver", "unipc"):
        raise ValueError(f"order is the multistep solvers' (method='dpm_solver' or 'unipc'); "
                         f"{method!r} has its own, got order={order!r}")
    if not (isinstance(time_scale, (int, float)) and time_scale > 0):
        raise ValueError(f"time_scale must be a float > 0, got {time_scale!r}")
    if sigmas is not None:
        if shift != 1.0 or mu is not None or terminal is not None:
            raise ValueError("sigmas are used as given: leave shift, mu and terminal at "
                             "their defaults")
        levels = _check_levels(sigmas, at_most=1.0)
        steps = len(levels) - 1
    elif method == "dpm_solver":
        levels = _dpm_levels(steps, shift, mu, terminal, T)
    elif method == "unipc":
        levels = _unipc_levels(steps, shift, mu, terminal, T)
    else:
        levels = flow_sigmas(steps, shift=shift, mu=mu, terminal=terminal, T=T).tolist()

    x, k_noise = _init(key, shape, dtype, device)  # (B, ...)
    stream = NoiseStream(k_noise, shape, steps, dtype, x.device) if stochastic else None
    B = shape[0]

    def v(x: Tensor, level: float) -> Tensor:
        t = torch.full((B,), level * time_scale, dtype=dtype, device=x.device)  # (B,)
        out = velocity_fn(x, t)
        _check_out(out, x)
        return out

    if method in ("dpm_solver", "unipc"):
        solve = _dpm_solver if method == "dpm_solver" else _unipc
        return solve(v, x, levels, order, return_chain, progress)
    chain = [x] if return_chain else None
    for i in _progress(range(steps), steps, progress, f"flow ({method})"):
        s, s_next = levels[i], levels[i + 1]
        d = v(x, s)  # (B, ...)
        if stream is not None:
            x0 = x - s * d
            x = (1.0 - s_next) * x0 + s_next * stream(i)
        elif method == "heun" and s_next > 0:
            x_pred = x + (s_next - s) * d
            x = x + (s_next - s) * 0.5 * (d + v(x_pred, s_next))
        else:
            x = x + (s_next - s) * d
        if chain is not None:
            chain.append(x)
    return torch.stack(chain) if chain is not None else x


def _dpm_levels(steps: int, shift: float, mu: float | None, terminal: float | None,
                T: int) -> list[float]:
    """diffusers' DPM-Solver levels for flows (``use_flow_sigmas``): ``1 - linspace(1, 1/T,
    steps + 1)`` reversed, bent by the shift, the last dropped, then a final 0. Evenly
    down to 0, where :func:`flow_sigmas` spends its last step from ``sigma_min``."""
    flow_sigmas(max(steps, 2), shift=shift, mu=mu, T=T)  # the same argument checks
    if terminal is not None:
        raise ValueError("terminal is not used by diffusers' DPM-Solver levels; pass sigmas")
    shift = math.exp(mu) if mu is not None else shift
    u = 1.0 - np.linspace(1.0, 1.0 / T, steps + 1)
    levels = np.flip(_shifted(u, shift))[:-1]
    return [*levels.tolist(), 0.0]


def _dpm_solver(v: Callable[[Tensor, float], Tensor], x: Tensor, levels: list[float],
                order: int, return_chain: bool, progress: bool) -> Tensor:
    """DPM-Solver++ on ``x_sigma = (1 - sigma) x0 + sigma eps``, ``x0 = x - sigma v``."""
    steps = len(levels) - 1
    alphas = [1.0 - s for s in levels]
    lams = [log_snr(a, s) for a, s in zip(alphas, levels)]  # -inf at sigma = 1
    chain = [x] if return_chain else None
    x0s: list[Tensor] = []
    for i in _progress(range(steps), steps, progress, "flow (dpm-solver++)"):
        x0 = x - levels[i] * v(x, levels[i])  # (B, ...)
        x0s = [*x0s[-(order - 1):], x0] if order > 1 else [x0]
        k = order_at(i, steps, order)
        x = update(x, x0s, lams[max(0, i + 1 - len(x0s)):i + 1], alphas[i + 1],
                   levels[i + 1], levels[i], lams[i + 1], k, None)
        if chain is not None:
            chain.append(x)
    return torch.stack(chain) if chain is not None else x


def _unipc_levels(steps: int, shift: float, mu: float | None, terminal: float | None,
                  T: int) -> list[float]:
    """diffusers' UniPC levels for flows: ``linspace(1, 1/T, steps + 1)`` without its
    last, bent by the shift, the first moved to ``1 - 1e-6`` (log(alpha) is finite
    there), then a final 0; float32 values, as diffusers keeps them."""
    flow_sigmas(max(steps, 2), shift=shift, mu=mu, T=T)  # the same argument checks
    if terminal is not None:
        raise ValueError("terminal is not used by diffusers' UniPC levels; pass sigmas")
    shift = math.exp(mu) if mu is not None else shift
    levels = _shifted(np.linspace(1.0, 1.0 / T, steps + 1)[:-1], shift)
    if abs(levels[0] - 1.0) < 1e-6:
        levels[0] -= 1e-6
    return np.append(levels, 0.0).astype(np.float32).astype(np.float64).tolist()


def _unipc(v: Callable[[Tensor, float], Tensor], x: Tensor, levels: list[float],
           order: int, return_chain: bool, progress: bool) -> Tensor:
    """UniPC (bh2) on ``x_sigma = (1 - sigma) x0 + sigma eps``, ``x0 = x - sigma v``."""
    alphas = [1.0 - s for s in levels]
    lams = [log_snr(a, s) for a, s in zip(alphas, levels)]
    return unipc_run(x, lambda i, x: x - levels[i] * v(x, levels[i]), alphas, levels, lams,
                     order, "bh2", return_chain, progress, "flow (unipc)")
