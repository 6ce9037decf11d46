"""Conjugate gradients on pytrees with implicit derivatives (``jax.scipy.sparse.linalg.cg``).

``x = cg(matvec, b, args=args)`` solves ``A x = b`` for a symmetric positive-definite
``A`` given as ``matvec(v, *args)``; ``x`` is differentiated by the implicit rule, never
through the iterations, as JAX's ``custom_linear_solve`` does:

- reverse mode: ``λ = A⁻¹ g`` (one more solve: ``A`` is symmetric), then ``b̄ = λ`` and
  ``ārgs = -(∂(A x)/∂args)ᵀ λ``;
- forward mode: ``ẋ = A⁻¹ (ḃ - (∂(A x)/∂args) ȧrgs)``;
- higher orders: each rule solves through ``cg`` again, so its derivative is implicit too.

Uses: Newton and Hessian-free steps (with :func:`hessian_operator`), influence
functions (``H⁻¹ ∇L``), implicit hypergradients, a Gaussian process's ``K⁻¹ y``.
Under ``vmap`` each example's solve stops at its own tolerance.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from torchfn.core._lanes import all_lanes, max_over_lanes
from torchfn.core.custom_vjp import custom_vjp

__all__ = ["cg"]


class _Options(NamedTuple):
    tol: float
    atol: float
    maxiter: int | None


def cg(
    matvec: Callable[..., Any],
    b: Any,
    *,
    args: tuple = (),
    x0: Any = None,
    tol: float = 1e-5,
    atol: float = 0.0,
    maxiter: int | None = None,
    M: Callable[[Any], Any] | None = None,
) -> Any:
    """Solve ``A x = b`` by (preconditioned) conjugate gradients; ``A`` symmetric
    positive definite, given as a product.

    Args:
        matvec: ``matvec(v, *args) -> A v``, ``v`` with ``b``'s structure.
        b: the right-hand side, a tensor or a pytree of them.
        args: tensors ``A`` depends on, to differentiate through (e.g. params); a
            ``matvec`` that closes over tensors instead is fine where nothing
            differentiates them, and an error where something does.
        x0: the starting point (``b``'s structure; zeros by default); no derivatives.
        tol, atol: stop once ``|r| <= max(tol |b|, atol)`` (JAX's rule), ``r = b - A x``.
        maxiter: iterations at most; default ``10 n``. A solve that stops there warns.
        M: a preconditioner, ``v -> M v`` with ``M ≈ A⁻¹`` symmetric positive definite
            (e.g. the inverse diagonal); ``b``'s structure.

    Returns:
        ``x``, with ``b``'s structure.

    Works under ``grad``, ``vmap``, ``jacrev``, ``jacfwd``, ``jvp`` and ``hessian``.

    Example (a Newton step ``H⁻¹ ∇f``)::

        >>> import torch
        >>> from torchfn.transforms import cg, hessian_operator
        >>> f = lambda w: (w ** 4).sum() + (w ** 2).sum()
        >>> w = torch.tensor([1.0, -2.0])
        >>> step = cg(hessian_operator(f, w), torch.func.grad(f)(w))
        >>> step                                      # (4 w^3 + 2 w) / (12 w^2 + 2)
        tensor([ 0.4286, -0.7200])
    """
    if not callable(matvec):
        raise TypeError(f"cg: matvec must be callable, got {type(matvec).__name__}")
    if M is not None and not callable(M):
        raise TypeError(f"cg: M must be callable or None, got {type(M).__name__}")
    if not isinstance(args, tuple):
        raise TypeError(f"cg: args must be a tuple (the operator's extra arguments), got "
                        f"{type(args).__name__}")
    leaves = pytree.tree_leaves(b)
    if not leaves or not all(isinstance(x, Tensor) and x.is_floating_point() for x in leaves):
        raise TypeError("cg: b must be a floating-point tensor or a pytree of them, got "
                        f"{[type(x).__name__ for x in leaves] or 'no leaves'}")
    if x0 is not None:
        _check_like("x0", b, x0)
    if not (isinstance(tol, (int, float)) and tol >= 0):
        raise ValueError(f"cg: tol must be a non-negative number, got {tol!r}")
    if not (isinstance(atol, (int, float)) and atol >= 0):
        raise ValueError(f"cg: atol must be a non-negative number, got {atol!r}")
    if maxiter is not None and not (isinstance(maxiter, int) and maxiter >= 1):
        raise ValueError(f"cg: maxiter must be a positive int or None, got {maxiter!r}")
    x0 = pytree.tree_map(torch.zeros_like, b) if x0 is None else x0
    return _solve(matvec, M, _Options(float(tol), float(atol), maxiter), b, args, x0)


def _check_like(name: str, b: Any, x: Any) -> None:
    lb, sb = pytree.tree_flatten(b)
    lx, sx = pytree.tree_flatten(x)
    if sb != sx or [t.shape for t in lb] != [getattr(t, "shape", None) for t in lx]:
        got = [tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__ for t in lx]
        raise ValueError(f"cg: {name} must have b's structure and shapes "
                         f"{[tuple(t.shape) for t in lb]}, got {got}")


@functools.partial(custom_vjp, nondiff_argnums=(0, 1, 2), traceable_fwd=False)
def _solve(matvec, M, opts: _Options, b, args, x0):
    return _iterate(matvec, M, opts, b, args, x0)


def _fwd(matvec, M, opts, b, args, x0):
    x = _iterate(matvec, M, opts, b, args, x0)
    return x, (args, x)


def _bwd(matvec, M, opts, res, g):
    args, x = res
    # λ = A⁻¹ g: A is symmetric, so the adjoint system is the same one; solved through
    # _solve so that higher orders get the implicit rule again
    lam = _solve(matvec, M, opts, g, args, pytree.tree_map(torch.zeros_like, g))
    if args:
        _, pull = torch.func.vjp(lambda *a: matvec(x, *a), *args)
        d_args = tuple(pytree.tree_map(torch.neg, d) for d in pull(lam))
    else:
        d_args = ()
    return lam, d_args, None


def _jvp(matvec, M, opts, res, tangents):
    args, x = res
    t_b, t_args, _ = tangents
    t_b = pytree.tree_map(lambda x, t: torch.zeros_like(x) if t is None else t, x, t_b)
    rhs = t_b  # ẋ = A⁻¹ (ḃ - (∂(A x)/∂args) ȧrgs)
    if args:
        t_args = tuple(pytree.tree_map(lambda a, t: torch.zeros_like(a) if t is None else t,
                                       a, t) for a, t in zip(args, t_args))
        _, dA_x = torch.func.jvp(lambda *a: matvec(x, *a), args, t_args)
        rhs = pytree.tree_map(torch.sub, t_b, dA_x)
    return _solve(matvec, M, opts, rhs, args, pytree.tree_map(torch.zeros_like, rhs))


_solve.defvjp(_fwd, _bwd, jvp=_jvp)


@torch._disable_dynamo  # a loop that stops on a tolerance: not for a graph
def _iterate(matvec, M, opts: _Options, b, args, x0):
    leaves, spec = pytree.tree_flatten(b)

    def flat(tree, who):
        out_leaves, out_spec = pytree.tree_flatten(tree)
        if out_spec != spec or [t.shape for t in out_leaves] != [t.shape for t in leaves]:
            raise ValueError(f"cg: {who} must return b's structure and shapes "
                             f"{[tuple(t.shape) for t in leaves]}, got "
                             f"{[tuple(getattr(t, 'shape', ())) for t in out_leaves]}")
        return torch.cat([t.reshape(-1) for t in out_leaves])

    def tree(vec):
        out, i = [], 0
        for t in leaves:
            out.append(vec[i:i + t.numel()].reshape(t.shape))
            i += t.numel()
        return pytree.tree_unflatten(out, spec)

    def A(v):
        return flat(matvec(tree(v), *args), "matvec")

    def precondition(r):
        return r if M is None else flat(M(tree(r)), "M")

    bv = torch.cat([t.reshape(-1) for t in leaves])  # (n,)
    x = torch.cat([t.reshape(-1) for t in pytree.tree_leaves(x0)]).to(bv.dtype)
    maxiter = 10 * bv.numel() if opts.maxiter is None else opts.maxiter
    bound = torch.clamp(opts.tol * torch.linalg.vector_norm(bv).detach(), min=opts.atol)
    r = bv - A(x)
    z = precondition(r)
    p, rz = z, r @ z
    done = torch.linalg.vector_norm(r).detach() <= bound
    for _ in range(maxiter):
        if all_lanes(done):
            return tree(x)
        Ap = A(p)
        pAp = p @ Ap
        alpha = rz / torch.where(done, 1.0, pAp)  # a finished lane may have p = 0
        x_new, r_new = x + alpha * p, r - alpha * Ap
        z_new = precondition(r_new)
        rz_new = r_new @ z_new
        p_new = z_new + rz_new / torch.where(done, 1.0, rz) * p
        x, r, p, rz = (torch.where(done, old, new) for old, new in
                       ((x, x_new), (r, r_new), (p, p_new), (rz, rz_new)))
        done = done | (torch.linalg.vector_norm(r).detach() <= bound)
    if not all_lanes(done):
        residual = max_over_lanes(torch.linalg.vector_norm(r).detach() / bound.clamp_min(
            torch.finfo(bv.dtype).tiny))
        warnings.warn(f"cg did not converge: |r| is {residual:.3g} times the bound "
                      f"max(tol |b|, atol) after maxiter={maxiter} iterations",
                      RuntimeWarning, stacklevel=5)
    return tree(x)
