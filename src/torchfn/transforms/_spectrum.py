"""Spectra of symmetric operators given only as matrix-vector products over pytrees: the
Hessian of a loss (``hvp``), its Gauss-Newton matrix (``gauss_newton_vp``), a Fisher.

- :func:`eigsh`: extreme eigenpairs by Lanczos (the sharpness, the top-k directions);
- :func:`hutchinson_trace`: the trace from Rademacher probes;
- :func:`spectral_quadrature` and :func:`spectral_density`: the eigenvalue density by
  stochastic Lanczos quadrature (Ubaru, Chen and Saad, 2017; Ghorbani et al., 2019).

PyHessian computes the same three on an ``nn.Module`` (power iteration with deflation
for the eigenvalues). Here the operator is any function (a Hessian's fastest is
:func:`hessian_operator`), Lanczos needs fewer products than power iteration for the
same accuracy, the loop has a fixed number of steps and no branch on values, and the
randomness comes from keys: each runs under ``vmap`` (the sharpness of every member of an
ensemble at once) and replays exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.func import vmap

from torchfn import random
from torchfn.transforms._flat import Flat

__all__ = ["eigsh", "hutchinson_trace", "spectral_quadrature", "spectral_density"]

_WHICH = ("largest", "smallest", "magnitude")


class _Flat(Flat):
    """``like``'s leaves as one vector ``(n,)`` and back, and the operator on vectors."""

    def __init__(self, like: Any, matvec: Any, who: str):
        if not callable(matvec):
            raise TypeError(f"{who}: matvec must be callable, got {type(matvec).__name__}")
        super().__init__(like, who, "like")
        self.matvec = matvec

    def op(self, vec: Tensor) -> Tensor:
        return self.vector(self.matvec(self.tree(vec)), "matvec's output")


