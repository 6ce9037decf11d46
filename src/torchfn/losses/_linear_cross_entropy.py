"""Cross entropy of a linear head, ``softmax(h W^T + b)``, without the (N, V) logits.

A language model's last step, ``F.cross_entropy(h @ W.T, y)``, holds the logits, their
softmax and its gradient at once: three (N, V) tensors, which at V = 128k dwarf the
model's activations. Here the rows go through in chunks: each chunk's logits are made,
reduced to its loss and (when a gradient will be taken) its gradients, and dropped.
The gradients are computed in the forward pass, as Liger-Kernel's fused linear cross
entropy does, so training costs the same three matmuls as the plain form; a call
without a gradient (evaluation) costs one.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import Tensor

from torchfn.core.custom_vjp import custom_vjp

__all__ = ["linear_cross_entropy"]

_REDUCTIONS = ("mean", "sum", "none")


class _Opts(NamedTuple):
    chunk_size: int
    ignore_index: int
    label_smoothing: float
    z_loss: float
    softcap: float  # 0: none
    reduction: str


def _chunk_loss(opts: _Opts, h: Tensor, weight: Tensor, bias: Tensor | None, y: Tensor):
    """One chunk's per-row losses ``(n,)`` and what its gradient needs: the fp32 logits
    ``(n, V)``, their logsumexp ``(n,)``, ``tanh`` of the capped logits, the valid rows."""
    z = h @ weight.T if bias is None else torch.addmm(bias, h, weight.T)  # (n, V)
    z = z.float() if z.dtype in (torch.float16, torch.bfloat16) else z
    t = None
    if opts.softcap:
        t = torch.tanh(z / opts.softcap)
        z = opts.softcap * t  # Gemma 2's final-logit soft-capping
    lse = torch.logsumexp(z, dim=-1)  # (n,)
    valid = y != opts.ignore_index
    picked = z.gather(-1, torch.where(valid, y, 0)[:, None])[:, 0]  # (n,)
    loss = lse - picked
    if opts.label_smoothing:
        s = opts.label_smoothing
        loss = (1 - s) * loss + s * (lse - z.mean(dim=-1))
    if opts.z_loss:
        loss = loss + opts.z_loss * lse.square()
    return torch.where(valid, loss, 0.0), z, lse, t, valid


def _chunk_dlogits(opts: _Opts, z: Tensor, lse: Tensor, t: Tensor | None, y: Tensor,
                   valid: Tensor, row_scale: Tensor) -> Tensor:
    """d(sum_i row_scale_i loss_i) / d(pre-cap logits), ``(n, V)``. Consumes ``z`` (and
    ``t``): where nothing records the ops, the result is written over them."""
    scale = torch.where(valid, row_scale, 0.0)[:, None]  # (n, 1)
    target = torch.where(valid, y, 0)[:, None]  # (n, 1)
    s = opts.label_smoothing
    if not torch.is_grad_enabled() and not _wrapped(z):  # in place: one (n, V) buffer
        d = z.sub_(lse[:, None]).exp_()  # softmax
        if opts.z_loss:
            d.mul_((1 + 2 * opts.z_loss * lse)[:, None])
        if s:
            d.sub_(s / z.shape[-1])
        d.scatter_add_(-1, target, torch.full_like(d[:, :1], -(1 - s)))
        if t is not None:
            d.mul_(t.square_().neg_().add_(1))
        return d.mul_(scale)
    d = torch.exp(z - lse[:, None])  # softmax (n, V)
    if opts.z_loss:
        d = d * (1 + 2 * opts.z_loss * lse)[:, None]
    if s:
        d = d - s / z.shape[-1]
    d = d.scatter_add(-1, target, torch.full_like(d[:, :1], -(1 - s)))  # minus the target
    if t is not None:
        d = d * (1 - t.square())  # through cap * tanh(z / cap)
    return d * scale


def _wrapped(t: Tensor) -> bool:
    """A functorch (vmap / grad) wrapper: its in-place ops have batching rules to obey."""
    if torch.compiler.is_compiling():  # no wrappers in a graph; in-place ops are fine
        return False
    return torch._C._functorch.is_functorch_wrapped_tensor(t)


def _count(opts: _Opts, labels: Tensor) -> Tensor:
    """The mean's denominator: the rows not ignored (at least 1; all ignored gives 0)."""
    return (labels != opts.ignore_index).sum().clamp(min=1)


