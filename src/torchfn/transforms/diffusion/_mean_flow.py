"""Sampling a MeanFlow model (:func:`torchfn.losses.mean_flow_loss`): ``z_r = z_t - (t -
r) u(z_t, r, t)`` over a few intervals of ``[0, 1]``, one model call each, from
``z_1 ~ N(0, I)``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from torchfn.transforms.diffusion._samplers import _check_out, _check_shape, _init

__all__ = ["mean_flow_sample"]


def mean_flow_sample(
    u_fn: Callable[[Tensor, Tensor, Tensor], Tensor],
    shape: Sequence[int],
    key: Tensor,
    *,
    steps: int = 1,
    time_scale: float = 1.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    return_chain: bool = False,
) -> Tensor:
    """Samples with ``steps`` equal intervals from ``t = 1`` to 0: one model call each.

    Args:
        u_fn: ``u(z, r, t) -> (B, ...)``, ``r, t: (B,)`` floats times ``time_scale``.
        shape: ``(B, ...)``.
        key: PRNG key (the start, from ``split(key)[0]`` as every sampler here).
        steps: intervals (1: one-step generation).

    Returns:
        ``(B, ...)``, or ``(steps + 1, B, ...)`` with ``return_chain``.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> u = lambda z, r, t: (z - 3.0) / t[:, None]      # data at 3
        >>> x = mean_flow_sample(u, (2, 2), random.key(0))   # one step
        >>> torch.allclose(x, torch.full((2, 2), 3.0))
        True
    """
    if not callable(u_fn):
        raise TypeError(f"u_fn must be callable, got {type(u_fn).__name__}")
    shape = _check_shape(shape)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if not (isinstance(time_scale, (int, float)) and time_scale > 0):
        raise ValueError(f"time_scale must be a float > 0, got {time_scale!r}")
    x, _ = _init(key, shape, dtype, device)  # (B, ...)
    levels = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64).tolist()
    chain = [x] if return_chain else None
    for t, r in zip(levels[:-1], levels[1:]):
        tt = torch.full((shape[0],), t * time_scale, dtype=dtype, device=x.device)
        rr = torch.full((shape[0],), r * time_scale, dtype=dtype, device=x.device)
        out = u_fn(x, rr, tt)
        _check_out(out, x)
        x = x - (t - r) * out
        if chain is not None:
            chain.append(x)
    return torch.stack(chain) if chain is not None else x
