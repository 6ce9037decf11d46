"""The No-U-Turn Sampler (Hoffman & Gelman, 2014) in its multinomial form (Betancourt,
2017), as Stan, NumPyro and blackjax run it: the trajectory doubles forward or backward
until it turns back on itself (the generalised U-turn criterion, with Stan's extra
checks across merged subtrees), diverges, or reaches ``max_depth``; the draw is picked
from the whole trajectory in proportion to ``exp(-H)``, biased towards the newest half.

- :func:`nuts_step`: one transition of ``C`` chains at a given step size and mass;
- :func:`nuts`: whole chains, after the warm-up :func:`hmc` uses (dual averaging to a
  target acceptance, a mass from Stan's windows, Stan's step-size search).

Many chains, two ways, the same draws: ``num_chains=C`` runs them on a leading dim, or
``vmap`` over keys and starts as for :func:`hmc`. The tree depth depends on the data, so
every chain steps in lockstep, a chain whose tree has stopped is frozen by masks, and
the doubling ends when every chain in every ``vmap`` lane has stopped (JAX's batched
``while_loop``, through ``core._lanes``). Each chain draws only from its own key, so
chain ``c`` of a batch is the chain run alone from ``keys[c]``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from operator import itemgetter
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor
from torch.func import grad_and_value, vmap

from torchfn import random
from torchfn.core._lanes import lanes
from torchfn.transforms._adaptation import warmup
from torchfn.transforms._flat import Flat
from torchfn.transforms._hmc import _count, _positive
from torchfn.transforms._metric import Metric, dense_inverse_mass

__all__ = ["NUTSInfo", "nuts_step", "nuts"]

_MAX_DELTA_ENERGY = 1000.0  # Stan's and NumPyro's divergence threshold
_POOLED_DEPTH = 10  # merge uniforms of doublings below this depth are drawn up front


class NUTSInfo(NamedTuple):
    """What a NUTS transition did, per chain ``(C,)`` (``(C, num_samples)`` from
    :func:`nuts`): ``accept_prob`` (the mean Metropolis probability over the trajectory,
    what dual averaging tunes), ``num_steps`` (leapfrog steps), ``tree_depth`` (accepted
    doublings), ``diverging`` (the energy error passed 1000 or was NaN),
    ``log_density`` at the draw and ``energy``, the Hamiltonian there (Stan's
    ``energy__``, what :func:`bfmi` reads)."""

    accept_prob: Tensor
    num_steps: Tensor
    tree_depth: Tensor
    diverging: Tensor
    log_density: Tensor
    energy: Tensor


class _Batch:
    """``C`` chains' log densities and gradients on flat vectors ``(C, n)``."""

    def __init__(self, logdensity_fn: Callable[[Any], Tensor], flat: Flat, who: str):
        if not callable(logdensity_fn):
            raise TypeError(f"{who}: logdensity_fn must be callable, got "
                            f"{type(logdensity_fn).__name__}")

        def scalar(vec: Tensor) -> Tensor:
            out = logdensity_fn(flat.tree(vec))
            if not isinstance(out, Tensor) or out.dim() != 0:
                got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
                raise ValueError(f"{who}: logdensity_fn must return a scalar (shape ()), "
                                 f"got {got}")
            return out

        self.scalar, self.batched = scalar, vmap(scalar)
        self.functorch = grad_and_value(scalar)

    def grad_and_value(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(∇ log π (C, n), log π (C,))``: one batched forward, one backward (the
        chains are independent, so the gradient of the sum is each chain's); one chain
        skips ``vmap``, whose wrapping costs as much as a small model's gradient. Under
        a transform (``vmap`` over chains by the caller), ``torch.func``."""
        if torch._C._are_functorch_transforms_active():
            if x.shape[0] == 1:
                g, out = self.functorch(x[0])
                return g[None], out[None]
            return vmap(self.functorch)(x)
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            out = self.scalar(x[0])[None] if x.shape[0] == 1 else self.batched(x)  # (C,)
            (g,) = torch.autograd.grad(out.sum(), x)
        return g, out.detach()


class _Leaf(NamedTuple):  # a point of the trajectory, per chain
    x: Tensor  # (C, n)
    p: Tensor  # (C, n)
    g: Tensor  # (C, n)
    logp: Tensor  # (C,)


class _Tree(NamedTuple):
    """A subtree in the order it was built: ``end`` is its far leaf (where the next
    doubling starts), ``p_beg``/``p_end`` the momenta of its first and last leaves."""

    end: _Leaf
    p_beg: Tensor
    p_end: Tensor
    rho: Tensor  # (C, n), the sum of its momenta
    log_w: Tensor  # (C,), log Σ exp(H₀ - H)
    draw: _Leaf  # the multinomial pick among its leaves
    valid: Tensor  # (C,) bool: no U-turn inside, no divergence
    diverging: Tensor  # (C,) bool
    metro: Tensor  # (C,), Σ min(1, exp(H₀ - H))
    steps: Tensor  # (C,) leapfrog steps


def _pick(mask: Tensor, a: Any, b: Any) -> Any:
    """``a`` where ``mask (C,)``, else ``b``, leaf by leaf."""
    if isinstance(a, tuple):
        return type(a)(*(_pick(mask, u, v) for u, v in zip(a, b)))
    m = mask.reshape(mask.shape + (1,) * (a.dim() - mask.dim()))
    return torch.where(m, a, b)


class _Trajectory:
    """One NUTS transition's fixed pieces: the target, the step (signed per chain), the
    inverse mass, the starting energy and the merge uniforms."""

    def __init__(self, target: _Batch, eps: Tensor, metric: Metric, h0: Tensor):
        self.target, self.eps, self.metric, self.h0 = target, eps, metric, h0
        self.uniforms: Tensor | None = None  # (C, 2**depth - 1) for the current doubling

    def turning_ok(self, p_a: Tensor, p_b: Tensor, rho: Tensor) -> Tensor:
        """The generalised no-U-turn criterion between two end momenta over ``rho``:
        both ``M⁻¹ p · rho > 0``."""
        rho_sharp = self.metric.velocity(rho)  # (C, n)
        return ((p_a * rho_sharp).sum(-1) > 0) & ((p_b * rho_sharp).sum(-1) > 0)

    def merged_ok(self, a_beg: Tensor, a_end: Tensor, a_rho: Tensor, b: _Tree) -> Tensor:
        """No U-turn across ``a`` then ``b`` (in build order): over the whole, and Stan's
        two extra checks over each part extended by the neighbouring leaf of the other."""
        return self.turning_ok(a_beg, b.p_end, a_rho + b.rho) & \
            self.turning_ok(a_beg, b.p_beg, a_rho + b.p_beg) & \
            self.turning_ok(a_end, b.p_end, b.rho + a_end)

    def leaf(self, start: _Leaf, direction: Tensor) -> _Tree:
        """One leapfrog step from ``start``, forward or backward per chain."""
        eps = (self.eps * direction)[:, None]  # (C, 1)
        p = start.p + 0.5 * eps * start.g
        x = start.x + eps * self.metric.velocity(p)
        g, logp = self.target.grad_and_value(x)
        p = p + 0.5 * eps * g
        h = -logp + self.metric.kinetic(p)  # (C,)
        h = torch.where(torch.isnan(h), torch.inf, h)
        log_w = self.h0 - h
        diverging = -log_w > _MAX_DELTA_ENERGY
        new = _Leaf(x, p, g, logp)
        return _Tree(new, p, p, p, log_w, new, ~diverging, diverging,
                     log_w.clamp(max=0.0).exp(), torch.ones_like(log_w))

    def build(self, depth: int, start: _Leaf, direction: Tensor, mask: Tensor,
              offset: int) -> _Tree:
        """A subtree of ``2**depth`` leaves from ``start``; chains off ``mask`` are
        ignored by the caller. Merge uniforms ``offset .. offset + 2**depth - 2`` (post
        order, fixed by the tree's shape, so a chain's draws do not depend on the rest)."""
        if depth == 0:
            return self.leaf(start, direction)
        half = 2 ** (depth - 1) - 1  # merges inside each half
        a = self.build(depth - 1, start, direction, mask, offset)
        go_on = mask & a.valid
        if not _any_lane(go_on):
            return a
        b = self.build(depth - 1, a.end, direction, go_on, offset + half)
        log_w = torch.logaddexp(a.log_w, b.log_w)
        take_b = self.uniforms[:, offset + 2 * half] < (b.log_w - log_w).exp()
        merged = _Tree(
            end=b.end, p_beg=a.p_beg, p_end=b.p_end, rho=a.rho + b.rho, log_w=log_w,
            draw=_pick(take_b, b.draw, a.draw),
            valid=b.valid & self.merged_ok(a.p_beg, a.p_end, a.rho, b),
            diverging=b.diverging, metro=a.metro + b.metro, steps=a.steps + b.steps)
        if not _any_lane(mask & ~a.valid):  # chains off ``mask`` are ignored anyway
            return merged
        # a chain whose first half stopped keeps it, with the counts it reached
        return _pick(go_on, merged, a)


def _per_chain(fn: Callable[[Tensor], Any], keys: Tensor) -> Any:
    """``fn`` on each chain's key ``keys (C, 2)``, outputs stacked: a Python loop for a
    few CPU chains (the keys' fast path: 1.7 ms less per transition for 4 chains than
    ``vmap``, whose batched threefry costs per op), ``vmap`` otherwise; the same bits."""
    if keys.device.type != "cpu" or keys.shape[0] > 8:
        return vmap(fn)(keys)
    outs = [fn(k) for k in keys]
    if isinstance(outs[0], tuple):
        return tuple(torch.stack(o) for o in zip(*outs))
    return torch.stack(outs)


def _search_momentum(key: Tensor, j: int, n: int, dtype: torch.dtype) -> Tensor:
    """The ``j``-th standard normal of the step-size search."""
    return random.normal(random.fold_in(key, j), (n,), dtype=dtype)


def _any_lane(t: Tensor) -> bool:
    """Whether ``t`` holds anywhere: in any chain of any ``vmap`` lane (the loops run
    until every lane is done, finished ones frozen by masks, as JAX's batched
    ``while_loop``)."""
    return bool(lanes(t).any())


def _deep_uniforms(key: Tensor, depth: int, dtype: torch.dtype) -> Tensor:
    """The merge uniforms of a doubling past the pooled depths."""
    return random.uniform(random.fold_in(key, depth), (2 ** depth - 1,), dtype=dtype)


def _transition(target: _Batch, x: Tensor, logp: Tensor, g: Tensor, keys: Tensor,
                eps: Tensor, metric: Metric, max_depth: int
                ) -> tuple[Tensor, Tensor, Tensor, NUTSInfo]:
    """One NUTS transition of ``C`` chains: ``x, g (C, n)``, ``logp, eps (C,)``,
    ``keys (C, 2)``, a metric over ``(C, n)``."""
    C, n, dtype = x.shape[0], x.shape[1], x.dtype
    pool = 2 ** min(max_depth, _POOLED_DEPTH)

    def draws(key: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        k_mom, k_u, k_deep = random.split(key, 3)
        return random.normal(k_mom, (n,), dtype=dtype), \
            random.uniform(k_u, (2 * max_depth + pool,), dtype=dtype), k_deep

    p, u, k_deep = _per_chain(draws, keys)  # (C, n), (C, 2 max_depth + pool), (C, 2)
    p = metric.momentum(p.to(x.device))  # ~ N(0, M)
    u = u.to(x.device)
    u_dir, u_top, u_pool = u[:, :max_depth], u[:, max_depth:2 * max_depth], \
        u[:, 2 * max_depth:]
    h0 = -logp + metric.kinetic(p)
    traj = _Trajectory(target, eps, metric, h0)

    start = _Leaf(x, p, g, logp)
    left, right, draw = start, start, start
    rho, log_w = p, torch.zeros_like(logp)
    alive = torch.ones(C, dtype=torch.bool, device=x.device)
    depth = torch.zeros(C, dtype=torch.long, device=x.device)
    diverging = torch.zeros_like(alive)
    metro, steps = torch.zeros_like(logp), torch.zeros_like(logp)
    for d in range(max_depth):
        if not _any_lane(alive):
            break
        forward = u_dir[:, d] < 0.5  # (C,)
        direction = torch.where(forward, 1.0, -1.0).to(dtype)
        if d < _POOLED_DEPTH:  # this doubling's 2**d - 1 merges, after the earlier ones'
            base = 2 ** d - 1 - d
            traj.uniforms = u_pool[:, base:base + max(2 ** d - 1, 1)]
        else:
            traj.uniforms = _per_chain(partial(_deep_uniforms, depth=d, dtype=dtype), k_deep)
            traj.uniforms = traj.uniforms.to(x.device)
        sub = traj.build(d, _pick(forward, right, left), direction, alive, 0)
        metro = metro + torch.where(alive, sub.metro, 0.0)
        steps = steps + torch.where(alive, sub.steps, 0.0)
        diverging = diverging | (alive & sub.diverging)
        ok = alive & sub.valid
        # biased progressive sampling: the new half wins with prob min(1, w_new / w_old)
        take = ok & (u_top[:, d] < (sub.log_w - log_w).exp())
        draw = _pick(take, sub.draw, draw)
        log_w = torch.where(ok, torch.logaddexp(log_w, sub.log_w), log_w)
        # the old tree in build order: its far edge first, the edge the new half grew from last
        old_beg = torch.where(forward[:, None], left.p, right.p)
        old_end = torch.where(forward[:, None], right.p, left.p)
        no_turn = traj.merged_ok(old_beg, old_end, rho, sub)
        rho = torch.where(ok[:, None], rho + sub.rho, rho)
        right = _pick(ok & forward, sub.end, right)
        left = _pick(ok & ~forward, sub.end, left)
        depth = depth + ok.long()
        alive = ok & no_turn
    energy = -draw.logp + metric.kinetic(draw.p)
    info = NUTSInfo(metro / steps, steps.long(), depth, diverging, draw.logp, energy)
    return draw.x, draw.logp, draw.g, info


def _setup(who: str, logdensity_fn: Callable[[Any], Tensor], init: Any, key: Tensor,
           num_chains: int | None, max_depth: int) -> tuple[Flat, _Batch, Tensor, Tensor]:
    """Checks; ``init`` as ``(C, n)`` and one key per chain ``(C, 2)``."""
    _count("max_depth", max_depth, 1)
    if max_depth > 16:
        raise ValueError(f"{who}: max_depth must be <= 16 (65536 leapfrog steps per "
                         f"draw), got {max_depth}")
    if not isinstance(key, Tensor) or key.shape != (2,):
        got = tuple(key.shape) if isinstance(key, Tensor) else type(key).__name__
        raise ValueError(f"{who}: key must be one key of shape (2,), got {got}")
    if num_chains is None:
        flat = Flat(init, who, "init")
        keys = key[None]
    else:
        _count("num_chains", num_chains, 1)
        flat = Flat(optree.tree_map(lambda v: v[0] if isinstance(v, Tensor) and v.dim()
                                    else v, init), who, "init")
        keys = random.split(key, num_chains)
    x = _stack(flat, init, num_chains, "init")
    return flat, _Batch(logdensity_fn, flat, who), x, keys.to(x.device)


def _stack(flat: Flat, tree: Any, num_chains: int | None, what: str) -> Tensor:
    """``tree`` (``init``'s structure, with a leading ``(C,)`` on each leaf when
    ``num_chains``) as flat vectors ``(C, n)``."""
    if num_chains is None:
        return flat.vector(tree, what)[None]  # (1, n)
    leaves = optree.tree_leaves(tree)
    if not leaves or not all(isinstance(v, Tensor) and v.dim() and v.shape[0] == num_chains
                             for v in leaves):
        got = [tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
               for v in leaves]
        raise ValueError(f"{flat.who}: with num_chains={num_chains}, every leaf of {what} "
                         f"must have a leading dim of {num_chains}, got {got}")
    return torch.stack([flat.vector(optree.tree_map(itemgetter(c), tree), what)
                        for c in range(num_chains)])  # (C, n)


def _unbatch(flat: Flat, x: Tensor, num_chains: int | None, dim: int) -> Any:
    """Flat ``(..., C, ..., n)`` back to the pytree; without ``num_chains``, the chain dim
    ``dim`` is dropped."""
    return flat.tree(x if num_chains is not None else x.squeeze(dim))


def nuts_step(
    logdensity_fn: Callable[[Any], Tensor],
    position: Any,
    key: Tensor,
    *,
    step_size: float | Tensor,
    inverse_mass: Any = None,
    max_depth: int = 10,
    num_chains: int | None = None,
    dense_mass: bool = False,
) -> tuple[Any, NUTSInfo]:
    """One NUTS transition (blackjax's ``nuts.build_kernel()`` step).

    A momentum ``p ~ N(0, M)``; the trajectory of leapfrog steps of size ``step_size``
    doubles in a random direction until a U-turn, a divergence (energy error above
    1000) or ``2**max_depth`` steps; the new position is a multinomial pick over the
    trajectory. It leaves ``π`` invariant for any step size.

    Args:
        logdensity_fn: ``position -> ()``, the log density up to a constant; it is
            batched over chains with ``vmap``.
        position: a tensor or pytree of float tensors; with ``num_chains``, each leaf
            has a leading ``(C,)`` dim.
        key: one key ``(2,)``; with ``num_chains`` it is split into one per chain.
        step_size: the leapfrog step (a float or a tensor ``()`` or ``(C,)``).
        inverse_mass: the diagonal of ``M⁻¹``, ``position``'s structure; with
            ``dense_mass``, the whole ``M⁻¹``, ``(n, n)`` (or one per chain,
            ``(C, n, n)``) over the flat position (leaves in ``optree`` order); None:
            the identity.
        max_depth: at most ``2**max_depth`` leapfrog steps (Stan and NumPyro: 10).
        num_chains: run ``C`` chains at once (None: one chain, no chain dim).
        dense_mass: ``inverse_mass`` is a dense matrix.

    Returns:
        ``(new_position, info)``, a :class:`NUTSInfo` (``(C,)`` fields, ``()`` without
        ``num_chains``).

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> logp = lambda x: -0.5 * (x ** 2).sum()                      # N(0, I)
        >>> x, info = nuts_step(logp, torch.zeros(8, 3), random.key(0), step_size=0.5,
        ...                     num_chains=8)
        >>> x.shape, info.num_steps.shape, bool((info.tree_depth >= 1).all())
        (torch.Size([8, 3]), torch.Size([8]), True)
    """
    flat, target, x, keys = _setup("nuts_step", logdensity_fn, position, key, num_chains,
                                   max_depth)
    _positive("step_size", step_size)
    eps = torch.as_tensor(step_size, dtype=x.dtype, device=x.device).expand(x.shape[0])
    if inverse_mass is None:
        metric = Metric.identity(x, dense_mass)
    elif dense_mass:
        per_chain = num_chains is not None and isinstance(inverse_mass, Tensor) and \
            inverse_mass.dim() == 3  # else one matrix for every chain
        lead = (num_chains,) if per_chain else ()
        inv = dense_inverse_mass(inverse_mass, flat.n, lead, x.dtype, "nuts_step")
        metric = Metric(inv.expand(x.shape[0], flat.n, flat.n), True)
    else:
        metric = Metric(_stack(flat, inverse_mass, num_chains, "inverse_mass").expand_as(x),
                        False)
    g, logp = target.grad_and_value(x)
    x, _, _, info = _transition(target, x, logp, g, keys, eps, metric, max_depth)
    if num_chains is None:
        info = NUTSInfo(*(v[0] for v in info))
    return _unbatch(flat, x, num_chains, 0), info


def nuts(
    logdensity_fn: Callable[[Any], Tensor],
    init: Any,
    key: Tensor,
    *,
    num_samples: int,
    num_warmup: int = 500,
    step_size: float = 0.1,
    max_depth: int = 10,
    target_accept: float = 0.8,
    adapt_mass: bool = True,
    num_chains: int | None = None,
    dense_mass: bool = False,
) -> tuple[Any, NUTSInfo, dict[str, Any]]:
    """Chains of NUTS draws after the warm-up of :func:`hmc` (dual averaging of the step
    size to ``target_accept``, a diagonal mass from Stan's doubling windows, Stan's
    step-size search at the start and after each new mass), each chain adapting on its
    own.

    Args:
        logdensity_fn: ``position -> ()``, the log density up to a constant; it is
            batched over chains with ``vmap``.
        init: the starting position (a tensor or pytree); with ``num_chains``, each leaf
            has a leading ``(C,)`` dim, one start per chain.
        key: one key ``(2,)``; with ``num_chains``, chain ``c`` runs from
            ``random.split(key, C)[c]`` and equals ``nuts`` run alone from that key
            (as ``vmap`` over keys and ``init`` does).
        num_samples: draws to return.
        num_warmup: warm-up transitions (0: ``step_size`` as given, unit mass).
        step_size: where the step-size search starts (without warm-up: the fixed step).
        max_depth: at most ``2**max_depth`` leapfrog steps per draw.
        target_accept: the mean acceptance dual averaging aims at (Stan: 0.8).
        adapt_mass: learn the mass matrix during warm-up.
        num_chains: run ``C`` chains at once (None: one chain, no chain dim).
        dense_mass: learn a dense ``M⁻¹`` (the draws' covariance) instead of its
            diagonal; ``adapted["inverse_mass"]`` is then ``(n, n)`` (``(C, n, n)``).

    Returns:
        ``(samples, info, adapted)``: the draws with leading ``(num_samples,)`` dims
        (``(C, num_samples)`` with ``num_chains``: chains first, as ``vmap`` over
        :func:`hmc` and :func:`rhat` have them) on ``init``'s structure; a
        :class:`NUTSInfo` per draw (``(C, num_samples)`` fields); ``{"step_size": () or
        (C,), "inverse_mass": init's structure}``.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> scales = torch.tensor([1.0, 10.0])
        >>> logp = lambda x: -0.5 * ((x / scales) ** 2).sum()       # N(0, diag(1, 100))
        >>> samples, info, adapted = nuts(logp, torch.zeros(2, 2), random.key(0),
        ...                               num_samples=200, num_warmup=100, num_chains=2)
        >>> samples.shape
        torch.Size([2, 200, 2])
        >>> bool(((samples.flatten(0, 1).std(0) / scales - 1).abs() < 0.15).all())
        True
    """
    flat, target, x, keys = _setup("nuts", logdensity_fn, init, key, num_chains,
                                   max_depth)
    _positive("step_size", step_size)
    num_samples = _count("num_samples", num_samples, 1)
    num_warmup = _count("num_warmup", num_warmup, 0)
    if not isinstance(target_accept, float) or not 0 < target_accept < 1:
        raise ValueError(f"nuts: target_accept must be a float in (0, 1), got "
                         f"{target_accept!r}")
    g, logp = target.grad_and_value(x)
    k_warm, k_draw, k_search = _per_chain(partial(random.split, num=3), keys).unbind(1)
    log_eps = torch.full_like(logp, float(step_size)).log()  # (C,)

    def transition(state, i, eps, metric):
        step_keys = _per_chain(partial(random.fold_in, data=i), k_warm)
        *state, info = _transition(target, *state, step_keys, eps, metric, max_depth)
        return state, info.accept_prob

    def energy_change(state, j, eps, metric):
        x, logp, g = state
        p = _per_chain(partial(_search_momentum, j=j, n=x.shape[1], dtype=x.dtype),
                       k_search).to(x.device)
        p = metric.momentum(p)
        h0 = -logp + metric.kinetic(p)
        traj = _Trajectory(target, eps, metric, h0)
        return traj.leaf(_Leaf(x, p, g, logp), torch.ones_like(eps)).log_w  # H0 - H

    (x, logp, g), eps, metric = warmup(transition, energy_change, (x, logp, g),
                                       lambda s: s[0], log_eps, num_warmup, target_accept,
                                       adapt_mass, dense_mass)
    draws, infos = [], []
    for i in range(num_samples):
        step_keys = _per_chain(partial(random.fold_in, data=i), k_draw)
        x, logp, g, info = _transition(target, x, logp, g, step_keys, eps, metric,
                                       max_depth)
        draws.append(x)
        infos.append(info)
    # chains first, as hmc under vmap gives them and rhat takes them
    samples = _unbatch(flat, torch.stack(draws, 1), num_chains, 0)  # (C, S, ...) or (S, ...)
    info = NUTSInfo(*(torch.stack(v, 1) for v in zip(*infos)))  # (C, S)
    inv = metric.inv if dense_mass else flat.tree(metric.inv)  # (C, n, n) or pytree
    adapted = {"step_size": eps, "inverse_mass": inv}
    if num_chains is None:
        info = NUTSInfo(*(v[0] for v in info))
        inv = metric.inv[0] if dense_mass else flat.tree(metric.inv[0])
        adapted = {"step_size": eps[0], "inverse_mass": inv}
    return samples, info, adapted
