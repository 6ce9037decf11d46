"""Consistency models: a network that maps any point of a probability-flow trajectory
straight to its start, so that one call samples.

Two parameterisations:

- **Variance exploding** (Song et al. 2023, "Consistency Models"; iCT, Song & Dhariwal
  2023): ``x_sigma = x0 + sigma eps`` on ``[sigma_min, sigma_max]`` and

      f(x, sigma) = c_skip x + c_out F(c_in x, c_noise)
      c_skip = sd^2 / ((sigma - sigma_min)^2 + sd^2)
      c_out = (sigma - sigma_min) sd / sqrt(sigma^2 + sd^2)
      c_in = 1 / sqrt(sigma^2 + sd^2)        c_noise = log(sigma) / 4

  so ``f(x, sigma_min) = x`` exactly (the boundary condition). Sampling
  (:func:`consistency_sample`, Algorithm 1) maps ``sigma_0 z`` to data, then re-noises
  to each further level ``x0 + sqrt(sigma^2 - sigma_min^2) z`` and maps again.
- **TrigFlow** (Lu & Song 2024, "Simplifying, stabilizing and scaling continuous-time
  consistency models", sCM): ``x_t = cos(t) x0 + sin(t) z``, ``z ~ N(0, sd^2)``,
  ``t in [0, pi/2]``, and ``f(x, t) = cos(t) x - sin(t) sd F(x / sd, t)``
  (:func:`trigflow_consistency`). A TrigFlow diffusion model's network predicts the
  velocity, ``dx_t/dt = sd F(x_t / sd, t)``; :func:`trigflow_sample` samples a
  consistency model in one or a few steps.

The training losses are :func:`torchfn.losses.consistency_loss` (discrete: iCT or
distillation) and :func:`torchfn.losses.scm_loss` (continuous time: sCT or sCD, a
``jvp`` through the network).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from torchfn.transforms._noise import NoiseStream
from torchfn.transforms.diffusion._edm import _positive
from torchfn.transforms.diffusion._samplers import _check_out, _check_shape, _init, _progress

SCM_T_MAX = math.atan(80.0 / 0.5)  # sCM's one-step time: sigma_max = 80 with sd = 0.5

__all__ = [
    "consistency_levels",
    "consistency_scalings",
    "consistency_function",
    "consistency_sample",
    "trigflow_consistency",
    "trigflow_sample",
]


def consistency_scalings(sigma: Tensor, sigma_min: float = 0.002, sigma_data: float = 0.5
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(c_skip, c_out, c_in, c_noise)`` of a variance-exploding consistency model at
    levels ``sigma`` (any shape; each result has its shape): EDM's preconditioning with
    ``sigma - sigma_min`` in ``c_skip`` and ``c_out``, so that ``c_skip = 1`` and
    ``c_out = 0`` at ``sigma_min`` (diffusers' ``get_scalings_for_boundary_condition``).
    ``c_noise = log(sigma) / 4`` as EDM's (OpenAI's checkpoints see ``1000`` times it).

    Example::

        >>> sigma = torch.tensor([0.002, 80.0], dtype=torch.float64)
        >>> c_skip, c_out, c_in, c_noise = consistency_scalings(sigma)
        >>> [round(c, 5) for c in c_skip.tolist()], [round(c, 4) for c in c_out.tolist()]
        ([1.0, 4e-05], [0.0, 0.5])
    """
    lo, sd = _positive("sigma_min", sigma_min), _positive("sigma_data", sigma_data)
    if not isinstance(sigma, Tensor) or not sigma.dtype.is_floating_point:
        raise TypeError(f"sigma must be a floating-point Tensor, got {type(sigma).__name__}")
    total = sigma * sigma + sd * sd
    gap = sigma - lo
    return sd * sd / (gap * gap + sd * sd), gap * sd * total.rsqrt(), total.rsqrt(), \
        sigma.log() / 4


def consistency_function(net_fn: Callable[..., Tensor], sigma_min: float = 0.002,
                         sigma_data: float = 0.5) -> Callable[..., Tensor]:
    """Wraps a raw network ``F(x_in, c_noise, *args) -> (B, ...)`` into the consistency
    function ``f(x, sigma, *args) = c_skip x + c_out F(c_in x, c_noise, *args)``
    (:func:`consistency_scalings`), with ``x: (B, ...)``, ``sigma: (B,)``. What
    :func:`consistency_sample` and :func:`torchfn.losses.consistency_loss` call.

    Example::

        >>> f = consistency_function(lambda x_in, c_noise: torch.ones_like(x_in))
        >>> x = torch.zeros(2, 3)
        >>> f(x, torch.full((2,), 0.002)).abs().max().item()   # the boundary: f = x
        0.0
    """
    if not callable(net_fn):
        raise TypeError(f"net_fn must be callable, got {type(net_fn).__name__}")
    _positive("sigma_min", sigma_min)
    _positive("sigma_data", sigma_data)

    def f(x: Tensor, sigma: Tensor, *args) -> Tensor:
        if not isinstance(sigma, Tensor) or sigma.shape != x.shape[:1]:
            got = tuple(sigma.shape) if isinstance(sigma, Tensor) else type(sigma).__name__
            raise ValueError(f"sigma must have shape (B,) = {tuple(x.shape[:1])}, got {got}")
        c_skip, c_out, c_in, c_noise = consistency_scalings(sigma, sigma_min, sigma_data)
        view = (-1,) + (1,) * (x.dim() - 1)
        out = net_fn(c_in.view(view) * x, c_noise, *args)
        _check_out(out, x)
        return c_skip.view(view) * x + c_out.view(view) * out

    return f


