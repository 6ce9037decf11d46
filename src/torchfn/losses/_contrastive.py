"""Contrastive losses over a batch of paired embeddings: InfoNCE (CLIP's symmetric form),
NT-Xent (SimCLR's two views) and SigLIP's pairwise sigmoid loss.

Each couples the rows of a batch (the other rows are the negatives), so it takes the
whole batch ``(B, D)``; ``vmap`` over a further leading dim (an ensemble, a group of
batches) batches it as usual.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from torchfn.losses._classification import _check_float, _check_reduction, _reduce

__all__ = ["info_nce", "ntxent", "siglip"]


def _pair(x: Tensor, y: Tensor, names: tuple[str, str], normalize: bool
          ) -> tuple[Tensor, Tensor]:
    _check_float(names[0], x)
    _check_float(names[1], y)
    if x.dim() != 2 or x.shape[0] < 1:
        raise ValueError(f"{names[0]} must have shape (B, D) with B >= 1, got "
                         f"{tuple(x.shape)}")
    if y.shape != x.shape:
        raise ValueError(f"{names[1]} must have {names[0]}'s shape {tuple(x.shape)}, got "
                         f"{tuple(y.shape)}")
    if normalize:
        x, y = F.normalize(x, dim=-1), F.normalize(y, dim=-1)
    return x, y


def _positive(name: str, value: float | Tensor) -> None:
    if isinstance(value, Tensor):
        if value.dim() != 0:
            raise ValueError(f"{name} must be a float or a 0-d tensor, got shape "
                             f"{tuple(value.shape)}")
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{name} must be a positive float, got {value!r}")


def info_nce(
    x: Tensor,
    y: Tensor,
    *,
    temperature: float | Tensor = 0.07,
    symmetric: bool = True,
    normalize: bool = True,
    reduction: str = "mean",
) -> Tensor:
    """InfoNCE (van den Oord et al., 2018) over paired rows: row ``i`` of ``x`` should
    pick row ``i`` of ``y`` out of the batch; with ``symmetric`` (CLIP, Radford et al.,
    2021) also the other way round, the two averaged.

    ``logits = x̂ ŷᵀ / temperature`` (B, B) with ``x̂``, ``ŷ`` the unit rows; the loss is
    the cross entropy of each row of ``logits`` against the diagonal, and of each column.

    Args:
        x: ``(B, D)`` embeddings, e.g. of images.
        y: ``(B, D)`` embeddings of their pairs, e.g. of captions.
        temperature: a positive float, or a 0-d tensor to learn it (CLIP learns
            ``log(1 / temperature)``: pass ``1 / log_scale.exp()``).
        symmetric: average the ``x -> y`` and ``y -> x`` losses; else ``x -> y`` only.
        normalize: compare directions (cosine similarity); False: raw dot products.
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (``(B,)``, one loss per pair).

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> x = random.normal(random.key(0), (4, 8))                        # (B, D)
        >>> noisy = x + 0.1 * random.normal(random.key(1), (4, 8))
        >>> far = random.normal(random.key(2), (4, 8))
        >>> bool(info_nce(x, noisy) < info_nce(x, far))
        True
    """
    x, y = _pair(x, y, ("x", "y"), normalize)
    _positive("temperature", temperature)
    _check_reduction(reduction)
    logits = x @ y.transpose(0, 1) / temperature  # (B, B)
    diagonal = torch.arange(x.shape[0], device=x.device)
    loss = F.cross_entropy(logits, diagonal, reduction="none")  # (B,)
    if symmetric:
        loss = (loss + F.cross_entropy(logits.transpose(0, 1), diagonal,
                                       reduction="none")) / 2
    return _reduce(loss, reduction)


def ntxent(
    z1: Tensor,
    z2: Tensor | None = None,
    *,
    labels: Tensor | None = None,
    temperature: float | Tensor = 0.5,
    normalize: bool = True,
    reduction: str = "mean",
) -> Tensor:
    """NT-Xent, SimCLR's loss (Chen et al., 2020): two views ``z1[i]``, ``z2[i]`` of each
    example; each of the ``2B`` views should pick its partner out of the other ``2B - 1``.

    With ``z = [z1; z2]`` (2B, D), ``s = ẑ ẑᵀ / temperature`` and the diagonal left out,
    ``loss_k = -log softmax(s_k)[partner(k)]``, averaged over the ``2B`` views.

    With ``labels`` instead of ``z2`` (optax's and pytorch-metric-learning's form), the
    rows of ``z1`` that share a label are positive pairs, any number per label: each
    ordered pair ``(i, j)`` gives ``-log(exp(s_ij) / (exp(s_ij) + sum_k exp(s_ik)))``
    over the ``k`` with another label, averaged over the pairs. Two views are labels
    ``[0..B-1, 0..B-1]``.

    Args:
        z1: ``(B, D)`` embeddings of the first views; with ``labels``, ``(N, D)``.
        z2: ``(B, D)`` embeddings of the second views, or None with ``labels``.
        labels: ``(N,)`` integer group of each row of ``z1``, or None with ``z2``.
        temperature: a positive float or a 0-d tensor.
        normalize: cosine similarity (SimCLR's); False: raw dot products.
        reduction: ``"mean"`` (over the positive pairs: the ``2B`` views), ``"sum"`` or
            ``"none"``: ``(B,)``, each pair's two losses averaged; with ``labels``,
            ``(N, N)``, the pair losses, 0 off the positive pairs.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> z = random.normal(random.key(0), (4, 8))                        # (B, D)
        >>> bool(ntxent(z, z + 0.01) < ntxent(z, random.normal(random.key(1), (4, 8))))
        True
        >>> views = torch.cat([z, z + 0.01])                                # (2B, D)
        >>> bool(torch.isclose(ntxent(views, labels=torch.arange(4).repeat(2)),
        ...                    ntxent(z, z + 0.01)))
        True
    """
    _check_reduction(reduction)
    if (z2 is None) == (labels is None):
        raise ValueError("ntxent takes z2 (two views) or labels (groups of z1), exactly one "
                         f"of them; got {'neither' if z2 is None else 'both'}")
    if z2 is not None:
        z1, z2 = _pair(z1, z2, ("z1", "z2"), normalize)
        B = z1.shape[0]
        z = torch.cat([z1, z2])  # (2B, D)
        groups = torch.arange(B, device=z.device).repeat(2)  # (2B,): k and k + B
    else:
        z, _ = _pair(z1, z1, ("z1", "z1"), normalize)
        if not isinstance(labels, Tensor) or labels.dtype.is_floating_point or \
                labels.shape != z.shape[:1]:
            got = (f"{labels.dtype} of shape {tuple(labels.shape)}"
                   if isinstance(labels, Tensor) else type(labels).__name__)
            raise ValueError(f"labels must be an integer tensor of shape ({z.shape[0]},) "
                             f"(one group per row of z1), got {got}")
        groups = labels
    _positive("temperature", temperature)
    sim = z @ z.transpose(0, 1) / temperature  # (N, N)
    same = groups[:, None] == groups[None, :]  # (N, N)
    positive = same & ~torch.eye(len(groups), dtype=torch.bool, device=z.device)
    # log of the summed exp over each row's negatives; a finite floor where there are none
    floor = torch.finfo(sim.dtype).min / 2
    negatives = torch.where(same, floor, sim).logsumexp(-1, keepdim=True)  # (N, 1)
    pair = torch.where(positive, torch.logaddexp(sim, negatives) - sim, 0.0)  # (N, N)
    if labels is not None:
        if reduction == "none":
            return pair
        total = pair.sum()
        return total / positive.sum().clamp(min=1) if reduction == "mean" else total
    view = pair.sum(-1)  # (2B,): one positive each
    return _reduce((view[:B] + view[B:]) / 2, reduction)


def siglip(
    x: Tensor,
    y: Tensor,
    *,
    scale: float | Tensor = 10.0,
    bias: float | Tensor = -10.0,
    normalize: bool = True,
    reduction: str = "mean",
) -> Tensor:
    """SigLIP's pairwise sigmoid loss (Zhai et al., 2023): every pair ``(x_i, y_j)`` is a
    binary problem, positive on the diagonal, negative elsewhere; no softmax over the
    batch.

    ``logits = scale x̂ ŷᵀ + bias`` (B, B), ``z = 2I - 1``; the loss is
    ``-(1 / B) sum_ij log sigmoid(z_ij logits_ij)`` (the paper's normalisation).

    Args:
        x: ``(B, D)`` embeddings, e.g. of images.
        y: ``(B, D)`` embeddings of their pairs.
        scale: the logit scale ``t`` (a float, or a 0-d tensor: the paper learns
            ``log t``, initialised at ``log 10``).
        bias: the logit bias ``b`` (the paper initialises it at -10, so that the many
            negatives start out with a small loss).
        normalize: cosine similarity; False: raw dot products.
        reduction: ``"mean"`` (the sum over pairs over ``B``), ``"sum"``, or ``"none"``
            (``(B,)``: each row's sum over its ``B`` pairs).

    Example::

        >>> from torchfn import random
        >>> x = random.normal(random.key(0), (4, 8))                        # (B, D)
        >>> bool(siglip(x, x) < siglip(x, random.normal(random.key(1), (4, 8))))
        True
    """
    x, y = _pair(x, y, ("x", "y"), normalize)
    _positive("scale", scale)
    if not isinstance(bias, (Tensor, int, float)) or isinstance(bias, bool) or (
            isinstance(bias, Tensor) and bias.dim() != 0):
        raise ValueError(f"bias must be a float or a 0-d tensor, got {bias!r}")
    _check_reduction(reduction)
    B = x.shape[0]
    logits = scale * (x @ y.transpose(0, 1)) + bias  # (B, B)
    signs = 2 * torch.eye(B, dtype=logits.dtype, device=logits.device) - 1  # (B, B)
    rows = -F.logsigmoid(signs * logits).sum(-1)  # (B,)
    return _reduce(rows, reduction)  # "mean": the sum over all pairs over B
