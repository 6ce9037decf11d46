"""The Laplace approximation of a network's posterior around its trained (MAP) params,
with the generalised Gauss-Newton matrix, and its linearised predictive (MacKay, 1992;
Daxberger et al., 2021, "Laplace Redux"; laplace-torch).

``posterior = laplace(apply_fn, params, x, likelihood=...)`` forms the posterior
precision ``H = Σ_n J_nᵀ Λ_n J_n + δ I`` (``J_n`` the Jacobian of example ``n``'s output
in the params, ``Λ_n`` the likelihood's Hessian in the output: ``diag(p) - p pᵀ`` for a
softmax, ``1 / σ²`` for a Gaussian) in one of three structures:

- ``"full"``: ``H`` itself, ``(P, P)``: small networks, or the last layer's params;
- ``"diag"``: its diagonal;
- ``"lowrank"``: the top ``rank`` eigenpairs of the GGN by Lanczos (:func:`eigsh` on
  :func:`gauss_newton_vp`, never formed) plus the prior: ``U diag(λ) Uᵀ + δ I``;
- ``"kron"``: block-diagonal over layers, each ``Linear`` / ``Conv2d`` block the K-FAC
  product ``G ⊗ A + δ I`` (:func:`kfac`; laplace-torch's default), kept as the factors'
  eigendecompositions; the other params (norms, embeddings) get their exact GGN diagonal.
  Needs the network as a :class:`torchfn.Model`. It scales to large networks: memory
  ``Σ (fan_in² + out²)`` per layer instead of ``P²``.

:func:`laplace_predict` gives the linearised (GLM) predictive: the output mean
``f(x; θ*)`` and covariance ``J(x) H⁻¹ J(x)ᵀ``, and for classification the probit
approximation of the class probabilities, ``softmax(μ / sqrt(1 + π/8 diag Σ))``.
:func:`laplace_log_marginal` gives the evidence ``log p(data)`` under the approximation,
as a function of the prior precision, to choose it (MacKay's evidence framework).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import jacrev, vmap

from torchfn.core import random
from torchfn.core.module import Model
from torchfn.transforms._flat import Flat
from torchfn.transforms._laplace_kron import (
    KronPrecision,
    kron_power_times,
    kron_precision,
)
from torchfn.transforms._laplace_prior import Prior, block_delta, check_prior, prior_vector
from torchfn.transforms._layer_probes import output_hessian
from torchfn.transforms._spectrum import eigsh

__all__ = ["KronPrecision", "LaplacePosterior", "laplace", "laplace_predict",
           "laplace_sample"]

_LIKELIHOODS = ("classification", "regression")
_STRUCTURES = ("full", "diag", "lowrank", "kron")


class LaplacePosterior(NamedTuple):
    """A Gaussian ``N(params, H⁻¹)`` over the flattened params (``optree`` order).

    ``precision`` is ``(P, P)`` for ``"full"``, ``(P,)`` for ``"diag"``, for
    ``"lowrank"`` the pair ``(U (P, k), λ (k,))`` of the GGN's top eigenpairs, the prior
    ``δ I`` added on top, and for ``"kron"`` a :class:`KronPrecision` (the GGN's
    factors, without the prior). ``prior_precision``: one ``δ``, or ``{param name: δ}``.
    ``sigma`` is the regression noise (1 for classification). ``fixed``: with a
    ``subset``, the other params, held at their values (``params`` then holds the
    subset); None otherwise."""

    params: Any
    structure: str
    likelihood: str
    precision: Any
    prior_precision: Prior
    sigma: float
    fixed: Any = None


def _one_example(apply_fn: Callable[..., Tensor], state: dict[str, Tensor] | None,
                 who: str) -> Callable[[Any, Tensor], Tensor]:
    """``(params, x_one) -> (O,)``; a :class:`Model` runs on a batch of one (with its
    ``state``, in eval mode)."""
    if isinstance(apply_fn, Model):
        return lambda p, x_one: apply_fn.apply(p, x_one[None], state=state)[0]
    if state is not None:
        raise ValueError(f"{who}: state is for a torchfn.Model's buffers; apply_fn is a "
                         f"{type(apply_fn).__name__}, which takes none")
    return apply_fn


def _take_subset(params: Any, subset: Sequence[str] | None) -> tuple[Any, Any]:
    """``(the posterior's params, the fixed rest or None)``."""
    if subset is None:
        return params, None
    if not isinstance(params, dict):
        raise TypeError(f"laplace: subset needs params to be a dict of named tensors, got "
                        f"{type(params).__name__}")
    if isinstance(subset, str) or not all(isinstance(n, str) for n in subset):
        raise TypeError(f"laplace: subset must be a list of param names, got {subset!r}")
    unknown = [n for n in subset if n not in params]
    if unknown or not subset:
        raise ValueError(f"laplace: subset must name params among {sorted(params)}, got "
                         f"{list(subset)!r}")
    return ({n: params[n] for n in subset},
            {n: t for n, t in params.items() if n not in subset})


def _with_fixed(apply_fn: Callable[[Any, Tensor], Tensor],
                fixed: Any) -> Callable[[Any, Tensor], Tensor]:
    """``apply_fn`` of the subset, the other params held at their values."""
    if fixed is None:
        return apply_fn
    return lambda p, x_one: apply_fn({**fixed, **p}, x_one)


def laplace(
    apply_fn: Callable[[Any, Tensor], Tensor],
    params: Any,
    x: Tensor,
    *,
    likelihood: str = "classification",
    structure: str = "full",
    prior_precision: float | dict[str, float] = 1.0,
    sigma: float = 1.0,
    rank: int = 20,
    key: Tensor | None = None,
    fisher: str = "exact",
    batch_size: int | None = None,
    separate_bias: bool = False,
    subset: Sequence[str] | None = None,
    state: dict[str, Tensor] | None = None,
) -> LaplacePosterior:
    """The Laplace approximation at trained ``params``, with the GGN of ``x``'s
    likelihood and an isotropic Gaussian prior.

    Args:
        apply_fn: ``(params, x_one) -> (O,)``: ONE example's output (logits for
            classification, the mean for regression); or a :class:`torchfn.Model`,
            which runs on batches (``(n, ...) -> (n, O)``; one example as a batch of
            one). ``"kron"`` needs a Model.
        params: the MAP params (a pytree).
        x: ``(N, ...)`` the training inputs (the GGN does not need the targets).
        likelihood: ``"classification"`` (softmax cross entropy) or ``"regression"``
            (Gaussian with noise ``sigma``).
        structure: ``"full"``, ``"diag"``, ``"lowrank"`` or ``"kron"``.
        prior_precision: ``δ > 0`` of the prior ``N(0, δ⁻¹ I)``; or a dict
            ``{param name: δ}`` naming every param of the posterior, a prior
            ``N(0, δ_l⁻¹ I)`` on each (laplace-torch's layerwise prior; not for
            ``"lowrank"``; for ``"kron"`` a weight and the bias in its block need one
            ``δ``, or ``separate_bias=True``).
        sigma: the regression noise's standard deviation.
        rank: ``"lowrank"``: eigenpairs kept.
        key: ``"lowrank"``: the Lanczos start vector's key; ``"kron"`` with
            ``fisher="mc"``: the sampled targets' key.
        fisher: ``"kron"``: ``"exact"`` (``O`` backward passes per batch) or ``"mc"``
            (one, at a sampled target; for many classes), as in :func:`kfac`.
        batch_size: ``"kron"``: examples per forward pass (None: all at once).
        separate_bias: ``"kron"``: biases in blocks of their own, as laplace-torch
            (see :func:`kfac`).
        subset: names of the params the posterior covers (``params`` a dict), the
            rest held at their values: ``["fc.weight", "fc.bias"]`` is laplace-torch's
            default ``subset_of_weights="last_layer"``. None: all of them.
        state: a Model's buffers (BatchNorm statistics), for a model that has them; it
            runs in eval mode. Pass the same to :func:`laplace_predict`.

    Returns:
        A :class:`LaplacePosterior`.

    Example (Bayesian linear regression, where the Laplace approximation is exact)::

        >>> import torch
        >>> from torchfn import random
        >>> X = random.normal(random.key(0), (50, 3), dtype=torch.float64)
        >>> post = laplace(lambda w, x: (x @ w)[None], torch.zeros(3, dtype=torch.float64),
        ...                X, likelihood="regression", prior_precision=2.0, sigma=0.5)
        >>> exact = X.T @ X / 0.25 + 2.0 * torch.eye(3, dtype=torch.float64)
        >>> torch.allclose(post.precision, exact)
        True

    Kronecker-factored, for a network given as a :class:`torchfn.Model`::

        >>> from torch import nn
        >>> import torchfn
        >>> net = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 4))
        >>> model = torchfn.Model(net)
        >>> params = model.init(random.key(1))
        >>> post = laplace(model, params, X.float(), structure="kron")
        >>> [(f.A.shape, f.G.shape) for f in post.precision.factors.values()]
        [(torch.Size([4, 4]), torch.Size([16, 16])), (torch.Size([17, 17]), torch.Size([4, 4]))]
        >>> probs, cov = laplace_predict(post, model, X[:2].float())     # (M, O), (M, O, O)
        >>> probs.shape, cov.shape
        (torch.Size([2, 4]), torch.Size([2, 4, 4]))
    """
    if not callable(apply_fn):
        raise TypeError(f"laplace: apply_fn must be callable, got {type(apply_fn).__name__}")
    model, apply_fn = apply_fn, _one_example(apply_fn, state, "laplace")
    if likelihood not in _LIKELIHOODS:
        raise ValueError(f"laplace: likelihood must be one of {_LIKELIHOODS}, got "
                         f"{likelihood!r}")
    if structure not in _STRUCTURES:
        raise ValueError(f"laplace: structure must be one of {_STRUCTURES}, got "
                         f"{structure!r}")
    if not isinstance(sigma, (int, float)) or isinstance(sigma, bool) or not sigma > 0:
        raise ValueError(f"laplace: sigma must be a positive float, got {sigma!r}")
    if not isinstance(x, Tensor) or x.dim() < 1:
        raise ValueError(f"laplace: x must be a batch of inputs (N, ...), got "
                         f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
    all_params = params
    params, fixed = _take_subset(params, subset)
    prior_precision = check_prior(prior_precision, params, "laplace")
    if structure == "lowrank" and isinstance(prior_precision, dict):
        raise ValueError("laplace: structure='lowrank' takes one prior_precision (a float); "
                         "per-param precisions need 'full', 'diag' or 'kron'")
    flat = Flat(params, "laplace", "params")
    theta = flat.vector(params, "params")
    apply_fn = _with_fixed(apply_fn, fixed)

    def out_of(vec: Tensor, x_one: Tensor) -> Tensor:  # (P,), one input -> (O,)
        out = apply_fn(flat.tree(vec), x_one)
        if not isinstance(out, Tensor) or out.dim() != 1:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(f"laplace: apply_fn must return one example's output of "
                             f"shape (O,), got {got}")
        return out

    def posterior(structure: str, precision: Any) -> LaplacePosterior:
        return LaplacePosterior(params, structure, likelihood, precision,
                                prior_precision, float(sigma), fixed)

    if structure == "kron":
        prec = kron_precision(
            model, params, all_params, x, out_of, theta, likelihood=likelihood, sigma=sigma,
            fisher=fisher, key=key, batch_size=batch_size, separate_bias=separate_bias,
            state=state)
        for f in prec.factors.values():  # one δ per block
            block_delta(prior_precision, f.weight, f.bias, "laplace")
        return posterior("kron", prec)
    if structure == "lowrank":
        if key is None:
            raise ValueError("laplace: structure='lowrank' needs a key (Lanczos' start)")

        def ggn(v: Any) -> Any:  # Σ_n J_nᵀ Λ_n J_n v, never formed
            v = flat.vector(v, "v")

            def one(x_one: Tensor) -> Tensor:
                out, jv = torch.func.jvp(lambda t: out_of(t, x_one), (theta,), (v,))
                lam = output_hessian(likelihood, out, sigma) @ jv
                _, pull = torch.func.vjp(lambda t: out_of(t, x_one), theta)
                return pull(lam)[0]

            return flat.tree(vmap(one)(x).sum(0))

        k = min(rank, flat.n)
        values, vectors = eigsh(ggn, params, key, k=k, steps=min(flat.n, max(2 * k + 20, 30)))
        U = torch.stack([flat.vector(optree.tree_map(lambda t: t[i], vectors),  # noqa: B023
                                     "eigenvectors") for i in range(k)], 1)  # (P, k)
        return posterior(structure, (U, values.clamp(min=0)))

    J = vmap(jacrev(out_of), in_dims=(None, 0))(theta, x)  # (N, O, P)
    out = vmap(out_of, in_dims=(None, 0))(theta, x)  # (N, O)
    lam = vmap(lambda o: output_hessian(likelihood, o, sigma))(out)  # (N, O, O)
    delta = prior_vector(prior_precision, params, theta)  # (P,)
    if structure == "full":
        H = torch.einsum("nop,noq,nqr->pr", J, lam, J) + torch.diag(delta)
    else:
        H = torch.einsum("nop,noq,nqp->p", J, lam, J) + delta
    return posterior(structure, H)


def _one_prior(posterior: LaplacePosterior, who: str) -> float:
    """A ``"lowrank"`` posterior's one ``δ``."""
    if isinstance(posterior.prior_precision, dict):
        raise ValueError(f"{who}: a 'lowrank' posterior takes one prior_precision (a "
                         "float), got a dict")
    return posterior.prior_precision


def _covariance_times(posterior: LaplacePosterior, M: Tensor) -> Tensor:
    """``H⁻¹ M`` for ``M (P, m)``."""
    if posterior.structure == "kron":
        return kron_power_times(posterior.precision, posterior.prior_precision,
                                posterior.params, M, -1.0)
    if posterior.structure == "full":
        return torch.cholesky_solve(M, torch.linalg.cholesky(posterior.precision))
    if posterior.structure == "diag":
        return M / posterior.precision[:, None]
    U, lam = posterior.precision
    delta = _one_prior(posterior, "laplace_predict")
    # (U Λ Uᵀ + δ I)⁻¹ = (I - U Uᵀ) / δ + U diag(1 / (λ + δ)) Uᵀ   (U orthonormal)
    coef = U.transpose(0, 1) @ M  # (k, m)
    return (M - U @ coef) / delta + U @ (coef / (lam + delta)[:, None])


def laplace_predict(
    posterior: LaplacePosterior,
    apply_fn: Callable[[Any, Tensor], Tensor],
    x: Tensor,
    *,
    state: dict[str, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """The linearised predictive at inputs ``x (M, ...)``; ``apply_fn`` (and ``state``) as
    given to :func:`laplace` (one example's output, or a :class:`torchfn.Model`).

    Returns:
        ``(mean, covariance)``: the outputs ``(M, O)`` at the MAP params and their
        covariance ``J H⁻¹ Jᵀ`` ``(M, O, O)`` (plus ``sigma² I`` for regression: the
        predictive of a new target). For classification ``mean`` is the probit
        approximation of the class probabilities, ``softmax(μ / sqrt(1 + π/8 diag Σ))``.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> X = random.normal(random.key(0), (50, 3), dtype=torch.float64)
        >>> f = lambda w, x: (x @ w)[None]
        >>> post = laplace(f, torch.zeros(3, dtype=torch.float64), X, likelihood="regression")
        >>> mean, cov = laplace_predict(post, f, 10 * X[:2])           # far: wider
        >>> bool((cov[:, 0, 0] > laplace_predict(post, f, X[:2])[1][:, 0, 0]).all())
        True
    """
    if not isinstance(posterior, LaplacePosterior):
        raise TypeError(f"laplace_predict: posterior must be a LaplacePosterior (from "
                        f"laplace), got {type(posterior).__name__}")
    flat = Flat(posterior.params, "laplace_predict", "posterior.params")
    theta = flat.vector(posterior.params, "params")
    apply_fn = _with_fixed(_one_example(apply_fn, state, "laplace_predict"), posterior.fixed)

    def out_of(vec: Tensor, x_one: Tensor) -> Tensor:
        return apply_fn(flat.tree(vec), x_one)

    J = vmap(jacrev(out_of), in_dims=(None, 0))(theta, x)  # (M, O, P)
    out = vmap(out_of, in_dims=(None, 0))(theta, x)  # (M, O)
    m, o, p = J.shape
    cov_J = _covariance_times(posterior, J.reshape(m * o, p).transpose(0, 1))  # (P, M O)
    cov = torch.einsum("mop,mqp->moq", J, cov_J.transpose(0, 1).reshape(m, o, p))  # (M, O, O)
    if posterior.likelihood == "regression":
        eye = torch.eye(o, dtype=cov.dtype, device=cov.device)
        return out, cov + posterior.sigma ** 2 * eye
    var = cov.diagonal(dim1=-2, dim2=-1)  # (M, O)
    return F.softmax(out / (1 + math.pi / 8 * var).sqrt(), -1), cov


def laplace_sample(posterior: LaplacePosterior, key: Tensor, num_samples: int) -> Any:
    """Draws from the posterior ``N(θ*, H⁻¹)``, for the Monte Carlo predictive
    (laplace-torch's ``la.sample(n)``, ``pred_type="nn"``).

    ``θ* + H^{-1/2} z`` with ``z`` standard normal: ``H^{-1/2}`` from the Cholesky factor
    (``"full"``), the eigenvalues (``"diag"``, ``"lowrank"``, and each ``"kron"`` block:
    ``(Q_G ⊗ Q_A) diag(γ_i α_j + δ)^{-1/2} (Q_G ⊗ Q_A)ᵀ``, never formed).

    Args:
        posterior: from :func:`laplace`.
        key: a ``torchfn.random`` key.
        num_samples: ``S``.

    Returns:
        A pytree like ``posterior.params``, each leaf with a leading ``(S,)``; with a
        ``subset``, combine each draw with ``posterior.fixed``.

    Example (the Monte Carlo predictive of a classifier)::

        >>> import torch
        >>> from torch import nn
        >>> import torchfn
        >>> from torchfn import random
        >>> model = torchfn.Model(nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 3)))
        >>> params = model.init(random.key(0))
        >>> x = random.normal(random.key(1), (30, 2))
        >>> post = laplace(model, params, x, structure="kron")
        >>> draws = laplace_sample(post, random.key(2), 100)       # {name: (100, ...)}
        >>> probs = torch.func.vmap(lambda p: model(p, x[:4]).softmax(-1))(draws).mean(0)
        >>> probs.shape                                             # (M, O)
        torch.Size([4, 3])
    """
    if not isinstance(posterior, LaplacePosterior):
        raise TypeError(f"laplace_sample: posterior must be a LaplacePosterior (from "
                        f"laplace), got {type(posterior).__name__}")
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
        raise ValueError(f"laplace_sample: num_samples must be a positive int, got "
                         f"{num_samples!r}")
    flat = Flat(posterior.params, "laplace_sample", "posterior.params")
    theta = flat.vector(posterior.params, "params")  # (P,)
    z = random.normal(key, (flat.n, num_samples), dtype=theta.dtype).to(theta.device)
    prec, delta = posterior.precision, posterior.prior_precision
    if posterior.structure == "full":  # L⁻ᵀ z has covariance (L Lᵀ)⁻¹
        L = torch.linalg.cholesky(prec)
        eps = torch.linalg.solve_triangular(L.transpose(0, 1), z, upper=True)
    elif posterior.structure == "diag":
        eps = z * prec.rsqrt()[:, None]
    elif posterior.structure == "lowrank":
        U, lam = prec
        delta = _one_prior(posterior, "laplace_sample")
        coef = U.transpose(0, 1) @ z  # (k, S)
        eps = (z - U @ coef) / delta ** 0.5 + U @ (coef * (lam + delta).rsqrt()[:, None])
    else:
        eps = kron_power_times(prec, delta, posterior.params, z, -0.5)
    return flat.tree((theta[:, None] + eps).transpose(0, 1))  # leaves (S, ...)
