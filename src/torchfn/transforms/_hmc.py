"""Hamiltonian Monte Carlo (Duane et al., 1987; Neal, 2011) as pure functions of keys,
for one chain: ``vmap`` over keys (and starting points) runs many chains at once.

- :func:`hmc_step`: one transition: a momentum from the key, ``num_steps`` leapfrog
  steps, a Metropolis correction (``num_steps=1`` is MALA);
- :func:`hmc`: a whole chain, with warm-up that tunes the step size by dual averaging
  to a target acceptance (Hoffman & Gelman, 2014) and a diagonal mass matrix from the
  warm-up draws (Stan's regularised estimate), then ``num_samples`` draws.

The position is any pytree of float tensors (a Bayesian network's params). Every
branch (accept or not, a divergent trajectory) is a ``where``, so a batch of chains
under ``vmap`` is exactly that many single chains, each replaying from its key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.func import grad_and_value

from torchfn import random
from torchfn.transforms._adaptation import warmup
from torchfn.transforms._flat import Flat
from torchfn.transforms._metric import Metric, dense_inverse_mass

__all__ = ["HMCInfo", "hmc_step", "hmc"]


class HMCInfo(NamedTuple):
    """What :func:`hmc_step` did: ``accept_prob`` (the Metropolis probability, 0 for a
    divergent trajectory), ``accepted`` (bool) and ``log_density`` at the new position
    (0-d each; a leading dim per draw from :func:`hmc`)."""

    accept_prob: Tensor
    accepted: Tensor
    log_density: Tensor


def _positive(name: str, value: Any) -> None:
    if isinstance(value, Tensor):
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{name} must be a positive float, got {value!r}")


def _count(name: str, value: Any, lo: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
    return value


class _Target:
    """The log density and its gradient on flat vectors."""

    def __init__(self, logdensity_fn: Callable[[Any], Tensor], flat: Flat, who: str):
        if not callable(logdensity_fn):
            raise TypeError(f"{who}: logdensity_fn must be callable, got "
                            f"{type(logdensity_fn).__name__}")
        self.flat, self.who = flat, who

        def scalar(vec: Tensor) -> Tensor:
            out = logdensity_fn(flat.tree(vec))
            if not isinstance(out, Tensor) or out.dim() != 0:
                got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
                raise ValueError(f"{who}: logdensity_fn must return a scalar (shape ()), "
                                 f"got {got}")
            return out

        self.functorch = grad_and_value(scalar)
        self.scalar = scalar

    def grad_and_value(self, vec: Tensor) -> tuple[Tensor, Tensor]:
        """``(∇ log π, log π)`` at ``vec``: by ``torch.func`` under a transform (``vmap``
        over chains), else by one plain backward (2-3x cheaper per call there)."""
        if torch._C._are_functorch_transforms_active():
            return self.functorch(vec)
        with torch.enable_grad():
            vec = vec.detach().requires_grad_(True)
            out = self.scalar(vec)
            (g,) = torch.autograd.grad(out, vec)
        return g, out.detach()


def _transition(target: _Target, x: Tensor, logp: Tensor, g: Tensor, key: Tensor,
                step_size: Tensor, num_steps: int, metric: Metric
                ) -> tuple[Tensor, Tensor, Tensor, HMCInfo]:
    """One HMC transition on flat vectors ``x (n,)``, with ``logp`` and its gradient ``g``
    at ``x``; returns the new position, its log density and gradient, and the info."""
    k_momentum, k_accept = random.split(key)
    p = metric.momentum(random.normal(k_momentum, x.shape, dtype=x.dtype).to(x.device))
    h0 = -logp + metric.kinetic(p)
    x1, g1, logp1 = x, g, logp
    p1 = p + 0.5 * step_size * g1  # half step
    for i in range(num_steps):
        x1 = x1 + step_size * metric.velocity(p1)
        g1, logp1 = target.grad_and_value(x1)
        p1 = p1 + (step_size if i < num_steps - 1 else 0.5 * step_size) * g1
    h1 = -logp1 + metric.kinetic(p1)
    log_ratio = (h0 - h1).detach()
    log_ratio = torch.where(torch.isnan(log_ratio), -torch.inf, log_ratio)  # divergent
    accept_prob = log_ratio.clamp(max=0.0).exp()
    u = random.uniform(k_accept, (), dtype=x.dtype).to(x.device)
    accepted = u < accept_prob
    x_new = torch.where(accepted, x1, x)
    logp_new = torch.where(accepted, logp1, logp)
    g_new = torch.where(accepted, g1, g)
    return x_new, logp_new, g_new, HMCInfo(accept_prob, accepted, logp_new)


def _energy_change(target: _Target, x: Tensor, logp: Tensor, g: Tensor, key: Tensor,
                   step_size: Tensor, metric: Metric) -> Tensor:
    """``H0 - H`` after one leapfrog step from ``x`` with a momentum from ``key`` (-inf
    for a NaN energy): what Stan's step-size search reads."""
    p = metric.momentum(random.normal(key, x.shape, dtype=x.dtype).to(x.device))
    h0 = -logp + metric.kinetic(p)
    p1 = p + 0.5 * step_size * g
    x1 = x + step_size * metric.velocity(p1)
    g1, logp1 = target.grad_and_value(x1)
    p1 = p1 + 0.5 * step_size * g1
    change = (h0 - (-logp1 + metric.kinetic(p1))).detach()
    return torch.where(torch.isnan(change), -torch.inf, change)