def _chunks(opts: _Opts, n: int):
    return [(i, min(i + opts.chunk_size, n)) for i in range(0, n, opts.chunk_size)]


def _reduce(opts: _Opts, losses: Tensor, labels: Tensor) -> Tensor:
    if opts.reduction == "none":
        return losses
    total = losses.sum()
    return total / _count(opts, labels) if opts.reduction == "mean" else total


def _loss_only(opts: _Opts, hidden: Tensor, weight: Tensor, bias: Tensor | None,
               labels: Tensor) -> Tensor:
    """One matmul per chunk, nothing kept."""
    losses = torch.cat([_chunk_loss(opts, hidden[a:b], weight, bias, labels[a:b])[0]
                        for a, b in _chunks(opts, hidden.shape[0])])  # (N,)
    return _reduce(opts, losses.to(hidden.dtype), labels)


@functools.partial(custom_vjp, nondiff_argnums=(0,))
def _lce(opts: _Opts, hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor):
    """Without a gradient: the loss alone."""
    return _loss_only(opts, hidden, weight, bias, labels)


def _chunked_grads(opts: _Opts, hidden: Tensor, weight: Tensor, bias: Tensor | None,
                   labels: Tensor, row_scale: Tensor):
    """Per-row losses ``(N,)`` and the gradients of ``sum_i row_scale_i loss_i`` in
    (hidden, weight, bias), chunk by chunk; ``weight``'s accumulated in float32 at least."""
    acc = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
    losses, d_hidden = [], []
    d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)  # (V, D)
    d_bias = None if bias is None else torch.zeros(weight.shape[0], dtype=acc,
                                                   device=weight.device)
    for a, b in _chunks(opts, hidden.shape[0]):
        h, y = hidden[a:b], labels[a:b]
        loss, z, lse, t, valid = _chunk_loss(opts, h, weight, bias, y)
        d = _chunk_dlogits(opts, z, lse, t, y, valid, row_scale[a:b].to(z.dtype))  # (n, V)
        losses.append(loss)
        d_hidden.append((d.to(h.dtype) @ weight).to(h.dtype))  # (n, D)
        d_weight = d_weight + d.T.to(h.dtype) @ h  # (V, D)
        if d_bias is not None:
            d_bias = d_bias + d.sum(0)
    return (torch.cat(losses), torch.cat(d_hidden), d_weight.to(weight.dtype),
            None if bias is None else d_bias.to(bias.dtype))


def _lce_fwd(opts: _Opts, hidden, weight, bias, labels):
    if opts.reduction == "none":  # the gradient needs the cotangent of every row: later
        return _loss_only(opts, hidden, weight, bias, labels), (hidden, weight, bias, labels)
    one = torch.ones((), dtype=torch.float64, device=hidden.device)
    scale = one / _count(opts, labels) if opts.reduction == "mean" else one
    losses, *grads = _chunked_grads(opts, hidden, weight, bias, labels,
                                    scale.expand(hidden.shape[0]))
    return _reduce(opts, losses.to(hidden.dtype), labels), tuple(grads)


def _lce_bwd(opts: _Opts, res, g):
    if opts.reduction != "none":  # the gradients made in the forward, times the cotangent
        d_hidden, d_weight, d_bias = res
        return (g * d_hidden, g * d_weight, None if d_bias is None else g * d_bias, None)
    hidden, weight, bias, labels = res  # recompute each chunk, scaled per row by g
    return (*_chunked_grads(opts, hidden, weight, bias, labels, g)[1:], None)


