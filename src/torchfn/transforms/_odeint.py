"""``odeint``: adaptive Dormand-Prince (or a fixed grid) with adjoint gradients
(``jax.experimental.ode.odeint``).

``ys = odeint(func, y0, t, *args)`` integrates ``dy/dt = func(y, t, *args)`` and
returns ``y`` at every time in ``t`` (``ys[0] = y0``). Derivatives come from their
own equations, not from backpropagating through the steps, so memory does not grow
with the number of steps:

- reverse mode (``grad``, ``vmap(grad)``, ``jacrev``) solves the adjoint equations
  backwards, ``da/dt = -a^T df/dy``, ``dargs/dt = -a^T df/dargs`` (Pontryagin; the
  neural-ODE adjoint), adding each output time's cotangent as it passes it;
- forward mode (``jvp``, ``jacfwd``) solves the sensitivity equations forwards,
  ``dty/dt = df/dy ty + df/dargs targs``, beside ``y``.

Both run the same adaptive solver on the augmented state. Under ``vmap`` every example
keeps its own step size and step count: the loop runs until every lane has reached
the last time, finished lanes unchanged (JAX's batched ``while_loop``). A PyTorch loop
that branches on the error norm cannot run under ``vmap`` at all.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree

from torchfn.core._lanes import all_lanes, lanes
from torchfn.core.custom_vjp import custom_vjp

__all__ = ["odeint"]

# Dormand and Prince (1980), RK5(4)7M: nodes, stage weights, the 5th-order solution and
# the 4th-order error estimate (b5 - b4)
_C = (0.0, 1 / 5, 3 / 10, 4 / 5, 8 / 9, 1.0, 1.0)
_A = (
    (),
    (1 / 5,),
    (3 / 40, 9 / 40),
    (44 / 45, -56 / 15, 32 / 9),
    (19372 / 6561, -25360 / 2187, 64448 / 6561, -212 / 729),
    (9017 / 3168, -355 / 33, 46732 / 5247, 49 / 176, -5103 / 18656),
    (35 / 384, 0.0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84),
)
_B5 = (35 / 384, 0.0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84, 0.0)
_B4 = (5179 / 57600, 0.0, 7571 / 16695, 393 / 640, -92097 / 339200, 187 / 2100, 1 / 40)
_E = tuple(b5 - b4 for b5, b4 in zip(_B5, _B4))


class _Options(NamedTuple):
    rtol: float
    atol: float
    mxstep: int
    method: str = "dopri5"
    step_size: float | None = None


# fixed-grid Runge-Kutta methods: (nodes c, stage matrix a, weights b), Butcher's tableau
_FIXED = {
    "euler": ((0.0,), ((),), (1.0,)),
    "midpoint": ((0.0, 0.5), ((), (0.5,)), (0.0, 1.0)),
    "heun": ((0.0, 1.0), ((), (1.0,)), (0.5, 0.5)),
    "rk4": ((0.0, 0.5, 0.5, 1.0), ((), (0.5,), (0.0, 0.5), (0.0, 0.0, 1.0)),
            (1 / 6, 1 / 3, 1 / 3, 1 / 6)),
}
_METHODS = ("dopri5", *_FIXED)


def odeint(func: Callable[..., Any], y0: Any, t: torch.Tensor, *args: Any,
           rtol: float | None = None, atol: float | None = None,
           mxstep: int = 10_000, method: str = "dopri5",
           step_size: float | None = None) -> Any:
    """Integrate ``dy/dt = func(y, t, *args)`` from ``y0`` at ``t[0]``; ``y`` at each ``t``.

    Args:
        func: ``func(y, t, *args) -> dy/dt``, pure, with ``y``'s structure; ``t`` is a
            0-d tensor.
        y0: pytree of floating-point tensors, the state at ``t[0]``.
        t: (T,) strictly increasing times, ``T >= 2`` (``t[0]`` is the start).
        *args: pytrees of tensors ``func`` reads (parameters); they are differentiated.
        rtol, atol: the error tolerance per step, ``atol + rtol * |y|`` per component
            (RMS norm). Defaults: JAX's 1.4e-8 for float64, 1e-6 and 1e-9 otherwise.
        mxstep: steps per interval between output times at most; past it
            ``odeint`` raises (a stiff problem, or tolerances beyond the dtype).
        method: ``"dopri5"`` (adaptive, the default), or a fixed grid as torchdiffeq's
            fixed-grid methods: ``"euler"``, ``"midpoint"``, ``"heun"`` (order 2) or
            ``"rk4"`` (the classical one; torchdiffeq's ``"rk4"`` is the 3/8 rule).
            A fixed grid ignores ``rtol``, ``atol`` and ``mxstep``: its cost is known
            in advance, and its error is not controlled.
        step_size: a fixed grid's step: each interval between output times is cut
            into ``ceil(length / step_size)`` equal steps. None: one step per interval.
            The adjoint and tangent solves use the same grid, backwards and forwards.

    Returns:
        A pytree like ``y0`` whose leaves have a leading T dim: ``ys[i]`` at ``t[i]``.

    Gradients flow to ``y0``, ``t`` and ``args``. Works under ``grad``, ``vmap``
    (per-example step sizes), ``jacrev``, ``jacfwd``, ``jvp``, ``hessian`` and
    ``torch.compile`` (the solve runs eagerly there).

    Example (exponential decay, and its gradient in the rate)::

        >>> import torch
        >>> from torchfn import transforms
        >>> t = torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64)
        >>> def decay(y, t, k):                    # y: (2,), k: ()
        ...     return -k * y
        >>> k = torch.tensor(0.5, dtype=torch.float64)
        >>> ys = transforms.odeint(decay, torch.ones(2, dtype=torch.float64), t, k)
        >>> torch.allclose(ys[:, 0], torch.exp(-k * t))
        True
        >>> g = torch.func.grad(lambda k: transforms.odeint(
        ...     decay, torch.ones(2, dtype=torch.float64), t, k)[-1].sum())(k)
        >>> torch.allclose(g, -2 * 2 * torch.exp(-2 * k))  # d/dk of 2 exp(-2k)
        True
    """
    if not callable(func):
        raise TypeError(f"odeint: func must be callable, got {type(func).__name__}")
    leaves = pytree.tree_leaves(y0)
    if not leaves:
        raise ValueError("odeint: y0 has no tensors")
    for path, leaf in pytree.tree_flatten_with_path(y0)[0]:
        if not (isinstance(leaf, torch.Tensor) and leaf.is_floating_point()):
            where = pytree.keystr(path) or "y0"
            got = (f"a tensor of dtype {leaf.dtype}" if isinstance(leaf, torch.Tensor)
                   else type(leaf).__name__)
            raise TypeError(f"odeint: y0 must be a pytree of floating-point tensors, got "
                            f"{got} at {where}")
    dtype = leaves[0].dtype
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] < 2:
        got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"odeint: t must be a 1-d tensor of at least 2 times, got {got}")
    if not torch.compiler.is_compiling() and not bool((lanes(t).diff(dim=-1) > 0).all()):
        raise ValueError("odeint: t must be strictly increasing")
    if not (isinstance(mxstep, int) and mxstep >= 1):
        raise ValueError(f"odeint: mxstep must be a positive int, got {mxstep!r}")
    f64 = dtype == torch.float64
    rtol = (1.4e-8 if f64 else 1e-6) if rtol is None else rtol
    atol = (1.4e-8 if f64 else 1e-9) if atol is None else atol
    for name, v in (("rtol", rtol), ("atol", atol)):
        if not (isinstance(v, (int, float)) and v >= 0):
            raise ValueError(f"odeint: {name} must be a non-negative number, got {v!r}")
    if rtol == 0 and atol == 0:
        raise ValueError("odeint: rtol and atol cannot both be 0")
    if method not in _METHODS:
        raise ValueError(f"odeint: method must be one of {list(_METHODS)}, got {method!r}")
    if step_size is not None:
        if method == "dopri5":
            raise ValueError("odeint: step_size is for the fixed-grid methods "
                             f"{list(_FIXED)}; method='dopri5' chooses its own steps")
        if isinstance(step_size, bool) or not (isinstance(step_size, (int, float))
                                               and step_size > 0):
            raise ValueError(f"odeint: step_size must be a number > 0 or None, got "
                             f"{step_size!r}")
        step_size = float(step_size)
    opts = _Options(float(rtol), float(atol), mxstep, method, step_size)
    return _odeint(func, opts, y0, t.to(dtype), args)


class _FloatArgs:
    """``args``' floating-point tensor leaves, and ``args`` rebuilt around new ones."""

    def __init__(self, args):
        self.leaves, self.spec = pytree.tree_flatten(args)
        self.where = [i for i, a in enumerate(self.leaves) if _is_float(a)]
        self.tensors = [self.leaves[i] for i in self.where]

    def with_(self, tensors) -> Any:
        full = list(self.leaves)
        for i, x in zip(self.where, tensors):
            full[i] = x
        return pytree.tree_unflatten(full, self.spec)

    def tangents(self, t_args) -> list[torch.Tensor]:
        """The float leaves' tangents (zeros where none was given)."""
        given = pytree.tree_leaves(t_args, is_leaf=_none)
        return [torch.zeros_like(self.leaves[i]) if given[i] is None else given[i]
                for i in self.where]

    def cotangent(self, flat: torch.Tensor) -> Any:
        """``args``' structure from one flat vector over the float leaves (None elsewhere)."""
        out: list[Any] = [None] * len(self.leaves)
        start = 0
        for i, a in zip(self.where, self.tensors):
            out[i] = flat[start:start + a.numel()].reshape(a.shape)
            start += a.numel()
        return pytree.tree_unflatten(out, self.spec)


