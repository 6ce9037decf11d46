"""Classifier-free guidance (Ho & Salimans 2022), as diffusers' ``ClassifierFreeGuidance``
guider: one model, trained with its condition sometimes replaced by a null one
(:func:`drop_condition`), sampled with its conditional prediction pushed away from
its unconditional one:

    out = u + scale (c - u)          c = model(x, t, cond),  u = model(x, t, null)

with optionally the "rescale" of Lin et al. (2023) (diffusers' ``guidance_rescale``)
and the guidance interval of Kynkaanniemi et al. (2024) (guide only at middle noise
levels). The combination is linear, so it serves every parameterisation: noise,
``x0``, ``v`` and a flow's velocity.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch
from torch import Tensor

from torchfn import random

__all__ = ["classifier_free_guidance", "drop_condition"]


def _batch(tree: Any, name: str) -> int:
    leaves = optree.tree_leaves(tree)
    if not leaves or not all(isinstance(x, Tensor) and x.dim() >= 1 for x in leaves):
        raise TypeError(f"{name} must be a tensor (B, ...) or a pytree of them")
    return leaves[0].shape[0]


def drop_condition(key: Tensor, cond: Any, null: Any, p: float) -> Any:
    """``cond`` with each example's condition replaced by ``null`` with probability
    ``p`` (the label dropout that trains a model for classifier-free guidance).

    Args:
        key: PRNG key (one Bernoulli draw per example).
        cond: a tensor ``(B, ...)``, or a pytree of them with the same ``B``.
        null: the null condition, ``cond``'s structure with leading dim ``B`` or 1.
        p: the drop probability, in [0, 1].

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> labels = torch.arange(8)
        >>> drop_condition(random.key(0), labels, torch.tensor([10]), p=0.5).tolist()
        [0, 1, 10, 10, 4, 10, 10, 7]
    """
    if not (isinstance(p, (int, float)) and 0 <= p <= 1) or isinstance(p, bool):
        raise ValueError(f"p must be a probability in [0, 1], got {p!r}")
    B = _batch(cond, "cond")
    drop = random.uniform(key, (B,)) < p  # (B,)

    def pick(c: Tensor, n: Tensor) -> Tensor:
        if n.dim() != c.dim() or n.shape[0] not in (1, B) or n.shape[1:] != c.shape[1:]:
            raise ValueError(f"null must have cond's shape {tuple(c.shape)} with leading dim "
                             f"{B} or 1, got {tuple(n.shape)}")
        mask = drop.to(c.device).view((B,) + (1,) * (c.dim() - 1))
        return torch.where(mask, n.to(c.dtype), c)

    return optree.tree_map(pick, cond, null)


def classifier_free_guidance(
    model_fn: Callable[[Tensor, Tensor, Any], Tensor],
    cond: Any,
    null: Any,
    scale: float,
    *,
    rescale: float = 0.0,
    interval: tuple[float, float] | None = None,
) -> Callable[[Tensor, Tensor], Tensor]:
    """A guided ``model_fn(x, t)`` for any sampler, from ``model_fn(x, t, cond)``.

    Each call runs the model once on the doubled batch ``[x, x]`` with ``[cond, null]``
    and returns ``u + scale (c - u)``; ``scale = 1`` is the conditional model (one call
    of batch ``B``, no doubling), ``scale = 0`` the unconditional one.

    Args:
        model_fn: ``model_fn(x, t, cond) -> (B, ...)``.
        cond: the condition, a tensor ``(B, ...)`` or a pytree of them.
        null: the null condition, ``cond``'s structure, leading dim ``B`` or 1.
        scale: the guidance weight (diffusers' ``guidance_scale``; 1: no guidance).
        rescale: in [0, 1], Lin et al.'s fix for over-exposure: the guided output is
            rescaled, per example, to the conditional one's standard deviation and mixed
            in with this weight (diffusers' ``guidance_rescale``).
        interval: ``(lo, hi)`` in the model's time units: guide only where
            ``lo <= t <= hi`` and use the conditional model elsewhere (one call).

    Returns:
        ``guided(x, t) -> (B, ...)``.

    Example::

        >>> import torch
        >>> net = lambda x, t, y: x * y[:, None]              # a toy conditional model
        >>> guided = classifier_free_guidance(net, torch.tensor([2.0]), torch.tensor([0.0]), 3.0)
        >>> guided(torch.ones(1, 2), torch.zeros(1))         # 0 + 3 (2 - 0)
        tensor([[6., 6.]])
    """
    if not callable(model_fn):
        raise TypeError(f"model_fn must be callable, got {type(model_fn).__name__}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    if not (isinstance(rescale, (int, float)) and 0 <= rescale <= 1):
        raise ValueError(f"rescale must lie in [0, 1], got {rescale!r}")
    if interval is not None and not (len(interval) == 2 and interval[0] <= interval[1]):
        raise ValueError(f"interval must be (lo, hi) with lo <= hi, got {interval!r}")
    B = _batch(cond, "cond")
    _batch(null, "null")

    def full(n: Tensor, c: Tensor) -> Tensor:
        if n.dim() != c.dim() or n.shape[0] not in (1, B) or n.shape[1:] != c.shape[1:]:
            raise ValueError(f"null must have cond's shape {tuple(c.shape)} with leading dim "
                             f"{B} or 1, got {tuple(n.shape)}")
        return n.expand_as(c).to(c.dtype)

    null_b = optree.tree_map(full, null, cond)
    both = optree.tree_map(lambda c, n: torch.cat([c, n]), cond, null_b)  # (2B, ...)

    def guided(x: Tensor, t: Tensor) -> Tensor:
        if x.shape[0] != B:
            raise ValueError(f"x must have the condition's batch {B}, got {tuple(x.shape)}")
        inside = interval is None or interval[0] <= float(t.reshape(-1)[0]) <= interval[1]
        if scale == 1.0 or not inside:
            return model_fn(x, t, cond)
        out = model_fn(torch.cat([x, x]), torch.cat([t, t]), both)  # (2B, ...)
        c, u = out[:B], out[B:]
        pred = u + scale * (c - u)
        if rescale > 0:
            dims = list(range(1, pred.dim()))
            matched = pred * (c.std(dim=dims, keepdim=True) / pred.std(dim=dims, keepdim=True))
            pred = rescale * matched + (1 - rescale) * pred
        return pred

    return guided
