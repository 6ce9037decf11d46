"""Muon (Jordan et al. 2024): momentum, orthogonalised by a Newton-Schulz iteration.

    B = mu B + (1 - mu) g                       (torch's lerp form)
    N = g + mu (B - g) if nesterov else B       (lerp(g, B, mu))
    O = NS_k(N)                                 ~ U V^T of N's SVD, in ``ns_dtype``
    update = -lr_adj O - lr wd p                (decoupled weight decay)
    lr_adj = lr sqrt(max(1, A / B))             ("original", Keller Jordan's)
           = 0.2 lr sqrt(max(A, B))             ("match_rms_adamw", Moonshot's)

``torch.optim.Muon`` orthogonalises one matrix at a time. Here the matrices of one
shape, dtype and device are stacked and orthogonalised together by batched
matmuls (a transformer's layers share a handful of shapes), which is where the
time goes.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from torchfn.optim import _checks, _ops
from torchfn.optim._base import GradientTransformation, check_state, lr_at, new_count
from torchfn.optim._tree import check_params, check_structure

__all__ = ["MuonState", "muon", "newton_schulz"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_ADJUST = ("original", "match_rms_adamw", None)


class MuonState(NamedTuple):
    count: Tensor  # () int32, steps taken
    momentum: Any  # momentum buffers, params' structure


def newton_schulz(
    x: Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
    dtype: torch.dtype | None = torch.bfloat16,
) -> Tensor:
    """Approximately orthogonalise the last two dims of ``x``: (..., A, B) -> (..., A, B).

    The quintic iteration ``X <- a X + (b X X^T + c (X X^T)^2) X`` from
    ``X = x / ||x||_F`` (per matrix), run on the short side. Its singular values land
    in about [0.7, 1.2] rather than exactly 1, which Muon does not mind. ``dtype``
    is the iteration's (bf16, as torch.optim.Muon; None keeps x's).

    Example:
        >>> import torch
        >>> from torchfn import random
        >>> x = random.normal(random.key(0), (3, 8, 4))
        >>> s = torch.linalg.svdvals(newton_schulz(x, dtype=None))  # (3, 4)
        >>> bool(((s > 0.6) & (s < 1.3)).all())
        True
    """
    if x.ndim < 2:
        raise ValueError(f"newton_schulz: x must have >= 2 dims (..., A, B), got {tuple(x.shape)}")
    a, b, c = coefficients
    out_dtype = x.dtype
    y = x if dtype is None else x.to(dtype)
    tall = y.shape[-2] > y.shape[-1]
    if tall:
        y = y.mT
    norm = torch.linalg.vector_norm(y, dim=(-2, -1), keepdim=True)
    y = y / norm.clamp(min=eps)
    for _ in range(steps):
        gram = y @ y.mT  # (..., S, S), S the short side
        poly = _addmm(gram, gram, gram, beta=b, alpha=c)  # b X X^T + c (X X^T)^2
        y = _addmm(y, poly, y, beta=a, alpha=1.0)
    if tall:
        y = y.mT
    return y.to(out_dtype)


def _addmm(x: Tensor, m1: Tensor, m2: Tensor, beta: float, alpha: float) -> Tensor:
    """``beta x + alpha m1 @ m2`` with torch's fused kernels where the rank allows."""
    if x.ndim == 2:
        return torch.addmm(x, m1, m2, beta=beta, alpha=alpha)
    if x.ndim == 3:
        return torch.baddbmm(x, m1, m2, beta=beta, alpha=alpha)
    return beta * x + alpha * (m1 @ m2)


def _lr_scale(shape: torch.Size, adjust: str | None) -> float:
    rows, cols = shape[-2], shape[-1]
    if adjust == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


