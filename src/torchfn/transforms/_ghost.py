"""Ghost clipping: per-example gradient norms of Linear layers without per-example grads.

For a linear layer ``out = a @ W.T + b`` and per-example losses ``l_n`` the
gradient of example ``n`` is ``g_n = delta_n^T a_n`` with
``delta_n = dl_n / d out_n``. Its squared norm needs no ``(d_out, d_in)``
matrix per example (Goodfellow 2015; Li et al. 2022 for sequences):

- single token, ``a_n: (d_in,)``:  ``||g_n||^2 = ||a_n||^2 ||delta_n||^2``
- sequence, ``a_n: (T, d_in)``:     ``||g_n||^2 = sum_{t,s} (a_t . a_s)(delta_t . delta_s)``
  (the Gram form, ``O(T^2 (d_in + d_out))``; when ``T^2`` exceeds
  ``d_in d_out / 2`` the per-example gradient is cheaper and is used instead)
- bias:                             ``||sum_t delta_t||^2``

:func:`ghost_clip_grads` does one batched forward and one backward to the
layer outputs (activations ``a`` and backprops ``delta`` captured on the way),
computes the norms above, then forms the clipped SUM of gradients directly
from the same ``a`` and ``delta`` ("book-keeping", Bu et al. 2023):
``sum_n c_n delta_n^T a_n`` with ``c_n = min(1, C / (||g_n|| + 1e-6))``. No
second backward pass, no per-example gradient tensors.

Capture is pure: a ``TorchFunctionMode`` active only during the call records
every ``F.linear`` whose weight is one of ``params``; no hooks are left on any
module. Requirements (checked, with errors naming the parameter):

- every parameter is the ``weight`` or ``bias`` of exactly one ``F.linear``
  call (``nn.Linear`` layers; parameter-free layers in between are fine);
- each Linear input keeps the batch as its leading dim: ``(B, d)`` or
  ``(B, ..., d)``;
- examples do not interact (no BatchNorm in train mode): ``delta_n`` must be
  the gradient of ``l_n`` alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from torchfn import tree
from torchfn.transforms._per_sample import clip_coefficients

__all__ = ["GhostClipResult", "ghost_norms", "ghost_clip_grads"]

PyTree = Any


class GhostClipResult(NamedTuple):
    grads: PyTree  # clipped sum of per-example grads, shaped like params
    norms: torch.Tensor  # (B,) unclipped per-example gradient norms
    losses: torch.Tensor  # (B,) per-example losses (detached)


class _Record(NamedTuple):
    weight: int  # leaf index of the weight
    bias: int | None  # leaf index of the bias
    a: torch.Tensor  # (B, ..., d_in) layer input
    out: torch.Tensor  # (B, ..., d_out) layer output


def _tensors(args: tuple, kwargs: dict) -> list:
    out = []
    for v in (*args, *kwargs.values()):
        out.extend(v if isinstance(v, (list, tuple)) else (v,))
    return [t for t in out if isinstance(t, torch.Tensor)]


class _LinearCapture(TorchFunctionMode):
    """Records F.linear calls on the given leaves; flags any other use of them."""

    def __init__(self, ids: dict[int, int], names: list[str]):
        super().__init__()
        self.ids, self.names = ids, names
        self.records: list[_Record] = []
        self.used: dict[int, int] = {}

    def _use(self, i: int) -> None:
        self.used[i] = self.used.get(i, 0) + 1
        if self.used[i] > 1:
            raise ValueError(
                f"ghost clipping: parameter {self.names[i]!r} is used more than once in the "
                "forward (tied or reused weights are not supported); use per_sample_grads"
            )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0] if args else kwargs["input"]
            w = args[1] if len(args) > 1 else kwargs["weight"]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            wi = self.ids.get(id(w))
            bi = self.ids.get(id(b)) if b is not None else None
            if wi is not None:
                self._use(wi)
                if bi is not None:
                    self._use(bi)
                out = func(*args, **kwargs)
                self.records.append(_Record(wi, bi, x, out))
                return out
            if bi is not None:
                raise ValueError(
                    f"ghost clipping: parameter {self.names[bi]!r} is a Linear bias whose "
                    "weight is not a parameter"
                )
        else:
            used = [self.ids[id(t)] for t in _tensors(args, kwargs) if id(t) in self.ids]
            if used:  # metadata queries (.shape, .dtype) are fine; differentiable uses are not
                out = func(*args, **kwargs)
                if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree.leaves(out)):
                    raise ValueError(
                        f"ghost clipping supports parameters of Linear layers only: "
                        f"{self.names[used[0]]!r} is used by {getattr(func, '__name__', func)}"
                    )
                return out
        return func(*args, **kwargs)


def _capture(loss_fn: Callable[..., torch.Tensor], params: PyTree, batch: tuple, weights):
    """Forward + backward to the Linear outputs. Returns (records, deltas, losses, leaves, spec)."""
    leaves, spec = tree.flatten(params)
    names = tree.paths(params)
    if not leaves:
        raise ValueError("params has no leaves")
    live = [p.detach().requires_grad_(True) for p in leaves]  # fresh leaves: no user state touched
    mode = _LinearCapture({id(p): i for i, p in enumerate(live)}, names)
    with torch.enable_grad():
        with mode:
            losses = loss_fn(tree.unflatten(spec, live), *batch)
        if not isinstance(losses, torch.Tensor) or losses.ndim != 1:
            shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses)
            raise ValueError(
                "ghost clipping needs loss_fn(params, *batch) to return per-example losses "
                f"of shape (B,), got {shape}"
            )
        missing = [names[i] for i in range(len(live)) if i not in mode.used]
        if missing:
            raise ValueError(
                f"ghost clipping: parameters {missing} were not used as the weight/bias of a "
                "Linear layer in the forward; only Linear parameters are supported"
            )
        b = losses.shape[0]
        for r in mode.records:
            if r.a.ndim < 2 or r.a.shape[0] != b:
                raise ValueError(
                    f"ghost clipping: the input of the Linear with weight {names[r.weight]!r} "
                    f"must have the batch (B={b}) as leading dim, got shape {tuple(r.a.shape)}"
                )
        total = losses
        if weights is not None:
            if weights.shape != losses.shape:
                raise ValueError(
                    f"weights must have shape {tuple(losses.shape)}, got {tuple(weights.shape)}"
                )
            total = losses * weights.to(losses.dtype)
        outs = [r.out for r in mode.records]
        deltas = torch.autograd.grad(total.sum(), outs, allow_unused=True)
    deltas = [torch.zeros_like(o) if d is None else d for d, o in zip(deltas, outs)]
    return mode.records, deltas, losses.detach(), live, spec


def _as_seq(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(1, -2) if x.ndim > 2 else x[:, None, :]  # (B, T, d)


def _sq_norms(records: list[_Record], deltas: list[torch.Tensor]) -> torch.Tensor:
    total = 0
    for r, d in zip(records, deltas):
        a, d = _as_seq(r.a.detach()), _as_seq(d)  # (B, T, d_in), (B, T, d_out)
        t, d_in, d_out = a.shape[1], a.shape[2], d.shape[2]
        if t == 1:
            w = a.pow(2).sum((1, 2)) * d.pow(2).sum((1, 2))  # ||a||^2 ||delta||^2
        elif 2 * t * t <= d_in * d_out:
            ga = a @ a.transpose(1, 2)  # (B, T, T)
            gd = d @ d.transpose(1, 2)  # (B, T, T)
            w = (ga * gd).sum((1, 2))
        else:
            w = torch.einsum("bto,bti->boi", d, a).pow(2).sum((1, 2))  # (B, d_out, d_in)
        total = total + w
        if r.bias is not None:
            total = total + d.sum(1).pow(2).sum(1)
    return total  # (B,)


def ghost_norms(
    loss_fn: Callable[..., torch.Tensor], params: PyTree, *batch: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example gradient norms of a Linear-only model, without per-example grads.

    Args:
        loss_fn: ``loss_fn(params, *batch) -> (B,)`` per-example losses of a
            BATCHED forward (unlike :func:`per_sample_grads`).
        params: pytree of Linear weights ``(d_out, d_in)`` and biases ``(d_out,)``.

    Returns:
        ``(norms (B,), losses (B,))``; ``norms`` equals
        ``per_sample_grad_norms`` of the single-example loss.

    Example::

        >>> import torch
        >>> import torch.nn.functional as F
        >>> from torchfn import random
        >>> from torchfn.transforms import ghost_norms, per_sample_grad_norms
        >>> params = {"weight": torch.ones(2, 3), "bias": torch.zeros(2)}    # one Linear
        >>> def loss_fn(p, x, y):                       # batched: x (B, 3), y (B, 2) -> (B,)
        ...     return ((F.linear(x, p["weight"], p["bias"]) - y) ** 2).sum(-1)
        >>> x, y = random.normal(random.key(0), (4, 3)), random.normal(random.key(1), (4, 2))
        >>> norms, losses = ghost_norms(loss_fn, params, x, y)
        >>> norms.shape, losses.shape
        (torch.Size([4]), torch.Size([4]))
        >>> one = lambda p, x, y: loss_fn(p, x[None], y[None])[0]   # the loss of ONE example
        >>> bool(torch.allclose(norms, per_sample_grad_norms(one)(params, x, y)))
        True
    """
    records, deltas, losses, _, _ = _capture(loss_fn, params, batch, None)
    return _sq_norms(records, deltas).sqrt(), losses


