"""Influence functions with EK-FAC curvature (Koh & Liang, 2017; Grosse et al., 2023;
kronfluence): how much each training example moved each query's loss.

``score[q, i] = ∇ℓ_qᵀ (H + λ I)⁻¹ ∇ℓ_i`` over the Linear/Conv2d layers' params, with
``H`` the EK-FAC blocks of the mean curvature (:func:`ekfac`'s eigenvalues over its
``N``). Leaving example ``i`` out of a fit of the mean training loss changes query
``q``'s loss by about ``score[q, i] / N``: positive scores mark training examples that
helped the query, negative ones that hurt it. Per-example gradients come from one
backward pass per batch (the layers' inputs and output gradients, never a per-example
copy of the network), the query's are preconditioned once, block by block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from torchfn.core.module import Model
from torchfn.transforms import _layer_probes as lp
from torchfn.transforms._ekfac import EKFACFactor

__all__ = ["influence"]

_HEURISTIC_DAMPING = 0.1  # kronfluence's: 0.1 × the block's mean eigenvalue


def _check_pair(name: str, pair: Any) -> tuple[Tensor, Tensor]:
    if (not isinstance(pair, (tuple, list)) or len(pair) != 2
            or not all(isinstance(t, Tensor) for t in pair) or len(pair[0]) != len(pair[1])
            or len(pair[0]) == 0):
        got = ([tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__ for t in pair]
               if isinstance(pair, (tuple, list)) else type(pair).__name__)
        raise ValueError(f"influence: {name} must be a pair (x (n, ...), y (n, ...)) of "
                         f"tensors with the same non-zero n, got {got}")
    return pair[0], pair[1]


def influence(
    model: Model,
    params: dict[str, Tensor],
    factors: dict[str, EKFACFactor],
    train: tuple[Tensor, Tensor],
    query: tuple[Tensor, Tensor],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    *,
    damping: float | None = None,
    batch_size: int | None = None,
    state: dict[str, Tensor] | None = None,
) -> Tensor:
    """Pairwise influence scores of training examples on queries.

    Args:
        model: a :class:`torchfn.Model`, ``model.apply(params, x) -> (n, O)``.
        params: its trained params.
        factors: from :func:`ekfac` (the layers it covers are the layers scored).
        train: ``(x (N, ...), y (N, ...))`` the training examples to score.
        query: ``(x (Q, ...), y (Q, ...))`` the examples whose loss is explained.
        loss_fn: ``(outputs (n, O), y (n, ...)) -> (n,)``, one loss per example (e.g.
            ``lambda out, y: F.cross_entropy(out, y, reduction="none")``).
        damping: ``λ`` added to each block's mean eigenvalues; None: ``0.1 ×`` the
            block's mean eigenvalue (kronfluence's heuristic).
        batch_size: training examples per forward/backward pass (None: all at once).
        state: the model's buffers, for a model that has them (eval mode).

    Returns:
        ``(Q, N)``: ``score[q, i] = ∇ℓ_qᵀ (H + λ I)⁻¹ ∇ℓ_i``.

    Example::

        >>> import torch
        >>> import torch.nn.functional as F
        >>> from torch import nn
        >>> import torchfn
        >>> from torchfn import random
        >>> from torchfn.transforms import ekfac
        >>> model = torchfn.Model(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)))
        >>> params = model.init(random.key(0))
        >>> x, y = random.normal(random.key(1), (50, 4)), torch.arange(50) % 3
        >>> factors = ekfac(model, params, x)
        >>> loss = lambda out, y: F.cross_entropy(out, y, reduction="none")
        >>> scores = influence(model, params, factors, (x, y), (x[:2], y[:2]), loss)
        >>> scores.shape                                    # (Q, N)
        torch.Size([2, 50])
        >>> bool((scores[0, 0] > 0) and (scores[1, 1] > 0))  # each helps itself
        True
    """
    if not isinstance(model, Model):
        raise TypeError(f"influence: model must be a torchfn.Model, got {type(model).__name__}")
    if (not isinstance(factors, dict) or not factors
            or not all(isinstance(f, EKFACFactor) for f in factors.values())):
        raise TypeError("influence: factors must be the dict of EKFACFactor that ekfac "
                        f"returns, got {type(factors).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"influence: loss_fn must be callable, got {type(loss_fn).__name__}")
    if damping is not None and (not isinstance(damping, (int, float))
                                or isinstance(damping, bool) or not damping >= 0):
        raise ValueError(f"influence: damping must be a float >= 0 or None, got {damping!r}")
    if batch_size is not None and (not isinstance(batch_size, int)
                                   or isinstance(batch_size, bool) or batch_size < 1):
        raise ValueError(f"influence: batch_size must be a positive int, got {batch_size!r}")
    x_train, y_train = _check_pair("train", train)
    x_query, y_query = _check_pair("query", query)
    found = lp.factorable(model)
    unknown = [n for n in factors if n not in found]
    if unknown:
        raise ValueError(f"influence: factors name layers {unknown} that the model's "
                         f"Linear/Conv2d layers {list(found)} do not include")
    layers = {n: found[n] for n in factors}
    params = {k: v.detach() for k, v in params.items()}

    def per_example(xb: Tensor, yb: Tensor) -> dict[str, Tensor]:
        """``{layer: (n, out, fan_in (+1))}``, each example's loss gradient."""
        with lp.probed(layers) as records:
            out = lp.forward("influence", model, params, xb, records, state)
            losses = loss_fn(out, yb)
            if not isinstance(losses, Tensor) or losses.shape != (len(xb),):
                got = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses)
                raise ValueError(f"influence: loss_fn must return one loss per example, "
                                 f"shape ({len(xb)},), got {got}")
            gs = torch.autograd.grad(losses.sum(), lp.probes_of(records), allow_unused=True)
            gs = [None if g is None else g[None] for g in gs]  # one direction: (1, ...)
            calls = lp.by_layer(records, gs)
            return {name: lp.per_example("influence", name, layers[name], calls[name],
                                         len(xb))[0] if name in calls else None
                    for name in layers}

    pre = {}  # each query gradient through (H + λ I)⁻¹, block by block
    for name, g in per_example(x_query, y_query).items():
        f = factors[name]
        if g is None:
            continue
        mean = f.eigenvalues / f.num_examples  # (out, fan_in + 1)
        lam = _HEURISTIC_DAMPING * mean.mean() if damping is None else damping
        z = torch.einsum("po,qpr,rs->qos", f.QG, g, f.QA) / (mean + lam)  # in the basis
        pre[name] = torch.einsum("po,qos,rs->qpr", f.QG, z, f.QA)  # (Q, out, fan_in + 1)
    size = len(x_train) if batch_size is None else batch_size
    scores = []
    for start in range(0, len(x_train), size):
        grads = per_example(x_train[start:start + size], y_train[start:start + size])
        s = x_query.new_zeros(len(x_query), min(size, len(x_train) - start),
                              dtype=next(iter(factors.values())).QA.dtype)
        for name, p in pre.items():
            if grads[name] is not None:
                s = s + torch.einsum("qoi,noi->qn", p, grads[name])
        scores.append(s)
    return torch.cat(scores, 1)
