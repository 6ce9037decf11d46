"""Adversarial examples (FGSM, PGD in L-inf and L2) and the adversarial-training loss.

The attacks are gradient ascent on the INPUT of a loss, with the parameters held
constant: the returned examples are detached, so a training loss built on them sees
them as data (the usual stop-gradient of adversarial training, Madry et al. 2018).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import optree
import torch
from torch import Tensor

from torchfn import random

__all__ = ["fgsm", "pgd", "adversarial_loss"]

_NORMS = ("linf", "l2")
_ATTACKS = ("fgsm", "pgd")
_TINY = 1e-12  # guards the L2 normalisation of a zero gradient

LossFn = Callable[[Any, Tensor, Any], Tensor]


# --------------------------------------------------------------------------- checks


def _check_number(name: str, value: object, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or (value <= 0 if positive else value < 0):
        raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'}, got {value}")
    return float(value)


def _check_inputs(loss_fn: object, x: object, clamp: object) -> None:
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not isinstance(x, Tensor) or not x.dtype.is_floating_point or x.dim() < 1:
        got = f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"x must be a floating-point Tensor of shape (B, ...), got {got}")
    if clamp is not None:
        if not (isinstance(clamp, (tuple, list)) and len(clamp) == 2 and clamp[0] < clamp[1]):
            raise ValueError(f"clamp must be None or (lo, hi) with lo < hi, got {clamp!r}")


def _stop_gradient(tree: Any) -> Any:
    return optree.tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, tree)


# --------------------------------------------------------------------------- gradients


def _input_grad(loss_fn: LossFn, params: Any, x: Tensor, y: Any) -> Tensor:
    """``d sum(loss_fn(params, x, y)) / dx`` with ``params`` held constant: ``(B, ...)``.

    At top level one ``torch.autograd.grad`` (no graph kept); inside torch.func
    transforms (``vmap`` over keys, ``grad`` over params) ``torch.func.grad``.
    """

    def total(x_: Tensor) -> Tensor:
        loss = loss_fn(params, x_, y)
        if not isinstance(loss, Tensor) or not loss.dtype.is_floating_point:
            raise TypeError(f"loss_fn must return a floating-point Tensor, got {type(loss)}")
        if loss.dim() > 1 or (loss.dim() == 1 and loss.shape[0] != x_.shape[0]):
            raise ValueError(
                "loss_fn must return a scalar or per-example losses (B,) with "
                f"B = {x_.shape[0]}, got shape {tuple(loss.shape)}"
            )
        return loss.sum()

    if torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling():
        return torch.func.grad(total)(x)
    with torch.enable_grad():
        x_ = x.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(total(x_), x_)
    return g


def _clamp(x: Tensor, clamp: tuple[float, float] | None) -> Tensor:
    return x if clamp is None else x.clamp(clamp[0], clamp[1])


def _per_example_norm(t: Tensor) -> Tensor:
    """``||t_b||_2`` over all but the batch dim, shaped ``(B, 1, ..., 1)`` to broadcast."""
    n = torch.linalg.vector_norm(t.flatten(1), dim=1)  # (B,)
    return n.reshape((t.shape[0],) + (1,) * (t.dim() - 1))


def _project(delta: Tensor, eps: float, norm: str) -> Tensor:
    """The nearest point of the eps-ball (linf: a box; l2: radial rescale)."""
    if norm == "linf":
        return delta.clamp(-eps, eps)
    n = _per_example_norm(delta)
    return delta * torch.clamp(eps / (n + _TINY), max=1.0)


def _random_start(key: Tensor, x: Tensor, eps: float, norm: str) -> Tensor:
    """A uniform point of the eps-ball around 0, one per example: ``(B, ...)``."""
    if norm == "linf":
        if eps == 0:  # the ball is a point (uniform needs minval < maxval)
            return torch.zeros_like(x)
        return random.uniform(key, tuple(x.shape), x.dtype, -eps, eps).to(x.device)
    k_dir, k_rad = random.split(key)
    d = x[0].numel()
    direction = random.normal(k_dir, tuple(x.shape), x.dtype).to(x.device)
    direction = direction / (_per_example_norm(direction) + _TINY)
    u = random.uniform(k_rad, (x.shape[0],), x.dtype).to(x.device)
    radius = eps * u ** (1.0 / d)  # uniform in the ball: P(r < t) = (t / eps)^d
    return direction * radius.reshape((x.shape[0],) + (1,) * (x.dim() - 1))


# --------------------------------------------------------------------------- attacks


def fgsm(
    loss_fn: LossFn,
    params: Any,
    x: Tensor,
    y: Any,
    *,
    eps: float,
    clamp: tuple[float, float] | None = None,
) -> Tensor:
    """Fast gradient sign method (Goodfellow et al. 2015): ``x + eps * sign(grad_x loss)``.

    Args:
        loss_fn: ``(params, x, y) -> loss``, a scalar (mean or sum over the batch) or
            per-example losses ``(B,)`` (their sum is differentiated). Examples must not
            interact (no train-mode BatchNorm): each example's step uses its own gradient.
        params: the model's parameter pytree (held constant).
        x: ``(B, ...)`` inputs.
        y: targets, passed through to ``loss_fn``.
        eps: the L-inf radius, ``>= 0``.
        clamp: ``(lo, hi)`` valid input range (e.g. ``(0, 1)`` for images), or ``None``.

    Returns:
        ``(B, ...)`` adversarial inputs, detached.

    Example::

        >>> import torchfn, torch.nn.functional as F
        >>> from torchfn.models import MLP
        >>> model = torchfn.Model(MLP(4, (16,), 3))
        >>> params = model.init(torchfn.random.key(0))
        >>> loss_fn = lambda p, x, y: F.cross_entropy(model.apply(p, x), y)
        >>> x = torchfn.random.uniform(torchfn.random.key(1), (8, 4))
        >>> y = torchfn.random.randint(torchfn.random.key(2), (8,), 0, 3)
        >>> x_adv = fgsm(loss_fn, params, x, y, eps=0.1, clamp=(0.0, 1.0))   # (8, 4)
    """
    _check_inputs(loss_fn, x, clamp)
    eps = _check_number("eps", eps, positive=False)
    params, x = _stop_gradient(params), x.detach()
    g = _input_grad(loss_fn, params, x, y)
    return _clamp(x + eps * g.sign(), clamp).detach()


def pgd(
    loss_fn: LossFn,
    params: Any,
    x: Tensor,
    y: Any,
    key: Tensor | None,
    *,
    eps: float,
    step_size: float,
    steps: int,
    norm: str = "linf",
    random_start: bool = True,
    clamp: tuple[float, float] | None = None,
) -> Tensor:
    """Projected gradient descent attack (Madry et al. 2018): ``steps`` ascent steps on
    the loss, each projected back onto the eps-ball around ``x`` (and into ``clamp``).

    * ``norm="linf"``: ``x <- x + step_size * sign(g)``, then clip ``x - x0`` to
      ``[-eps, eps]``.
    * ``norm="l2"``: ``x <- x + step_size * g / ||g||``, then rescale ``x - x0`` to
      norm ``<= eps`` (norms per example, over all non-batch dims).

    ``random_start`` begins at a uniform point of the ball drawn from ``key``, so the
    result is a deterministic function of ``(params, x, y, key)`` and ``vmap`` over
    keys gives independent restarts. With ``random_start=False``, ``steps=1`` and
    ``step_size=eps`` the linf attack is exactly :func:`fgsm`.

    Args:
        loss_fn, params, y, clamp: as in :func:`fgsm`.
        x: ``(B, ...)`` clean inputs.
        key: a ``torchfn.random`` key (may be ``None`` when ``random_start=False``).
        eps: the ball's radius, ``>= 0``.
        step_size: ``> 0``; a common choice is ``2.5 * eps / steps``.
        steps: number of ascent steps, ``>= 1``.
        norm: ``"linf"`` or ``"l2"``.

    Returns:
        ``(B, ...)`` adversarial inputs, detached, within the eps-ball of ``x``.

    Example::

        >>> import torch, torchfn, torch.nn.functional as F
        >>> from torchfn.models import MLP
        >>> model = torchfn.Model(MLP(4, (16,), 3))
        >>> params = model.init(torchfn.random.key(0))
        >>> loss_fn = lambda p, x, y: F.cross_entropy(model.apply(p, x), y)
        >>> x = torchfn.random.uniform(torchfn.random.key(1), (8, 4))
        >>> y = torchfn.random.randint(torchfn.random.key(2), (8,), 0, 3)
        >>> x_adv = pgd(loss_fn, params, x, y, torchfn.random.key(1),
        ...             eps=0.1, step_size=0.025, steps=10)     # (8, 4)
    """
    _check_inputs(loss_fn, x, clamp)
    eps = _check_number("eps", eps, positive=False)
    step_size = _check_number("step_size", step_size, positive=True)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if norm not in _NORMS:
        raise ValueError(f"norm must be one of {_NORMS}, got {norm!r}")
    if not isinstance(random_start, bool):
        raise TypeError(f"random_start must be a bool, got {type(random_start).__name__}")
    if random_start and key is None:
        raise ValueError("key must be a torchfn.random key when random_start=True, got None")

    params, x0 = _stop_gradient(params), x.detach()
    x_adv = x0
    if random_start:
        x_adv = _clamp(x0 + _random_start(key, x0, eps, norm), clamp)
    for _ in range(steps):
        g = _input_grad(loss_fn, params, x_adv, y)  # (B, ...)
        if norm == "linf":
            step = g.sign()
        else:
            step = g / (_per_example_norm(g) + _TINY)
        x_adv = x_adv + step_size * step
        x_adv = _clamp(x0 + _project(x_adv - x0, eps, norm), clamp).detach()
    return x_adv


def adversarial_loss(
    loss_fn: LossFn,
    params: Any,
    x: Tensor,
    y: Any,
    key: Tensor | None = None,
    *,
    eps: float,
    mix: float = 0.5,
    attack: str = "pgd",
    step_size: float | None = None,
    steps: int = 10,
    norm: str = "linf",
    random_start: bool = True,
    clamp: tuple[float, float] | None = None,
) -> Tensor:
    """Adversarial-training loss ``(1 - mix) * L(x) + mix * L(x_adv)``.

    ``x_adv`` is :func:`fgsm` (``attack="fgsm"``) or :func:`pgd` of ``x`` against the
    current ``params``, with the gradient STOPPED through the attack: differentiating
    this loss w.r.t. ``params`` treats ``x_adv`` as data (Danskin's theorem; Madry et
    al.). ``mix=1`` is pure adversarial training, ``mix=0.5`` Goodfellow et al.'s mixture.

    Args:
        loss_fn: ``(params, x, y) -> loss`` as in :func:`fgsm`.
        params, x, y: as in :func:`fgsm`.
        key: a key for PGD's random start (unused by FGSM).
        eps, norm, random_start, clamp, steps: the attack's settings.
        mix: weight of the adversarial term in ``[0, 1]``.
        attack: ``"pgd"`` or ``"fgsm"``.
        step_size: PGD's step; ``None`` means ``2.5 * eps / steps``.

    Returns:
        The mixed loss, shaped as ``loss_fn``'s output.

    Example::

        >>> import torch, torchfn, torch.nn.functional as F
        >>> from torchfn.models import MLP
        >>> model = torchfn.Model(MLP(4, (16,), 3))
        >>> params = model.init(torchfn.random.key(0))
        >>> loss_fn = lambda p, x, y: F.cross_entropy(model.apply(p, x), y)
        >>> x = torchfn.random.uniform(torchfn.random.key(1), (8, 4))
        >>> y = torchfn.random.randint(torchfn.random.key(2), (8,), 0, 3)
        >>> step_loss = lambda p, k: adversarial_loss(loss_fn, p, x, y, k, eps=0.1)
        >>> grads = torch.func.grad(step_loss)(params, torchfn.random.key(2))
    """
    if attack not in _ATTACKS:
        raise ValueError(f"attack must be one of {_ATTACKS}, got {attack!r}")
    if isinstance(mix, bool) or not isinstance(mix, (int, float)) or not 0.0 <= mix <= 1.0:
        raise ValueError(f"mix must be a number in [0, 1], got {mix!r}")
    if attack == "fgsm":
        x_adv = fgsm(loss_fn, params, x, y, eps=eps, clamp=clamp)
    else:
        eps = _check_number("eps", eps, positive=False)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {steps!r}")
        if step_size is None:
            step_size = 2.5 * eps / steps if eps > 0 else 1.0
        x_adv = pgd(loss_fn, params, x, y, key, eps=eps, step_size=step_size, steps=steps,
                    norm=norm, random_start=random_start, clamp=clamp)
    if mix == 1.0:
        return loss_fn(params, x_adv, y)
    if mix == 0.0:
        return loss_fn(params, x, y)
    return (1.0 - mix) * loss_fn(params, x, y) + mix * loss_fn(params, x_adv, y)
