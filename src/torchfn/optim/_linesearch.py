"""Line searches as gradient transformations (optax's), and the reuse of their work.

A line search scales the incoming updates, a descent direction ``d``, by a step size
``t`` it finds by calling ``value_fn`` on trial params ``x + t d``; its ``update``
takes optax's extra keywords ``value=f(x)``, ``grad=g(x)`` and ``value_fn=f``, which
``chain`` passes on. Both searches are tensors and ``torch.where``: under ``vmap``
each problem keeps its own step, and the loop stops when every problem has accepted.

- ``scale_by_backtracking_linesearch``: Armijo's sufficient decrease, by shrinking.
- ``scale_by_zoom_linesearch``: the strong Wolfe conditions (sufficient decrease and
  a flat enough slope), by bracketing and cubic interpolation (Nocedal & Wright,
  Algorithms 3.5 and 3.6), as ``optax.scale_by_zoom_linesearch`` and
  ``torch.optim.LBFGS(line_search_fn="strong_wolfe")``. The curvature condition keeps
  quasi-Newton updates positive definite.
- ``value_and_grad_from_state``: the value and gradient the last search computed at
  the params it chose, for the next iteration.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from torchfn.core._lanes import all_lanes
from torchfn.optim._base import GradientTransformation, check_state, new_count
from torchfn.optim._tree import check_params

__all__ = ["LineSearchState", "scale_by_backtracking_linesearch", "scale_by_zoom_linesearch",
           "value_and_grad_from_state"]


def _dot(a: list[Tensor], b: list[Tensor]) -> Tensor:
    return sum((x * y).sum() for x, y in zip(a, b))


def _need_extra(who: str, value, grad, value_fn) -> None:
    if value is None or value_fn is None or grad is None:
        missing = [n for n, v in (("value", value), ("grad", grad), ("value_fn", value_fn))
                   if v is None]
        raise ValueError(f"{who}: update needs value=f(params), grad=df/dparams and "
                         f"value_fn=f as keywords; missing {missing}")


class LineSearchState(NamedTuple):
    learning_rate: Tensor  # () the last accepted step size
    evaluations: Tensor  # () int32, value_fn calls so far
    value: Tensor  # () f at the accepted point (nan before the first search)
    grad: Any  # its gradient, the params' structure (() when not kept)


def _check_ranges(who: str, checks: tuple) -> None:
    for name, v, ok in checks:
        if not ok or isinstance(v, bool):
            raise ValueError(f"{who}: {name} is out of range, got {v!r}")


def _init_state(params: Any, t0: float, keep_grad: bool) -> LineSearchState:
    leaves, spec = optree.tree_flatten(params)
    like = leaves[0] if leaves else torch.zeros(())
    full = functools.partial(torch.full, (), dtype=like.dtype, device=like.device)
    grad = optree.tree_unflatten(spec, [torch.zeros_like(x) for x in leaves])
    return LineSearchState(full(t0), new_count(leaves), full(float("nan")),
                           grad if keep_grad else ())


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
    _check_ranges("scale_by_backtracking_linesearch", (
        ("max_backtracking_steps", max_backtracking_steps,
         isinstance(max_backtracking_steps, int) and max_backtracking_steps >= 1),
        ("slope_rtol", slope_rtol, 0 <= slope_rtol < 1),
        ("decrease_factor", decrease_factor, 0 < decrease_factor < 1),
        ("increase_factor", increase_factor, increase_factor >= 1),
        ("max_learning_rate", max_learning_rate, max_learning_rate > 0)))

    def init(params: Any) -> LineSearchState:
        # the first search starts at max_learning_rate
        return _init_state(params, max_learning_rate / increase_factor, store_grad)

    def update(updates: Any, state: LineSearchState, params: Any = None, *,
               inplace: Any = None, value: Tensor | None = None, grad: Any = None,
               value_fn: Callable[[Any], Tensor] | None = None, **extra: Any):
        check_state(state, LineSearchState, "scale_by_backtracking_linesearch")
        _need_extra("scale_by_backtracking_linesearch", value, grad, value_fn)
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
        new = LineSearchState(chosen, evaluations, f_chosen if store_grad else state.value,
                              stored)
        return optree.tree_unflatten(spec, out), new

    return GradientTransformation(init, update)


def _select(cases: list[tuple[Tensor, tuple]], default: tuple) -> tuple:
    """Per lane, the first case's triple whose mask holds, else ``default``."""
    out = default
    for mask, value in reversed(cases):
        out = tuple(torch.where(mask, v, o) for v, o in zip(value, out))
    return out


