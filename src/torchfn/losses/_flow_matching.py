"""The flow-matching (rectified-flow) loss, as Stable Diffusion 3 trains: regress the
velocity ``eps - x0`` of the straight path ``x_sigma = (1 - sigma) x0 + sigma eps``."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor
from torch._C._functorch import get_unwrapped, is_batchedtensor, is_functorch_wrapped_tensor

from torchfn import random

__all__ = ["flow_matching_loss", "ot_pairing"]

TIME_SAMPLINGS = ("uniform", "logit_normal")
WEIGHTINGS = (None, "cosmap")
COUPLINGS = ("independent", "ot")


def _check_x0(x0) -> None:
    if not isinstance(x0, Tensor) or not x0.dtype.is_floating_point or x0.dim() < 1:
        raise TypeError(
            "x0 must be a floating-point Tensor of shape (B, ...), got "
            f"{getattr(x0, 'dtype', type(x0).__name__)}"
        )


def _host(t: Tensor, name: str) -> np.ndarray:
    """``t``'s values as a float64 numpy array, unwrapped from ``grad`` levels (and copied
    with the levels switched off: inside one, every new tensor is wrapped again)."""
    while is_functorch_wrapped_tensor(t):
        if is_batchedtensor(t):
            raise ValueError(f"ot_pairing pairs a whole batch: {name} must not be vmapped "
                             "(pair the batch first, then vmap)")
        t = get_unwrapped(t)
    with torch._C._DisableFuncTorch(), torch.no_grad():
        return t.double().cpu().numpy().reshape(t.shape[0], -1)


def ot_pairing(x0: Tensor, eps: Tensor) -> Tensor:
    """The ``(B,)`` permutation ``p`` minimising ``sum_i |x0_i - eps_p[i]|^2``: the exact
    optimal transport between the two batches as point clouds (scipy's
    ``linear_sum_assignment`` on the host; a sync, outside any transform).

    Example::

        >>> x0 = torch.tensor([[0.0], [10.0]])
        >>> ot_pairing(x0, torch.tensor([[9.0], [1.0]])).tolist()
        [1, 0]
    """
    try:
        from scipy.optimize import linear_sum_assignment
    except ImportError as e:  # pragma: no cover - scipy comes with the dev extra
        raise ImportError("coupling='ot' needs scipy (pip install scipy)") from e
    a, b = _host(x0, "x0"), _host(eps, "eps")  # (B, D) each
    cost = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * a @ b.T  # (B, B)
    _, cols = linear_sum_assignment(cost)
    return torch.from_numpy(cols).to(x0.device)


def flow_matching_loss(
    velocity_fn: Callable[[Tensor, Tensor], Tensor],
    x0: Tensor,
    key: Tensor,
    *,
    time_sampling: str = "uniform",
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    shift: float = 1.0,
    weighting: str | None = None,
    coupling: str = "independent",
    time_scale: float = 1.0,
) -> Tensor:
    """Conditional flow matching: ``mean_b w_b * mean_d (v(x_sigma, sigma) - (eps - x0))^2``.

    Per example a level ``sigma`` and noise ``eps ~ N(0, I)`` are drawn from ``key``, and
    ``x_sigma = (1 - sigma) x0 + sigma eps``. The minimiser over ``v`` is the velocity
    ``E[eps - x0 | x_sigma]`` whose flow carries ``N(0, I)`` at ``sigma = 1`` to the data at
    0; :func:`torchfn.transforms.diffusion.flow_sample` integrates it. No ODE is solved
    while training (against the maximum likelihood of a continuous flow, which solves two
    per step).

    * ``time_sampling="uniform"``: ``u ~ U[0, 1)``; ``"logit_normal"``:
      ``u = sigmoid(N(logit_mean, logit_std))``, SD3's choice, which favours the middle
      levels; then ``sigma = shift u / (1 + (shift - 1) u)``.
    * ``weighting="cosmap"``: ``w = 2 / (pi (1 - 2 sigma + 2 sigma^2))`` (SD3's
      "cosmap"); ``None``: ``w = 1``.
    * ``coupling="ot"``: the batch's noise is paired with its data by exact optimal
      transport (:func:`ot_pairing`; Tong et al.'s OT-CFM, Pooladian et al.'s
      multisample flow matching) instead of at random. The noise is only permuted, so its
      law is unchanged, while the paths straighten and few-step sampling improves. It is
      a whole-batch step, so not under ``vmap`` over examples.

    Args:
        velocity_fn: ``v(x, t) -> (B, ...)``, ``t: (B,)`` float, ``t = sigma * time_scale``.
        x0: ``(B, ...)`` data.
        key: PRNG key for the levels and the noise.
        time_scale: the model's time units per unit ``sigma`` (use the same in sampling).

    Returns:
        The scalar loss, in ``x0``'s dtype. Take ``grad`` with respect to the parameters
        ``velocity_fn`` closes over; written for a batch, it also runs per example under
        ``vmap`` (with one key per example).

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> x0 = torch.full((256, 2), 3.0, dtype=torch.float64)   # data at one point
        >>> exact = lambda x, t: (x - 3.0) / t[:, None]          # its velocity: eps - x0
        >>> float(flow_matching_loss(exact, x0, random.key(0))) < 1e-8
        True
    """
    if not callable(velocity_fn):
        raise TypeError(f"velocity_fn must be callable, got {type(velocity_fn).__name__}")
    _check_x0(x0)
    if time_sampling not in TIME_SAMPLINGS:
        raise ValueError(f"time_sampling must be one of {TIME_SAMPLINGS}, got {time_sampling!r}")
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    if coupling not in COUPLINGS:
        raise ValueError(f"coupling must be one of {COUPLINGS}, got {coupling!r}")
    for name, value in (("logit_std", logit_std), ("shift", shift), ("time_scale", time_scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a float > 0, got {value!r}")

    B = x0.shape[0]
    k_t, k_noise = random.split(key)
    if time_sampling == "uniform":
        u = random.uniform(k_t, (B,), dtype=x0.dtype)  # (B,)
    else:
        u = torch.sigmoid(logit_mean + logit_std * random.normal(k_t, (B,), dtype=x0.dtype))
    u = u.to(x0.device)
    sigma = shift * u / (1.0 + (shift - 1.0) * u)  # (B,)
    eps = random.normal(k_noise, tuple(x0.shape), dtype=x0.dtype).to(x0.device)  # (B, ...)
    if coupling == "ot":
        eps = eps[ot_pairing(x0, eps)]
    s = sigma.view((B,) + (1,) * (x0.dim() - 1))
    x_t = (1.0 - s) * x0 + s * eps  # (B, ...)
    out = velocity_fn(x_t, sigma * time_scale)
    if not isinstance(out, Tensor) or out.shape != x0.shape:
        got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(f"velocity_fn(x, t) must return x0's shape {tuple(x0.shape)}, got {got}")
    per_example = (out - (eps - x0)).pow(2).reshape(B, -1).mean(dim=1)  # (B,)
    if weighting == "cosmap":
        per_example = per_example * (2.0 / (math.pi * (1.0 - 2.0 * sigma + 2.0 * sigma * sigma)))
    return per_example.mean()