def _count(name: str, value: Any, lo: int, hi: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (
            hi is not None and value > hi):
        want = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be an int {want}, got {value!r}")
    return value


def _orthogonalize(w: Tensor, basis: Tensor) -> Tensor:
    """``w`` minus its projection on the rows of ``basis`` (m, n), twice (Gram-Schmidt
    loses orthogonality once the Ritz values converge)."""
    w = w - basis.transpose(0, 1) @ (basis @ w)
    return w - basis.transpose(0, 1) @ (basis @ w)


def _lanczos(flat: _Flat, v0: Tensor, steps: int, key: Tensor) -> tuple[Tensor, Tensor]:
    """``steps`` Lanczos steps from the unit vector ``v0`` (n,), fully reorthogonalised:
    the tridiagonal ``T`` (steps, steps) and the basis ``Q`` (steps, n), ``Q A Qᵀ = T``.

    Where the Krylov space closes (``beta`` ~ 0: the start vector lay in an invariant
    subspace) the next vector is a random one orthogonal to ``Q`` and ``beta`` is 0, so
    ``T`` splits into blocks whose eigenvalues are all eigenvalues of ``A``. That choice is
    a ``where``, not a branch, so the loop runs under ``vmap``."""
    eps = torch.finfo(flat.dtype).eps
    basis = [v0]
    alphas, betas = [], []
    q, q_prev = v0, torch.zeros_like(v0)
    beta = v0.new_zeros(())
    scale = v0.new_zeros(())  # a running estimate of ||A||, for the breakdown test
    for j in range(steps):
        w = flat.op(q)
        alpha = q @ w
        w = w - alpha * q - beta * q_prev
        Q = torch.stack(basis)  # (j + 1, n)
        w = _orthogonalize(w, Q)
        alphas.append(alpha)
        if j == steps - 1:
            break
        norm = w.norm()
        scale = torch.maximum(scale, alpha.abs() + norm)
        closed = norm <= 64 * eps * scale
        fresh = _orthogonalize(random.normal(random.fold_in(key, j), (flat.n,),
                                             dtype=flat.dtype).to(flat.device), Q)
        q_next = torch.where(closed, fresh / fresh.norm(), w / torch.where(closed, 1.0, norm))
        beta = torch.where(closed, 0.0, norm)
        betas.append(beta)
        q_prev, q = q, q_next
        basis.append(q)
    T = torch.diag_embed(torch.stack(alphas))
    if betas:
        off = torch.stack(betas)
        T = T + torch.diag_embed(off, 1) + torch.diag_embed(off, -1)
    return T, torch.stack(basis)


def _unit(key: Tensor, flat: _Flat) -> Tensor:
    v = random.normal(key, (flat.n,), dtype=flat.dtype).to(flat.device)
    return v / v.norm()


def eigsh(
    matvec: Callable[[Any], Any],
    like: Any,
    key: Tensor,
    *,
    k: int = 1,
    steps: int | None = None,
    which: str = "largest",
) -> tuple[Tensor, Any]:
    """The ``k`` extreme eigenvalues and eigenvectors of a symmetric operator, by Lanczos
    with full reorthogonalisation (scipy's ``eigsh`` on a ``LinearOperator``).

    The top Hessian eigenvalue is a loss's sharpness (edge-of-stability, SAM studies):
    ``eigsh(hessian_operator(loss, params), params, key)``. Extreme eigenvalues converge
    first; ``steps = n`` is an exact eigendecomposition.

    Args:
        matvec: ``v -> A v``, ``v`` with ``like``'s structure (e.g. a params dict).
        like: a tensor or pytree: the operator's domain (its values are not used).
        key: the start vector's key.
        k: how many eigenpairs.
        steps: Lanczos steps (matvecs), in ``[k, n]``; default ``min(n, max(2k + 20, 30))``.
        which: ``"largest"`` (algebraic), ``"smallest"`` or ``"magnitude"``.

    Returns:
        ``(eigenvalues (k,), eigenvectors)``, the eigenvectors unit-norm with ``like``'s
        structure and a leading dim ``k``; ordered largest first (``"smallest"``:
        smallest first).

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> from torchfn.transforms import eigsh, hessian_operator
        >>> def loss(p):                                          # Hessian diag(2, 6, 12)
        ...     return (p["w"] ** 2).sum() + 3 * (p["b"] ** 2).sum() + 6 * p["c"] ** 2
        >>> params = {"w": torch.ones(1), "b": torch.ones(1), "c": torch.tensor(1.0)}
        >>> H = hessian_operator(loss, params)
        >>> values, vectors = eigsh(H, params, random.key(0), k=2)
        >>> [round(x, 4) for x in values.tolist()], vectors["c"].abs().round().tolist()
        ([12.0, 6.0], [1.0, 0.0])
    """
    flat = _Flat(like, matvec, "eigsh")
    k = _count("k", k, 1, flat.n)
    if steps is None:
        steps = min(flat.n, max(2 * k + 20, 30))
    steps = _count("steps", steps, k, flat.n)
    if which not in _WHICH:
        raise ValueError(f"which must be one of {_WHICH}, got {which!r}")
    start, restarts = random.split(key)
    T, Q = _lanczos(flat, _unit(start, flat), steps, restarts)
    theta, S = torch.linalg.eigh(T)  # ascending
    if which == "largest":
        pick = torch.arange(steps - 1, steps - 1 - k, -1, device=theta.device)
    elif which == "smallest":
        pick = torch.arange(k, device=theta.device)
    else:
        pick = theta.abs().topk(k).indices
    values = theta[pick]  # (k,)
    vectors = S[:, pick].transpose(0, 1) @ Q  # (k, n)
    return values, flat.tree(vectors)


def hutchinson_trace(
    matvec: Callable[[Any], Any],
    like: Any,
    key: Tensor,
    *,
    samples: int = 64,
    vectorized: bool = False,
) -> tuple[Tensor, Tensor]:
    """The trace of a symmetric operator by Hutchinson's estimator:
    ``mean_i zᵢᵀ A zᵢ`` over Rademacher probes ``zᵢ`` (exact for a diagonal ``A``).

    Args:
        matvec: ``v -> A v`` over ``like``'s structure.
        like: a tensor or pytree: the operator's domain.
        key: the probes' key.
        samples: how many probes (``>= 2``).
        vectorized: one ``vmap(matvec)`` over all probes instead of a loop (faster where
            ``matvec`` batches, e.g. an ``hvp``; memory grows with ``samples``).

    Returns:
        ``(estimate, standard_error)``, 0-d tensors; the error is the probes' standard
        deviation over ``sqrt(samples)``.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> A = torch.tensor([[2.0, 1.0], [1.0, 3.0]])
        >>> trace, err = hutchinson_trace(lambda v: A @ v, torch.zeros(2), random.key(0))
        >>> abs(trace.item() - 5.0) < 4 * err.item() + 1e-6
        True
    """
    flat = _Flat(like, matvec, "hutchinson_trace")
    samples = _count("samples", samples, 2)
    probes = random.rademacher(key, (samples, flat.n), dtype=flat.dtype).to(flat.device)
    if vectorized:
        quads = (probes * vmap(flat.op)(probes)).sum(-1)  # (samples,)
    else:
        quads = torch.stack([z @ flat.op(z) for z in probes.unbind(0)])
    return quads.mean(), quads.std() / samples ** 0.5


def spectral_quadrature(
    matvec: Callable[[Any], Any],
    like: Any,
    key: Tensor,
    *,
    steps: int | None = None,
    runs: int = 4,
) -> tuple[Tensor, Tensor]:
    """Stochastic Lanczos quadrature: the eigenvalue distribution of a symmetric operator
    as ``runs`` Gauss quadratures of ``steps`` nodes each.

    From a random unit vector ``v``, ``steps`` Lanczos steps give ``T = S diag(θ) Sᵀ``;
    the nodes are ``θ`` and the weights ``S[0]²`` (they sum to 1), and
    ``sum_i w_i f(θ_i) = vᵀ f(A) v`` exactly for polynomials ``f`` of degree up to
    ``2 steps - 1``. So ``n * mean_runs sum_i w_i f(θ_i)`` estimates ``tr f(A)`` (e.g.
    ``f = log``: a log-determinant) and :func:`spectral_density` smooths the nodes into
    the spectral density, PyHessian's ``density()`` and its plot.

    Args:
        matvec: ``v -> A v`` over ``like``'s structure.
        like: a tensor or pytree: the operator's domain.
        key: the start vectors' key.
        steps: nodes per run (matvecs per run), in ``[1, n]``; default ``min(n, 32)``.
        runs: independent start vectors.

    Returns:
        ``(nodes, weights)``, each ``(runs, steps)``.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> A = torch.diag(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        >>> nodes, weights = spectral_quadrature(lambda v: A @ v, torch.zeros(4),
        ...                                      random.key(0), steps=4, runs=2)
        >>> nodes.round(decimals=4).tolist(), weights.sum(-1).round(decimals=4).tolist()
        ([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]], [1.0, 1.0])
    """
    flat = _Flat(like, matvec, "spectral_quadrature")
    steps = _count("steps", min(flat.n, 32) if steps is None else steps, 1, flat.n)
    runs = _count("runs", runs, 1)
    nodes, weights = [], []
    for r in range(runs):
        start, restarts = random.split(random.fold_in(key, r))
        T, _ = _lanczos(flat, _unit(start, flat), steps, restarts)
        theta, S = torch.linalg.eigh(T)
        nodes.append(theta)
        weights.append(S[0] ** 2)
    return torch.stack(nodes), torch.stack(weights)


def spectral_density(nodes: Tensor, weights: Tensor, grid: Tensor, *, sigma: float
                     ) -> Tensor:
    """The quadrature of :func:`spectral_quadrature` smoothed by a Gaussian of width
    ``sigma`` and averaged over the runs: a density on ``grid`` (it integrates to 1 where
    the grid covers the nodes).

    Args:
        nodes: ``(runs, steps)`` eigenvalue nodes.
        weights: ``(runs, steps)`` their weights.
        grid: ``(G,)`` where to evaluate the density.
        sigma: the Gaussian's standard deviation (> 0).

    Returns:
        ``(G,)`` the density.

    Example::

        >>> import torch
        >>> nodes, weights = torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.5]])
        >>> grid = torch.linspace(-1, 2, 3001)
        >>> density = spectral_density(nodes, weights, grid, sigma=0.05)
        >>> round(float(torch.trapezoid(density, grid)), 4)
        1.0
    """
    for name, x in (("nodes", nodes), ("weights", weights)):
        if not isinstance(x, Tensor) or x.dim() != 2:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a (runs, steps) tensor, got {got}")
    if weights.shape != nodes.shape:
        raise ValueError(f"weights must have nodes' shape {tuple(nodes.shape)}, got "
                         f"{tuple(weights.shape)}")
    if not isinstance(grid, Tensor) or grid.dim() != 1:
        got = tuple(grid.shape) if isinstance(grid, Tensor) else type(grid).__name__
        raise ValueError(f"grid must be a (G,) tensor, got {got}")
    if not isinstance(sigma, (int, float)) or isinstance(sigma, bool) or not sigma > 0:
        raise ValueError(f"sigma must be a positive float, got {sigma!r}")
    z = (grid[:, None, None] - nodes) / sigma  # (G, runs, steps)
    kernel = torch.exp(-0.5 * z ** 2) / (sigma * (2 * torch.pi) ** 0.5)
    return (kernel * weights).sum(-1).mean(-1)  # (G,)
