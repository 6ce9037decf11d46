"""Read a value across every ``vmap`` lane, for loops that stop when all lanes are done.

Under ``vmap`` a function sees one example, and Python cannot branch on a batched
value: an adaptive loop (a solver that stops at a tolerance, an ODE step-size control)
would have to run a fixed number of iterations. JAX's ``while_loop`` batches instead by
running until every lane is done, the finished lanes masked. ``lanes(t)`` gives the
same here: it peels the ``torch.func`` wrappers off ``t`` and returns the plain tensor
holding every lane of every level, which the loop may read (``.all()``, ``.max()``).
The loop must keep finished lanes unchanged itself (``torch.where``).

Not under ``torch.compile`` (the caller must run eagerly there).
"""

from __future__ import annotations

import torch
from torch._C._functorch import get_unwrapped, is_batchedtensor, is_functorch_wrapped_tensor


def lanes(t: torch.Tensor) -> torch.Tensor:
    """``t`` with every vmap lane (and grad wrapper) peeled: a plain tensor to read."""
    while is_functorch_wrapped_tensor(t) or is_batchedtensor(t):
        t = get_unwrapped(t)
    return t.detach()


def all_lanes(t: torch.Tensor) -> bool:
    """True when the boolean ``t`` holds in every lane."""
    return bool(lanes(t).all())


def max_over_lanes(t: torch.Tensor) -> float:
    """The largest value of ``t`` over every lane."""
    return float(lanes(t).max())
