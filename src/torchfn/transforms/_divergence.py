"""The divergence ``tr(df/dx)`` of a vector field, exact or by Hutchinson's estimator.

Continuous normalizing flows (the trace in ``d log p / dt``), score matching (the
trace of the score's Jacobian) and Stein's identities all need it. One forward pass
is shared by every probe: exact is ``n`` vector-Jacobian products, the rows of ``J``
(batched by ``vmap``); Hutchinson's ``E[v^T J v]`` with Rademacher probes ``v``
(FFJORD, sliced score matching) is one product per probe, unbiased, with probes drawn
from a ``torchfn.random`` key so a training step stays reproducible and ``vmap`` over
keys gives each example its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.func import vjp, vmap

from torchfn import random

__all__ = ["divergence"]

_DISTS = ("rademacher", "normal")


def divergence(f: Callable[..., torch.Tensor], x: torch.Tensor, *args, key=None,
               samples: int = 1, probe: str = "rademacher",
               return_value: bool = False):
    """``tr(df/dx)`` at ``x`` for ``f(x, *args)`` with the shape of ``x``.

    Args:
        f: ``x -> f(x)`` (one example), the output shaped like ``x``; ``args`` are
            passed after ``x`` and not differentiated here.
        x: a tensor (any shape: the trace is over all its entries).
        key: ``None`` for the exact trace; a PRNG key for Hutchinson's estimator.
        samples: probes averaged by the estimator.
        probe: ``"rademacher"`` (the least variance for a fixed Jacobian) or ``"normal"``.
        return_value: also return ``f(x)`` (computed in the same forward passes).

    Returns:
        ``div`` (a 0-d tensor), or ``(f(x), div)``.

    Example::

        >>> import torch
        >>> from torchfn import random, transforms
        >>> f = lambda x: torch.tanh(x) * 2            # x: (3,); df/dx = diag(2 (1 - tanh^2))
        >>> x = torch.tensor([0.0, 1.0, -1.0])
        >>> exact = transforms.divergence(f, x)
        >>> torch.allclose(exact, (2 * (1 - torch.tanh(x) ** 2)).sum())
        True
        >>> est = transforms.divergence(f, x, key=random.key(0), samples=4096)
        >>> bool((est - exact).abs() < 0.01)           # diagonal J: Rademacher is exact
        True
    """
    if not callable(f):
        raise TypeError(f"divergence: f must be callable, got {type(f).__name__}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = f"a tensor of dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"divergence: x must be a floating-point tensor, got {got}")
    if probe not in _DISTS:
        raise ValueError(f"divergence: probe must be one of {_DISTS}, got {probe!r}")
    if not (isinstance(samples, int) and samples >= 1):
        raise ValueError(f"divergence: samples must be a positive int, got {samples!r}")

    def g(x):
        out = f(x, *args)
        if not isinstance(out, torch.Tensor) or out.shape != x.shape:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"divergence: f(x) must have x's shape {tuple(x.shape)}, got {got}")
        return out

    fx, pull = vjp(g, x)  # one forward pass, shared by every probe below
    if key is None:  # the exact trace: e_i^T J for every basis vector e_i, batched
        n = x.numel()
        basis = torch.eye(n, dtype=x.dtype, device=x.device).reshape(n, *x.shape)
        (rows,) = vmap(pull)(basis)  # (n, *x.shape): the rows of J
        div = rows.reshape(n, n).diagonal().sum()
    else:
        shape = (samples, *x.shape)
        if probe == "rademacher":
            v = random.rademacher(key, shape, dtype=x.dtype)
        else:
            v = random.normal(key, shape, dtype=x.dtype)
        (vj,) = vmap(pull)(v)  # (samples, *x.shape): v^T J
        div = (vj * v).reshape(samples, -1).sum(-1).mean()
    return (fx, div) if return_value else div