def _decreasing(levels, name: str, low: float, high: float) -> list[float]:
    """A strictly decreasing sequence of at least one level in ``(low, high]``."""
    s = torch.as_tensor(levels, dtype=torch.float64).flatten()
    ok = s.numel() >= 1 and bool((s[1:] < s[:-1]).all())
    if not ok or not (float(s[-1]) > low and float(s[0]) <= high):
        raise ValueError(f"{name} must be a strictly decreasing sequence of levels in "
                         f"({low:g}, {high:g}], got {s.tolist()[:8]}")
    return s.tolist()


def _multistep(fn: Callable[[Tensor, Tensor], Tensor], shape: Sequence[int], key: Tensor,
               levels: list[float], start: float,
               renoise: Callable[[Tensor, Tensor, float], Tensor], clip: tuple | None,
               dtype: torch.dtype, device, return_chain: bool, progress: bool,
               desc: str) -> Tensor:
    """``x0 = fn(start * z, levels[0])``, then per further level ``x0 = fn(renoise(x0, z,
    level), level)``: one call per level."""
    if not callable(fn):
        raise TypeError(f"the model must be callable, got {type(fn).__name__}")
    shape = _check_shape(shape)
    if clip is not None and not (isinstance(clip, (tuple, list)) and len(clip) == 2
                                 and float(clip[0]) < float(clip[1])):
        raise ValueError(f"clip must be None or (low, high) with low < high, got {clip!r}")
    z, k_noise = _init(key, shape, dtype, device)  # (B, ...)
    stream = NoiseStream(k_noise, shape, max(1, len(levels) - 1), dtype, z.device)
    x, B = start * z, shape[0]
    chain = [] if return_chain else None
    x0 = x
    for i in _progress(range(len(levels)), len(levels), progress, desc):
        if i > 0:
            x = renoise(x0, stream(i - 1), levels[i])
        x0 = fn(x, torch.full((B,), levels[i], dtype=dtype, device=x.device))
        _check_out(x0, x)
        if clip is not None:
            x0 = x0.clamp(float(clip[0]), float(clip[1]))
        if chain is not None:
            chain.append(x0)
    return torch.stack(chain) if chain is not None else x0


def consistency_sample(
    consistency_fn: Callable[[Tensor, Tensor], Tensor],
    shape: Sequence[int],
    key: Tensor,
    *,
    sigmas: Sequence[float] | Tensor = (80.0,),
    sigma_min: float = 0.002,
    clip: tuple[float, float] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    return_chain: bool = False,
    progress: bool = False,
) -> Tensor:
    """Multistep consistency sampling (Song et al. 2023, Algorithm 1): ``x0 =
    f(sigmas[0] z, sigmas[0])``, then for each further level ``x0 = f(x0 + sqrt(sigma^2 -
    sigma_min^2) z', sigma)``. One call per level; the default is one-step generation.

    Equal to diffusers' ``CMStochasticIterativeScheduler`` loop given its levels
    (``clip=(-1, 1)`` is its ``clip_denoised``), and to OpenAI's ``stochastic_iterative``
    sampler.

    Args:
        consistency_fn: ``f(x, sigma) -> (B, ...)``, ``sigma: (B,)`` float; a raw network
            goes through :func:`consistency_function` first.
        shape: ``(B, ...)``.
        key: PRNG key (the start from ``split(key)[0]``, the re-noising from
            ``split(key)[1]``).
        sigmas: the levels, strictly decreasing, each above ``sigma_min`` (the CM
            paper's two-step ImageNet-64 sampler is ``(80.0, 0.661)``, from its 40-level
            grid). The first is the start's scale, ``sigma_max``.
        sigma_min: the boundary level the model was trained with.
        clip: clamp each ``x0`` to ``(low, high)``, or None.
        return_chain: also return each level's ``x0``.

    Returns:
        ``(B, ...)``, or ``(levels, B, ...)`` with ``return_chain``.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> f = lambda x, sigma: torch.full_like(x, 3.0)       # data at 3
        >>> consistency_sample(f, (2, 2), random.key(0), sigmas=(80.0, 2.0)).tolist()
        [[3.0, 3.0], [3.0, 3.0]]
    """
    lo = _positive("sigma_min", sigma_min)
    levels = _decreasing(sigmas, "sigmas", lo, math.inf)

    def renoise(x0: Tensor, z: Tensor, level: float) -> Tensor:
        return x0 + (level * level - lo * lo) ** 0.5 * z

    return _multistep(consistency_fn, shape, key, levels, levels[0], renoise, clip, dtype,
                      device, return_chain, progress, "consistency")