def hmc_step(
    logdensity_fn: Callable[[Any], Tensor],
    position: Any,
    key: Tensor,
    *,
    step_size: float | Tensor,
    num_steps: int = 10,
    inverse_mass: Any = None,
    dense_mass: bool = False,
) -> tuple[Any, HMCInfo]:
    """One HMC transition of one chain (blackjax's ``hmc.build_kernel()`` step).

    A momentum ``p ~ N(0, M)`` from ``key``, ``num_steps`` leapfrog steps of size
    ``step_size`` on ``H = -log π(x) + pᵀ M⁻¹ p / 2``, then the proposal is accepted with
    probability ``min(1, exp(H₀ - H₁))`` (a NaN energy rejects). It leaves ``π``
    invariant for any step size.

    Args:
        logdensity_fn: ``position -> ()``, the log density up to a constant.
        position: a tensor or pytree of float tensors.
        key: this transition's key.
        step_size: the leapfrog step (a float or 0-d tensor).
        num_steps: leapfrog steps (1: MALA).
        inverse_mass: the diagonal of ``M⁻¹``, ``position``'s structure; with
            ``dense_mass``, the whole ``M⁻¹``, ``(n, n)`` over the flat position (leaves
            raveled in ``optree`` order); None: the identity.
        dense_mass: ``inverse_mass`` is a dense matrix.

    Returns:
        ``(new_position, info)``, an :class:`HMCInfo`.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> logp = lambda x: -0.5 * (x ** 2).sum()                    # N(0, I)
        >>> keys = random.split(random.key(0), 4000)
        >>> x0 = torch.zeros(4000, 2)
        >>> x, info = torch.func.vmap(lambda x, k: hmc_step(logp, x, k, step_size=0.5))(
        ...     x0, keys)                                            # 4000 chains, 1 step
        >>> x.shape, bool(info.accept_prob.mean() > 0.9)
        (torch.Size([4000, 2]), True)
    """
    flat = Flat(position, "hmc_step", "position")
    target = _Target(logdensity_fn, flat, "hmc_step")
    _positive("step_size", step_size)
    num_steps = _count("num_steps", num_steps, 1)
    x = flat.vector(position, "position")
    if inverse_mass is None:
        metric = Metric.identity(x, dense_mass)
    elif dense_mass:
        metric = Metric(dense_inverse_mass(inverse_mass, flat.n, (), x.dtype, "hmc_step"),
                        True)
    else:
        metric = Metric(flat.vector(inverse_mass, "inverse_mass"), False)
    g, logp = target.grad_and_value(x)
    x, _, _, info = _transition(target, x, logp, g, key, torch.as_tensor(
        step_size, dtype=x.dtype), num_steps, metric)
    return flat.tree(x), info