@functools.partial(custom_vjp, nondiff_argnums=(0, 1), traceable_fwd=False)
def _odeint(func, opts: _Options, y0, t, args):
    return _forward(func, opts, y0, t, args)


def _forward(func, opts, y0, t, args):
    leaves, spec = pytree.tree_flatten(y0)

    def f(y, s):
        return _flat_f(func, y, s, args, leaves, spec)

    ys = _solve(f, _ravel(leaves), t, opts, "odeint")  # (T, n)
    return _unravel_time(ys, leaves, spec)


def _fwd(func, opts, y0, t, args):
    ys = _forward(func, opts, y0, t, args)
    return ys, (ys, t, args)  # ys is the output: saved as it


def _bwd(func, opts, res, g):
    ys, t, args = res
    y_leaves, spec = pytree.tree_flatten(ys)
    like = [y[0] for y in y_leaves]  # one time's leaves
    ys_flat = torch.stack([_ravel([y[i] for y in y_leaves]) for i in range(t.shape[0])])
    g_leaves = pytree.tree_leaves(g)
    gs = torch.stack([_ravel([gl[i] for gl in g_leaves]) for i in range(t.shape[0])])
    fargs = _FloatArgs(args)
    n = ys_flat.shape[-1]
    n_args = sum(a.numel() for a in fargs.tensors)
    # record the pullbacks' own ops only if something differentiates this backward
    # (second order): under a single torch.func.grad they would be recorded for nothing
    graph = any(x.requires_grad for x in (ys_flat, gs, t, *fargs.tensors))

    def aug(s, tau):  # the state [y, a_y, a_args] in reversed time tau = -t
        y, a_y = s[:n], s[n:2 * n]

        def f_y_args(y, *tensors):
            return _flat_f(func, y, -tau, fargs.with_(tensors), like, spec)

        fy, pull = torch.func.vjp(f_y_args, y, *fargs.tensors)
        ct = pull(a_y, create_graph=graph)
        parts = [-fy, ct[0]] + [c.reshape(-1) for c in ct[1:]]
        return torch.cat(parts) if n_args else torch.cat(parts[:2])

    def f_at(i):
        return _flat_f(func, ys_flat[i], t[i], args, like, spec)

    # moving an output time t_i (i >= 1) moves ys[i] along the flow: g_i . f(y_i, t_i)
    ct_t = [None] + [(gs[i] * f_at(i)).sum() for i in range(1, t.shape[0])]
    a_y = gs[-1]
    a_args = torch.zeros(n_args, dtype=ys_flat.dtype, device=ys_flat.device)
    for i in range(t.shape[0] - 1, 0, -1):
        s0 = torch.cat([ys_flat[i], a_y, a_args])
        taus = torch.stack([-t[i], -t[i - 1]])
        s1 = _solve(aug, s0, taus, opts, "odeint (the adjoint solve)")[-1]
        a_y = s1[n:2 * n] + (gs[i - 1] if i > 1 else 0)
        a_args = s1[2 * n:]
    # moving t_0 shifts every later output back along the flow; ys[0] = y0 does not move
    ct_t[0] = -(a_y * f_at(0)).sum()
    a_y = a_y + gs[0]
    ct_y0 = pytree.tree_unflatten(_unravel(a_y, like), spec)
    return ct_y0, torch.stack(ct_t), fargs.cotangent(a_args)


