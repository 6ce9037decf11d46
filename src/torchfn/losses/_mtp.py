"""DeepSeek-V3's multi-token prediction loss: each depth's logits against the token it
predicts, further ahead than the next."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["multi_token_prediction"]


def multi_token_prediction(mtp_logits: Sequence[Tensor], tokens: Tensor, *,
                           mask: Tensor | None = None,
                           segment_ids: Tensor | None = None) -> Tensor:
    """The mean over the depths ``k = 1 .. D`` of the cross-entropy of depth ``k``'s
    logits at position ``t`` against token ``t + k + 1`` (DeepSeek-V3's ``L_MTP`` before
    its weight ``lambda``: 0.3, then 0.1). A target counts where tokens ``t`` and ``t + k +
    1`` are real (``mask``) and in one document (``segment_ids``); each depth's mean is
    over its counted targets. Logits are taken in float32 or wider.

    Args:
        mtp_logits: depth ``k``'s logits ``(B, N - k, V)`` for each ``k``, as
            ``TransformerEncoder(mtp=D)``'s forward returns them with ``return_mtp=True``.
        tokens: ``(B, N)`` the input tokens.
        mask: ``(B, N)`` bool, True for real tokens (None: all).
        segment_ids: ``(B, N)`` the document of each token, for packed rows (None: one).

    Returns:
        A scalar.

    Example::

        >>> import torch
        >>> from torchfn import losses
        >>> tokens = torch.tensor([[0, 1, 2, 3]])
        >>> sure = 20 * torch.eye(4)[None, [2, 3, 0]]  # (B, N - 1, V): t says t + 2
        >>> losses.multi_token_prediction([sure], tokens) < 1e-6
        tensor(True)
    """
    if not isinstance(tokens, Tensor) or tokens.dim() != 2 or tokens.is_floating_point():
        raise ValueError(f"multi_token_prediction: tokens must be an int tensor (B, N), got "
                         f"{getattr(tokens, 'shape', type(tokens).__name__)}")
    b, n = tokens.shape
    depths = list(mtp_logits) if not isinstance(mtp_logits, Tensor) else None
    if not depths:
        raise ValueError("multi_token_prediction: mtp_logits must be a non-empty sequence of "
                         "(B, N - k, V) tensors, one per depth")
    for name, t in (("mask", mask), ("segment_ids", segment_ids)):
        if t is not None and (not isinstance(t, Tensor) or tuple(t.shape) != (b, n)):
            raise ValueError(f"multi_token_prediction: {name} must be (B, N) = {(b, n)}, got "
                             f"{getattr(t, 'shape', t)}")
    losses = []
    for k, logits in enumerate(depths, start=1):
        m = n - k - 1  # positions whose target t + k + 1 exists
        if not isinstance(logits, Tensor) or logits.dim() != 3 \
                or tuple(logits.shape[:2]) != (b, n - k) or m < 1:
            raise ValueError(f"multi_token_prediction: depth {k}'s logits must be (B, N - "
                             f"{k}, V) = ({b}, {n - k}, V) with N > {k + 1}, got "
                             f"{getattr(logits, 'shape', logits)}")
        work = logits[:, :m].to(torch.promote_types(logits.dtype, torch.float32))
        ce = F.cross_entropy(work.transpose(1, 2), tokens[:, k + 1:], reduction="none")
        valid = torch.ones_like(ce, dtype=torch.bool)  # (B, m)
        if mask is not None:
            valid = valid & mask[:, :m].to(torch.bool) & mask[:, k + 1:].to(torch.bool)
        if segment_ids is not None:
            valid = valid & (segment_ids[:, :m] == segment_ids[:, k + 1:])
        losses.append(torch.where(valid, ce, 0.0).sum() / valid.sum().clamp_min(1))
    return torch.stack(losses).mean()
