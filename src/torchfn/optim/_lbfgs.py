"""L-BFGS as gradient transformations (``optax.lbfgs``).

    tx = lbfgs()                                   # memory 10, strong-Wolfe zoom search
    state = tx.init(params)
    value, grads = value_and_grad(loss)(params)
    updates, state = tx.update(grads, state, params, value=value, grad=grads,
                               value_fn=loss)
    params = apply_updates(params, updates)

``scale_by_lbfgs`` turns the gradient into ``H g``, ``H`` the inverse-Hessian estimate
of the last ``memory_size`` steps (Byrd, Nocedal & Schnabel's compact form of the
two-loop recursion); a line search (``optim._linesearch``) then picks the step along
``-H g``, calling ``value_fn`` on trial params. Everything is tensors and
``torch.where``: ``vmap`` over a batch of problems runs one L-BFGS per problem, each
with its own memory and steps, where ``torch.optim.LBFGS`` solves one at a time.

The memory keeps a pair ``(s, y)`` only when its curvature ``s.y`` is positive: the
zoom search's Wolfe conditions guarantee it, a backtracking search does not.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from torchfn.optim._base import GradientTransformation, chain, check_state, new_count
from torchfn.optim._elementary import scale
from torchfn.optim._linesearch import scale_by_zoom_linesearch
from torchfn.optim._tree import check_params

__all__ = ["LbfgsState", "scale_by_lbfgs", "lbfgs"]


class LbfgsState(NamedTuple):
    count: Tensor  # () int32, updates so far
    stored: Tensor  # () int32, pairs stored so far (the memory's write position)
    params: Tensor  # (n,) the params of the last update, flattened
    grads: Tensor  # (n,) the gradient of the last update, flattened
    diff_params: Tensor  # (m, n) s_i = x_{i+1} - x_i, a ring buffer
    diff_grads: Tensor  # (m, n) y_i = g_{i+1} - g_i
    gamma: Tensor  # () the initial inverse-Hessian scale s.y / y.y of the newest pair


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


def lbfgs(learning_rate: float | None = None, memory_size: int = 10,
          scale_init_precond: bool = True,
          linesearch: GradientTransformation | None = None) -> GradientTransformation:
    """L-BFGS (``optax.lbfgs``): ``scale_by_lbfgs``, then a step along ``-H g``.

    With ``learning_rate=None`` (the default) the step comes from ``linesearch``
    (default :func:`scale_by_zoom_linesearch`, the strong Wolfe conditions, as optax's
    and torch's "strong_wolfe"), and ``update`` needs the
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
        step = chain(scale(-1.0), linesearch or scale_by_zoom_linesearch())
    return chain(scale_by_lbfgs(memory_size, scale_init_precond), step)