def _cubic_min(a: Tensor, fa: Tensor, da: Tensor, b: Tensor, fb: Tensor, db: Tensor
               ) -> Tensor:
    """The minimiser of the cubic through (a, fa, da) and (b, fb, db) (N&W 3.59),
    kept inside the middle 80% of [a, b]; bisection where the cubic has none."""
    d1 = da + db - 3 * (fa - fb) / (a - b)
    disc = d1 * d1 - da * db
    d2 = torch.sign(b - a) * torch.sqrt(torch.clamp(disc, min=0))
    t = b - (b - a) * (db + d2 - d1) / (db - da + 2 * d2)
    lo, hi = torch.minimum(a, b), torch.maximum(a, b)
    margin = 0.1 * (hi - lo)
    ok = (disc >= 0) & torch.isfinite(t) & (t >= lo + margin) & (t <= hi - margin)
    return torch.where(ok, t, (a + b) / 2)


def scale_by_zoom_linesearch(
    max_linesearch_steps: int = 20,
    slope_rtol: float = 1e-4,
    curv_rtol: float = 0.9,
    initial_guess: float = 1.0,
    max_learning_rate: float = 1e3,
) -> GradientTransformation:
    """Scale a descent direction ``d`` by a step ``t`` that satisfies the strong Wolfe
    conditions, ``f(x + t d) <= f(x) + slope_rtol t <g, d>`` and ``|<g(x + t d), d>| <=
    curv_rtol |<g, d>|`` (``optax.scale_by_zoom_linesearch``; torch's "strong_wolfe").

    Each search starts at ``initial_guess`` (1 suits quasi-Newton directions), doubles
    the step while the function keeps decreasing with a negative slope (up to
    ``max_learning_rate``), and zooms into the bracket it finds by safeguarded cubic
    interpolation. Every trial computes the value and the gradient; the state keeps
    both at the accepted point, for :func:`value_and_grad_from_state`. After
    ``max_linesearch_steps`` trials without success it takes the best point with
    sufficient decrease found, or the last trial.

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> f = lambda p: (p["w"] ** 4).sum()
        >>> p = {"w": torch.tensor([1.0], dtype=torch.float64)}
        >>> g = {"w": 4 * p["w"] ** 3}
        >>> tx = optim.scale_by_zoom_linesearch()
        >>> u, s = tx.update({"w": -g["w"]}, tx.init(p), p, value=f(p), grad=g, value_fn=f)
        >>> new = optim.apply_updates(p, u)
        >>> bool(f(new) < f(p)) and bool(abs(4 * new["w"] ** 3 * g["w"]) <= 0.9 * g["w"] ** 2)
        True
    """
    _check_ranges("scale_by_zoom_linesearch", (
        ("max_linesearch_steps", max_linesearch_steps,
         isinstance(max_linesearch_steps, int) and max_linesearch_steps >= 1),
        ("slope_rtol", slope_rtol, 0 < slope_rtol < 1),
        ("curv_rtol", curv_rtol, slope_rtol < curv_rtol < 1),
        ("initial_guess", initial_guess, initial_guess > 0),
        ("max_learning_rate", max_learning_rate, max_learning_rate >= initial_guess)))
    grad_and_value = torch.func.grad_and_value

    def init(params: Any) -> LineSearchState:
        return _init_state(params, initial_guess, keep_grad=True)

    def update(updates: Any, state: LineSearchState, params: Any = None, *, inplace: Any = None,
               value: Tensor | None = None, grad: Any = None,
               value_fn: Callable[[Any], Tensor] | None = None, **extra: Any):
        check_state(state, LineSearchState, "scale_by_zoom_linesearch")
        _need_extra("scale_by_zoom_linesearch", value, grad, value_fn)
        d, spec = optree.tree_flatten(updates)
        p = check_params(params, spec, "scale_by_zoom_linesearch")
        f0 = value
        s0 = _dot(optree.tree_leaves(grad), d)  # phi'(0) < 0 for a descent direction

        def phi(t):  # (f, slope, grad leaves) at x + t d
            g_t, f_t = grad_and_value(value_fn)(
                optree.tree_unflatten(spec, [x + t * dx for x, dx in zip(p, d)]))
            g_t = optree.tree_leaves(g_t)
            return f_t, _dot(g_t, d), g_t

        t = torch.full_like(f0, initial_guess)
        zero = torch.zeros_like(f0)
        prev = (zero, f0, s0)  # the last bracketing trial (t, f, slope): 0 at first
        lo = hi = (zero, f0, s0)  # the zoom bracket; lo has the lower f
        zooming = torch.zeros((), dtype=torch.bool, device=f0.device)
        done = torch.zeros_like(zooming)
        best_t, best_f, best_g = t, f0, None  # the accepted point, or the fallback
        evaluations = state.evaluations
        for i in range(max_linesearch_steps):
            f_t, s_t, g_t = phi(t)
            trial = (t, f_t, s_t)
            evaluations = evaluations + 1
            armijo = f_t <= f0 + slope_rtol * t * s0
            flat = s_t.abs() <= -curv_rtol * s0
            bracketing = ~zooming & ~done
            # Alg. 3.5: a bracket [prev, t] (A) or [t, prev] (C), accept (B), or go on (D)
            a = bracketing & (~armijo | ((i > 0) & (f_t >= prev[1])))
            b = bracketing & ~a & flat
            c = bracketing & ~a & ~b & (s_t >= 0)
            d_ = bracketing & ~a & ~b & ~c
            # Alg. 3.6: the trial replaces hi (E), is accepted (F), or replaces lo (G,
            # and hi takes the old lo when the slope points away from hi)
            zoom_now = zooming & ~done
            e = zoom_now & (~armijo | (f_t >= lo[1]))
            f_ = zoom_now & ~e & flat
            g = zoom_now & ~e & ~f_
            flip = g & (s_t * (hi[0] - lo[0]) >= 0)
            new_lo = _select([(a, prev), (c, trial), (g, trial)], lo)
            new_hi = _select([(a, trial), (c, prev), (e, trial), (flip, lo)], hi)
            accept = b | f_
            # the accepted point; until then the best trial with sufficient decrease
            better = ~done & (accept | (armijo & (f_t < best_f)) | (i == 0))
            best_t, best_f = torch.where(better, t, best_t), torch.where(better, f_t, best_f)
            best_g = g_t if best_g is None else [torch.where(better, u, v)
                                                 for u, v in zip(g_t, best_g)]
            done = done | accept
            zooming = zooming | a | c
            lo, hi = new_lo, new_hi
            prev = _select([(d_, trial)], prev)
            if all_lanes(done):
                break
            t = torch.where(zooming, _cubic_min(*lo, *hi),
                            torch.clamp(2 * t, max=max_learning_rate))
        # unaccepted: the best point with sufficient decrease, else the first trial
        out = [best_t * dx for dx in d]
        new = LineSearchState(best_t, evaluations, best_f, optree.tree_unflatten(spec, best_g))
        return optree.tree_unflatten(spec, out), new

    return GradientTransformation(init, update)


def value_and_grad_from_state(value_fn: Callable[[Any], Tensor]
                              ) -> Callable[..., tuple[Tensor, Any]]:
    """``(params, *, state) -> (value, grad)``: what a ``store_grad`` line search in
    ``state`` (an optimizer state, searched for its ``LineSearchState``) computed at
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
    return isinstance(x, LineSearchState)


