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

import torch
from torch import Tensor

from torchfn.transforms._flat import Flat
from torchfn.transforms._laplace import LaplacePosterior
from torchfn.transforms._laplace_kron import kron_logdet

__all__ = ["laplace_log_marginal", "laplace_optimize_prior"]


def laplace_log_marginal(
    posterior: LaplacePosterior,
    log_likelihood: Tensor,
    prior_precision: float | Tensor | None = None,
) -> Tensor:
    """The Laplace estimate of the log evidence, ``log p(data | δ)``:
    ``log p(data | θ*) - δ |θ*|² / 2 + (P / 2) log δ - log det(GGN + δ I) / 2``.

    Maximise it over ``δ`` to set the prior (laplace-torch's
    ``optimize_prior_precision(method="marglik")``): a grid, or gradient steps on a
    0-d tensor ``δ`` (it is differentiable in ``δ``). The GGN is the posterior's; ``θ*``
    stays where it was fitted, as in laplace-torch. For Bayesian linear regression with
    ``θ*`` the posterior mean this is the exact evidence.

    Args:
        posterior: from :func:`laplace`.
        log_likelihood: ``log p(data | θ*)``, a 0-d tensor (minus the summed training
            loss; for regression, with the Gaussian's constants).
        prior_precision: the ``δ`` to evaluate at; None: the posterior's.

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
    delta = posterior.prior_precision if prior_precision is None else prior_precision
    if not isinstance(delta, Tensor) and not (
            isinstance(delta, (int, float)) and not isinstance(delta, bool) and delta > 0):
        raise ValueError(f"laplace_log_marginal: prior_precision must be a positive float "
                         f"or a 0-d tensor, got {delta!r}")
    flat = Flat(posterior.params, "laplace_log_marginal", "posterior.params")
    theta = flat.vector(posterior.params, "params")
    P = flat.n
    delta = torch.as_tensor(delta, dtype=theta.dtype)
    fitted = posterior.prior_precision
    if posterior.structure == "full":
        ggn = posterior.precision - fitted * torch.eye(P, dtype=theta.dtype)
        logdet = torch.linalg.slogdet(ggn + delta * torch.eye(P, dtype=theta.dtype))[1]
    elif posterior.structure == "diag":
        logdet = (posterior.precision - fitted + delta).log().sum()
    elif posterior.structure == "kron":
        logdet = kron_logdet(posterior.precision, delta)
    else:
        _, lam = posterior.precision
        logdet = (lam + delta).log().sum() + (P - lam.shape[0]) * delta.log()
    return (log_likelihood - 0.5 * delta * (theta ** 2).sum() + 0.5 * P * delta.log()
            - 0.5 * logdet)


def _ggn_eigenvalues(posterior: LaplacePosterior) -> Tensor:
    """All ``P`` eigenvalues of the posterior's GGN (its precision less ``δ I``)."""
    prec, delta = posterior.precision, posterior.prior_precision
    P = Flat(posterior.params, "laplace_optimize_prior", "posterior.params").n
    if posterior.structure == "full":
        eye = torch.eye(P, dtype=prec.dtype, device=prec.device)
        return torch.linalg.eigvalsh(prec - delta * eye)
    if posterior.structure == "diag":
        return prec - delta
    if posterior.structure == "lowrank":
        _, lam = prec
        return torch.cat([lam, lam.new_zeros(P - len(lam))])
    blocks = [(g[:, None] * a[None, :]).reshape(-1) for a, _, g, _ in prec.eigh.values()]
    return torch.cat(blocks + [d.reshape(-1) for d in prec.diag.values()])


def laplace_optimize_prior(
    posterior: LaplacePosterior,
    *,
    bounds: tuple[float, float] = (1e-8, 1e8),
) -> LaplacePosterior:
    """The posterior with the prior precision ``δ`` that maximises the evidence
    (:func:`laplace_log_marginal`), ``θ*`` held where it was fitted.

    The evidence is concave in ``δ``; its maximum is the root of
    ``Σ λ_i / (λ_i + δ) - δ |θ*|²`` (decreasing in ``δ``), found by bisection on
    ``log δ`` to float64 precision from the GGN's eigenvalues (one symmetric
    eigendecomposition for ``"full"``; the other structures have them already).

    Args:
        posterior: from :func:`laplace`.
        bounds: ``(low, high)``, the range searched; the optimum clamps to it (a GGN of
            zeros, or ``θ* = 0``, has its supremum at an end).

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
    """
    if not isinstance(posterior, LaplacePosterior):
        raise TypeError(f"laplace_optimize_prior: posterior must be a LaplacePosterior "
                        f"(from laplace), got {type(posterior).__name__}")
    if (not isinstance(bounds, tuple) or len(bounds) != 2
            or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds)
            or not 0 < bounds[0] < bounds[1]):
        raise ValueError(f"laplace_optimize_prior: bounds must be (low, high) with "
                         f"0 < low < high, got {bounds!r}")
    flat = Flat(posterior.params, "laplace_optimize_prior", "posterior.params")
    theta = flat.vector(posterior.params, "params").double()
    lam = _ggn_eigenvalues(posterior).double().clamp(min=0)
    norm = float((theta ** 2).sum())

    def slope(log_delta: float) -> float:  # γ(δ) - δ |θ*|², decreasing in δ
        delta = float(torch.tensor(log_delta, dtype=torch.float64).exp())
        return float((lam / (lam + delta)).sum()) - delta * norm

    lo, hi = float(torch.tensor(bounds[0]).log()), float(torch.tensor(bounds[1]).log())
    if slope(lo) <= 0:
        best = lo
    elif slope(hi) >= 0:
        best = hi
    else:
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if slope(mid) > 0:
                lo = mid
            else:
                hi = mid
            if hi - lo < 1e-14:
                break
        best = 0.5 * (lo + hi)
    delta = float(torch.tensor(best, dtype=torch.float64).exp())
    old, prec = posterior.prior_precision, posterior.precision
    if posterior.structure == "full":
        prec = prec + (delta - old) * torch.eye(prec.shape[0], dtype=prec.dtype,
                                                device=prec.device)
    elif posterior.structure == "diag":
        prec = prec + (delta - old)
    return posterior._replace(precision=prec, prior_precision=delta)
