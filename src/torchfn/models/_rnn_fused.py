"""One LSTM or GRU layer (one direction) as an ``autograd.Function``, for plain eager
mode only.

``models.LSTM`` and ``models.GRU`` are a ``scan`` of plain ops so that every
``torch.func`` transform and forward-mode AD go through them. In plain eager training
that costs: autograd records about seven nodes a step and replays them one by one. This
Function runs torch's own layer instead (``torch.lstm`` / ``torch.gru``, what
``nn.LSTM`` / ``nn.GRU`` call: oneDNN's fused kernels on a CPU), forward and backward,
with its autograd graph kept inside the Function's node. torch's fused backward cannot
be differentiated again, so a backward with ``create_graph=True`` (double backward)
differentiates the scan instead, and higher derivatives stay exact.

It is used only where nothing else can see the difference (``fusable``): no
``torch.func`` transform, no forward-mode AD, no tracing, plain tensors.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.autograd import forward_ad

from torchfn.core._eager import plain
from torchfn.core.scan import scan


def fusable(*ts: Tensor) -> bool:
    """Plain eager mode: no transform, no forward AD, no tracing, plain tensors
    (``nn.Parameter`` included)."""
    if torch._C._are_functorch_transforms_active() or forward_ad._current_level >= 0:
        return False
    if torch.compiler.is_compiling():
        return False
    return all(type(t) in (Tensor, nn.Parameter) and plain(t.detach()) for t in ts)


@contextlib.contextmanager
def _quiet_cudnn(x: Tensor):
    """On CUDA, cuDNN warns that separate weights are copied into one buffer on every
    call (as ``nn.LSTM``'s after ``.to()`` without ``flatten_parameters``): that copy is
    the price of weights kept as a pytree. Nothing to silence on a CPU (and changing the
    warning filters costs ~0.5 ms a call there)."""
    if not x.is_cuda:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="RNN module weights are not part")
        yield


class _TorchLayer(torch.autograd.Function):
    """``(cell, x (T, B, F), w_ih, w_hh, b_ih, b_hh, w_hr (each may be None), *state)``
    -> ``(ys (T, B, R), *final state)``; ``state`` is ``(h0 (B, R), c0 (B, H))`` for an
    LSTM (``R`` = proj_size, or H without ``w_hr``), ``(h0,)`` for a GRU; ``cell`` is
    ``_rnn._lstm`` or ``_rnn._gru``, the scan a double backward differentiates."""

    @staticmethod
    def forward(ctx, cell: Callable, x, w_ih, w_hh, b_ih, b_hh, w_hr, *state):
        inputs = (x, w_ih, w_hh, b_ih, b_hh, w_hr, *state)
        ctx.cell = cell
        ctx.save_for_backward(*inputs)  # for a double backward
        leaves = [None if t is None else t.detach().requires_grad_(need)
                  for t, need in zip(inputs, ctx.needs_input_grad[1:])]
        x, w_ih, w_hh, b_ih, b_hh, w_hr, *state = leaves
        weights = [w for w in (w_ih, w_hh, b_ih, b_hh, w_hr) if w is not None]
        run = torch.lstm if len(state) == 2 else torch.gru
        hx = tuple(s[None] for s in state) if len(state) == 2 else state[0][None]
        with torch.enable_grad(), _quiet_cudnn(x):  # their graph kept inside
            ys, *finals = run(x, hx, weights, b_ih is not None, 1, 0.0, True, False, False)
            outs = (ys, *(s[0] for s in finals))
        ctx.inner = (leaves, outs)
        return tuple(t.detach() for t in outs)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        inner = getattr(ctx, "inner", None)
        if torch.is_grad_enabled() or inner is None:
            # create_graph, or a second backward (retain_graph=True; without it, reading
            # the saved inputs raises torch's "backward through the graph a second time")
            return (None, *_through_the_scan(ctx, grads))
        leaves, outs = inner
        del ctx.inner  # freed now, as autograd frees saved tensors after a backward
        wanted = [t for t in leaves if t is not None and t.requires_grad]
        got = iter(torch.autograd.grad(outs, wanted, grads, allow_unused=True))
        return (None, *(next(got) if t is not None and t.requires_grad else None
                        for t in leaves))


def _through_the_scan(ctx, grads: tuple[Tensor, ...]) -> tuple:
    x, w_ih, w_hh, b_ih, b_hh, w_hr, *state = inputs = ctx.saved_tensors
    need = ctx.needs_input_grad[1:]
    wanted = [t for t, n in zip(inputs, need) if n]
    create_graph = torch.is_grad_enabled()
    with torch.enable_grad():
        gx, step = ctx.cell(x, w_ih, w_hh, b_ih, b_hh, w_hr)  # (T, B, G*H)
        carry, ys = scan(step, tuple(state) if len(state) == 2 else state[0], gx)
        outs = (ys, *(carry if len(state) == 2 else (carry,)))
        got = iter(torch.autograd.grad(outs, wanted, grads, create_graph=create_graph,
                                       allow_unused=True))
    return tuple(next(got) if n else None for n in need)


def torch_layer(cell: Callable, x: Tensor, init, w_ih: Tensor, w_hh: Tensor,
                b_ih: Tensor | None, b_hh: Tensor | None, w_hr: Tensor | None,
                reverse: bool = False):
    """One layer through torch's kernels, as ``scan`` returns it: ``(carry, ys)`` with
    ``carry`` = ``(h_T, c_T)`` for an LSTM (``init`` = ``(h0, c0)``), ``h_T`` for a GRU
    (``init`` = ``h0``)."""
    state = tuple(init) if isinstance(init, (tuple, list)) else (init,)
    ys, *finals = _TorchLayer.apply(cell, x.flip(0) if reverse else x, w_ih, w_hh, b_ih,
                                    b_hh, w_hr, *state)
    carry = tuple(finals) if len(finals) == 2 else finals[0]
    return carry, (ys.flip(0) if reverse else ys)