def hmc(
    logdensity_fn: Callable[[Any], Tensor],
    init: Any,
    key: Tensor,
    *,
    num_samples: int,
    num_warmup: int = 500,
    num_steps: int = 10,
    step_size: float = 0.1,
    target_accept: float = 0.8,
    adapt_mass: bool = True,
    dense_mass: bool = False,
) -> tuple[Any, HMCInfo, dict[str, Any]]:
    """A chain of HMC draws after a warm-up that tunes the step size and a diagonal mass
    matrix (Stan's and blackjax's window adaptation).

    Warm-up: dual averaging of ``log step_size`` to make the mean acceptance
    ``target_accept`` (Hoffman & Gelman's constants ``gamma=0.05, t0=10, kappa=0.75``);
    with ``adapt_mass``, Stan's windows: after a buffer of 75 transitions, slow windows
    of 25, 50, 100, ... draws (the last stretched to end 50 before the warm-up does;
    15% / 10% buffers and one window below 150 transitions, none below 20) each give
    the inverse mass (their variance, shrunk to 1e-3 as Stan does). At the start and
    after each new mass, Stan's step-size search (double or halve while one leapfrog
    step's ``exp(H0 - H)`` stays on its side of 0.8) and a restart of dual averaging
    from there. Then ``num_samples`` transitions with the final averaged step size.

    Args:
        logdensity_fn: ``position -> ()``, the log density up to a constant.
        init: the starting position (a tensor or pytree).
        key: the chain's key (``vmap`` over keys and ``init`` for many chains).
        num_samples: draws to return.
        num_warmup: warm-up transitions (0: no adaptation; ``step_size`` as given).
        num_steps: leapfrog steps per transition.
        step_size: where the step-size search starts (without warm-up: the fixed step).
        target_accept: the acceptance dual averaging aims at.
        adapt_mass: learn the mass matrix during warm-up.
        dense_mass: learn a dense ``M⁻¹`` (the draws' covariance: for correlated
            posteriors) instead of its diagonal.

    Returns:
        ``(samples, info, adapted)``: the draws with a leading ``num_samples`` dim on
        ``init``'s structure; an :class:`HMCInfo` per draw; ``{"step_size": (),
        "inverse_mass": init's structure}`` (dense: an ``(n, n)`` tensor over the flat
        position).

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> scales = torch.tensor([1.0, 10.0])
        >>> logp = lambda x: -0.5 * ((x / scales) ** 2).sum()        # N(0, diag(1, 100))
        >>> samples, info, adapted = hmc(logp, torch.zeros(2), random.key(0),
        ...                              num_samples=500, num_warmup=200, num_steps=5)
        >>> bool(((samples.std(0) / scales - 1).abs() < 0.15).all())    # the scales
        True
        >>> bool(((adapted["inverse_mass"].sqrt() / scales - 1).abs() < 0.25).all())
        True
    """
    flat = Flat(init, "hmc", "init")
    target = _Target(logdensity_fn, flat, "hmc")
    _positive("step_size", step_size)
    num_samples = _count("num_samples", num_samples, 1)
    num_warmup = _count("num_warmup", num_warmup, 0)
    num_steps = _count("num_steps", num_steps, 1)
    if not isinstance(target_accept, float) or not 0 < target_accept < 1:
        raise ValueError(f"target_accept must be a float in (0, 1), got {target_accept!r}")
    x = flat.vector(init, "init")
    g, logp = target.grad_and_value(x)
    log_eps = torch.tensor(float(step_size), dtype=x.dtype).log().to(x.device)
    k_warm, k_draw, k_search = random.split(key, 3)

    def transition(state, i, eps, metric):
        *state, info = _transition(target, *state, random.fold_in(k_warm, i), eps,
                                   num_steps, metric)
        return state, info.accept_prob

    def energy_change(state, j, eps, metric):
        return _energy_change(target, *state, random.fold_in(k_search, j), eps, metric)

    (x, logp, g), eps, metric = warmup(transition, energy_change, (x, logp, g),
                                       lambda s: s[0], log_eps, num_warmup, target_accept,
                                       adapt_mass, dense_mass)
    draws, infos = [], []
    for i in range(num_samples):
        x, logp, g, info = _transition(target, x, logp, g, random.fold_in(k_draw, i), eps,
                                       num_steps, metric)
        draws.append(x)
        infos.append(info)
    samples = flat.tree(torch.stack(draws))  # (num_samples, ...)
    info = HMCInfo(*(torch.stack(v) for v in zip(*infos)))
    inverse_mass = metric.inv if dense_mass else flat.tree(metric.inv)
    return samples, info, {"step_size": eps, "inverse_mass": inverse_mass}
