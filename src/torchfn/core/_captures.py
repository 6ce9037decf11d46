"""Refuse closures over tensors being differentiated, inside an ``autograd.Function``.

A Function's forward records no graph, so a tensor it uses without receiving it as an
argument (a closure over parameters, an ``nn.Module`` attribute) would silently get no
gradient. ``no_captured_grads(who, inputs)`` raises ``ValueError`` instead. It checks
``requires_grad``, not "is a functorch wrapper": ``torch.func.grad`` wraps every
argument of the function it differentiates, also those it does not differentiate.

The mode sees every torch call in the forward, so it scans the arguments by hand (one
level of lists and tuples, as torch ops take them) rather than flattening pytrees.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch._C._functorch import maybe_get_level
from torch.overrides import TorchFunctionMode


class _NoCapturedGrads(TorchFunctionMode):
    def __init__(self, who: str, inputs: Sequence[torch.Tensor]):
        super().__init__()
        self.who = who
        self.inputs = {id(t) for t in inputs}
        # a view keeps requires_grad under no_grad, so slicing an argument inside the
        # forward (``x[a:b]``) makes one: accept views of the arguments' storage
        self.bases = {id(_base(t)) for t in inputs}

    def _check(self, t: torch.Tensor) -> None:
        if t.requires_grad and id(t) not in self.inputs and id(_base(t)) not in self.bases \
                and not _made_inside(t):
            raise ValueError(
                f"{self.who}: the function uses a tensor that is being differentiated but is "
                f"not one of its arguments (shape {tuple(t.shape)}; a closure over "
                "parameters or a module attribute?). Pass it as an argument, or it gets no "
                "gradient"
            )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        for a in (*args, *(kwargs.values() if kwargs else ())):
            if isinstance(a, torch.Tensor):
                self._check(a)
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if isinstance(b, torch.Tensor):
                        self._check(b)
        return func(*args, **(kwargs or {}))


def _base(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage ``t`` views (``t`` itself if it is not a view)."""
    return t if t._base is None else t._base


def _made_inside(t: torch.Tensor) -> bool:
    """True for a tensor of a transform run inside the forward: a nested ``jacrev``
    wraps its inputs with ``requires_grad`` at a level active there, and what it leaves
    behind is wrapped at a dead level (-2). A captured tensor is a plain one (-1) or
    wrapped at an outer level, which the forward runs with popped off the stack."""
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    level = maybe_get_level(t)
    if level == -1:
        return False
    return level == -2 or any(i.level() == level for i in retrieve_all_functorch_interpreters())


def no_captured_grads(who: str, inputs: Sequence[torch.Tensor]):
    """The check in eager mode; under ``torch.compile`` dynamo tracks captures itself."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return _NoCapturedGrads(who, inputs)
