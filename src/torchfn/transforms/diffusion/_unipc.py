"""UniPC (Zhao et al. 2023, "UniPC: A Unified Predictor-Corrector Framework for Fast
Sampling of Diffusion Models"), as diffusers' ``UniPCMultistepScheduler``
(``predict_x0=True``): a multistep predictor (UniP) as DPM-Solver++'s, and after each
model call a corrector (UniC) that refits the step just taken with the new ``x0``
prediction, at no extra call.

On ``x_t = alpha_t x0 + sigma_t eps`` in ``lambda = log(alpha / sigma)``, a step
``s -> t`` (``h = lambda_t - lambda_s``, ``B(h) = e^-h - 1`` for ``"bh2"``, ``-h`` for
``"bh1"``) is

    x_t = (sigma_t / sigma_s) x - alpha_t (e^-h - 1) m_s - alpha_t B(h) sum_k rho_k D_k

with ``D_k = (m_k - m_s) / r_k`` the scaled differences of earlier predictions and the
weights ``rho`` from a small linear system in ``r_k = (lambda_k - lambda_s) / h``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from torchfn.transforms.diffusion._dpm_solver import SPACINGS, vp_levels
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

__all__ = ["unipc_sample"]

SOLVER_TYPES = ("bh2", "bh1")


def _weights(rks: list[float], hh: float, order: int, bh: str) -> tuple[list[float], float,
                                                                          float, list[float]]:
    """(rhs b of the order conditions, h phi_1, B(h), the r's with a final 1)."""
    h_phi_1 = math.expm1(hh)  # e^hh - 1
    h_phi_k = h_phi_1 / hh - 1
    B_h = hh if bh == "bh1" else math.expm1(hh)
    b, factorial = [], 1
    for i in range(1, order + 1):
        b.append(h_phi_k * factorial / B_h)
        factorial *= i + 1
        h_phi_k = h_phi_k / hh - 1 / factorial
    return b, h_phi_1, B_h, [*rks, 1.0]


def _solve(rks: list[float], b: list[float]) -> list[float]:
    """The rho solving sum_k rho_k r_k^(i-1) = b_i, i = 1 .. len(rks)."""
    n = len(rks)
    R = torch.tensor([[r ** i for r in rks] for i in range(n)], dtype=torch.float64)
    return torch.linalg.solve(R, torch.tensor(b[:n], dtype=torch.float64)).tolist()


def unipc_step(x: Tensor, ms: list[Tensor], lams: list[float], alpha_t: float, sigma_t: float,
          sigma_s: float, lam_t: float, order: int, bh: str, m_t: Tensor | None = None
          ) -> Tensor:
    """UniP (``m_t`` None) or UniC (with the new prediction ``m_t`` at the step's end)
    of ``order`` from ``x`` at level s; ``ms``: predictions, newest (at s) last, at
    ``lams``."""
    lam_s, m_s = lams[-1], ms[-1]
    h = lam_t - lam_s
    rks = [(lams[-1 - k] - lam_s) / h for k in range(1, order)]
    diffs = [(ms[-1 - k] - m_s) / r for k, r in zip(range(1, order), rks)]
    hh = -h
    b, h_phi_1, B_h, rks = _weights(rks, hh, order, bh)
    x_t = (sigma_t / sigma_s) * x - (alpha_t * h_phi_1) * m_s
    if m_t is None:  # predictor: the weights of the earlier differences
        if not diffs:
            return x_t
        rhos = [0.5] if order == 2 else _solve(rks[:-1], b)
        res = sum(r * d for r, d in zip(rhos, diffs))
    else:  # corrector: the system includes the new prediction's difference
        rhos = [0.5] if order == 1 else _solve(rks, b)
        res = sum((r * d for r, d in zip(rhos[:-1], diffs)), rhos[-1] * (m_t - m_s))
    return x_t - (alpha_t * B_h) * res


def unipc_sample(
    model_fn: ModelFn,
    schedule: Schedule,
    shape: Sequence[int],
    key: Tensor,
    *,
    steps: int = 20,
    order: int = 2,
    solver_type: str = "bh2",
    spacing: str = "linspace",
    karras: bool = False,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    prediction: str = "eps",
    clip_x0: float | DynamicThreshold | None = None,
    return_chain: bool = False,
    progress: bool = False,
) -> Tensor:
    """UniPC multistep sampling (``order`` 1-3), one model call per step: equal to
    diffusers' ``UniPCMultistepScheduler(solver_order=order, solver_type=solver_type)``
    with its other defaults (``predict_x0``, ``lower_order_final``: the last steps at
    lower order, and no corrector after the last call).

    Args:
        model_fn: ``model_fn(x, t) -> (B, ...)``, ``t: (B,)`` int64.
        schedule, shape, key, steps, spacing, karras, prediction, clip_x0: as
            :func:`dpm_solver_sample` (the same timesteps and levels).
        order: 1, 2 or 3 (the predictor's; the corrector adds one).
        solver_type: ``"bh2"`` (diffusers' default) or ``"bh1"`` (the paper's choice
            for unconditional sampling).

    Returns:
        ``(B, ...)`` samples, or ``(steps + 1, B, ...)`` with ``return_chain`` (each
        entry the sample after its step's predictor, before the next corrector).

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> from torchfn.transforms.diffusion import linear_schedule
        >>> eps_fn = lambda x, t: torch.zeros_like(x)     # a trained model's noise
        >>> unipc_sample(eps_fn, linear_schedule(1000), (8, 2), random.key(0), steps=8).shape
        torch.Size([8, 2])
    """
    _check_schedule(schedule)
    shape = _check_shape(shape)
    _check_common(prediction, clip_x0)
    if order not in (1, 2, 3) or isinstance(order, bool):
        raise ValueError(f"order must be 1, 2 or 3, got {order!r}")
    if solver_type not in SOLVER_TYPES:
        raise ValueError(f"solver_type must be one of {SOLVER_TYPES}, got {solver_type!r}")
    if spacing not in SPACINGS:
        raise ValueError(f"spacing must be one of {SPACINGS}, got {spacing!r}")
    ts, alphas, sigmas, lams = vp_levels(schedule, steps, spacing, karras)
    x, _ = _init(key, shape, dtype, device)  # (B, ...)

    def x0_at(i: int, x: Tensor) -> Tensor:
        tt = torch.full((shape[0],), ts[i], dtype=torch.int64, device=x.device)  # (B,)
        out = model_fn(x, tt)  # (B, ...)
        _check_out(out, x)
        return clip(_x0_eps(x, out, alphas[i] ** 2, prediction)[0], clip_x0)

    return unipc_run(x, x0_at, alphas, sigmas, lams, order, solver_type, return_chain,
                     progress, "unipc")


def unipc_run(x: Tensor, x0_at, alphas: list[float], sigmas: list[float], lams: list[float],
              order: int, solver_type: str, return_chain: bool, progress: bool,
              desc: str) -> Tensor:
    """UniPC over the levels: at each, ``x0_at(i, x)`` (one model call), the corrector
    of the step before, then the predictor; ``lower_order_final`` and the warm-up as
    diffusers'. Any Gaussian path: the levels' ``alpha``, ``sigma``, ``lambda``."""
    steps = len(alphas) - 1
    chain = [x] if return_chain else None
    ms: list[Tensor] = []
    last, last_order = None, 1
    for i in _progress(range(steps), steps, progress, desc):
        m = x0_at(i, x)
        if last is not None:  # UniC: redo the last step with this prediction
            x = unipc_step(last, ms, lams[i - len(ms):i], alphas[i], sigmas[i], sigmas[i - 1],
                           lams[i], last_order, solver_type, m_t=m)
        ms = [*ms[-(order - 1):], m] if order > 1 else [m]
        k = min(order, steps - i, len(ms))  # lower_order_final, and the warm-up
        last, last_order = x, k
        x = unipc_step(x, ms, lams[i + 1 - len(ms):i + 1], alphas[i + 1], sigmas[i + 1],
                       sigmas[i], lams[i + 1], k, solver_type)
        if chain is not None:
            chain.append(x)
    return torch.stack(chain) if chain is not None else x
