"""Curvature: Jacobians, Hessians, Hessian-vector products (forward-over-reverse),
Gauss-Newton-vector products and the empirical neural tangent kernel, over pytrees."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch
from torch import Tensor
from torch.func import grad, jacfwd, jacrev, jvp, vjp, vmap

__all__ = ["jacobian", "hessian", "hvp", "hessian_operator", "gauss_newton_vp", "ntk"]

_MODES = ("reverse", "forward")
_NTK_COMPUTE = ("full", "trace", "diagonal")


def _scalar(f: Callable[..., Tensor], what: str) -> Callable[..., Tensor]:
    def g(*args: Any) -> Tensor:
        out = f(*args)
        if not isinstance(out, Tensor) or out.dim() != 0:
            got = f"shape {tuple(out.shape)}" if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(f"{what}: f must return a scalar (shape ()), got {got}")
        return out

    return g


def _check_same_tree(name: str, a: Any, b: Any, ref: str) -> Any:
    """``b`` checked to have ``a``'s structure and shapes, rebuilt in ``a``'s dict key
    order (torch.func's pytrees compare insertion order; ours sort the keys)."""
    la, sa = optree.tree_flatten(a)
    lb, sb = optree.tree_flatten(b)
    if sa != sb:
        raise ValueError(f"{name} must have the structure of {ref} ({sa}), got {sb}")
    for i, (x, y) in enumerate(zip(la, lb)):
        if tuple(x.shape) != tuple(y.shape):
            raise ValueError(
                f"{name} must have the shapes of {ref}: leaf {i} is {tuple(y.shape)}, "
                f"expected {tuple(x.shape)}"
            )
    return optree.tree_unflatten(sa, lb)


def jacobian(
    f: Callable[..., Any], argnums: int | tuple[int, ...] = 0, *, mode: str = "reverse",
    has_aux: bool = False,
) -> Callable[..., Any]:
    """``jacobian(f)(*args)``: the Jacobian of ``f`` w.r.t. ``args[argnums]``.

    ``mode="reverse"`` is ``torch.func.jacrev`` (one VJP per output element; best for
    few outputs), ``"forward"`` is ``jacfwd`` (one JVP per input element; best for few
    inputs). For ``f: (n,) -> (m,)`` the result is ``(m, n)``; for pytree inputs and
    outputs it is a pytree of pytrees with leaf shapes ``out.shape + in.shape``.

    Example::

        >>> J = jacobian(lambda x: x.sin() * x.sum())(torch.ones(3))     # (3, 3)
    """
    if not callable(f):
        raise TypeError(f"f must be callable, got {type(f).__name__}")
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    if mode == "reverse":
        return jacrev(f, argnums=argnums, has_aux=has_aux)
    return jacfwd(f, argnums=argnums, has_aux=has_aux)


def hessian(f: Callable[..., Tensor], argnums: int | tuple[int, ...] = 0) -> Callable[..., Any]:
    """``hessian(f)(*args)``: the Hessian of a scalar ``f`` w.r.t. ``args[argnums]``,
    forward-over-reverse (``jacfwd(jacrev(f))``).

    For ``x: (n,)`` the result is ``(n, n)``; for a dict of params ``{a: A, b: B}`` it is
    ``{a: {a: (*A, *A), b: (*A, *B)}, b: {...}}``.

    Example::

        >>> H = hessian(lambda x: (x ** 3).sum())(torch.tensor([1.0, 2.0]))
        >>> H
        tensor([[ 6.,  0.],
                [ 0., 12.]])
    """
    if not callable(f):
        raise TypeError(f"f must be callable, got {type(f).__name__}")
    return jacfwd(jacrev(_scalar(f, "hessian"), argnums=argnums), argnums=argnums)


def hvp(f: Callable[[Any], Tensor], x: Any, v: Any) -> Any:
    """The Hessian-vector product ``H(x) v`` of a scalar ``f`` without forming ``H``.

    Forward-over-reverse: ``jvp(grad(f), (x,), (v,))`` -- one gradient's cost (about
    2-3x a forward pass), O(params) memory.

    Args:
        f: ``x -> ()``; ``x`` a tensor or a pytree (e.g. a params dict).
        x: the point, a tensor or pytree.
        v: the direction, same structure and shapes as ``x``.

    Returns:
        ``H v``, same structure as ``x``.

    Example::

        >>> f = lambda p: (p["w"] ** 2).sum() * p["b"].sum()
        >>> p = {"w": torch.ones(3), "b": torch.ones(2)}
        >>> Hv = hvp(f, p, {"w": torch.ones(3), "b": torch.zeros(2)})   # {"w": (3,), "b": (2,)}
    """
    if not callable(f):
        raise TypeError(f"f must be callable, got {type(f).__name__}")
    v = _check_same_tree("v", x, v, "x")
    return jvp(grad(_scalar(f, "hvp")), (x,), (v,))[1]


def hessian_operator(f: Callable[[Any], Tensor], x: Any) -> Callable[[Any], Any]:
    """``v -> H(x) v`` for many ``v`` at one point: reverse-over-reverse on the gradient's
    graph, recorded once (``vjp(grad(f), x)``), as PyHessian does with ``autograd``.

    Each product is one backward pass through the gradient's graph, where :func:`hvp`
    recomputes the gradient every call: about 2.7x faster per product on an MLP (see
    bench/RESULTS.md), the way to feed :func:`eigsh`, :func:`hutchinson_trace` and
    :func:`spectral_quadrature`. The graph stays alive as long as the operator does. ``H``
    is symmetric, so the vector-Jacobian product of the gradient is ``H v``. It works
    under ``vmap`` (of the operator over vectors, or of the whole over models).

    Args:
        f: ``x -> ()``; ``x`` a tensor or a pytree.
        x: the point.

    Returns:
        ``matvec(v)``, ``v`` and the result with ``x``'s structure.

    Example::

        >>> f = lambda p: (p["w"] ** 2).sum() * p["b"].sum()
        >>> p = {"w": torch.ones(3), "b": torch.ones(2)}
        >>> H = hessian_operator(f, p)
        >>> v = {"w": torch.ones(3), "b": torch.zeros(2)}
        >>> all(torch.allclose(H(v)[k], hvp(f, p, v)[k]) for k in p)
        True
    """
    if not callable(f):
        raise TypeError(f"f must be callable, got {type(f).__name__}")
    _, pullback = vjp(grad(_scalar(f, "hessian_operator")), x)

    def matvec(v: Any) -> Any:
        return pullback(_check_same_tree("v", x, v, "x"))[0]

    return matvec


def gauss_newton_vp(
    apply_fn: Callable[[Any], Tensor], loss_fn: Callable[[Tensor], Tensor], params: Any, v: Any
) -> Any:
    """The generalised Gauss-Newton product ``J^T H_L J v``.

    ``J`` is the Jacobian of the outputs ``z = apply_fn(params)`` w.r.t. ``params`` and
    ``H_L`` the Hessian of ``loss_fn(z)`` w.r.t. ``z``: ``Jv`` by a JVP, ``H_L Jv`` by
    :func:`hvp` in output space, ``J^T (.)`` by a VJP. For a convex ``loss_fn`` the GGN
    is positive semi-definite (unlike the Hessian), the usual curvature for
    natural-gradient / K-FAC style methods.

    Args:
        apply_fn: ``params -> z``, e.g. ``lambda p: model.apply(p, x)`` -> ``(B, O)``.
        loss_fn: ``z -> ()``.
        params: pytree; ``v`` has its structure.

    Returns:
        ``G v``, with ``params``' structure.

    Example::

        >>> import torchfn
        >>> x = torchfn.random.normal(torchfn.random.key(0), (5, 3))
        >>> Gv = gauss_newton_vp(lambda p: x @ p, lambda z: (z ** 2).sum(),
        ...                      torch.ones(3), torch.ones(3))          # 2 x^T x 1
        >>> torch.allclose(Gv, 2 * x.T @ x @ torch.ones(3))
        True
    """
    if not callable(apply_fn) or not callable(loss_fn):
        raise TypeError("apply_fn and loss_fn must be callable")
    v = _check_same_tree("v", params, v, "params")
    z, jv = jvp(apply_fn, (params,), (v,))  # z, J v: (outputs)
    hjv = hvp(loss_fn, z, jv)  # H_L J v
    _, pullback = vjp(apply_fn, params)
    return pullback(hjv)[0]


def ntk(
    apply_fn: Callable[[Any, Tensor], Tensor],
    params: Any,
    x1: Tensor,
    x2: Tensor | None = None,
    *,
    compute: str = "full",
) -> Tensor:
    """The empirical neural tangent kernel ``Theta(x1, x2) = J(x1) J(x2)^T``.

    ``J(x)`` is the Jacobian of one example's output w.r.t. all of ``params`` (summed
    over every leaf): ``Theta[n, m] = sum_leaves J_leaf(x1_n) J_leaf(x2_m)^T``. Per-example
    Jacobians come from ``vmap(jacrev(apply_fn))``.

    Args:
        apply_fn: ``(params, x) -> (O,)`` or ``()``: ONE example's output.
        params: the parameter pytree.
        x1: ``(N, ...)`` examples.
        x2: ``(M, ...)`` examples; ``None`` means ``x1``.
        compute: ``"full"`` -> ``(N, M, O, O)``; ``"trace"`` -> ``(N, M)`` (sum over the
            output diagonal); ``"diagonal"`` -> ``(N, M, O)``. For a scalar output
            every mode returns ``(N, M)``.

    Example::

        >>> import torchfn
        >>> from torchfn.models import MLP
        >>> model = torchfn.Model(MLP(3, (8,), 2))
        >>> params = model.init(torchfn.random.key(0))
        >>> x1 = torchfn.random.normal(torchfn.random.key(1), (4, 3))
        >>> x2 = torchfn.random.normal(torchfn.random.key(2), (5, 3))
        >>> ntk(model.apply, params, x1, x2).shape
        torch.Size([4, 5, 2, 2])
    """
    if not callable(apply_fn):
        raise TypeError(f"apply_fn must be callable, got {type(apply_fn).__name__}")
    if compute not in _NTK_COMPUTE:
        raise ValueError(f"compute must be one of {_NTK_COMPUTE}, got {compute!r}")
    x2 = x1 if x2 is None else x2
    for name, x in (("x1", x1), ("x2", x2)):
        if not isinstance(x, Tensor) or x.dim() < 1:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a batch of examples (N, ...), got {got}")
    if x1.shape[1:] != x2.shape[1:]:
        raise ValueError(
            f"x2's examples must have x1's example shape {tuple(x1.shape[1:])}, "
            f"got {tuple(x2.shape[1:])}"
        )

    out_dims: list[int] = []

    def one(p: Any, x: Tensor) -> Tensor:
        out = apply_fn(p, x)
        if not isinstance(out, Tensor) or out.dim() > 1:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(
                f"apply_fn must return one example's output of shape (O,) or (), got {got}"
            )
        out_dims.append(out.dim())
        return out.reshape(-1)  # (O,)

    def jac(x: Tensor) -> list[Tensor]:
        j = vmap(jacrev(one), in_dims=(None, 0))(params, x)  # leaves (N, O, *p.shape)
        return [leaf.flatten(2) for leaf in optree.tree_leaves(j)]  # (N, O, P_leaf)

    j1 = jac(x1)
    j2 = j1 if x2 is x1 else jac(x2)
    eq = {"full": "naf,mbf->nmab", "trace": "naf,maf->nm", "diagonal": "naf,maf->nma"}[compute]
    out = sum(torch.einsum(eq, a, b) for a, b in zip(j1, j2))
    if out_dims[0] == 0:  # scalar outputs: (N, M) in every mode
        out = out.reshape(x1.shape[0], x2.shape[0])
    return out