def muon(
    lr: Any = 1e-3,
    momentum: Any = 0.95,
    weight_decay: Any = 0.1,
    *,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
    adjust_lr: str | None = "original",
    ns_dtype: torch.dtype | None = torch.bfloat16,
) -> GradientTransformation:
    """Muon, equal to ``torch.optim.Muon`` (same defaults) up to bf16 rounding.

    Muon is for 2-D weight matrices; every leaf it sees must be 2-D. Give it the
    hidden layers' weights and the rest (embeddings, the head, biases, norms) to
    AdamW with ``optim.partition``, as the example does.

    Args:
        lr: learning rate >= 0, a 0-d tensor or a schedule.
        momentum: in [0, 1).
        weight_decay: decoupled, ``- lr * wd * p`` (needs params).
        nesterov: take ``lerp(g, B, momentum)`` instead of ``B``.
        ns_steps: Newton-Schulz iterations (>= 1).
        ns_coefficients: the quintic's (a, b, c).
        eps: floor of the Frobenius norm the iteration starts by dividing by.
        adjust_lr: ``"original"`` (``sqrt(max(1, A/B))``), ``"match_rms_adamw"``
            (``0.2 sqrt(max(A, B))``, so AdamW's lr and decay carry over) or None
            (the same as ``"original"``, as torch).
        ns_dtype: the iteration's dtype (bf16 as torch; None: the params' dtype).

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> params = {"hidden": torch.ones(8, 8), "head": torch.ones(8), "emb": torch.ones(5, 8)}
        >>> labels = lambda p: {k: "muon" if k == "hidden" else "adamw" for k in p}
        >>> tx = optim.partition({"muon": optim.muon(0.02), "adamw": optim.adamw(3e-4)}, labels)
        >>> from torchfn import random
        >>> grads = {k: random.normal(random.key(0), tuple(v.shape)) for k, v in params.items()}
        >>> u, state = tx.update(grads, tx.init(params), params)
        >>> u["hidden"].shape
        torch.Size([8, 8])
    """
    _checks.lr(lr)
    _checks.unit_interval("momentum", momentum)
    _checks.nonneg("weight_decay", weight_decay)
    _checks.positive_int("ns_steps", ns_steps)
    if adjust_lr not in _ADJUST:
        raise ValueError(
            f"adjust_lr must be 'original', 'match_rms_adamw' or None, got {adjust_lr!r}"
        )
    if not isinstance(nesterov, bool):
        raise TypeError(f"nesterov must be a bool, got {nesterov!r}")
    has_wd = not _checks.is_zero(weight_decay)

    def _check_2d(leaves: list[Tensor], spec: optree.PyTreeSpec) -> None:
        for path, x in zip(optree.treespec_paths(spec), leaves):
            if x.ndim != 2:
                name = ".".join(str(k) for k in path) or "<root>"
                raise ValueError(
                    f"muon: leaf {name!r} has shape {tuple(x.shape)}; Muon updates 2-D "
                    "matrices only. Give other leaves another optimizer with "
                    "optim.partition (see muon's docstring)."
                )

    def init(params: Any) -> MuonState:
        leaves, spec = optree.tree_flatten(params)
        _check_2d(leaves, spec)
        return MuonState(new_count(leaves), optree.tree_unflatten(spec, _ops.zeros_like(leaves)))

    def update(grads: Any, state: MuonState, params: Any = None, *, inplace: Any = None):
        check_state(state, MuonState, "muon")
        g, spec = optree.tree_flatten(grads)
        _check_2d(g, spec)
        buf = check_structure(state.momentum, "optimizer state", grads, "grads")
        lr_t = lr_at(lr, state.count)
        buf = _ops.lerp(buf, g, 1 - momentum)
        direction = _ops.lerp(g, buf, momentum) if nesterov else buf
        ortho = _orthogonalise(direction, ns_steps, ns_coefficients, eps, ns_dtype)
        updates = [o * (-lr_t * _lr_scale(o.shape, adjust_lr)) for o in ortho]
        if has_wd:
            p = check_params(params, spec, "muon with weight_decay")
            updates = _ops.add_(updates, p, alpha=-lr_t * weight_decay)
        new_state = MuonState(state.count + 1, optree.tree_unflatten(spec, buf))
        return optree.tree_unflatten(spec, updates), new_state

    return GradientTransformation(init, update)


def _orthogonalise(xs: list[Tensor], steps, coefficients, eps, dtype) -> list[Tensor]:
    """``newton_schulz`` of each matrix, same-shape matrices stacked into one batch."""
    if not _ops.fast():  # under a transform: leaves may be batched tensors; one at a time
        return [newton_schulz(x, steps, coefficients, eps, dtype) for x in xs]
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, x in enumerate(xs):
        groups[(x.shape, x.dtype, x.device)].append(i)
    out: list[Tensor] = [None] * len(xs)  # type: ignore[list-item]
    for idx in groups.values():
        first = xs[idx[0]]
        if len(idx) == 1:
            out[idx[0]] = newton_schulz(first, steps, coefficients, eps, dtype)
            continue
        # stack straight into the iteration's dtype: one copy, not a stack and a cast
        stacked = torch.stack([xs[i].to(dtype or first.dtype) for i in idx])  # (k, A, B)
        ortho = newton_schulz(stacked, steps, coefficients, eps, None)
        for i, o in zip(idx, ortho.unbind(0)):
            out[i] = o.to(first.dtype)
    return out
