"""SOAP (Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo using Adam"):
Adam run in the eigenbasis of Shampoo's preconditioner, as the authors' code.

For a matrix leaf ``G`` (m, n), Shampoo's statistics ``L = EMA(G G^T)`` (m, m) and
``R = EMA(G^T G)`` (n, n) have eigenbases ``Q_L``, ``Q_R``. SOAP rotates the gradient
into them, keeps Adam's second moment there, and rotates the step back:

    G' = Q_L^T G Q_R                     v = b2 v + (1 - b2) G'^2
    m = b1 m + (1 - b1) G                 (the momentum stays in the original basis)
    update = -lr sqrt(1 - b2^t) / (1 - b1^t) Q_L ((Q_L^T m Q_R) / (sqrt(v) + eps)) Q_R^T
    p <- (p + update) (1 - lr wd)

A leaf of any rank gets one basis per dimension (up to ``max_precondition_dim``; a
larger dimension, and 1-D leaves unless ``precondition_1d``, keep the identity). The
first call only measures: it fills ``L``, ``R`` from the first gradient and takes their
eigenvectors, and returns a zero update. Every ``precondition_frequency`` steps the
bases are refreshed by one step of power iteration and a QR decomposition, and ``v``
is permuted to follow the re-sorted eigenvalues.

The refresh schedule reads the step counter on the host (one sync per step, as the
authors' code, whose step is a Python int); under ``vmap`` every member's counter must
be the same.
"""

from __future__ import annotations

from itertools import chain
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from torchfn.core._lanes import lanes
from torchfn.optim import _checks, _ops
from torchfn.optim._base import GradientTransformation, check_state, lr_at, new_count
from torchfn.optim._tree import check_params, check_structure

__all__ = ["SOAPState", "soap"]

_NONE = (0,)  # the shape of the empty tensor that stands for "no basis on this dimension"


class SOAPState(NamedTuple):
    count: Tensor  # () int32, calls so far (the first only measures)
    mu: Any  # momentum, in the original basis
    nu: Any  # second moment, in the rotated basis
    gg: Any  # per leaf, a tuple with one (d, d) statistic per dimension (or an empty tensor)
    q: Any  # per leaf, a tuple with one (d, d) eigenbasis per dimension (or an empty tensor)


def _has(mat: Tensor) -> bool:
    return mat.dim() == 2


def _project(x: Tensor, qs: tuple[Tensor, ...], back: bool = False) -> Tensor:
    """``x`` with every dimension rotated into its basis (``back``: out of it)."""
    for q in qs:  # each step contracts dim 0 and appends the result last
        if _has(q):
            x = torch.tensordot(x, q, dims=([0], [1 if back else 0]))
        else:
            x = x.permute(*range(1, x.dim()), 0)
    return x


def _statistics(g: Tensor, gg: tuple[Tensor, ...], beta: float) -> tuple[Tensor, ...]:
    """Each dimension's ``EMA(G_(i) G_(i)^T)``, ``G_(i)`` the unfolding along dim ``i``."""
    out = []
    for i, mat in enumerate(gg):
        if not _has(mat):
            out.append(mat)
            continue
        rest = [*chain(range(i), range(i + 1, g.dim()))]
        outer = torch.tensordot(g, g, dims=(rest, rest))  # (d_i, d_i)
        out.append(torch.lerp(mat, outer.to(mat.dtype), 1 - beta))
    return tuple(out)


