"""``sdeint``: stochastic differential equations on a keyed Brownian path.

``ys = sdeint(drift, diffusion, y0, t, key, *args)`` integrates

    dy = f(y, t) dt + g(y, t) dW        (Ito; Stratonovich with ``method="heun"``)

with fixed steps of at most ``dt`` between the output times. Each step's Brownian
increment ``dW = sqrt(h) N(0, I)`` is drawn from ``fold_in(key, step)``, so:

- the same key gives the same path, whatever else the program draws;
- ``vmap`` over keys gives every example its own path (no global generator, no
  per-example seeding by hand, which torchsde's ``BrownianInterval`` needs);
- the path does not depend on ``drift`` or ``diffusion``: two SDEs driven by the same
  key and ``dt`` share their noise (common random numbers, strong-error checks).

Gradients are pathwise: autograd (or ``grad``, ``jvp``, ``vmap``) differentiates the
steps, as for a reparameterised sample.

Noise: ``diffusion`` returns either y's shape (diagonal noise, ``g_i dW_i``) or
``(*y.shape, m)`` (general noise from an m-dimensional Brownian motion, ``g @ dW``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from torchfn import random

__all__ = ["sdeint"]

_METHODS = ("euler", "milstein", "heun")


def sdeint(drift: Callable[..., torch.Tensor], diffusion: Callable[..., torch.Tensor],
           y0: torch.Tensor, t: torch.Tensor, key: torch.Tensor, *args: Any,
           dt: float, method: str = "euler") -> torch.Tensor:
    """Integrate an SDE from ``y0`` at ``t[0]``; ``y`` at every time in ``t``.

    Args:
        drift: ``f(y, t, *args)``, y's shape.
        diffusion: ``g(y, t, *args)``: y's shape (diagonal noise) or ``(*y.shape, m)``.
        y0: a floating-point tensor (one example; ``vmap`` for a batch or over keys).
        t: (T,) increasing output times, ``T >= 2``, the same for every example (the
            step count is read from it).
        key: a ``torchfn.random`` key for the Brownian path.
        *args: passed to ``drift`` and ``diffusion`` (parameters to differentiate).
        dt: the largest step; each interval ``[t_i, t_{i+1}]`` takes
            ``ceil((t_{i+1} - t_i) / dt)`` equal steps.
        method: ``"euler"`` (Euler-Maruyama, Ito, strong order 1/2), ``"milstein"``
            (Ito, diagonal noise where ``g_i`` depends on ``y_i`` alone: strong order 1)
            or ``"heun"`` (Stratonovich, the stochastic Heun method).

    Returns:
        (T, *y0.shape).

    Example (geometric Brownian motion, each key its own path)::

        >>> import torch
        >>> from torchfn import random, transforms
        >>> t = torch.linspace(0, 1, 5)
        >>> gbm = lambda f: transforms.sdeint(lambda y, t: 0.1 * y, lambda y, t: 0.2 * y,
        ...                                   torch.ones(()), t, f, dt=0.01)
        >>> paths = torch.vmap(gbm)(random.split(random.key(0), 3))   # (3 keys, 5 times)
        >>> paths.shape, bool((paths[:, 0] == 1).all())
        (torch.Size([3, 5]), True)
    """
    for name, fn in (("drift", drift), ("diffusion", diffusion)):
        if not callable(fn):
            raise TypeError(f"sdeint: {name} must be callable, got {type(fn).__name__}")
    if not isinstance(y0, torch.Tensor) or not y0.is_floating_point():
        got = f"a tensor of dtype {y0.dtype}" if isinstance(y0, torch.Tensor) else type(y0).__name__
        raise TypeError(f"sdeint: y0 must be a floating-point tensor, got {got}")
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] < 2:
        got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"sdeint: t must be a 1-d tensor of at least 2 times, got {got}")
    if method not in _METHODS:
        raise ValueError(f"sdeint: method must be one of {_METHODS}, got {method!r}")
    if isinstance(dt, bool) or not isinstance(dt, (int, float)) or not dt > 0:
        raise ValueError(f"sdeint: dt must be a positive number, got {dt!r}")
    times = [float(v) for v in t.detach().tolist()]
    if any(b <= a for a, b in zip(times, times[1:])):
        raise ValueError("sdeint: t must be strictly increasing")
    t = t.to(y0.dtype)

    def f(y, s):
        return _checked(drift(y, s, *args), y.shape, "drift", diagonal_ok=False)

    def g(y, s):
        return _checked(diffusion(y, s, *args), y.shape, "diffusion", diagonal_ok=True)

    g0 = g(y0, t[0])
    diagonal = g0.shape == y0.shape
    noise_shape = y0.shape if diagonal else g0.shape[-1:]  # dW: y's shape, or (m,)
    out, y, step = [y0], y0, 0
    for i in range(len(times) - 1):
        n = max(1, math.ceil((times[i + 1] - times[i]) / dt - 1e-9))
        h = (t[i + 1] - t[i]) / n
        for j in range(n):
            s = t[i] + j * h
            dw = torch.sqrt(h) * random.normal(random.fold_in(key, step), noise_shape,
                                               dtype=y0.dtype)
            y = _step(method, f, g, y, s, h, dw, diagonal)
            step += 1
        out.append(y)
    return torch.stack(out)


def _step(method, f, g, y, s, h, dw, diagonal: bool):
    def noise(gy):  # g dW: elementwise for diagonal noise, g @ dW for general noise
        return gy * dw if diagonal else gy @ dw

    gy = g(y, s)
    if method == "euler":
        return y + f(y, s) * h + noise(gy)
    if method == "milstein":
        if not diagonal:
            raise ValueError("sdeint: method='milstein' needs diagonal noise (diffusion with "
                             f"y's shape {tuple(y.shape)}), got {tuple(gy.shape)}")
        # g_i dg_i/dy_i: the diagonal of dg/dy, which for diagonal noise is jvp(g, ones)
        _, dg = torch.func.jvp(lambda y: g(y, s), (y,), (torch.ones_like(y),))
        return y + f(y, s) * h + gy * dw + 0.5 * gy * dg * (dw * dw - h)
    # heun (Stratonovich): a predictor with the slope at y, then the average
    fy = f(y, s)
    pred = y + fy * h + noise(gy)
    return y + 0.5 * (fy + f(pred, s + h)) * h + 0.5 * (noise(gy) + noise(g(pred, s + h)))


def _checked(v: Any, shape: torch.Size, what: str, diagonal_ok: bool) -> torch.Tensor:
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"sdeint: {what} must return a tensor, got {type(v).__name__}")
    if v.shape == shape or (diagonal_ok and v.dim() == len(shape) + 1 and v.shape[:-1] == shape):
        return v
    want = (f"y's shape {tuple(shape)}" + (f" or {tuple(shape)} + (m,)" if diagonal_ok else ""))
    raise ValueError(f"sdeint: {what} returned shape {tuple(v.shape)}; expected {want}")
