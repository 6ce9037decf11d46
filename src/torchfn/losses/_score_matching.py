"""Score matching (Hyvarinen 2005) and its sliced estimate (Song et al. 2019), per example."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from torchfn.transforms._divergence import divergence

__all__ = ["score_matching"]


def score_matching(score_fn: Callable[..., Tensor], x: Tensor, *args, key: Tensor | None = None,
                   samples: int = 1) -> Tensor:
    """Hyvarinen's score-matching loss of ``score_fn`` at one example ``x``.

    ``0.5 |s(x)|^2 + tr(ds/dx)``, whose mean over the data equals the Fisher divergence
    ``0.5 E |s(x) - grad log p(x)|^2`` up to a constant that does not depend on the
    model: no density or normalising constant needed, only the model's score.
    With a ``key`` the trace is Hutchinson's estimate from ``samples`` Rademacher probes
    (sliced score matching, the variance-reduced form): unbiased, and one
    vector-Jacobian product per probe instead of one per input dimension.

    Args:
        score_fn: ``score_fn(x, *args) -> s(x)``, shaped like ``x`` (e.g. ``-grad E(x)`` of
            an energy model, or a network that outputs the score directly).
        x: one example, any shape (``vmap`` for a batch).
        key: ``None`` for the exact trace; a PRNG key for the sliced estimate.
        samples: probes for the sliced estimate.

    Returns:
        A 0-d tensor.

    Example (a Gaussian model's score at the data's own parameters)::

        >>> import torch
        >>> from torchfn import losses, random
        >>> score = lambda x, prec: -prec @ x          # N(0, prec^-1): s(x) = -prec x
        >>> x = random.normal(random.key(0), (512, 2))
        >>> l_true = torch.vmap(lambda x: losses.score_matching(score, x, torch.eye(2)))(x)
        >>> l_off = torch.vmap(lambda x: losses.score_matching(score, x, 3 * torch.eye(2)))(x)
        >>> bool(l_true.mean() < l_off.mean())         # the data's precision scores better
        True
    """
    if not callable(score_fn):
        raise TypeError(f"score_matching: score_fn must be callable, got {type(score_fn).__name__}")
    s, div = divergence(score_fn, x, *args, key=key, samples=samples, return_value=True)
    return 0.5 * (s * s).sum() + div
