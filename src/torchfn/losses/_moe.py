"""Auxiliary losses for mixture-of-experts routers: load balance (Switch, Mixtral; and
DeepSeek-V3's per sequence) and the router z-loss (ST-MoE)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["moe_load_balance", "moe_sequence_balance", "router_z_loss"]


def _logits(router_logits: Tensor | Sequence[Tensor], mask: Tensor | None,
            who: str) -> tuple[Tensor, Tensor | None]:
    """The layers' logits ``(L, ..., E)`` in float32 or wider, and the mask ``(L, ...)``
    as weights (None: all tokens)."""
    layers = [router_logits] if isinstance(router_logits, Tensor) else list(router_logits)
    if not layers or not all(isinstance(t, Tensor) and t.dtype.is_floating_point
                             and t.dim() >= 1 for t in layers):
        raise TypeError(f"{who}: router_logits must be a float tensor (..., E) or a "
                        f"non-empty sequence of them (one per layer), got "
                        f"{[getattr(t, 'dtype', type(t).__name__) for t in layers]}")
    shape = layers[0].shape
    if any(t.shape != shape for t in layers):
        raise ValueError(f"{who}: every layer's router_logits must have one shape, got "
                         f"{[tuple(t.shape) for t in layers]}")
    logits = torch.stack(layers)  # (L, ..., E)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if mask is None:
        return logits, None
    if not isinstance(mask, Tensor) or mask.shape != shape[:-1]:
        raise ValueError(f"{who}: mask must be a tensor of the tokens' shape "
                         f"{tuple(shape[:-1])}, got {getattr(mask, 'shape', mask)}")
    weight = mask.to(logits.dtype).expand(len(layers), *mask.shape)  # (L, ...)
    return logits, weight


def _mean(x: Tensor, weight: Tensor | None, dims: int) -> Tensor:
    """Mean over the first ``dims`` dims of ``x``, weighted by ``weight`` where given."""
    if weight is None:
        return x.flatten(0, dims - 1).mean(0)
    w = weight.reshape(*weight.shape, *([1] * (x.dim() - weight.dim())))
    return (x * w).flatten(0, dims - 1).sum(0) / w.flatten(0, dims - 1).sum(0).clamp_min(1)


def moe_load_balance(router_logits: Tensor | Sequence[Tensor], top_k: int, *,
                     mask: Tensor | None = None) -> Tensor:
    """The load-balancing loss of Switch Transformer (Fedus et al. 2021), in the form
    Mixtral trains with (Hugging Face's ``load_balancing_loss_func``)::

        E * sum_{s, e} f[s, e] * P[e]

    ``f[s, e]``: the fraction of tokens whose ``s``-th choice (of ``top_k``) is expert
    ``e``; ``P[e]``: the mean router probability of ``e``. The tokens of all layers are
    pooled. ``f`` is not differentiable; the gradient pushes ``P`` towards the experts
    that get few tokens. Perfectly balanced routing gives ``top_k``; all tokens on one
    expert with certainty gives ``E * top_k``. Scale it yourself (Mixtral: 0.02,
    Switch: 0.01) and add it to the task loss.

    Args:
        router_logits: ``(..., E)``, or one such tensor per layer, e.g. the logits that
            ``TransformerEncoder(..., experts=E)`` returns with
            ``return_router_logits=True``.
        top_k: the experts each token is sent to (the layer's ``top_k``).
        mask: ``(...)`` bool, True for the tokens that count (real tokens, not padding).

    Returns:
        A scalar.

    Example::

        >>> import torch
        >>> from torchfn import losses
        >>> balanced = 10 * torch.eye(4).repeat(2, 1)   # (T, E): two tokens per expert
        >>> losses.moe_load_balance(balanced, top_k=1)
        tensor(1.)
        >>> losses.moe_load_balance(balanced[:1].repeat(8, 1), top_k=1)  # all on expert 0
        tensor(3.9995)
    """
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"moe_load_balance: top_k must be an int >= 1, got {top_k!r}")
    logits, weight = _logits(router_logits, mask, "moe_load_balance")
    experts = logits.shape[-1]
    if top_k > experts:
        raise ValueError(f"moe_load_balance: top_k must be <= the {experts} experts, got "
                         f"{top_k}")
    dims = logits.dim() - 1  # layers and token dims
    probs = logits.softmax(-1)  # (L, ..., E)
    chosen = probs.detach().topk(top_k, dim=-1).indices  # (L, ..., k)
    one_hot = torch.nn.functional.one_hot(chosen, experts).to(probs.dtype)  # (L, ..., k, E)
    f = _mean(one_hot, weight, dims)  # (k, E)
    p = _mean(probs, weight, dims)  # (E,)
    return experts * (f * p).sum()


def moe_sequence_balance(router_logits: Tensor | Sequence[Tensor], top_k: int, *,
                         scoring: str = "sigmoid", bias: Tensor | None = None,
                         mask: Tensor | None = None) -> Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss: within each sequence (row
    of ``router_logits``), over its ``T`` tokens::

        sum_e f[e] * P[e],   f[e] = E / (top_k T) * #{t : e among t's top_k},
                             P[e] = mean_t s[t, e] / sum_j s[t, j]

    with ``s`` the router's scores (``scoring``: ``"sigmoid"`` as DeepSeek-V3, or
    ``"softmax"``), averaged over the sequences (and layers). A sequence whose tokens
    spread evenly over the experts gives 1; all on ``top_k`` experts gives ``E /
    top_k``. Unlike :func:`moe_load_balance`, which pools every token of the batch, it
    penalises a sequence that leans on few experts even when the batch as a whole is
    balanced. DeepSeek-V3 scales it by 1e-4 (balancing mainly with the selection bias,
    :func:`torchfn.models.moe_bias_update`). ``f`` is not differentiable.

    Args:
        router_logits: ``(B, T, E)``, or one such tensor per layer.
        top_k: the experts each token is sent to.
        scoring: how the router scores the logits: ``"sigmoid"`` or ``"softmax"``.
        bias: ``(E,)``, the selection bias the router adds before its top-k (the routed
            choice is counted), or None: the top-k of the scores.
        mask: ``(B, T)`` bool, True for the tokens that count (a row without any does
            not count).

    Returns:
        A scalar.

    Example::

        >>> import torch
        >>> from torchfn import losses
        >>> even = 10 * torch.eye(4).repeat(1, 2, 1)   # (B, T, E): each expert twice
        >>> losses.moe_sequence_balance(even, top_k=1, scoring="softmax")
        tensor(1.)
        >>> skewed = torch.cat([even[:, :4:2], even[:, 1:4:2]])  # experts 0, 2 | 1, 3
        >>> losses.moe_sequence_balance(skewed, top_k=1, scoring="softmax")  # batch even
        tensor(1.9998)
        >>> losses.moe_load_balance(skewed, top_k=1)  # pooled over the batch: balanced
        tensor(1.)
    """
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"moe_sequence_balance: top_k must be an int >= 1, got {top_k!r}")
    if scoring not in ("sigmoid", "softmax"):
        raise ValueError(f"moe_sequence_balance: scoring must be 'sigmoid' or 'softmax', "
                         f"got {scoring!r}")
    logits, weight = _logits(router_logits, mask, "moe_sequence_balance")  # (L, B, T, E)
    if logits.dim() != 4:
        raise ValueError(f"moe_sequence_balance: router_logits must be (B, T, E) a layer, "
                         f"got {tuple(logits.shape[1:])}")
    experts = logits.shape[-1]
    if top_k > experts:
        raise ValueError(f"moe_sequence_balance: top_k must be <= the {experts} experts, "
                         f"got {top_k}")
    if bias is not None and (not isinstance(bias, Tensor) or bias.shape != (experts,)):
        raise ValueError(f"moe_sequence_balance: bias must be a tensor ({experts},), got "
                         f"{getattr(bias, 'shape', bias)}")
    scores = logits.sigmoid() if scoring == "sigmoid" else logits.softmax(-1)
    share = scores / scores.sum(-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)
    pick = scores.detach() if bias is None else scores.detach() + bias.to(scores.dtype)
    chosen = torch.zeros_like(scores).scatter(-1, pick.topk(top_k, dim=-1).indices, 1.0)
    if weight is None:
        weight = scores.new_ones(scores.shape[:-1])  # (L, B, T)
    count = weight.sum(-1)  # (L, B): each sequence's real tokens
    w = weight[..., None] / count.clamp_min(1)[..., None, None]  # (L, B, T, 1)
    f = (chosen * w).sum(-2) * (experts / top_k)  # (L, B, E)
    p = (share * w).sum(-2)  # (L, B, E)
    per = (f * p).sum(-1)  # (L, B)
    some = (count > 0).to(per.dtype)
    return (per * some).sum() / some.sum().clamp_min(1)


def router_z_loss(router_logits: Tensor | Sequence[Tensor], *,
                  mask: Tensor | None = None) -> Tensor:
    """ST-MoE's router z-loss (Zoph et al. 2022): the mean of ``logsumexp(logits)^2``
    over tokens (and layers). It keeps the router's logits small, where bf16 rounding
    of the softmax is mild. ST-MoE scales it by 0.001.

    Args:
        router_logits: ``(..., E)``, or one such tensor per layer.
        mask: ``(...)`` bool, True for the tokens that count.

    Example::

        >>> import torch
        >>> from torchfn import losses
        >>> losses.router_z_loss(torch.zeros(3, 4))   # logsumexp = log 4 per token
        tensor(1.9218)
    """
    logits, weight = _logits(router_logits, mask, "router_z_loss")
    z = logits.logsumexp(-1).square()  # (L, ...)
    return _mean(z, weight, z.dim())