def _jvp(func, opts, res, tangents):
    ys, t, args = res
    t_y0, t_t, t_args = tangents
    y_leaves, spec = pytree.tree_flatten(ys)
    like = [y[0] for y in y_leaves]
    y0 = _ravel(like)
    ty0 = _ravel([torch.zeros_like(x) if tx is None else tx
                  for x, tx in zip(like, pytree.tree_leaves(t_y0, is_leaf=_none))])
    ty0_out = ty0  # ys[0] = y0 whatever t_0 is
    if t_t is not None:  # moving t_0 starts the flow later: y shifts back by f(y0, t0) dt0
        ty0 = ty0 - _flat_f(func, y0, t[0], args, like, spec) * t_t[0]
    fargs = _FloatArgs(args)
    arg_tangents = fargs.tangents(t_args)
    n = y0.shape[-1]

    def aug(s, time):  # [y, ty]: dty/dt = df/dy ty + df/dargs targs
        def f_y_args(y, *tensors):
            return _flat_f(func, y, time, fargs.with_(tensors), like, spec)

        fy, tf = torch.func.jvp(f_y_args, (s[:n], *fargs.tensors), (s[n:], *arg_tangents))
        return torch.cat([fy, tf])

    out = _solve(aug, torch.cat([y0, ty0]), t, opts, "odeint (the tangent solve)")  # (T, 2n)
    ty = out[:, n:]
    if t_t is not None:  # moving t_i (i >= 1) moves ys[i] along the flow
        ys_flat = out[:, :n]
        ty = torch.stack([ty0_out] + [ty[i] + _flat_f(func, ys_flat[i], t[i], args, like,
                                                      spec) * t_t[i]
                                      for i in range(1, t.shape[0])])
    return _unravel_time(ty, like, spec)


