"""The Laplace approximation's evidence ``log p(data | δ)`` as a function of the prior
precision ``δ``, and the ``δ`` that maximises it (MacKay, 1992; laplace-torch's
``optimize_prior_precision(method="marglik")``).

With the GGN's eigenvalues ``λ_i`` (``P`` of them, zeros included) and ``θ*`` held
where it was fitted, the evidence is
``log p(data | θ*) - δ |θ*|² / 2 + (P / 2) log δ - Σ log(λ_i + δ) / 2``: concave in
``log δ``'s exponent, with its maximum where MacKay's effective number of parameters
``γ = Σ λ_i / (λ_i + δ)`` equals ``δ |θ*|²``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from torchfn.transforms._flat import Flat
from torchfn.transforms._laplace import LaplacePosterior
from torchfn.transforms._laplace_kron import kron_eigenvalues, kron_logdet
from torchfn.transforms._laplace_prior import (
    check_prior,
    is_scalar,
    offsets,
    prior_vector,
)

__all__ = ["laplace_log_marginal", "laplace_optimize_prior"]


def laplace_log_marginal(
    posterior: LaplacePosterior,
    log_likelihood: Tensor,
    prior_precision: float | Tensor | dict[str, float | Tensor] | None = None,
) -> Tensor:
    """The Laplace estimate of the log evidence, ``log p(data | δ)``:
    ``log p(data | θ*) - δ |θ*|² / 2 + (P / 2) log δ - log det(GGN + δ I) / 2``, or with
    a ``δ_l`` per param tensor, ``Σ_l (n_l log δ_l - δ_l |θ*_l|²) / 2`` in place of the
    middle terms and ``diag(δ_l)`` in the determinant.

    Maximise it over ``δ`` to set the prior (laplace-torch's
    ``optimize_prior_precision(method="marglik")``): a grid, or gradient steps on a
    0-d tensor ``δ`` (it is differentiable in ``δ``). The GGN is the posterior's; ``θ*``
    stays where it was fitted, as in laplace-torch. For Bayesian linear regression with
    ``θ*`` the posterior mean this is the exact evidence.

    Args:
        posterior: from :func:`laplace`.
        log_likelihood: ``log p(data | θ*)``, a 0-d tensor (minus the summed training
            loss; for regression, with the Gaussian's constants).
        prior_precision: the ``δ`` to evaluate at (a float or 0-d tensor, or a dict
            ``{param name: δ}`` of them as :func:`laplace` takes); None: the posterior's.

    Returns:
        The 0-d log evidence.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> X = random.normal(random.key(0), (50, 3), dtype=torch.float64)
        >>> from torchfn.transforms import laplace
        >>> f = lambda w, x: (x @ w)[None]
        >>> post = laplace(f, torch.zeros(3, dtype=torch.float64), X, likelihood="regression")
        >>> ll = torch.tensor(-40.0, dtype=torch.float64)
        >>> deltas = [0.01, 0.1, 1.0, 10.0]
        >>> evidence = [float(laplace_log_marginal(post, ll, d)) for d in deltas]
        >>> deltas[max(range(4), key=evidence.__getitem__)]   # θ* = 0: the strongest prior
        10.0
    """
    if not isinstance(posterior, LaplacePosterior):
        raise TypeError(f"laplace_log_marginal: posterior must be a LaplacePosterior (from "
                        f"laplace), got {type(posterior).__name__}")
    if not isinstance(log_likelihood, Tensor) or log_likelihood.dim() != 0:
        raise ValueError("laplace_log_marginal: log_likelihood must be a 0-d tensor, got "
                         f"{getattr(log_likelihood, 'shape', type(log_likelihood).__name__)}")
    flat = Flat(posterior.params, "laplace_log_marginal", "posterior.params")
    theta = flat.vector(posterior.params, "params")
    P = flat.n
    fitted = posterior.prior_precision
    delta = fitted if prior_precision is None else check_prior(
        prior_precision, posterior.params, "laplace_log_marginal", tensors=True)
    if posterior.structure == "lowrank" and not is_scalar(delta):
        raise ValueError("laplace_log_marginal: a 'lowrank' posterior takes one "
                         "prior_precision (a float or a 0-d tensor), got a dict")
    new = prior_vector(delta, posterior.params, theta)  # (P,)
    if posterior.structure == "full":
        ggn = posterior.precision - torch.diag(prior_vector(fitted, posterior.params, theta))
        logdet = torch.linalg.slogdet(ggn + torch.diag(new))[1]
    elif posterior.structure == "diag":
        logdet = (posterior.precision - prior_vector(fitted, posterior.params, theta)
                  + new).log().sum()
    elif posterior.structure == "kron":
        logdet = kron_logdet(posterior.precision, delta)
    else:
        _, lam = posterior.precision
        delta = torch.as_tensor(delta, dtype=theta.dtype)
        logdet = (lam + delta).log().sum() + (P - lam.shape[0]) * delta.log()
    return (log_likelihood - 0.5 * (new * theta ** 2).sum() + 0.5 * new.log().sum()
            - 0.5 * logdet)


def _ggn(posterior: LaplacePosterior, theta: Tensor) -> Tensor:
    """A ``"full"`` / ``"diag"`` posterior's GGN (its precision less the prior)."""
    delta = prior_vector(posterior.prior_precision, posterior.params, theta)  # (P,)
    if posterior.structure == "full":
        return posterior.precision - torch.diag(delta)
    return posterior.precision - delta


def _eigenvalue_groups(posterior: LaplacePosterior, theta: Tensor,
                       layerwise: bool) -> dict[tuple[str, ...], Tensor]:
    """The GGN's eigenvalues by group of params that get one ``δ``: all of them
    together, or (``layerwise``) each param tensor, a Kronecker block's weight and bias
    together. ``"full"``'s layerwise eigenvalues do not separate: None there."""
    names = tuple(offsets(posterior.params))
    prec = posterior.precision
    if posterior.structure == "kron":
        groups = kron_eigenvalues(prec)
        return groups if layerwise else {names: torch.cat(list(groups.values()))}
    if posterior.structure == "lowrank":
        _, lam = prec
        return {names: torch.cat([lam, lam.new_zeros(len(theta) - len(lam))])}
    ggn = _ggn(posterior, theta)
    if posterior.structure == "full":
        return {names: torch.linalg.eigvalsh(ggn)}
    if not layerwise:
        return {names: ggn}
    return {(n,): ggn[a:a + k] for n, (a, k) in offsets(posterior.params).items()}


def _bisect(lam: Tensor, norm: float, bounds: tuple[float, float]) -> float:
    """The root of ``Σ λ_i / (λ_i + δ) - δ |θ|²`` (decreasing in ``δ``) in ``bounds``,
    by bisection on ``log δ`` to float64 precision; an end if there is none inside."""
    def slope(log_delta: float) -> float:
        delta = math.exp(log_delta)
        return float((lam / (lam + delta)).sum()) - delta * norm

    lo, hi = math.log(bounds[0]), math.log(bounds[1])
    if slope(lo) <= 0:
        return bounds[0]
    if slope(hi) >= 0:
        return bounds[1]
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if slope(mid) > 0:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-14:
            break
    return math.exp(0.5 * (lo + hi))


def _mackay_full(ggn: Tensor, theta: Tensor, where: dict[str, tuple[int, int]],
                 start: float, bounds: tuple[float, float]) -> dict[str, float]:
    """Per-tensor ``δ_l`` of a full GGN by MacKay's fixed point
    ``δ_l ← γ_l / |θ*_l|²``, ``γ_l = n_l - δ_l tr_l(H⁻¹)``, from ``δ_l = start``."""
    delta = {n: start for n in where}
    for _ in range(10_000):
        vec = torch.cat([theta.new_full((k,), delta[n]) for n, (_, k) in where.items()])
        inverse = torch.cholesky_inverse(torch.linalg.cholesky(ggn + torch.diag(vec)))
        diag = inverse.diagonal()
        new = {}
        for n, (a, k) in where.items():
            gamma = k - delta[n] * float(diag[a:a + k].sum())
            norm = float((theta[a:a + k] ** 2).sum())
            new[n] = min(max(gamma / norm if norm > 0 else math.inf, bounds[0]), bounds[1])
        change = max(abs(math.log(new[n] / delta[n])) for n in where)
        delta = new
        if change < 1e-12:
            break
    return delta


def laplace_optimize_prior(
    posterior: LaplacePosterior,
    *,
    bounds: tuple[float, float] = (1e-8, 1e8),
    layerwise: bool = False,
) -> LaplacePosterior:
    """The posterior with the prior precision that maximises the evidence
    (:func:`laplace_log_marginal`), ``θ*`` held where it was fitted: one ``δ``, or with
    ``layerwise=True`` one per param tensor (laplace-torch's
    ``prior_structure="layerwise"``).

    The evidence is concave in ``δ``; its maximum is the root of
    ``Σ λ_i / (λ_i + δ) - δ |θ*|²`` (decreasing in ``δ``), found by bisection on
    ``log δ`` to float64 precision from the GGN's eigenvalues (one symmetric
    eigendecomposition for ``"full"``; the other structures have them already).
    Layerwise, the ``"diag"`` and ``"kron"`` evidences split into one such problem per
    param tensor (per Kronecker block: a weight and the bias in its block share one
    ``δ``); ``"full"``'s do not, and MacKay's fixed point ``δ_l ← γ_l / |θ*_l|²``
    (``γ_l = n_l - δ_l tr_l(H⁻¹)``) finds them, a Cholesky factorisation a step.
    ``"lowrank"`` has one ``δ`` only.

    Args:
        posterior: from :func:`laplace`.
        bounds: ``(low, high)``, the range searched; the optimum clamps to it (a GGN of
            zeros, or ``θ* = 0``, has its supremum at an end).
        layerwise: one ``δ`` per param tensor (a dict ``{name: δ}``).

    Returns:
        The posterior with ``prior_precision`` the optimum (the GGN unchanged).

    Example (Bayesian linear regression)::

        >>> import torch
        >>> from torchfn import random
        >>> from torchfn.transforms import laplace
        >>> X = random.normal(random.key(0), (50, 3), dtype=torch.float64)
        >>> w = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
        >>> post = laplace(lambda w, x: (x @ w)[None], w, X, likelihood="regression")
        >>> best = laplace_optimize_prior(post)
        >>> lam = torch.linalg.eigvalsh(X.T @ X)             # MacKay: γ = δ |θ*|²
        >>> gamma = (lam / (lam + best.prior_precision)).sum()
        >>> bool(torch.isclose(gamma, best.prior_precision * (w ** 2).sum()))
        True

    Layerwise, on two params of different scales::

        >>> f = lambda p, x: (x[:2] @ p["a"] + x[2:] @ p["b"])[None]
        >>> p = {"a": torch.tensor([3.0, -4.0], dtype=torch.float64),
        ...      "b": torch.tensor([0.01], dtype=torch.float64)}
        >>> post = laplace(f, p, X, likelihood="regression", structure="diag")
        >>> best = laplace_optimize_prior(post, layerwise=True)
        >>> best.prior_precision["b"] > 1000 * best.prior_precision["a"]
        True
    """
    if not isinstance(posterior, LaplacePosterior):
        raise TypeError(f"laplace_optimize_prior: posterior must be a LaplacePosterior "
                        f"(from laplace), got {type(posterior).__name__}")
    if (not isinstance(bounds, tuple) or len(bounds) != 2
            or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds)
            or not 0 < bounds[0] < bounds[1]):
        raise ValueError(f"laplace_optimize_prior: bounds must be (low, high) with "
                         f"0 < low < high, got {bounds!r}")
    if not isinstance(layerwise, bool):
        raise TypeError(f"laplace_optimize_prior: layerwise must be a bool, got "
                        f"{layerwise!r}")
    if layerwise and posterior.structure == "lowrank":
        raise ValueError("laplace_optimize_prior: a 'lowrank' posterior has one prior "
                         "precision (its GGN's eigenvectors mix the params); layerwise "
                         "needs 'full', 'diag' or 'kron'")
    bounds = (float(bounds[0]), float(bounds[1]))
    flat = Flat(posterior.params, "laplace_optimize_prior", "posterior.params")
    theta = flat.vector(posterior.params, "params")
    where = offsets(posterior.params)
    groups = _eigenvalue_groups(posterior, theta, layerwise and posterior.structure != "full")
    theta64 = theta.detach().double()

    def sq_norm(names: tuple[str, ...]) -> float:
        return sum(float((theta64[a:a + k] ** 2).sum()) for a, k in (where[n] for n in names))

    scalars = {names: _bisect(lam.detach().double().clamp(min=0), sq_norm(names), bounds)
               for names, lam in groups.items()}
    if not layerwise:
        (delta,) = scalars.values()
    elif posterior.structure == "full":
        delta = _mackay_full(_ggn(posterior, theta).detach().double(), theta64, where,
                             next(iter(scalars.values())), bounds)
    else:
        delta = {n: d for names, d in scalars.items() for n in names}
        delta = {n: delta[n] for n in where}  # in the params' order
    prec = posterior.precision
    if posterior.structure == "full":
        prec = _ggn(posterior, theta) + torch.diag(prior_vector(delta, posterior.params, theta))
    elif posterior.structure == "diag":
        prec = _ggn(posterior, theta) + prior_vector(delta, posterior.params, theta)
    return posterior._replace(precision=prec, prior_precision=delta)
