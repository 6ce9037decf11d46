"""MeanFlow (Geng et al. 2025, "Mean Flows for One-step Generative Modeling"): learn the
average velocity of the flow over an interval, so that one step samples.

On the path ``z_t = (1 - t) x0 + t eps`` (``t = 1`` noise), the average velocity over
``[r, t]`` is ``u(z_t, r, t) = (z_t - z_r) / (t - r)`` along the flow, and it obeys

    u(z_t, r, t) = v(z_t, t) - (t - r) d/dt u(z_t, r, t)

with ``d/dt`` the total derivative along the flow, ``v . du/dz + du/dt``: one
forward-mode product (``torch.func.jvp``) of the network along ``(v, 0, 1)``. The loss
regresses ``u`` on that right-hand side with the conditional velocity ``v = eps - x0``
and the target's gradient stopped; sampling is then ``z_0 = z_1 - u(z_1, 0, 1)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from torchfn import random
from torchfn.losses._flow_matching import TIME_SAMPLINGS, _check_x0

__all__ = ["mean_flow_loss"]


def _times(key: Tensor, B: int, dtype: torch.dtype, sampling: str, mean: float,
           std: float) -> Tensor:
    if sampling == "uniform":
        return random.uniform(key, (B,), dtype=dtype)
    return torch.sigmoid(mean + std * random.normal(key, (B,), dtype=dtype))


def mean_flow_loss(
    u_fn: Callable[[Tensor, Tensor, Tensor], Tensor],
    x0: Tensor,
    key: Tensor,
    *,
    ratio: float = 0.25,
    time_sampling: str = "logit_normal",
    logit_mean: float = -0.4,
    logit_std: float = 1.0,
    adaptive_p: float = 1.0,
    adaptive_c: float = 1e-3,
    time_scale: float = 1.0,
) -> Tensor:
    """MeanFlow's loss: ``mean_b w_b |u(z_t, r, t) - sg(v - (t - r) du/dt)|^2``.

    Per example ``t`` and ``r`` are two draws of ``time_sampling`` (sorted, ``r <= t``),
    and with probability ``1 - ratio`` ``r = t`` (then the target is ``v``: flow
    matching). ``w = 1 / (|err|^2 + c)^p`` with the error's gradient stopped (the
    paper's adaptive weighting; ``adaptive_p=0``: the plain squared error, whose
    minimiser is exactly the average velocity). The squared error is summed over each
    example's coordinates, as the paper's.

    Args:
        u_fn: ``u(z, r, t) -> (B, ...)``, ``r, t: (B,)`` floats times ``time_scale``.
            Its forward-mode derivative is taken: the model must support ``jvp``
            (``torchfn.kernels.attention`` does; SDPA has no forward-mode rule).
        x0: ``(B, ...)`` data.
        key: PRNG key for the times, the choice ``r = t`` and the noise.
        ratio: the share of examples with ``r < t`` (the paper's 25%).
        time_sampling, logit_mean, logit_std: ``"uniform"`` or ``"logit_normal"``
            (the paper's ImageNet choice: mean -0.4, std 1).
        adaptive_p, adaptive_c: the weighting's power and floor.

    Returns:
        The scalar loss, in ``x0``'s dtype.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> x0 = torch.full((64, 2), 3.0, dtype=torch.float64)   # data at one point
        >>> exact = lambda z, r, t: (z - 3.0) / t[:, None]       # its average velocity
        >>> float(mean_flow_loss(exact, x0, random.key(0))) < 1e-12
        True
    """
    if not callable(u_fn):
        raise TypeError(f"u_fn must be callable, got {type(u_fn).__name__}")
    _check_x0(x0)
    if time_sampling not in TIME_SAMPLINGS:
        raise ValueError(f"time_sampling must be one of {TIME_SAMPLINGS}, got {time_sampling!r}")
    if not (isinstance(ratio, (int, float)) and 0 <= ratio <= 1):
        raise ValueError(f"ratio must lie in [0, 1], got {ratio!r}")
    for name, value in (("logit_std", logit_std), ("adaptive_c", adaptive_c),
                        ("time_scale", time_scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a float > 0, got {value!r}")
    if not (isinstance(adaptive_p, (int, float)) and adaptive_p >= 0):
        raise ValueError(f"adaptive_p must be a float >= 0, got {adaptive_p!r}")

    B, dtype, device = x0.shape[0], x0.dtype, x0.device
    k_t, k_r, k_pick, k_noise = random.split(key, 4)
    a = _times(k_t, B, dtype, time_sampling, logit_mean, logit_std)
    b = _times(k_r, B, dtype, time_sampling, logit_mean, logit_std)
    t, r = torch.maximum(a, b).to(device), torch.minimum(a, b).to(device)  # (B,) each
    same = (random.uniform(k_pick, (B,)) >= ratio).to(device)  # (B,): r = t
    r = torch.where(same, t, r)
    eps = random.normal(k_noise, tuple(x0.shape), dtype=dtype).to(device)  # (B, ...)
    col = (B,) + (1,) * (x0.dim() - 1)
    z = (1 - t.view(col)) * x0 + t.view(col) * eps  # (B, ...)
    v = eps - x0  # the conditional velocity

    def u_of(z: Tensor, r: Tensor, t: Tensor) -> Tensor:
        out = u_fn(z, r * time_scale, t * time_scale)
        if not isinstance(out, Tensor) or out.shape != x0.shape:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(f"u_fn(z, r, t) must return x0's shape {tuple(x0.shape)}, "
                             f"got {got}")
        return out

    u, dudt = torch.func.jvp(u_of, (z, r, t), (v, torch.zeros_like(r), torch.ones_like(t)))
    target = (v - (t - r).view(col) * dudt).detach()
    err = (u - target).pow(2).reshape(B, -1).sum(dim=1)  # (B,)
    if adaptive_p > 0:
        err = err / (err.detach() + adaptive_c) ** adaptive_p
    return err.mean()