def trigflow_consistency(net_fn: Callable[..., Tensor], sigma_data: float = 0.5,
                         time_scale: float = 1.0) -> Callable[..., Tensor]:
    """Wraps a TrigFlow network ``F(x_in, c_noise, *args) -> (B, ...)`` into the
    consistency function ``f(x, t, *args) = cos(t) x - sin(t) sd F(x / sd, time_scale t,
    *args)``, ``x: (B, ...)``, ``t: (B,)`` in ``[0, pi/2]``; ``f(x, 0) = x``.

    Example::

        >>> f = trigflow_consistency(lambda x_in, t: -x_in)
        >>> f(torch.ones(1, 2), torch.full((1,), torch.pi / 2)).round(decimals=6)  # sd x / sd
        tensor([[1., 1.]])
    """
    if not callable(net_fn):
        raise TypeError(f"net_fn must be callable, got {type(net_fn).__name__}")
    sd = _positive("sigma_data", sigma_data)
    scale = _positive("time_scale", time_scale)

    def f(x: Tensor, t: Tensor, *args) -> Tensor:
        if not isinstance(t, Tensor) or t.shape != x.shape[:1]:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"t must have shape (B,) = {tuple(x.shape[:1])}, got {got}")
        view = (-1,) + (1,) * (x.dim() - 1)
        out = net_fn(x / sd, t * scale, *args)
        _check_out(out, x)
        return t.cos().view(view) * x - (sd * t.sin()).view(view) * out

    return f


def trigflow_sample(
    consistency_fn: Callable[[Tensor, Tensor], Tensor],
    shape: Sequence[int],
    key: Tensor,
    *,
    times: Sequence[float] | Tensor = (SCM_T_MAX,),
    sigma_data: float = 0.5,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    return_chain: bool = False,
    progress: bool = False,
) -> Tensor:
    """Sampling a TrigFlow consistency model (sCM): ``x0 = f(sd z, times[0])``, then for
    each further time ``x0 = f(cos(t) x0 + sin(t) sd z', t)``. One call per time.

    Args:
        consistency_fn: ``f(x, t) -> (B, ...)``, ``t: (B,)``; a raw network goes through
            :func:`trigflow_consistency` first.
        shape: ``(B, ...)``.
        key: PRNG key (the start from ``split(key)[0]``, the re-noising from
            ``split(key)[1]``).
        times: strictly decreasing, in ``(0, pi/2]``. The default is sCM's one step at
            ``arctan(80 / 0.5)``; its two-step sampler adds ``1.1``.
        sigma_data: the data's (and the noise's) standard deviation.

    Returns:
        ``(B, ...)``, or ``(len(times), B, ...)`` with ``return_chain``.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> f = lambda x, t: torch.full_like(x, -1.0)           # data at -1
        >>> trigflow_sample(f, (1, 3), random.key(0), times=(1.56, 1.1)).tolist()
        [[-1.0, -1.0, -1.0]]
    """
    sd = _positive("sigma_data", sigma_data)
    levels = _decreasing(times, "times", 0.0, math.pi / 2)

    def renoise(x0: Tensor, z: Tensor, t: float) -> Tensor:
        return math.cos(t) * x0 + math.sin(t) * sd * z

    return _multistep(consistency_fn, shape, key, levels, sd, renoise, None, dtype, device,
                      return_chain, progress, "trigflow")


def consistency_levels(step: int, total_steps: int, *, s0: int = 10, s1: int = 1280,
                       sigma_min: float = 0.002, sigma_max: float = 80.0,
                       rho: float = 7.0) -> Tensor:
    """iCT's discretisation curriculum (Song & Dhariwal 2023): the ``(N,)`` float64 levels
    at training step ``step`` of ``total_steps``, increasing from ``sigma_min`` to
    ``sigma_max`` evenly in ``sigma^(1/rho)``, with ``N = min(s0 2^floor(step / K'),
    s1) + 1`` and ``K' = floor(total_steps / (floor(log2(s1 / s0)) + 1))``: ``N`` doubles
    in equal stages from ``s0 + 1`` to ``s1 + 1``.

    Example::

        >>> [len(consistency_levels(k, 800)) for k in (0, 99, 100, 799)]
        [11, 11, 21, 1281]
    """
    for name, value, least in (("step", step, 0), ("total_steps", total_steps, 1),
                               ("s0", s0, 1), ("s1", s1, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    if s1 < s0:
        raise ValueError(f"s1 must be >= s0, got s0={s0} and s1={s1}")
    lo, hi, rho = (_positive(n, v) for n, v in (("sigma_min", sigma_min),
                                                ("sigma_max", sigma_max), ("rho", rho)))
    if not lo < hi:
        raise ValueError(f"sigma_min must be < sigma_max, got {lo} and {hi}")
    stage = max(1, total_steps // (int(math.log2(s1 / s0)) + 1))
    n = min(s0 * 2 ** (step // stage), s1) + 1
    ramp = torch.linspace(0, 1, n, dtype=torch.float64)
    return (lo ** (1 / rho) + ramp * (hi ** (1 / rho) - lo ** (1 / rho))) ** rho
