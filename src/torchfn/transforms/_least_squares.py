"""``least_squares``: Levenberg-Marquardt on a residual function of a parameter pytree.

Minimises ``0.5 |r(params)|^2`` for ``r = residual_fn(params, *args)``, any pytree of
residuals, as ``scipy.optimize.least_squares(method="lm")`` and jaxopt's
``LevenbergMarquardt`` do. Each step takes the Jacobian ``J`` of the flattened
residuals (``torch.func.jacrev``, or ``jacfwd`` on request) and solves the damped
Gauss-Newton system ``(J^T J + lam I) delta = -J^T r``; ``lam`` follows Nielsen's rule (shrink after
a good step by how well the quadratic model predicted it, double up after a bad one).

Everything is tensors and ``torch.where``: under ``vmap`` every problem (a dataset to
fit, a starting point) keeps its own damping and stops at its own tolerance; the loop
runs until the last one has.

The solution's derivatives in ``args`` are implicit (jaxopt's ``implicit_diff``): at
the minimum the gradient ``F = J^T r`` vanishes, so ``d params / d args = -H^-1
dF/d args`` with ``H`` the cost's Hessian in the params. The iterations themselves are
not differentiated: the cost is one Hessian and one solve, whatever the step count.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from torchfn.core._lanes import all_lanes
from torchfn.core.custom_vjp import custom_vjp

__all__ = ["LeastSquaresInfo", "least_squares"]


class LeastSquaresInfo(NamedTuple):
    cost: Tensor  # () 0.5 |r|^2 at the returned params
    steps: Tensor  # () int32, Levenberg-Marquardt iterations taken
    converged: Tensor  # () bool: a tolerance was met (else max_steps ran out)


def least_squares(
    residual_fn: Callable[..., Any],
    params: Any,
    *args: Any,
    max_steps: int = 100,
    ftol: float = 1e-12,
    gtol: float = 1e-10,
    xtol: float = 1e-12,
    damping: float = 1e-3,
    jacobian: str = "rev",
) -> tuple[Any, LeastSquaresInfo]:
    """Fit ``params`` so that ``residual_fn(params, *args)`` is as small as it gets.

    Args:
        residual_fn: ``(params, *args) -> residuals``, any pytree of tensors.
        params: the starting point, a pytree of floating-point tensors.
        *args: passed to ``residual_fn`` (data); not differentiated by the solver.
        max_steps: iterations at most.
        ftol: stop when the step's predicted decrease of the cost is below ``ftol``
            times the cost (nothing left to gain at this precision; MINPACK's ftol).
        gtol: stop when the gradient ``J^T r`` is below this in every entry.
        xtol: stop when an accepted step is below ``xtol (|params| + xtol)``.
        damping: the initial ``lam`` relative to the largest entry of ``diag(J^T J)``.
        jacobian: ``"rev"`` (``jacrev``: fewer parameters than residuals, the usual
            fit) or ``"fwd"`` (``jacfwd``).

    Returns:
        ``(params, info)``: the fitted params (the input's structure and dtypes) and a
        :class:`LeastSquaresInfo`. Derivatives of the params in the floating-point
        tensors of ``args`` are implicit (one Hessian and one solve); they need the
        minimum to be strict (an invertible Hessian) and ``residual_fn`` to read
        every tensor it differentiates from ``args`` (not from a closure). The
        starting params get no gradient: the minimum does not depend on them.

    Example (an exponential decay, the same fit scipy's MINPACK finds)::

        >>> import torch
        >>> from torchfn import transforms
        >>> t = torch.linspace(0, 4, 50, dtype=torch.float64)
        >>> y = 2.0 * torch.exp(-1.3 * t) + 0.5
        >>> def residual(p, t, y):
        ...     return p["a"] * torch.exp(-p["b"] * t) + p["c"] - y
        >>> p0 = {k: torch.tensor(1.0, dtype=torch.float64) for k in "abc"}
        >>> fit, info = transforms.least_squares(residual, p0, t, y)
        >>> [round(float(fit[k]), 6) for k in "abc"], bool(info.converged)
        ([2.0, 1.3, 0.5], True)
    """
    if not callable(residual_fn):
        raise TypeError(f"least_squares: residual_fn must be callable, got "
                        f"{type(residual_fn).__name__}")
    leaves, spec = optree.tree_flatten(params)
    if not leaves or not all(isinstance(x, Tensor) and x.is_floating_point() for x in leaves):
        raise TypeError("least_squares: params must be a non-empty pytree of floating-point "
                        f"tensors, got {[type(x).__name__ for x in leaves]}")
    if jacobian not in ("rev", "fwd"):
        raise ValueError(f"least_squares: jacobian must be 'rev' or 'fwd', got {jacobian!r}")
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(f"least_squares: max_steps must be an int >= 1, got {max_steps!r}")
    for name, v in (("ftol", ftol), ("gtol", gtol), ("xtol", xtol), ("damping", damping)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ValueError(f"least_squares: {name} must be a number >= 0, got {v!r}")
    dtype = leaves[0].dtype
    layout = [(x.shape, x.dtype) for x in leaves]

    def unflat(theta: Tensor) -> Any:
        parts = torch.split(theta, [s.numel() for s, _ in layout])
        return optree.tree_unflatten(spec, [p.reshape(s).to(d)
                                            for p, (s, d) in zip(parts, layout)])

    def residuals(theta: Tensor, args: tuple) -> Tensor:  # (m,)
        out = optree.tree_leaves(residual_fn(unflat(theta), *args))
        return torch.cat([o.reshape(-1).to(dtype) for o in out])

    fixed_args = optree.tree_map(
        lambda a: a.detach() if isinstance(a, Tensor) else a, args)  # the loop's data

    def r(theta: Tensor) -> Tensor:  # (m,)
        return residuals(theta, fixed_args)

    jac = torch.func.jacrev(r) if jacobian == "rev" else torch.func.jacfwd(r)
    theta = torch.cat([x.detach().reshape(-1).to(dtype) for x in leaves])  # (n,)
    n = theta.shape[0]
    eye = torch.eye(n, dtype=dtype, device=theta.device)

    res = r(theta)
    J = jac(theta)  # (m, n)
    cost = 0.5 * res @ res
    A, g = J.T @ J, J.T @ res  # (n, n), (n,)
    lam = damping * torch.diagonal(A).max()
    nu = torch.full_like(cost, 2.0)
    converged = g.abs().max() <= gtol
    steps = torch.zeros((), dtype=torch.int32, device=theta.device)
    for _ in range(max_steps):
        if all_lanes(converged):
            break
        go = ~converged
        delta = torch.linalg.solve(A + lam * eye, -g)  # (n,)
        trial = theta + delta
        res_t = r(trial)
        cost_t = 0.5 * res_t @ res_t
        predicted = -(g @ delta + 0.5 * delta @ (A @ delta))  # the model's decrease > 0
        rho = (cost - cost_t) / torch.clamp(predicted, min=torch.finfo(dtype).tiny)
        good = go & (rho > 0) & torch.isfinite(cost_t)
        # Nielsen (1999): shrink by how well the model predicted; double after a miss
        lam = torch.where(good, lam * torch.clamp(1 - (2 * rho - 1) ** 3, min=1 / 3),
                          torch.where(go, lam * nu, lam))
        nu = torch.where(good, torch.full_like(nu, 2.0), torch.where(go, nu * 2, nu))
        small = good & (delta.norm() <= xtol * (theta.norm() + xtol))
        flat = go & (predicted <= ftol * cost)
        theta = torch.where(good, trial, theta)
        if not all_lanes(~good):  # some problem moved: its new Jacobian and residuals
            J = torch.where(good, jac(theta), J)
            res = torch.where(good, res_t, res)
        cost = torch.where(good, cost_t, cost)
        A, g = J.T @ J, J.T @ res
        steps = steps + go.to(steps.dtype)
        converged = converged | small | flat | (go & (g.abs().max() <= gtol))
    arg_leaves, arg_spec = optree.tree_flatten(args)
    if any(_is_float(a) for a in arg_leaves):
        tensors = [a for a in arg_leaves if isinstance(a, Tensor)]
        theta = _implicit(_Residuals(residuals, arg_leaves, arg_spec), theta, tensors)
    return unflat(theta), LeastSquaresInfo(cost, steps, converged)


def _is_float(x: Any) -> bool:
    return isinstance(x, Tensor) and x.is_floating_point()


class _Residuals:
    """``residuals(theta, args)`` as a function of ``theta`` and args' tensor leaves
    (all of them go through the rule: a tensor kept here from outside a transform
    cannot be used inside it)."""

    def __init__(self, residuals, arg_leaves, arg_spec):
        self.residuals, self.arg_spec = residuals, arg_spec
        self.is_tensor = [isinstance(a, Tensor) for a in arg_leaves]
        self.others = [None if t else a for a, t in zip(arg_leaves, self.is_tensor)]

    def cost(self, theta: Tensor, tensors: list[Tensor]) -> Tensor:
        it = iter(tensors)
        leaves = [next(it) if t else a for a, t in zip(self.others, self.is_tensor)]
        r = self.residuals(theta, optree.tree_unflatten(self.arg_spec, leaves))
        return 0.5 * r @ r


@functools.partial(custom_vjp, nondiff_argnums=(0,), traceable_fwd=False)
def _implicit(res: _Residuals, theta: Tensor, tensors: list[Tensor]) -> Tensor:
    """``theta`` (the minimum), with the implicit derivative in ``tensors``."""
    return theta.clone()


def _implicit_fwd(res, theta, tensors):
    # one residual evaluation inside the rule, so that custom_vjp's closure check sees
    # a tensor residual_fn captures while it is being differentiated (its gradient
    # would otherwise be silently lost)
    res.cost(theta, tensors)
    return theta.clone(), (theta, tensors)


def _implicit_bwd(res, saved, g):
    theta, tensors = saved
    float_at = [i for i, t in enumerate(tensors) if t.is_floating_point()]

    def with_floats(floats):
        full = list(tensors)
        for i, f in zip(float_at, floats):
            full[i] = f
        return full

    floats = [tensors[i] for i in float_at]
    H = torch.func.hessian(res.cost)(theta, tensors)  # (n, n), at the minimum
    u = torch.linalg.solve(H, g)
    grad_theta = torch.func.grad(res.cost)  # F(theta, args) = J^T r, zero at the minimum
    _, pull = torch.func.vjp(lambda fl: grad_theta(theta, with_floats(fl)), floats)
    (ct_floats,) = pull(-u)
    ct = [None] * len(tensors)
    for i, c in zip(float_at, ct_floats):
        ct[i] = c
    return None, ct


_implicit.defvjp(_implicit_fwd, _implicit_bwd)