_odeint.defvjp(_fwd, _bwd, jvp=_jvp)


# -- the adaptive solver on a flat state -----------------------------------------------

@torch._disable_dynamo  # a loop that decides steps from the error: not for a graph
def _solve(f: Callable, y0: torch.Tensor, t: torch.Tensor, opts: _Options,
           who: str) -> torch.Tensor:
    """Dormand-Prince (or a fixed grid) on ``y: (n,)`` from ``t[0]``; returns ``(T, n)``,
    ``y`` at each t."""
    if opts.method != "dopri5":
        out = [y0]
        for i in range(t.shape[0] - 1):
            out.append(_fixed_interval(f, out[-1], t[i], t[i + 1], opts))
        return torch.stack(out)
    out = [y0]
    y = y0
    k1 = f(y0, t[0])  # the slope at the current point, carried from step to step (FSAL)
    h = _initial_step(f, y0, k1, t[0], t[-1], opts)
    for i in range(t.shape[0] - 1):
        y, k1, h = _interval(f, y, k1, t[i], t[i + 1], h, opts, who)
        out.append(y)
    return torch.stack(out)


def _interval(f, y, k1, t0, t1, h, opts: _Options, who: str):
    """Step from t0 to exactly t1; every lane its own step size, done lanes frozen."""
    tc = t0
    done = torch.zeros((), dtype=torch.bool, device=y.device) | (t0 >= t1)
    for _ in range(opts.mxstep):
        if all_lanes(done):
            return y, k1, h
        remaining = (t1 - tc).detach()
        last = h >= remaining
        step = torch.where(last, remaining, h)
        y_new, err, k7 = _dopri_step(f, y, k1, tc, step)
        scale = opts.atol + opts.rtol * torch.maximum(y.abs(), y_new.abs())
        err_norm = torch.sqrt(torch.mean((err / scale) ** 2)).detach()
        accept = (err_norm <= 1) & ~done
        y = torch.where(accept, y_new, y)
        k1 = torch.where(accept, k7, k1)  # the last stage is the slope at y_new
        tc = torch.where(accept, torch.where(last, t1, tc + step), tc)
        # the usual controller: safety 0.9, order 5, growth within [0.2, 10]
        factor = torch.where(err_norm == 0, 10.0,
                             (0.9 * err_norm.clamp_min(1e-30) ** -0.2).clamp(0.2, 10.0))
        h = torch.where(done, h, (step * factor).detach())
        done = done | (accept & last)
    if not all_lanes(done):
        raise RuntimeError(
            f"{who}: mxstep={opts.mxstep} steps did not reach t={float(lanes(t1).max()):g} "
            f"from t={float(lanes(t0).min()):g}; the problem may be stiff, or rtol/atol "
            "too small for the dtype"
        )
    return y, k1, h