_lce.defvjp(_lce_fwd, _lce_bwd)


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    chunk_size: int = 1024,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    reduction: str = "mean",
) -> Tensor:
    """``F.cross_entropy(hidden @ weight.T + bias, labels)``, ``chunk_size`` rows at a time.

    Peak memory holds one chunk's ``(chunk_size, V)`` logits, not all ``N x V``; the
    result and its derivatives equal the plain form's (tested to float64 rounding,
    under ``grad``, ``vmap(grad)``, ``jvp`` and Hessian-vector products). Logits of
    fp16/bf16 inputs are taken to float32 before the softmax.

    Args:
        hidden: ``(..., D)`` the last hidden states (one row per predicted token).
        weight: ``(V, D)``, the output layer's (or the tied embedding's) weight.
        labels: ``(...)`` int64 targets in ``[0, V)``, or ``ignore_index``.
        bias: optional ``(V,)``.
        chunk_size: rows per chunk; memory ``chunk_size x V`` floats per live chunk.
        ignore_index: label of rows that add nothing (padding, prompt tokens).
        label_smoothing: torch's convention, ``(1 - s) nll + s mean_c(-log p_c)``.
        z_loss: adds ``z_loss * logsumexp(logits)^2`` per row (PaLM uses 1e-4).
        softcap: logits become ``softcap * tanh(logits / softcap)`` first (Gemma 2: 30).
        reduction: ``"mean"`` over rows not ignored (0 if all are), ``"sum"`` or ``"none"``
            (``(...)``, 0 at ignored rows).

    Example::

        >>> import torch
        >>> import torch.nn.functional as F
        >>> from torchfn import random
        >>> from torchfn.losses import linear_cross_entropy
        >>> h = random.normal(random.key(0), (4, 8, 16))                  # (B, N, D)
        >>> w = random.normal(random.key(1), (100, 16))                   # (V, D)
        >>> y = random.randint(random.key(2), (4, 8), 0, 100)             # (B, N)
        >>> loss = linear_cross_entropy(h, w, y, chunk_size=10)
        >>> torch.allclose(loss, F.cross_entropy((h @ w.T).flatten(0, 1), y.flatten()))
        True
    """
    for name, x in (("hidden", hidden), ("weight", weight)):
        if not isinstance(x, Tensor) or not x.is_floating_point():
            got = x.dtype if isinstance(x, Tensor) else type(x).__name__
            raise TypeError(f"{name} must be a float tensor, got {got}")
    if hidden.dim() < 1 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be (V, D) with D = hidden.shape[-1] = "
                         f"{hidden.shape[-1] if hidden.dim() else None}, got weight "
                         f"{tuple(weight.shape)} and hidden {tuple(hidden.shape)}")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise TypeError(f"weight must have hidden's dtype and device ({hidden.dtype}, "
                        f"{hidden.device}), got {weight.dtype}, {weight.device}")
    if not isinstance(labels, Tensor) or labels.dtype not in (torch.int64, torch.int32) \
            or tuple(labels.shape) != tuple(hidden.shape[:-1]):
        got = f"{labels.dtype} {tuple(labels.shape)}" if isinstance(labels, Tensor) else \
            type(labels).__name__
        raise ValueError(f"labels must be an int tensor of shape hidden.shape[:-1] = "
                         f"{tuple(hidden.shape[:-1])}, got {got}")
    if bias is not None and (not isinstance(bias, Tensor) or tuple(bias.shape) != (
            weight.shape[0],) or bias.dtype != weight.dtype):
        raise ValueError(f"bias must be a ({weight.shape[0]},) tensor of weight's dtype, got "
                         f"{getattr(bias, 'dtype', type(bias).__name__)} "
                         f"{tuple(getattr(bias, 'shape', ()))}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if not z_loss >= 0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    opts = _Opts(chunk_size, int(ignore_index), float(label_smoothing), float(z_loss),
                 float(softcap or 0.0), reduction)
    lead = hidden.shape[:-1]
    out = _lce(opts, hidden.reshape(-1, hidden.shape[-1]), weight, bias,
               labels.reshape(-1).long())
    return out.reshape(lead) if reduction == "none" else out
