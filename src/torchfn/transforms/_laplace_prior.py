"""The prior precision of :func:`laplace`: one ``δ`` for every param, or one per param
tensor (laplace-torch's ``prior_structure="layerwise"``), ``N(0, diag(δ_l)⁻¹)``.

A per-tensor prior is a dict ``{param name: δ}`` naming every param of the posterior
(the names :func:`offsets` gives: a dict's keys). Inside the posterior it becomes the
vector of ``P`` precisions in the flat order (:func:`prior_vector`) or, for a
Kronecker block, the one ``δ`` of the block (:func:`block_delta`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optree
import torch
from torch import Tensor

Prior = float | dict[str, float]


def offsets(params: Any) -> dict[str, tuple[int, int]]:
    """Each leaf's ``(start, numel)`` in the flat vector (``optree`` order), by name."""
    paths, leaves, _ = optree.tree_flatten_with_path(params)
    out, start = {}, 0
    for path, leaf in zip(paths, leaves):
        out[".".join(map(str, path))] = (start, leaf.numel())
        start += leaf.numel()
    return out


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def check_prior(prior: Any, params: Any, who: str, *, tensors: bool = False) -> Prior:
    """``prior`` as a float or a ``{name: float}`` over exactly ``params``' names (0-d
    tensors kept as they are with ``tensors=True``: the evidence's gradient)."""
    if tensors and isinstance(prior, Tensor) and prior.dim() == 0:
        return prior
    if _positive(prior):
        return float(prior)
    if not isinstance(prior, Mapping):
        what = "a positive float, a 0-d tensor" if tensors else "a positive float"
        raise ValueError(f"{who}: prior_precision must be {what} or a dict "
                         f"{{param name: positive float}}, got {prior!r}")
    names = list(offsets(params))
    unknown = [n for n in prior if n not in names]
    missing = [n for n in names if n not in prior]
    if unknown or missing:
        raise ValueError(f"{who}: a per-param prior_precision must name each of the "
                         f"posterior's params {names}; unknown {unknown}, missing {missing}")
    out = {}
    for name in names:
        v = prior[name]
        if tensors and isinstance(v, Tensor) and v.dim() == 0:
            out[name] = v
        elif _positive(v):
            out[name] = float(v)
        else:
            raise ValueError(f"{who}: prior_precision[{name!r}] must be a positive float, "
                             f"got {v!r}")
    return out


def prior_vector(prior: Any, params: Any, like: Tensor) -> Tensor:
    """``(P,)``: each param's ``δ`` in the flat order (differentiable in 0-d tensors)."""
    where = offsets(params)
    if not isinstance(prior, Mapping):
        return torch.as_tensor(prior, dtype=like.dtype, device=like.device).expand(
            sum(n for _, n in where.values()))
    return torch.cat([torch.as_tensor(prior[name], dtype=like.dtype, device=like.device)
                      .expand(n) for name, (_, n) in where.items()])


def prior_of(prior: Any, name: str) -> Any:
    """The ``δ`` of param ``name``."""
    return prior[name] if isinstance(prior, Mapping) else prior


def block_delta(prior: Any, weight: str, bias: str | None, who: str) -> Any:
    """The one ``δ`` of a Kronecker block over ``weight`` (and ``bias``)."""
    delta = prior_of(prior, weight)
    if bias is None or not isinstance(prior, Mapping):
        return delta
    other = prior[bias]
    same = other is delta or (not isinstance(delta, Tensor) and not isinstance(other, Tensor)
                              and delta == other)
    if not same:
        raise ValueError(f"{who}: {weight!r} and {bias!r} share one Kronecker block, so "
                         f"their prior precisions must be one value (got {delta!r} and "
                         f"{other!r}); fit with separate_bias=True for a block each")
    return delta


def is_scalar(prior: Any) -> bool:
    """One ``δ`` for every param."""
    return not isinstance(prior, Mapping)