def _fixed_interval(f, y, t0, t1, opts: _Options):
    """From t0 to t1 in equal steps of at most ``opts.step_size`` (one step if None)."""
    c, a, b = _FIXED[opts.method]
    length = float(lanes((t1 - t0).detach()).abs().max())
    n = 1 if opts.step_size is None else max(1, math.ceil(length / opts.step_size - 1e-9))
    h = (t1 - t0) / n
    for j in range(n):
        k = _stages(f, y, t0 + j * h, h, c, a, [])
        y = y + h * sum(bi * ki for bi, ki in zip(b, k) if bi)
    return y


def _stages(f, y, t, h, c, a, k: list[torch.Tensor]) -> list[torch.Tensor]:
    """A Runge-Kutta step's stages after the ``len(k)`` given: ``k_i = f(y + h sum_j
    a_ij k_j, t + c_i h)`` for the tableau's rows ``c``, ``a``."""
    for ci, ai in zip(c[len(k):], a[len(k):]):
        yi = y
        for aij, kj in zip(ai, k):
            if aij:
                yi = yi + (h * aij) * kj
        k.append(f(yi, t + ci * h))
    return k


def _dopri_step(f, y, k1, t, h):
    """One Dormand-Prince step from the slope ``k1 = f(y, t)``: the 5th-order solution,
    the error estimate and the last stage, ``f(y_new, t + h)``."""
    k = _stages(f, y, t, h, _C, _A, [k1])
    y_new = y + h * sum(b * kj for b, kj in zip(_B5, k) if b)
    err = h * sum(e * kj for e, kj in zip(_E, k) if e)
    return y_new, err, k[-1]


def _initial_step(f, y0, f0, t0, t1, opts: _Options) -> torch.Tensor:
    """Hairer, Norsett and Wanner's starting step (II.4), per lane, at most t1 - t0."""
    scale = opts.atol + opts.rtol * y0.abs()
    d0 = torch.sqrt(torch.mean((y0 / scale) ** 2))
    d1 = torch.sqrt(torch.mean((f0 / scale) ** 2))
    h0 = torch.where((d0 < 1e-5) | (d1 < 1e-5), 1e-6, 0.01 * d0 / d1.clamp_min(1e-30))
    h0 = torch.minimum(h0, t1 - t0)
    f1 = f(y0 + h0 * f0, t0 + h0)
    d2 = torch.sqrt(torch.mean(((f1 - f0) / scale) ** 2)) / h0
    big = torch.maximum(d1, d2)
    h1 = torch.where(big <= 1e-15, torch.clamp_min(h0 * 1e-3, 1e-6),
                     (0.01 / big.clamp_min(1e-30)) ** 0.2)
    return torch.minimum(torch.minimum(100 * h0, h1), t1 - t0).detach()


# -- pytrees <-> flat vectors ----------------------------------------------------------

def _flat_f(func, y, t, args, like, spec):
    if spec.is_leaf():  # y is one tensor: no pytree work on the hot path
        out = func(y.reshape(like[0].shape), t, *args)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"odeint: func must return y's structure (a tensor), got "
                            f"{type(out).__name__}")
        if out.shape != like[0].shape:
            raise ValueError(f"odeint: func's leaf 0 is {tuple(out.shape)}; y's is "
                             f"{tuple(like[0].shape)}")
        return out.reshape(-1).to(y.dtype)
    out = func(pytree.tree_unflatten(_unravel(y, like), spec), t, *args)
    leaves, out_spec = pytree.tree_flatten(out)
    if out_spec != spec:
        raise TypeError(f"odeint: func must return y's structure {spec}, got {out_spec}")
    for i, (a, b) in enumerate(zip(leaves, like)):
        if not isinstance(a, torch.Tensor) or a.shape != b.shape:
            got = tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__
            raise ValueError(f"odeint: func's leaf {i} is {got}; y's is {tuple(b.shape)}")
    return _ravel(leaves).to(y.dtype)


def _ravel(leaves) -> torch.Tensor:
    return torch.cat([x.reshape(-1) for x in leaves])


def _unravel(vec: torch.Tensor, like) -> list[torch.Tensor]:
    out, start = [], 0
    for x in like:
        out.append(vec[start:start + x.numel()].reshape(x.shape))
        start += x.numel()
    return out


def _unravel_time(ys: torch.Tensor, like, spec):
    """(T, n) -> the pytree with a leading T dim on each leaf."""
    out, start = [], 0
    for x in like:
        m = x.numel()
        out.append(ys[:, start:start + m].reshape(ys.shape[0], *x.shape))
        start += m
    return pytree.tree_unflatten(out, spec)


def _is_float(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _none(x: Any) -> bool:
    return x is None
