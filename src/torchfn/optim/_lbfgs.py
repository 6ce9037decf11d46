"""L-BFGS as gradient transformations (``optax.lbfgs``), with a backtracking line search.

    tx = lbfgs()                                   # memory 10, Armijo backtracking
    state = tx.init(params)
    value, grads = value_and_grad(loss)(params)
    updates, state = tx.update(grads, state, params, value=value, value_fn=loss)
    params = apply_updates(params, updates)

``scale_by_lbfgs`` turns the gradient into ``H g``, ``H`` the inverse-Hessian estimate
of the last ``memory_size`` steps (the two-loop recursion, Nocedal & Wright Alg. 7.4);
``scale_by_backtracking_linesearch`` then picks the step along ``-H g`` by the Armijo
condition, calling ``value_fn`` on trial params. Everything is tensors and
``torch.where``: ``vmap`` over a batch of problems runs one L-BFGS per problem, each
with its own memory and steps, where ``torch.optim.LBFGS`` solves one at a time.

The memory keeps a pair ``(s, y)`` only when its curvature ``s.y`` is positive (a
backtracking search does not enforce the Wolfe curvature condition, which keeps ``H``
positive definite; optax's zoom search does, and stores every pair).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from torchfn.core._lanes import all_lanes
from torchfn.optim._base import GradientTransformation, chain, check_state, new_count
from torchfn.optim._elementary import scale
from torchfn.optim._tree import check_params

__all__ = ["LbfgsState", "BacktrackingState", "scale_by_lbfgs",
           "scale_by_backtracking_linesearch", "value_and_grad_from_state", "lbfgs"]


class LbfgsState(NamedTuple):
    count: Tensor  # () int32, updates so far
    stored: Tensor  # () int32, pairs stored so far (the memory's write position)
    params: Tensor  # (n,) the params of the last update, flattened
    grads: Tensor  # (n,) the gradient of the last update, flattened
    diff_params: Tensor  # (m, n) s_i = x_{i+1} - x_i, a ring buffer
    diff_grads: Tensor  # (m, n) y_i = g_{i+1} - g_i
    gamma: Tensor  # () the initial inverse-Hessian scale s.y / y.y of the newest pair


def _dot(a: list[Tensor], b: list[Tensor]) -> Tensor:
    return sum((x * y).sum() for x, y in zip(a, b))


def _flat(leaves: list[Tensor], dtype: torch.dtype) -> Tensor:
    return torch.cat([x.reshape(-1).to(dtype) for x in leaves])


def _unflat(vec: Tensor, like: list[Tensor]) -> list[Tensor]:
    out, start = [], 0
    for x in like:
        out.append(vec[start:start + x.numel()].reshape(x.shape).to(x.dtype))
        start += x.numel()
    return out


def _inverse_hessian_times(g: Tensor, S: Tensor, Y: Tensor, filled: Tensor,
                           gamma: Tensor) -> Tensor:
    """``H g`` in Byrd, Nocedal & Schnabel's compact form (1994, eq. 3.13): the
    two-loop recursion's product in a fixed number of matrix ops, not 4m small ones.
    S, Y: (m, n), oldest pair first; ``filled`` (m,) marks real pairs (the others are
    zero and drop out: their diagonal in R is set to 1)."""
    SY = S @ Y.T  # (m, m): s_i . y_j
    R = torch.triu(SY) + torch.diag((~filled).to(SY.dtype))  # upper triangle of S^T Y
    D = torch.diagonal(SY)  # s_i . y_i
    Sg, Yg = S @ g, Y @ g  # (m,) each
    # H g = gamma g + S^T a + gamma Y^T b, with (N&W 7.24 / BNS 3.13)
    #   p = R^-1 S g;  a = R^-T (D + gamma Y Y^T) p - gamma R^-T Y g;  b = -p
    p = torch.linalg.solve_triangular(R, Sg[:, None], upper=True)[:, 0]
    inner = D * p + gamma * (Y @ (Y.T @ p)) - gamma * Yg
    a = torch.linalg.solve_triangular(R.T, inner[:, None], upper=False)[:, 0]
    return gamma * g + S.T @ a - gamma * (Y.T @ p)


def scale_by_lbfgs(memory_size: int = 10, scale_init_precond: bool = True
                   ) -> GradientTransformation:
    """``g -> H g`` with ``H`` the L-BFGS inverse-Hessian estimate (``optax.scale_by_lbfgs``).

    Needs ``params`` (the memory is of parameter differences). Follow it with a step
    size: ``scale(-lr)``, or ``scale(-1)`` and a line search (as :func:`lbfgs` does).
    The memory is kept flat, in the params' first floating dtype: (m, n) for n
    parameters in all.

    Args:
        memory_size: the number ``m`` of past pairs kept.
        scale_init_precond: start from ``gamma I`` with ``gamma = s.y / y.y`` of the
            newest pair (Nocedal & Wright 7.20); else from ``I``. Before the first
            pair, ``H = min(1, 1 / |g|_1) I``, as ``torch.optim.LBFGS``'s first step
            (optax starts from ``I``).

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.scale_by_lbfgs(memory_size=3)
        >>> p = {"w": torch.ones(2)}
        >>> u, s = tx.update({"w": torch.tensor([1.0, 2.0])}, tx.init(p), p)
        >>> u["w"]                          # the first step: H = min(1, 1 / |g|_1) I
        tensor([0.3333, 0.6667])
    """
    if isinstance(memory_size, bool) or not isinstance(memory_size, int) or memory_size < 1:
        raise ValueError(f"scale_by_lbfgs: memory_size must be an int >= 1, got "
                         f"{memory_size!r}")
    m = memory_size

    def init(params: Any) -> LbfgsState:
        leaves = optree.tree_leaves(params)
        like = leaves[0] if leaves else torch.zeros(())
        n = sum(x.numel() for x in leaves)
        zeros = torch.zeros(n, dtype=like.dtype, device=like.device)
        memory = torch.zeros((m, n), dtype=like.dtype, device=like.device)
        return LbfgsState(new_count(leaves), new_count(leaves), zeros, zeros.clone(), memory,
                          memory.clone(), torch.ones((), dtype=like.dtype, device=like.device))

    def update(grads: Any, state: LbfgsState, params: Any = None, *, inplace: Any = None,
               **extra: Any):
        check_state(state, LbfgsState, "scale_by_lbfgs")
        g_leaves, spec = optree.tree_flatten(grads)
        p_leaves = check_params(params, spec, "scale_by_lbfgs")
        dtype = state.gamma.dtype
        g, p = _flat(g_leaves, dtype), _flat(p_leaves, dtype)  # (n,) each
        s, y = p - state.params, g - state.grads
        sy, yy, ss = s @ y, y @ y, s @ s
        # keep the pair if it has positive curvature (not on the first update: no pair)
        keep = (state.count > 0) & (sy > 1e-10 * torch.sqrt(ss * yy))
        slot = state.stored % m
        write = ((torch.arange(m, device=slot.device) == slot) & keep)[:, None]  # (m, 1)
        S = torch.where(write, s, state.diff_params)  # (m, n)
        Y = torch.where(write, y, state.diff_grads)
        stored = state.stored + keep.to(state.stored.dtype)
        gamma = torch.where(keep, sy / torch.where(keep, yy, torch.ones_like(yy)), state.gamma)
        # no pair yet: torch.optim.LBFGS's first step, H = min(1, 1 / |g|_1) I, so that
        # a line search starting at 1 does not leap far off on a steep start
        first = torch.clamp(1.0 / g.abs().sum(), max=1.0)
        gamma = torch.where(stored == 0, first, gamma)
        scale0 = gamma if scale_init_precond else torch.where(stored == 0, first, 1.0)
        # the ring buffer, oldest pair first; slots not yet written are zero
        age = (torch.arange(m, device=slot.device) + stored) % m  # (m,)
        filled = torch.arange(m, device=slot.device) >= m - torch.clamp(stored, max=m)
        r = _inverse_hessian_times(g, S[age], Y[age], filled, scale0)
        new = LbfgsState(state.count + 1, stored, p, g, S, Y, gamma)
        return optree.tree_unflatten(spec, _unflat(r, g_leaves)), new

    return GradientTransformation(init, update)


class BacktrackingState(NamedTuple):
    learning_rate: Tensor  # () the last accepted step size
    evaluations: Tensor  # () int32, value_fn calls so far
    value: Tensor  # () f at the accepted point (with store_grad; nan before the first)
    grad: Any  # its gradient, the params' structure (with store_grad; else ())


def scale_by_backtracking_linesearch(
    max_backtracking_steps: int = 15,
    slope_rtol: float = 1e-4,
    decrease_factor: float = 0.8,
    increase_factor: float = 1.5,
    max_learning_rate: float = 1.0,
    store_grad: bool = False,
) -> GradientTransformation:
    """Scale a descent direction ``d`` (the incoming updates) by the first step size
    ``t`` that satisfies Armijo's condition ``f(x + t d) <= f(x) + slope_rtol t <g, d>``
    (``optax.scale_by_backtracking_linesearch``).

    The search starts at ``min(increase_factor * t_prev, max_learning_rate)`` and
    multiplies by ``decrease_factor`` until the condition holds, at most
    ``max_backtracking_steps`` times (it then takes the last, smallest, step). Its
    ``update`` needs the keywords ``value=f(x)``, ``grad=g`` (the gradient at ``x``:
    the incoming updates are the direction, which an earlier transform made) and
    ``value_fn=f``; ``chain`` passes them on. Under ``vmap`` the search stops when
    every problem has accepted; each keeps its own step.

    With ``store_grad=True`` each trial computes the gradient too, and the state keeps
    the accepted point's value and gradient: :func:`value_and_grad_from_state` then
    hands them to the next iteration instead of computing them again (optax's
    ``store_grad``), one forward and backward per iteration when the first trial is
    accepted, where a value-only search costs two forwards and a backward.

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> f = lambda p: (p["w"] ** 2).sum()
        >>> p = {"w": torch.tensor([3.0])}
        >>> tx = optim.scale_by_backtracking_linesearch()
        >>> g = {"w": 2 * p["w"]}
        >>> u, s = tx.update({"w": -g["w"]}, tx.init(p), p, value=f(p), grad=g, value_fn=f)
        >>> float(f(optim.apply_updates(p, u))) < float(f(p))
        True
    """
    for name, v, ok in (("max_backtracking_steps", max_backtracking_steps,
                         isinstance(max_backtracking_steps, int) and max_backtracking_steps >= 1),
                        ("slope_rtol", slope_rtol, 0 <= slope_rtol < 1),
                        ("decrease_factor", decrease_factor, 0 < decrease_factor < 1),
                        ("increase_factor", increase_factor, increase_factor >= 1),
                        ("max_learning_rate", max_learning_rate, max_learning_rate > 0)):
        if not ok or isinstance(v, bool):
            raise ValueError(f"scale_by_backtracking_linesearch: {name} is out of range, "
                             f"got {v!r}")

    def init(params: Any) -> BacktrackingState:
        leaves, spec = optree.tree_flatten(params)
        like = leaves[0] if leaves else torch.zeros(())
        # the first search starts at max_learning_rate
        t0 = torch.full((), max_learning_rate / increase_factor, dtype=like.dtype,
                        device=like.device)
        nan = torch.full((), float("nan"), dtype=like.dtype, device=like.device)
        grad = optree.tree_unflatten(spec, [torch.zeros_like(x) for x in leaves])
        return BacktrackingState(t0, new_count(leaves), nan, grad if store_grad else ())

    def update(updates: Any, state: BacktrackingState, params: Any = None, *,
               inplace: Any = None, value: Tensor | None = None, grad: Any = None,
               value_fn: Callable[[Any], Tensor] | None = None, **extra: Any):
        check_state(state, BacktrackingState, "scale_by_backtracking_linesearch")
        if value is None or value_fn is None or grad is None:
            missing = [n for n, v in (("value", value), ("grad", grad), ("value_fn", value_fn))
                       if v is None]
            raise ValueError(
                "scale_by_backtracking_linesearch: update needs value=f(params), "
                f"grad=df/dparams and value_fn=f as keywords; missing {missing}")
        d, spec = optree.tree_flatten(updates)
        p = check_params(params, spec, "scale_by_backtracking_linesearch")
        slope = _dot(optree.tree_leaves(grad), d)  # <g, d> < 0 for a descent direction
        t = torch.clamp(state.learning_rate * increase_factor, max=max_learning_rate)
        accepted = torch.zeros((), dtype=torch.bool, device=t.device)
        chosen, f_chosen, g_chosen = t, value, None
        evaluations = state.evaluations
        for _ in range(max_backtracking_steps):
            trial = optree.tree_unflatten(spec, [x + t * dx for x, dx in zip(p, d)])
            if store_grad:
                g_t, f_t = torch.func.grad_and_value(value_fn)(trial)
            else:
                f_t = value_fn(trial)
            evaluations = evaluations + 1
            ok = ~accepted & torch.isfinite(f_t) & (f_t <= value + slope_rtol * t * slope)
            take = ok | ~accepted  # accepted now, or still the last tried
            chosen = torch.where(take, t, chosen)
            f_chosen = torch.where(take, f_t, f_chosen)
            if store_grad:
                g_t = optree.tree_leaves(g_t)
                g_chosen = g_t if g_chosen is None else [
                    torch.where(take, a, b) for a, b in zip(g_t, g_chosen)]
            accepted = accepted | ok
            if all_lanes(accepted):
                break
            t = t * decrease_factor
        out = [chosen * dx for dx in d]
        stored = optree.tree_unflatten(spec, g_chosen) if store_grad else ()
        new = BacktrackingState(chosen, evaluations, f_chosen if store_grad else state.value,
                                stored)
        return optree.tree_unflatten(spec, out), new

    return GradientTransformation(init, update)


def value_and_grad_from_state(value_fn: Callable[[Any], Tensor]
                              ) -> Callable[..., tuple[Tensor, Any]]:
    """``(params, *, state) -> (value, grad)``: what a ``store_grad`` line search in
    ``state`` (an optimizer state, searched for its ``BacktrackingState``) computed at
    ``params``, or ``torch.func.grad_and_value(value_fn)(params)`` before its first
    step (``optax.value_and_grad_from_state``).

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> f = lambda p: ((p["x"] - 1.0) ** 2).sum()
        >>> tx = optim.lbfgs(linesearch=optim.scale_by_backtracking_linesearch(store_grad=True))
        >>> value_and_grad = optim.value_and_grad_from_state(f)
        >>> p = {"x": torch.zeros(3)}
        >>> state = tx.init(p)
        >>> for _ in range(5):
        ...     value, g = value_and_grad(p, state=state)
        ...     u, state = tx.update(g, state, p, value=value, grad=g, value_fn=f)
        ...     p = optim.apply_updates(p, u)
        >>> float(f(p)) < 1e-10
        True
    """
    grad_and_value = torch.func.grad_and_value(value_fn)

    def value_and_grad(params: Any, *, state: Any) -> tuple[Tensor, Any]:
        found = [s for s in optree.tree_leaves(state, is_leaf=_is_search,
                                               none_is_leaf=True) if _is_search(s)]
        if len(found) != 1 or isinstance(found[0].grad, tuple):
            raise ValueError("value_and_grad_from_state: state must hold one line search "
                             "made with store_grad=True")
        search = found[0]
        if all_lanes(~torch.isnan(search.value)):  # the search has stepped: reuse
            return search.value, search.grad
        g, v = grad_and_value(params)  # the first step
        return v, g

    return value_and_grad


def _is_search(x: Any) -> bool:
    return isinstance(x, BacktrackingState)


def lbfgs(learning_rate: float | None = None, memory_size: int = 10,
          scale_init_precond: bool = True,
          linesearch: GradientTransformation | None = None) -> GradientTransformation:
    """L-BFGS (``optax.lbfgs``): ``scale_by_lbfgs``, then a step along ``-H g``.

    With ``learning_rate=None`` (the default) the step comes from ``linesearch``
    (default :func:`scale_by_backtracking_linesearch`), and ``update`` needs the
    keywords ``value=f(params)``, ``grad=g`` and ``value_fn=f``; with a learning rate
    the step is ``-learning_rate H g`` and no line search runs.

    Example (a quadratic: L-BFGS finds its minimum in a few steps)::

        >>> import torch
        >>> from torchfn import optim
        >>> A = torch.tensor([[3.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
        >>> b = torch.tensor([1.0, -1.0], dtype=torch.float64)
        >>> f = lambda p: 0.5 * p["x"] @ A @ p["x"] - b @ p["x"]
        >>> p = {"x": torch.zeros(2, dtype=torch.float64)}
        >>> tx = optim.lbfgs()
        >>> state = tx.init(p)
        >>> for _ in range(10):
        ...     value, g = f(p), {"x": A @ p["x"] - b}
        ...     u, state = tx.update(g, state, p, value=value, grad=g, value_fn=f)
        ...     p = optim.apply_updates(p, u)
        >>> torch.allclose(p["x"], torch.linalg.solve(A, b))
        True
    """
    if learning_rate is not None:
        if linesearch is not None:
            raise ValueError("lbfgs: give learning_rate or linesearch, not both")
        step = scale(-learning_rate)
    else:
        step = chain(scale(-1.0), linesearch or scale_by_backtracking_linesearch())
    return chain(scale_by_lbfgs(memory_size, scale_init_precond), step)
