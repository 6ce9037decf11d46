"""Exponential moving averages: ``ema`` (of updates) and ``ema_params`` (of weights)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from torchfn.optim import _checks, _ops
from torchfn.optim._base import GradientTransformation, check_state, new_count
from torchfn.optim._tree import check_structure

__all__ = ["EmaState", "ema", "ema_params", "power_ema_decay", "sigma_rel_to_gamma",
           "posthoc_ema", "posthoc_ema_coefficients"]


class EmaState(NamedTuple):
    count: Tensor  # () int32
    ema: Any  # params' structure


def ema(decay: Any, debias: bool = True) -> GradientTransformation:
    """Replace updates by their moving average ``decay * ema + (1 - decay) * u``.

    With ``debias`` the average is divided by ``1 - decay**t`` (as Adam's first moment).

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.ema(0.9)
        >>> g = {"w": torch.ones(2)}
        >>> tx.update(g, tx.init(g))[0]["w"]
        tensor([1., 1.])
    """
    _checks.unit_interval("decay", decay)

    def init(params: Any) -> EmaState:
        leaves, spec = optree.tree_flatten(params)
        return EmaState(new_count(leaves), optree.tree_unflatten(spec, _ops.zeros_like(leaves)))

    def update(grads: Any, state: EmaState, params: Any = None, *, inplace: Any = None):
        check_state(state, EmaState, "ema")
        g, spec = optree.tree_flatten(grads)
        avg = _ops.lerp(check_structure(state.ema, "optimizer state", grads, "grads"), g, 1 - decay)
        count = state.count + 1
        out = avg
        if debias:
            out = _ops.mul(avg, 1.0 / (1 - decay ** count.to(torch.float64)))
        return optree.tree_unflatten(spec, out), EmaState(count, optree.tree_unflatten(spec, avg))

    return GradientTransformation(init, update)


def ema_params(ema_tree: Any, params: Any, decay: Any) -> Any:
    """One step of a parameter EMA: ``decay * ema_tree + (1 - decay) * params`` (pure).

    Equals ``torch.optim.swa_utils.get_ema_multi_avg_fn(decay)``; start from a copy
    of the initial params and evaluate with the averaged weights.

    Example:
        >>> import torch
        >>> from torchfn.optim import ema_params
        >>> ema_params({"w": torch.zeros(2)}, {"w": torch.ones(2)}, decay=0.9)["w"]
        tensor([0.1000, 0.1000])
    """
    _checks.unit_interval("decay", decay)
    leaves, spec = optree.tree_flatten(ema_tree)
    p = check_structure(params, "params", ema_tree, "ema_tree")
    return optree.tree_unflatten(spec, _ops.lerp(leaves, p, 1 - decay))


def sigma_rel_to_gamma(sigma_rel: float) -> float:
    """The power-function EMA's exponent ``gamma`` for a relative width ``sigma_rel``
    (EDM2, Karras et al. 2024): the root of ``sigma_rel^2 = (g + 1) / ((g + 2)^2 (g + 3))``.

    Example:
        >>> round(sigma_rel_to_gamma(0.10), 3)      # EDM2's widths are 0.05 to 0.15
        6.937
    """
    if not (isinstance(sigma_rel, (int, float)) and 0 < sigma_rel < 12 ** -0.5):
        raise ValueError(f"sigma_rel must lie in (0, 12^-1/2 = 0.2887), got {sigma_rel!r}")
    t = sigma_rel**-2
    # (g + 2)^2 (g + 3) = t (g + 1): g^3 + 7 g^2 + (16 - t) g + (12 - t) = 0, its largest root
    lo, hi = -1.0 + 1e-12, 1e6
    f = lambda g: ((g + 7) * g + 16 - t) * g + 12 - t  # noqa: E731
    for _ in range(200):  # bisection on the increasing branch right of the largest root
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return 0.5 * (lo + hi)


def power_ema_decay(step: int, *, gamma: float | None = None,
                    sigma_rel: float | None = None) -> float:
    """The decay of EDM2's power-function EMA at ``step`` (1, 2, ...):
    ``(1 - 1 / step)^(gamma + 1)``, for :func:`ema_params`. After ``T`` steps the average
    weighs the ``i``-th params about ``(gamma + 1) i^gamma / T^(gamma + 1)``: a profile
    that scales with the run's length (a plain EMA's forgets at a fixed rate). Give
    ``gamma`` or the width ``sigma_rel`` (0.05 to 0.15 in EDM2).

    Example:
        >>> [round(power_ema_decay(t, gamma=6.94), 3) for t in (1, 10, 1000)]
        [0.0, 0.433, 0.992]
    """
    if (gamma is None) == (sigma_rel is None):
        raise ValueError("give exactly one of gamma and sigma_rel")
    if gamma is None:
        gamma = sigma_rel_to_gamma(sigma_rel)
    if not gamma > -1:
        raise ValueError(f"gamma must be > -1, got {gamma!r}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1, got {step!r}")
    return math.pow(1.0 - 1.0 / step, gamma + 1.0)


def _profile_dot(t_a: Tensor, g_a: Tensor, t_b: Tensor, g_b: Tensor) -> Tensor:
    """Inner products of power profiles ``p(x) = (g + 1) x^g / t^(g + 1)`` on ``[0, t]``
    (EDM2's ``p_dot_p``), broadcast over the inputs."""
    ratio = t_a / t_b
    exponent = torch.where(t_a < t_b, g_b, -g_a)
    return (g_a + 1) * (g_b + 1) * ratio**exponent / ((g_a + g_b + 1) * torch.maximum(t_a, t_b))


def posthoc_ema_coefficients(steps: Any, sigma_rels: Any, step: int,
                             sigma_rel: float) -> Tensor:
    """Least-squares weights that combine saved power-EMA snapshots into the power EMA
    of width ``sigma_rel`` at ``step`` (EDM2's post-hoc EMA, Karras et al. 2024): the
    snapshot ``i`` was taken at ``steps[i]`` from an EMA of width ``sigma_rels[i]``.
    Returns ``(n,)`` float64 weights; :func:`posthoc_ema` applies them.

    Example:
        >>> w = posthoc_ema_coefficients([100, 200, 100, 200], [0.05, 0.05, 0.1, 0.1],
        ...                              200, 0.1)
        >>> [abs(round(float(x), 6)) for x in w]     # a snapshot that is the target itself
        [0.0, 0.0, 0.0, 1.0]
    """
    t = torch.as_tensor(steps, dtype=torch.float64).flatten()
    s = torch.as_tensor(sigma_rels, dtype=torch.float64).flatten()
    if t.numel() == 0 or t.shape != s.shape:
        raise ValueError(f"steps and sigma_rels must be non-empty and of one length, got "
                         f"{t.numel()} and {s.numel()}")
    if bool((t <= 0).any()):
        raise ValueError(f"steps must be > 0, got {t.tolist()}")
    g = torch.tensor([sigma_rel_to_gamma(float(x)) for x in s], dtype=torch.float64)
    g_out = torch.tensor(sigma_rel_to_gamma(sigma_rel), dtype=torch.float64)
    a = _profile_dot(t[:, None], g[:, None], t[None, :], g[None, :])  # (n, n)
    b = _profile_dot(t, g, torch.tensor(float(step), dtype=torch.float64), g_out)  # (n,)
    return torch.linalg.lstsq(a, b[:, None]).solution[:, 0]


def posthoc_ema(snapshots: list[tuple[int, float, Any]], step: int, sigma_rel: float) -> Any:
    """The power EMA of width ``sigma_rel`` at ``step``, synthesised after training from
    snapshots ``(step_i, sigma_rel_i, params_i)`` of power EMAs tracked during it
    (:func:`ema_params` with :func:`power_ema_decay`). EDM2 tracks two widths (0.05
    and 0.10) and saves both every few thousand steps; any width can then be tried
    without retraining. Pure: a new tree, the snapshots' structure.

    The weights are a least-squares fit of the target's averaging profile, not
    normalised: with few snapshots they sum to about 1 (1.03 for two snapshots at the
    same step), and closer as snapshots are added.

    Example:
        >>> import torch
        >>> snaps = [(100, 0.05, {"w": torch.ones(2)}), (100, 0.10, {"w": torch.ones(2)})]
        >>> posthoc_ema(snaps, 100, 0.10)["w"]         # the second snapshot itself
        tensor([1., 1.])
    """
    if not snapshots:
        raise ValueError("snapshots must not be empty")
    steps, widths, trees = zip(*snapshots)
    w = posthoc_ema_coefficients(steps, widths, step, sigma_rel)
    leaves = [optree.tree_leaves(check_structure(tree, f"snapshots[{i}]", trees[0],
                                                 "snapshots[0]"))
              for i, tree in enumerate(trees)]
    spec = optree.tree_structure(trees[0])
    out = [sum(float(wi) * ls[j].double() for wi, ls in zip(w, leaves)).to(leaves[0][j].dtype)
           for j in range(len(leaves[0]))]
    return optree.tree_unflatten(spec, out)