def ghost_clip_grads(
    loss_fn: Callable[..., torch.Tensor],
    params: PyTree,
    *batch: Any,
    l2_norm_clip: float,
    weights: torch.Tensor | None = None,
) -> GhostClipResult:
    """Clipped sum of per-example gradients by ghost clipping (one forward, one backward).

    Equals ``clip_and_sum(per_sample_grads(...)(params, *batch), C)`` for
    models whose parameters are all ``nn.Linear`` weights and biases.

    Args:
        loss_fn: ``loss_fn(params, *batch) -> (B,)`` per-example losses.
        params: pytree of Linear parameters (any tensors; not modified).
        *batch: batched inputs, leading dim ``B``.
        l2_norm_clip: ``C > 0``.
        weights: optional ``(B,)`` per-example loss weights, e.g. a 0/1 padding
            mask from :func:`pad_batch` (a 0 row contributes nothing).

    Returns:
        :class:`GhostClipResult` ``(grads, norms (B,), losses (B,))``.

    Example::

        >>> import torch
        >>> import torch.nn.functional as F
        >>> from torch import nn
        >>> import torchfn
        >>> from torchfn import random
        >>> from torchfn.transforms import clip_and_sum, ghost_clip_grads, per_sample_grads
        >>> mlp = torchfn.Model(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))
        >>> params = mlp.init(random.key(0))             # {'0.weight': (8, 4), ...}
        >>> def loss_fn(params, x, y):                   # x: (B, 4), y: (B,)
        ...     return F.cross_entropy(mlp.apply(params, x), y, reduction="none")   # (B,)
        >>> x, y = random.normal(random.key(0), (5, 4)), torch.tensor([0, 1, 2, 0, 1])
        >>> res = ghost_clip_grads(loss_fn, params, x, y, l2_norm_clip=0.1)
        >>> res.grads["0.weight"].shape, res.norms.shape   # shaped like params, (B,)
        (torch.Size([8, 4]), torch.Size([5]))
        >>> one = lambda p, x, y: loss_fn(p, x[None], y[None])[0]   # the loss of ONE example
        >>> ref, _ = clip_and_sum(per_sample_grads(one)(params, x, y), 0.1)
        >>> all(torch.allclose(res.grads[k], ref[k], atol=1e-6) for k in params)
        True
    """
    if not isinstance(l2_norm_clip, (int, float)) or l2_norm_clip <= 0:
        raise ValueError(f"l2_norm_clip must be a number > 0, got {l2_norm_clip!r}")
    records, deltas, losses, live, spec = _capture(loss_fn, params, batch, weights)
    norms = _sq_norms(records, deltas).sqrt()  # (B,)
    coef = clip_coefficients(norms, l2_norm_clip)  # (B,)
    grads: list[torch.Tensor | None] = [None] * len(live)
    for r, d in zip(records, deltas):
        a = _as_seq(r.a.detach())  # (B, T, d_in)
        dc = _as_seq(d) * coef.to(d.dtype)[:, None, None]  # (B, T, d_out) clip-weighted
        grads[r.weight] = dc.flatten(0, 1).T @ a.flatten(0, 1)  # (d_out, d_in)
        if r.bias is not None:
            grads[r.bias] = dc.sum((0, 1))  # (d_out,)
    grads = [g.reshape(p.shape) for g, p in zip(grads, live)]
    return GhostClipResult(tree.unflatten(spec, grads), norms, losses)
