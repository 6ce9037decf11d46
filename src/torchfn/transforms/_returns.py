"""Returns and advantages of reinforcement learning (rlax's ``discounted_returns``,
``truncated_generalized_advantage_estimation`` and ``vtrace``), as parallel scans over
time."""

from __future__ import annotations

import torch
from torch import Tensor

from torchfn.core.associative_scan import associative_scan

__all__ = ["discounted_returns", "gae", "vtrace"]


def _compose(later: tuple[Tensor, Tensor], earlier: tuple[Tensor, Tensor]
             ) -> tuple[Tensor, Tensor]:
    """``h -> a h + b`` maps, the later one applied first: ``earlier(later(h))``."""
    (a1, b1), (a2, b2) = later, earlier
    return a2 * a1, a2 * b1 + b2


def _backward(coef: Tensor, x: Tensor) -> Tensor:
    """``h[t] = x[t] + coef[t] h[t + 1]`` from ``h[T] = 0``, along the last dim, in
    ``O(log T)`` steps of elementwise work."""
    return associative_scan(_compose, (coef, x), reverse=True, dim=-1)[1]


def _check(who: str, **tensors: Tensor) -> torch.Size:
    shape = None
    for name, t in tensors.items():
        if not isinstance(t, Tensor) or not t.dtype.is_floating_point or t.dim() < 1:
            raise TypeError(f"{who}: {name} must be a floating-point tensor (..., T), got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
        if shape is not None and t.shape != shape:
            raise ValueError(f"{who}: rewards, values and discounts must share one shape "
                             f"(..., T), got {name} {tuple(t.shape)} against {tuple(shape)}")
        shape = t.shape
    return shape


def _bootstrap(who: str, bootstrap: Tensor | float, shape: torch.Size, like: Tensor) -> Tensor:
    """``bootstrap`` as ``(...)`` (a number broadcasts)."""
    if not isinstance(bootstrap, Tensor):
        return like.new_full(shape[:-1], float(bootstrap))
    if bootstrap.shape != shape[:-1]:
        raise ValueError(f"{who}: bootstrap must be a number or (...) = {tuple(shape[:-1])}, "
                         f"got {tuple(bootstrap.shape)}")
    return bootstrap.to(like.dtype)


def discounted_returns(rewards: Tensor, discounts: Tensor,
                       bootstrap: Tensor | float = 0.0) -> Tensor:
    """``G[t] = r[t] + discounts[t] G[t + 1]``, with ``G[T] = bootstrap``, along the last
    dim (time).

    ``discounts[t]`` is ``gamma`` times 0 where the episode ends at ``t`` (1 - done), so a
    trajectory of several episodes is one call. Computed as a parallel scan (``O(log T)``
    steps), so it runs under ``vmap`` and ``grad`` like any torch op.

    Args:
        rewards: ``(..., T)``.
        discounts: ``(..., T)``.
        bootstrap: the value after the last step ``(...)`` (or a number).

    Returns:
        ``(..., T)``.

    Example::

        >>> import torch
        >>> from torchfn.transforms import discounted_returns
        >>> discounted_returns(torch.ones(4), torch.tensor([0.5, 0.5, 0.0, 0.5]), 8.0)
        tensor([1.7500, 1.5000, 1.0000, 5.0000])
    """
    shape = _check("discounted_returns", rewards=rewards, discounts=discounts)
    last = torch.zeros_like(rewards)
    last[..., -1] = 1
    boot = _bootstrap("discounted_returns", bootstrap, shape, rewards)
    return _backward(discounts, rewards + last * discounts * boot[..., None])


def gae(rewards: Tensor, values: Tensor, discounts: Tensor, bootstrap: Tensor | float = 0.0,
        *, lam: float = 0.95) -> Tensor:
    """Generalized advantage estimation (Schulman et al. 2016):
    ``A[t] = delta[t] + discounts[t] lam A[t + 1]``, ``delta[t] = r[t] + discounts[t]
    V[t + 1] - V[t]``, with ``V[T] = bootstrap``, along the last dim (time). The value
    targets are ``A + values``; ``lam = 1`` gives ``discounted_returns - values``, ``lam
    = 0`` the one-step TD errors.

    Args:
        rewards, values, discounts: ``(..., T)``; ``discounts[t]`` is ``gamma`` times 0
            where the episode ends at ``t``.
        bootstrap: ``V[T]``, the value after the last step ``(...)`` (or a number).
        lam: ``lambda`` in [0, 1].

    Returns:
        The advantages ``(..., T)``, with no gradient path required: detach the inputs
        (or ``torch.no_grad``) when they come from a model being trained.

    Example::

        >>> import torch
        >>> from torchfn.transforms import gae
        >>> rewards, values = torch.tensor([1.0, 1.0]), torch.tensor([0.5, 0.5])
        >>> gae(rewards, values, torch.full((2,), 0.9), lam=0.0)   # TD errors
        tensor([0.9500, 0.5000])
    """
    shape = _check("gae", rewards=rewards, values=values, discounts=discounts)
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not 0 <= lam <= 1:
        raise ValueError(f"lam must be a number in [0, 1], got {lam!r}")
    boot = _bootstrap("gae", bootstrap, shape, values)
    following = torch.cat((values[..., 1:], boot[..., None]), -1)  # V[t + 1]  (..., T)
    delta = rewards + discounts * following - values
    return _backward(discounts * lam, delta)


def vtrace(log_rhos: Tensor, rewards: Tensor, values: Tensor, discounts: Tensor,
           bootstrap: Tensor | float = 0.0, *, clip_rho: float = 1.0, clip_c: float = 1.0,
           clip_pg_rho: float = 1.0, lam: float = 1.0) -> tuple[Tensor, Tensor]:
    """V-trace (Espeholt et al. 2018, IMPALA): off-policy value targets and policy-gradient
    advantages from trajectories a behaviour policy drew, along the last dim (time).

    With ``rho = exp(log_rhos)`` (target over behaviour probability of each action),
    ``delta[t] = min(clip_rho, rho[t]) (r[t] + discounts[t] V[t + 1] - V[t])`` and ``c[t] =
    lam min(clip_c, rho[t])``: ``vs[t] - V[t] = delta[t] + discounts[t] c[t] (vs[t + 1] -
    V[t + 1])``, and the advantages ``min(clip_pg_rho, rho[t]) (r[t] + discounts[t] vs[t +
    1] - V[t])`` (``V[T] = vs[T] = bootstrap``). On-policy (``log_rhos = 0``) ``vs - V`` is
    :func:`gae` with the same ``lam``.

    Args:
        log_rhos, rewards, values, discounts: ``(..., T)``.
        bootstrap: ``V[T]`` ``(...)`` (or a number).
        clip_rho, clip_c, clip_pg_rho: the truncation levels (> 0; IMPALA: 1).
        lam: in [0, 1] (rlax's ``lambda_``).

    Returns:
        ``(vs, advantages)``, each ``(..., T)``; constants for the learner (detach the
        inputs).

    Example::

        >>> import torch
        >>> from torchfn.transforms import discounted_returns, vtrace
        >>> r, v, d = torch.ones(3), torch.zeros(3), torch.full((3,), 0.5)
        >>> vs, adv = vtrace(torch.zeros(3), r, v, d)      # on-policy: the returns
        >>> vs, discounted_returns(r, d)
        (tensor([1.7500, 1.5000, 1.0000]), tensor([1.7500, 1.5000, 1.0000]))
    """
    shape = _check("vtrace", log_rhos=log_rhos, rewards=rewards, values=values,
                   discounts=discounts)
    for name, value in (("clip_rho", clip_rho), ("clip_c", clip_c),
                        ("clip_pg_rho", clip_pg_rho)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a number > 0, got {value!r}")
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not 0 <= lam <= 1:
        raise ValueError(f"lam must be a number in [0, 1], got {lam!r}")
    boot = _bootstrap("vtrace", bootstrap, shape, values)
    rhos = torch.exp(log_rhos)
    following = torch.cat((values[..., 1:], boot[..., None]), -1)  # V[t + 1]
    delta = rhos.clamp(max=clip_rho) * (rewards + discounts * following - values)
    vs = values + _backward(discounts * lam * rhos.clamp(max=clip_c), delta)
    vs_next = torch.cat((vs[..., 1:], boot[..., None]), -1)
    return vs, rhos.clamp(max=clip_pg_rho) * (rewards + discounts * vs_next - values)
