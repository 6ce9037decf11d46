"""Stochastic-gradient MCMC as gradient transformations: SGLD (Welling & Teh, 2011) and
SGHMC (Chen, Fox & Guestrin, 2014). The "optimizer" samples: fed minibatch gradients of
the potential ``U(θ) = -log p(θ | data)`` (the minibatch loss scaled to the dataset,
plus the prior's), its iterates are approximate posterior draws.

    SGLD:   Δθ = -lr ∇U + sqrt(2 lr T) ξ
    pSGLD:  Δθ = -lr G ∇U + sqrt(2 lr T G) ξ,   G = 1 / (eps + sqrt(V)), V an RMSprop
            average of ∇U² (Li et al., 2016)
    SGHMC:  v ← (1 - friction) v - lr ∇U + sqrt(2 friction lr T) ξ,   Δθ = v

``ξ ~ N(0, I)`` comes from the key in the state, folded with the step count, so a run
replays exactly and ``vmap`` over keys runs independent chains. ``T`` is the
temperature (1: the posterior; < 1: the "cold posteriors" of Wenzel et al., 2020; 0: SGD
and SGD with momentum). The gradient-noise correction of both papers is left at 0, as
most implementations do.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from torchfn import random
from torchfn.optim import _checks
from torchfn.optim._base import GradientTransformation, check_state, lr_at, new_count
from torchfn.optim._tree import check_structure

__all__ = ["SGLDState", "SGHMCState", "PSGLDState", "sgld", "sghmc", "psgld"]


class SGLDState(NamedTuple):
    count: Tensor  # () int32
    key: Tensor  # the chain's key


class PSGLDState(NamedTuple):
    count: Tensor  # () int32
    key: Tensor
    square_avg: Any  # params' structure: the RMSprop average V of the squared gradients


class SGHMCState(NamedTuple):
    count: Tensor  # () int32
    key: Tensor
    velocity: Any  # params' structure


def _check_key(key: Any, who: str) -> Tensor:
    if not isinstance(key, Tensor) or key.shape[-1:] != (2,) or key.dtype.is_floating_point:
        got = tuple(key.shape) if isinstance(key, Tensor) else type(key).__name__
        raise TypeError(f"{who}: key must be a torchfn.random key (shape (2,)), got {got}")
    return key


def _noise(key: Tensor, count: Tensor, leaves: list[Tensor]) -> list[Tensor]:
    """Standard normals shaped as ``leaves``, from ``key`` folded with the step."""
    step = random.fold_in(key, count)
    keys = random.split(step, len(leaves))
    return [random.normal(keys[i], x.shape, dtype=x.dtype).to(x.device)
            for i, x in enumerate(leaves)]


def sgld(lr: Any, key: Tensor, *, temperature: Any = 1.0) -> GradientTransformation:
    """Stochastic gradient Langevin dynamics: ``Δθ = -lr ∇U + sqrt(2 lr T) ξ``.

    Args:
        lr: the step (Welling & Teh's ``ε / 2``), a number, a 0-d tensor or a schedule
            ``step -> lr`` (their polynomially decaying one, or cyclical SG-MCMC's).
        key: the chain's key.
        temperature: ``T >= 0`` (0: plain SGD).

    Example::

        >>> import torch
        >>> from torchfn import optim, random
        >>> tx = optim.sgld(0.01, random.key(0))
        >>> theta = torch.zeros(20000)                   # 20000 chains on U = θ² / 2
        >>> state = tx.init(theta)
        >>> for _ in range(500):
        ...     updates, state = tx.update(theta, state)   # ∇U = θ
        ...     theta = optim.apply_updates(theta, updates)
        >>> round(theta.var().item(), 1)                  # N(0, 1), to O(lr)
        1.0
    """
    _checks.lr(lr)
    _checks.nonneg("temperature", temperature)
    key = _check_key(key, "sgld")

    def init(params: Any) -> SGLDState:
        return SGLDState(new_count(optree.tree_leaves(params)), key)

    def update(grads: Any, state: SGLDState, params: Any = None, *, inplace: Any = None):
        check_state(state, SGLDState, "sgld")
        g, spec = optree.tree_flatten(grads)
        lr_t = lr_at(lr, state.count)
        scale = (2 * lr_t * temperature) ** 0.5
        xi = _noise(state.key, state.count, g)
        updates = [-lr_t * gi + scale * n for gi, n in zip(g, xi)]
        return optree.tree_unflatten(spec, updates), SGLDState(state.count + 1, state.key)

    return GradientTransformation(init, update)


def psgld(lr: Any, key: Tensor, *, beta: Any = 0.99, eps: Any = 1e-5,
          temperature: Any = 1.0) -> GradientTransformation:
    """Preconditioned SGLD (Li, Chen, Carlson & Carin, 2016): SGLD with RMSprop's
    diagonal preconditioner, ``Δθ = -lr G ∇U + sqrt(2 lr T G) ξ`` with
    ``G = 1 / (eps + sqrt(V))`` and ``V ← beta V + (1 - beta) ∇U²``: a coordinate's
    step shrinks with its gradients' size, so the spread of scales the sampler sees is
    its square root (on a Gaussian, ``G ≈ σ``). ``V`` is bias-corrected as Adam's (divided by
    ``1 - beta^t``), so the first steps are not scaled by ``1 / eps``. The ``Γ``
    correction term of the paper is left at 0, as in its experiments: it is small
    while ``V`` averages over many more steps than a coordinate takes to mix (``beta``
    near 1); where ``V`` follows the chain, the draws come out overdispersed.

    Args:
        lr: the step, a number, tensor or schedule.
        key: the chain's key.
        beta: RMSprop's decay of ``V`` in ``[0, 1)``.
        eps: added to ``sqrt(V)`` (the paper's ``λ``).
        temperature: ``T >= 0`` (0: RMSprop without momentum).

    Example::

        >>> import torch
        >>> from torchfn import optim, random
        >>> scales = torch.tensor([0.5, 2.0])                   # U = sum θ² / (2 scales²)
        >>> tx = optim.psgld(0.02, random.key(0), beta=0.9999)
        >>> theta = random.normal(random.key(1), (5000, 2)) * scales    # 5000 chains
        >>> state = tx.init(theta)
        >>> for _ in range(2000):
        ...     updates, state = tx.update(theta / scales ** 2, state)
        ...     theta = optim.apply_updates(theta, updates)
        >>> (theta.std(0) / scales).round(decimals=1).tolist()  # both scales
        [1.0, 1.0]
    """
    _checks.lr(lr)
    _checks.unit_interval("beta", beta)
    _checks.positive("eps", eps)
    _checks.nonneg("temperature", temperature)
    key = _check_key(key, "psgld")

    def init(params: Any) -> PSGLDState:
        leaves, spec = optree.tree_flatten(params)
        square_avg = optree.tree_unflatten(spec, [torch.zeros_like(x) for x in leaves])
        return PSGLDState(new_count(leaves), key, square_avg)

    def update(grads: Any, state: PSGLDState, params: Any = None, *, inplace: Any = None):
        check_state(state, PSGLDState, "psgld")
        g, spec = optree.tree_flatten(grads)
        v = check_structure(state.square_avg, "optimizer state", grads, "grads")
        lr_t = lr_at(lr, state.count)
        v = [beta * vi + (1 - beta) * gi * gi for vi, gi in zip(v, g)]
        correction = 1 - beta ** (state.count + 1).to(torch.float64)  # as Adam's
        xi = _noise(state.key, state.count, g)
        updates = []
        for vi, gi, n in zip(v, g, xi):
            precondition = 1 / (eps + (vi / correction.to(vi.dtype)).sqrt())
            updates.append(-lr_t * precondition * gi
                           + (2 * lr_t * temperature * precondition).sqrt() * n)
        return optree.tree_unflatten(spec, updates), PSGLDState(
            state.count + 1, state.key, optree.tree_unflatten(spec, v))

    return GradientTransformation(init, update)


def sghmc(lr: Any, key: Tensor, *, friction: Any = 0.1, temperature: Any = 1.0
          ) -> GradientTransformation:
    """Stochastic gradient Hamiltonian Monte Carlo, in its SGD-with-momentum form:
    ``v ← (1 - friction) v - lr ∇U + sqrt(2 friction lr T) ξ``, ``Δθ = v``.

    Args:
        lr: the step ``η`` (Chen et al.'s learning rate), a number, tensor or schedule.
        key: the chain's key.
        friction: ``α`` in ``(0, 1]``, the momentum's decay (``1 - α`` is SGD's
            momentum coefficient).
        temperature: ``T >= 0`` (0: SGD with momentum ``1 - α``).

    Example::

        >>> import torch
        >>> from torchfn import optim, random
        >>> tx = optim.sghmc(0.01, random.key(0), friction=0.1)
        >>> theta = torch.zeros(20000)
        >>> state = tx.init(theta)
        >>> for _ in range(1000):
        ...     updates, state = tx.update(theta, state)   # U = θ² / 2
        ...     theta = optim.apply_updates(theta, updates)
        >>> round(theta.var().item(), 1)
        1.0
    """
    _checks.lr(lr)
    _checks.nonneg("temperature", temperature)
    if not isinstance(friction, Tensor) and not (
            isinstance(friction, (int, float)) and 0 < friction <= 1):
        raise ValueError(f"friction must be in (0, 1], got {friction!r}")
    key = _check_key(key, "sghmc")

    def init(params: Any) -> SGHMCState:
        leaves, spec = optree.tree_flatten(params)
        velocity = optree.tree_unflatten(spec, [torch.zeros_like(x) for x in leaves])
        return SGHMCState(new_count(leaves), key, velocity)

    def update(grads: Any, state: SGHMCState, params: Any = None, *, inplace: Any = None):
        check_state(state, SGHMCState, "sghmc")
        g, spec = optree.tree_flatten(grads)
        v = check_structure(state.velocity, "optimizer state", grads, "grads")
        lr_t = lr_at(lr, state.count)
        scale = (2 * friction * lr_t * temperature) ** 0.5
        xi = _noise(state.key, state.count, g)
        v = [(1 - friction) * vi - lr_t * gi + scale * n for vi, gi, n in zip(v, g, xi)]
        v_tree = optree.tree_unflatten(spec, v)
        return v_tree, SGHMCState(state.count + 1, state.key, v_tree)

    return GradientTransformation(init, update)
