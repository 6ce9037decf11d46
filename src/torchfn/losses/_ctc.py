"""Connectionist temporal classification (Graves et al., 2006) in plain torch ops.

``F.ctc_loss`` is a fused kernel: it has a first derivative but no forward-mode rule
(``jvp``, ``jacfwd`` and ``hessian`` fail), no second derivative, and no ``vmap`` rule
(it falls back to a per-example loop with a warning). This one is the alpha recursion in
log space over time, a Python loop of batched torch ops, so every transform sees
ordinary differentiable code: per-sample gradients for DP-SGD on speech models, exact
Hessian-vector products, forward-mode sensitivities.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from torchfn.losses._classification import _check_float, _check_reduction, _inspectable

__all__ = ["ctc_loss"]

# Log-probability of an impossible state. Finite, unlike -inf, so that logsumexp's
# backward stays finite (-inf - -inf is NaN); far below any real path's log-probability.
_NEG = -1e30


def _lengths(name: str, value: Tensor | int | None, batch: int, full: int,
             device: torch.device) -> Tensor:
    """``value`` as an int64 ``(batch,)`` tensor (``full`` where None)."""
    if value is None:
        return torch.full((batch,), full, dtype=torch.long, device=device)
    if isinstance(value, int) and not isinstance(value, bool):
        value = torch.tensor(value, device=device)
    if not isinstance(value, Tensor) or value.dtype.is_floating_point or value.dtype in (
            torch.bool, torch.complex64, torch.complex128):
        got = value.dtype if isinstance(value, Tensor) else type(value).__name__
        raise TypeError(f"{name} must be an integer Tensor, an int or None, got {got}")
    value = value.to(device=device, dtype=torch.long)
    if value.dim() == 0:
        value = value.expand(batch)
    if value.shape != (batch,):
        raise ValueError(f"{name} must have shape ({batch},) (one per sequence) or be a "
                         f"scalar, got {tuple(value.shape)}")
    if _inspectable(value) and batch:
        lo, hi = int(value.min()), int(value.max())
        if lo < 0 or hi > full:
            raise ValueError(f"{name} must be in [0, {full}], got values in [{lo}, {hi}]")
    return value


def ctc_loss(
    logits: Tensor,
    targets: Tensor,
    input_lengths: Tensor | int | None = None,
    target_lengths: Tensor | int | None = None,
    *,
    blank: int = 0,
    reduction: str = "mean",
    zero_infinity: bool = False,
) -> Tensor:
    """CTC loss, ``-log p(targets | logits)`` summed over all alignments; equal to
    ``F.ctc_loss`` (time-major there, batch-first here) and differentiable by every
    ``torch.func`` transform.

    An alignment is a length-``T`` path over the classes that collapses to the target by
    merging repeats and then dropping ``blank``. The sum runs over the extended target
    ``(blank, y1, blank, y2, ..., yS, blank)`` with the forward (alpha) recursion, in
    log space, one step per frame: ``O(T)`` batched ops of size ``(B, 2S + 1)``.

    Args:
        logits: ``(B, T, C)``, or one sequence ``(T, C)`` (batch it with ``vmap``).
            Normalised with ``log_softmax`` over ``C``, so log-probabilities work too.
            fp16/bf16 are taken in float32.
        targets: ``(B, S)`` (or ``(S,)``) integer labels in ``[0, C)``, padded to ``S``;
            ``blank`` must not appear within a sequence's length.
        input_lengths: ``(B,)`` frames used per sequence, in ``[0, T]``; None: all ``T``.
        target_lengths: ``(B,)`` labels per sequence, in ``[0, S]``; None: all ``S``.
        blank: the blank class.
        reduction: ``"mean"`` (each loss over its target length, at least 1, then the
            mean over the batch: torch's convention), ``"sum"`` or ``"none"`` ((B,), or a
            scalar for one sequence).
        zero_infinity: impossible targets (too long for their input, counting a blank
            between repeats) give 0 instead of ``inf``. Either way they add no gradient.

    Returns:
        The loss in the logits' dtype (float32 for half types).

    Example::

        >>> import torch
        >>> import torch.nn.functional as F
        >>> from torchfn import random
        >>> logits = random.normal(random.key(0), (2, 6, 4))                 # (B, T, C)
        >>> targets = torch.tensor([[1, 2, 2], [3, 1, 0]])                   # (B, S)
        >>> ours = ctc_loss(logits, targets, target_lengths=torch.tensor([3, 2]))
        >>> theirs = F.ctc_loss(logits.log_softmax(-1).transpose(0, 1), targets,
        ...                     torch.tensor([6, 6]), torch.tensor([3, 2]))
        >>> bool(torch.isclose(ours, theirs))
        True
    """
    _check_float("logits", logits)
    if not isinstance(targets, Tensor) or targets.dtype.is_floating_point or \
            targets.dtype in (torch.bool, torch.complex64, torch.complex128):
        got = targets.dtype if isinstance(targets, Tensor) else type(targets).__name__
        raise TypeError(f"targets must be an integer Tensor, got {got}")
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits must have shape (B, T, C) or (T, C), got "
                         f"{tuple(logits.shape)}")
    unbatched = logits.dim() == 2
    if targets.dim() != logits.dim() - 1 or targets.shape[:-1] != logits.shape[:-2]:
        want = "(S,)" if unbatched else f"({logits.shape[0]}, S)"
        raise ValueError(f"targets must have shape {want} for logits of shape "
                         f"{tuple(logits.shape)}, got {tuple(targets.shape)}")
    if unbatched:
        logits, targets = logits.unsqueeze(0), targets.unsqueeze(0)
    B, T, C = logits.shape
    S = targets.shape[-1]
    if not isinstance(blank, int) or not 0 <= blank < C:
        raise ValueError(f"blank must be a class index in [0, {C}), got {blank!r}")
    _check_reduction(reduction)
    in_len = _lengths("input_lengths", input_lengths, B, T, logits.device)
    tgt_len = _lengths("target_lengths", target_lengths, B, S, logits.device)
    if _inspectable(targets) and targets.numel():
        used = torch.arange(S, device=targets.device) < tgt_len[:, None]  # (B, S)
        if bool(((targets < 0) | (targets >= C))[used].any()):
            raise ValueError(f"targets must be class indices in [0, {C}) within "
                             f"target_lengths")
        if bool((targets == blank)[used].any()):
            raise ValueError(f"targets must not contain the blank class {blank} within "
                             f"target_lengths")

    dtype = torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype
    logp = F.log_softmax(logits.to(dtype), dim=-1)  # (B, T, C)
    labels = targets.long().clamp(0, C - 1)  # padding may hold anything
    # extended target (blank, y1, blank, ..., yS, blank): (B, 2S + 1)
    blanks = torch.full_like(labels, blank)
    ext = torch.cat([torch.stack([blanks, labels], -1).flatten(-2), blanks[:, :1]
                     if S else torch.full((B, 1), blank, device=labels.device)], -1)
    ext_lp = logp.gather(-1, ext.unsqueeze(1).expand(B, T, 2 * S + 1))  # (B, T, 2S + 1)
    # a label may be reached from two states back (skipping the blank between) unless it
    # repeats the label before it
    differs = labels[:, 1:] != labels[:, :-1]  # (B, S - 1)
    skip = torch.cat([torch.zeros(B, 3, dtype=torch.bool, device=labels.device),
                      torch.stack([differs, torch.zeros_like(differs)], -1).flatten(-2)],
                     -1)[:, :2 * S + 1]  # (B, 2S + 1): True at labels 2..S that differ
    # added to (state s, s - 1, s - 2) rolled into place: _NEG where the move is not
    # allowed (the two-back state unless the skip is; whatever wrapped around the end)
    col = torch.arange(2 * S + 1, device=labels.device)
    allowed = torch.stack([torch.ones_like(skip), (col >= 1).expand_as(skip), skip])
    moves = torch.where(allowed, 0.0, _NEG).to(dtype)  # (3, B, 2S + 1)
    frames = ext_lp.unbind(1)  # T of (B, 2S + 1)

    alpha = torch.where(col < 2, frames[0], _NEG)  # (B, 2S + 1)
    frozen = None if input_lengths is None else (in_len[:, None] <= torch.arange(
        T, device=logp.device)).unsqueeze(-1).unbind(1)  # T of (B, 1): past the end
    for t in range(1, T):
        from_ = torch.stack([alpha, alpha.roll(1, -1), alpha.roll(2, -1)]) + moves
        new = torch.logsumexp(from_, 0) + frames[t]
        alpha = new if frozen is None else torch.where(frozen[t], alpha, new)

    last = alpha.gather(-1, (2 * tgt_len)[:, None]).squeeze(-1)  # (B,)
    before = alpha.gather(-1, (2 * tgt_len - 1).clamp(min=0)[:, None]).squeeze(-1)
    log_lik = torch.logaddexp(last, torch.where(tgt_len > 0, before, _NEG))
    # no frames: only the empty target is possible, with probability 1
    log_lik = torch.where(in_len == 0, torch.where(tgt_len == 0, 0.0, _NEG).to(dtype),
                          log_lik)
    impossible = log_lik < _NEG / 2
    loss = torch.where(impossible, 0.0 if zero_infinity else float("inf"), -log_lik)
    if unbatched:
        loss = loss.squeeze(0)
        tgt_len = tgt_len.squeeze(0)
    if reduction == "mean":
        return (loss / tgt_len.clamp(min=1).to(dtype)).mean()
    if reduction == "sum":
        return loss.sum()
    return loss
