"""Fixed points with implicit derivatives: deep equilibrium models, bilevel problems.

``z = fixed_point(f, params, z0)`` solves ``z = f(params, z)`` and differentiates
``z`` with respect to ``params`` by the implicit function theorem, never through
the solver's iterations, so memory does not grow with them:

- reverse mode (``grad``, ``vmap(grad)``, ``jacrev``): solve the adjoint
  ``u = g + (df/dz)^T u``, then ``dparams = (df/dparams)^T u`` (DEQ's backward);
- forward mode (``jvp``, ``jacfwd``): solve ``t = (df/dz) t + (df/dparams) tp``.

Second order (``hessian``) follows the implicit rule at ``z`` again and
differentiates the linear solves' iterations: exact to the tolerance with
``adjoint_method="iterate"``, approximate with Anderson's.

The solvers are Anderson acceleration (Walker & Ni, as in DEQ code) and plain
iteration. A solve stops once the relative residual ``|f(z) - z| / |f(z)|`` is
below ``tol`` and warns if ``max_iter`` passes first. Under ``vmap`` (one solve per
example) it stops once every example's solve has converged, each keeping its value
from the iteration where it did, as JAX's batched ``while_loop`` does.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree

from torchfn.core._lanes import all_lanes, max_over_lanes
from torchfn.core.custom_vjp import custom_vjp

__all__ = ["fixed_point"]

_METHODS = ("anderson", "iterate")


class _Options(NamedTuple):
    method: str
    adjoint_method: str
    max_iter: int
    tol: float
    memory: int
    damping: float


def fixed_point(
    f: Callable[[Any, Any], Any],
    params: Any,
    z0: Any,
    *,
    method: str = "anderson",
    adjoint_method: str | None = None,
    max_iter: int = 50,
    tol: float = 1e-5,
    memory: int = 5,
    damping: float = 1.0,
) -> Any:
    """Solve ``z = f(params, z)`` from ``z0``; differentiate ``z`` implicitly.

    Args:
        f: ``f(params, z) -> z``, pure; ``z`` any pytree of float tensors, its output
            with ``z``'s structure, shapes and dtypes. For a contraction in ``z``
            (a DEQ layer ``tanh(W z + U x + b)`` with small ``W``) the solve converges.
        params: pytree of the tensors to differentiate (weights, the input ``x``).
        z0: starting point; ``z`` gets no gradient with respect to it.
        method: ``"anderson"`` (Anderson acceleration, ``memory`` past iterates) or
            ``"iterate"`` (``z <- (1 - damping) z + damping f(params, z)``).
        adjoint_method: the method of the linear solves (the adjoint in reverse mode,
            the tangent in forward mode); ``None``: ``method``. Second order
            differentiates their iterations: with ``"iterate"`` that derivative
            converges with the solve and matches the closed form, with
            ``"anderson"`` (mixing weights held fixed) it is approximate (2.6 % off on
            a test problem, where first order is exact).
        max_iter: iterations at most.
        tol: relative residual ``|f(z) - z| / |f(z)|`` at which a solve stops
            (0: always ``max_iter`` iterations, with no reads back to the host).
        memory: Anderson's history length.
        damping: the mixing weight beta of the new value (1: none).

    Returns:
        ``z``, with ``z0``'s structure.

    Works under ``grad``, ``vmap``, ``jacrev``, ``jacfwd``, ``jvp``, ``hessian`` and
    ``torch.compile`` (the solve runs eagerly there), through ``custom_vjp``.

    Example (a per-example DEQ layer: gradients without backpropagating through the
    iterations)::

        >>> import torch
        >>> from torchfn import random, transforms
        >>> def layer(p, z):                      # z: (D,)
        ...     return torch.tanh(p["w"] @ z + p["x"])
        >>> p = {"w": 0.3 * random.normal(random.key(0), (4, 4)),
        ...      "x": random.normal(random.key(1), (4,))}
        >>> z = transforms.fixed_point(layer, p, torch.zeros(4), tol=1e-6)
        >>> bool(torch.allclose(layer(p, z), z, atol=1e-5))
        True
        >>> g = torch.func.grad(lambda p: transforms.fixed_point(layer, p, torch.zeros(4)).sum())(p)
        >>> g["w"].shape
        torch.Size([4, 4])
    """
    if not callable(f):
        raise TypeError(f"fixed_point: f must be callable, got {type(f).__name__}")
    if method not in _METHODS:
        raise ValueError(f"fixed_point: method must be one of {_METHODS}, got {method!r}")
    adjoint_method = method if adjoint_method is None else adjoint_method
    if adjoint_method not in _METHODS:
        raise ValueError(f"fixed_point: adjoint_method must be one of {_METHODS} or None, "
                         f"got {adjoint_method!r}")
    if not (isinstance(max_iter, int) and max_iter >= 1):
        raise ValueError(f"fixed_point: max_iter must be a positive int, got {max_iter!r}")
    if not (isinstance(memory, int) and memory >= 1):
        raise ValueError(f"fixed_point: memory must be a positive int, got {memory!r}")
    if not (isinstance(tol, (int, float)) and tol >= 0):
        raise ValueError(f"fixed_point: tol must be a non-negative number, got {tol!r}")
    if not (isinstance(damping, (int, float)) and 0 < damping <= 1):
        raise ValueError(f"fixed_point: damping must be in (0, 1], got {damping!r}")
    for path, leaf in pytree.tree_flatten_with_path(z0)[0]:
        if not (isinstance(leaf, torch.Tensor) and leaf.is_floating_point()):
            where = pytree.keystr(path) or "z0"
            raise TypeError(f"fixed_point: z0 must be a pytree of floating-point tensors, got "
                            f"{type(leaf).__name__}"
                            + (f" of dtype {leaf.dtype}" if isinstance(leaf, torch.Tensor) else "")
                            + f" at {where}")
    opts = _Options(method, adjoint_method, max_iter, float(tol), memory, float(damping))
    return _solve(f, opts, params, z0)


@functools.partial(custom_vjp, nondiff_argnums=(0, 1), traceable_fwd=False)
def _solve(f, opts: _Options, params, z0):
    return _forward_solve(f, opts, params, z0)


def _fwd(f, opts, params, z0):
    z = _forward_solve(f, opts, params, z0)
    return z, (params, z)  # z is the output itself: saved as it, differentiated by bwd


def _bwd(f, opts, res, g):
    params, z = res
    # the adjoint u = g + (df/dz)^T u, then dparams = (df/dparams)^T u; the iterations
    # pull back through z only
    _, vjp_z = torch.func.vjp(lambda z: f(params, z), z)
    u = _linear_solve(lambda u: _add(g, vjp_z(u)[0]), g, opts, "the adjoint")
    _, vjp_p = torch.func.vjp(lambda p: f(p, z), params)
    return vjp_p(u)[0], None


def _jvp(f, opts, res, tangents):
    params, z = res
    tp, _ = tangents
    tp = pytree.tree_map(lambda p, t: torch.zeros_like(p) if t is None else t, params, tp)
    b = torch.func.jvp(lambda p: f(p, z), (params,), (tp,))[1]  # (df/dparams) tp

    def step(t):  # t <- b + (df/dz) t
        return _add(b, torch.func.jvp(lambda z: f(params, z), (z,), (t,))[1])

    return _linear_solve(step, b, opts, "the tangent")


_solve.defvjp(_fwd, _bwd, jvp=_jvp)


# -- solvers on pytrees ------------------------------------------------------------------

def _forward_solve(f, opts, params, z0):
    leaves, spec = pytree.tree_flatten(z0)

    def g(vec):
        out = f(params, _unravel(vec, leaves, spec))
        out_leaves, out_spec = pytree.tree_flatten(out)
        if out_spec != spec:
            raise TypeError(f"fixed_point: f(params, z) must return z's structure {spec}, "
                            f"got {out_spec}")
        for i, (a, b) in enumerate(zip(out_leaves, leaves)):
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ValueError(
                    f"fixed_point: f(params, z) leaf {i} has shape {tuple(a.shape)} and dtype "
                    f"{a.dtype}; z has {tuple(b.shape)} and {b.dtype}"
                )
        return _ravel(out_leaves)

    vec = _run(g, _ravel(leaves), opts, "fixed_point")
    return _unravel(vec, leaves, spec)


def _linear_solve(step, like, opts, what: str):
    """The fixed point of an affine ``step`` on pytrees (the adjoint or tangent systems)."""
    leaves, spec = pytree.tree_flatten(like)

    def g(vec):
        return _ravel(pytree.tree_flatten(step(_unravel(vec, leaves, spec)))[0])

    vec = _run(g, _ravel(leaves), opts._replace(method=opts.adjoint_method),
               f"fixed_point ({what} solve)")
    return _unravel(vec, leaves, spec)


@torch._disable_dynamo  # a loop that stops on a tolerance: not for a graph
def _run(g, x, opts: _Options, who: str) -> torch.Tensor:
    """Iterate to ``x = g(x)`` on a flat vector ``x: (n,)``.

    Under ``vmap`` every lane iterates until all have converged (``_lanes``); a lane
    that converged earlier keeps its value.
    """
    history_x: list[torch.Tensor] = []
    history_g: list[torch.Tensor] = []
    residual = math.inf
    check = opts.tol > 0  # tol=0: exactly max_iter iterations, no host reads
    done = None  # per lane, once checking
    for _ in range(opts.max_iter):
        gx = g(x)
        if check:
            rel = (torch.linalg.vector_norm(gx - x).detach()
                   / torch.linalg.vector_norm(gx).detach().clamp_min(1e-30))
            now = rel <= opts.tol
            finished = now if done is None else done | now
            residual = max_over_lanes(torch.where(finished, 0.0, rel))
            if all_lanes(finished):  # lanes done before keep x; the others take gx
                return gx if done is None else torch.where(done, x, gx)
            done = finished
        if opts.method == "iterate":
            new = torch.lerp(x, gx, opts.damping) if opts.damping != 1 else gx
        else:
            history_x.append(x)
            history_g.append(gx)
            del history_x[:-opts.memory], history_g[:-opts.memory]
            new = _anderson_step(torch.stack(history_x), torch.stack(history_g), opts.damping)
        x = new if done is None else torch.where(done, x, new)  # converged lanes stay
    if check and residual > opts.tol:
        warnings.warn(
            f"{who} did not converge: relative residual {residual:.3g} > tol={opts.tol:g} "
            f"after max_iter={opts.max_iter} iterations",
            RuntimeWarning,
            stacklevel=5,
        )
    return x


def _anderson_step(xs: torch.Tensor, gs: torch.Tensor, beta: float) -> torch.Tensor:
    """One Anderson mixing step from the last m iterates ``xs`` and their images ``gs``: (m, n).

    alpha minimises |sum_i alpha_i (g_i - x_i)| subject to sum_i alpha_i = 1.
    """
    r = (gs - xs).detach()  # (m, n) residuals; the weights are constants to derivatives
    h = r @ r.T  # (m, m)
    h = h / (h.diagonal().amax() + torch.finfo(h.dtype).tiny)  # scale-free; all-zero stays 0
    m = h.shape[0]
    reg = max(1e-10, 10 * torch.finfo(h.dtype).eps)  # zero residuals: equal weights
    eye = torch.eye(m, dtype=h.dtype, device=h.device)
    a = torch.linalg.solve(h + reg * eye, torch.ones(m, dtype=h.dtype, device=h.device))
    alpha = a / a.sum()  # (m,)
    mixed_g = alpha @ gs
    return mixed_g if beta == 1 else torch.lerp(alpha @ xs, mixed_g, beta)


def _ravel(leaves) -> torch.Tensor:
    return torch.cat([leaf.reshape(-1) for leaf in leaves]) if len(leaves) != 1 else \
        leaves[0].reshape(-1)


def _unravel(vec: torch.Tensor, like, spec):
    out, start = [], 0
    for leaf in like:
        n = leaf.numel()
        out.append(vec[start:start + n].reshape(leaf.shape))
        start += n
    return pytree.tree_unflatten(out, spec)


def _add(a, b):
    return pytree.tree_map(torch.add, a, b)