def _eigenbases(gg: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """Eigenvectors of each statistic, by decreasing eigenvalue."""
    out = []
    for mat in gg:
        if not _has(mat):
            out.append(mat)
            continue
        eye = torch.eye(mat.shape[0], dtype=mat.dtype, device=mat.device)
        _, vecs = torch.linalg.eigh(mat + 1e-30 * eye)
        out.append(torch.flip(vecs, dims=[1]).contiguous())  # row-major, as a reload
    return tuple(out)


def _refresh(gg: tuple[Tensor, ...], qs: tuple[Tensor, ...], nu: Tensor
             ) -> tuple[tuple[Tensor, ...], Tensor]:
    """One power-iteration step and QR per basis; ``nu`` re-sorted with the eigenvalues."""
    out = []
    for i, (mat, q) in enumerate(zip(gg, qs)):
        if not _has(mat):
            out.append(q)
            continue
        product = mat @ q  # (d, d)
        est = (q * product).sum(dim=0)  # estimated eigenvalues, (d,)
        order = torch.argsort(est, descending=True)
        nu = nu.index_select(i, order)
        new_q, _ = torch.linalg.qr(product.index_select(1, order).to(torch.float32))
        out.append(new_q.to(q.dtype).contiguous())  # LAPACK's Q is column-major
    return tuple(out), nu


def soap(
    lr: Any = 3e-3,
    betas: tuple[Any, Any] = (0.95, 0.95),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    *,
    shampoo_beta: float | None = None,
    precondition_frequency: int = 10,
    max_precondition_dim: int = 10_000,
    precondition_1d: bool = False,
) -> GradientTransformation:
    """SOAP: Adam in the eigenbasis of Shampoo's preconditioner.

    Args:
        lr: learning rate >= 0, a 0-d tensor, or a schedule ``step -> lr``.
        betas: decay rates of the momentum and the (rotated) second moment.
        eps: added to the denominator.
        weight_decay: decoupled, applied after the step (needs params).
        shampoo_beta: decay rate of the statistics ``L``, ``R``; ``None``: ``betas[1]``.
        precondition_frequency: steps between refreshes of the bases.
        max_precondition_dim: dimensions larger than this keep the identity.
        precondition_1d: also rotate 1-D leaves (a full (d, d) statistic each).

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.soap(0.1, weight_decay=0.0)
        >>> p = {"w": torch.tensor([[2.0, 0.0], [0.0, -1.0]])}
        >>> u, s = tx.update(p, tx.init(p), p)        # the first call only measures
        >>> bool((u["w"] == 0).all())
        True
        >>> u, s = tx.update(p, s, p)                 # then Adam's first step, rotated
        >>> round(u["w"].abs().max().item(), 6)      # |Adam's first step| = lr
        0.1
    """
    _checks.lr(lr)
    b1, b2 = _checks.betas(betas)
    _checks.nonneg("eps", eps)
    _checks.nonneg("weight_decay", weight_decay)
    sb = b2 if shampoo_beta is None else shampoo_beta
    _checks.unit_interval("shampoo_beta", sb)
    _checks.positive_int("precondition_frequency", precondition_frequency)
    _checks.positive_int("max_precondition_dim", max_precondition_dim)
    has_wd = not _checks.is_zero(weight_decay)

    def dims(x: Tensor) -> list[int | None]:
        if x.dim() == 1 and not precondition_1d:
            return [None]
        return [d if d <= max_precondition_dim else None for d in x.shape]

    def init(params: Any) -> SOAPState:
        leaves, spec = optree.tree_flatten(params)
        gg, q = [], []
        for x in leaves:
            empty = x.new_zeros(_NONE)
            gg.append(tuple(x.new_zeros(d, d) if d else empty for d in dims(x)))
            q.append(tuple(torch.eye(d, dtype=x.dtype, device=x.device) if d else empty
                           for d in dims(x)))
        zeros = lambda: optree.tree_unflatten(spec, _ops.zeros_like(leaves))  # noqa: E731
        return SOAPState(new_count(leaves), zeros(), zeros(),
                         optree.tree_unflatten(spec, gg), optree.tree_unflatten(spec, q))

    def update(grads: Any, state: SOAPState, params: Any = None, *, inplace: Any = None):
        check_state(state, SOAPState, "soap")
        g, spec = optree.tree_flatten(grads)
        mu = check_structure(state.mu, "optimizer state", grads, "grads")
        nu = optree.tree_leaves(state.nu)
        gg = spec.flatten_up_to(state.gg)
        qs = spec.flatten_up_to(state.q)
        p = check_params(params, spec, "soap with weight_decay") if has_wd else None
        counts = lanes(state.count)
        step = int(counts.flatten()[0])
        if not bool((counts == step).all()):
            raise ValueError("soap: under vmap every member's step count must be the same, got "
                             f"{sorted(set(counts.flatten().tolist()))}")
        count = state.count + 1
        gg = [_statistics(x, s, sb) for x, s in zip(g, gg)]
        if step == 0:  # measure only: the first statistics and their eigenbases
            qs = [_eigenbases(s) for s in gg]
            new_state = SOAPState(count, state.mu, state.nu, optree.tree_unflatten(spec, gg),
                                  optree.tree_unflatten(spec, qs))
            return optree.tree_unflatten(spec, _ops.zeros_like(g)), new_state

        lr_t = lr_at(lr, state.count)
        scale = -lr_t * (1 - b2**step) ** 0.5 / (1 - b1**step)
        mu = _ops.lerp(mu, g, 1 - b1)
        updates, new_nu = [], []
        for x, m, v, q in zip(g, mu, nu, qs):
            rotated = _project(x, q)
            v = torch.lerp(v, rotated * rotated, 1 - b2)
            direction = _project(_project(m, q) / (torch.sqrt(v) + eps), q, back=True)
            updates.append(direction * scale)
            new_nu.append(v)
        if has_wd:  # (p + u)(1 - lr wd) - p = u - lr wd (p + u)
            updates = [u - lr_t * weight_decay * (x + u) for u, x in zip(updates, p)]
        if step % precondition_frequency == 0:
            refreshed = [_refresh(s, q, v) for s, q, v in zip(gg, qs, new_nu)]
            qs = [r[0] for r in refreshed]
            new_nu = [r[1] for r in refreshed]
        new_state = SOAPState(count, optree.tree_unflatten(spec, mu),
                              optree.tree_unflatten(spec, new_nu),
                              optree.tree_unflatten(spec, gg), optree.tree_unflatten(spec, qs))
        return optree.tree_unflatten(spec, updates), new_state

    return GradientTransformation(init, update)
