"""MCMC diagnostics over chains: split R-hat and the effective sample size, Stan's
estimators (as blackjax, numpyro and ArviZ compute them, without rank normalisation).

Both take draws ``(chains, draws, ...)`` (what ``vmap`` over :func:`hmc` returns) and
give one value per parameter ``(...)``; neither branches on values, so they run under
``vmap`` and ``torch.compile``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["rhat", "effective_sample_size"]


def _check(samples: object, who: str, min_draws: int) -> Tensor:
    if not isinstance(samples, Tensor) or not samples.dtype.is_floating_point:
        got = samples.dtype if isinstance(samples, Tensor) else type(samples).__name__
        raise TypeError(f"{who}: samples must be a floating-point tensor (chains, draws, "
                        f"...), got {got}")
    if samples.dim() < 2 or samples.shape[1] < min_draws:
        raise ValueError(f"{who}: samples must have shape (chains, draws, ...) with at least "
                         f"{min_draws} draws, got {tuple(samples.shape)}")
    return samples


def _variances(x: Tensor) -> tuple[Tensor, Tensor]:
    """Within-chain variance ``W`` and the pooled estimate ``var+`` of ``x (C, N, ...)``."""
    n = x.shape[1]
    within = x.var(1).mean(0)  # (...)
    between = x.mean(1).var(0) if x.shape[0] > 1 else torch.zeros_like(within)  # B / N
    return within, (n - 1) / n * within + between


def rhat(samples: Tensor) -> Tensor:
    """Split R-hat (Gelman et al., *Bayesian Data Analysis*, 3rd ed., 11.4): each chain
    cut in two halves, ``sqrt(var+ / W)`` over the ``2 * chains`` halves. Near 1 when the
    chains agree; above 1.01 is Stan's warning sign.

    Args:
        samples: ``(chains, draws, ...)`` draws, ``draws >= 4``.

    Returns:
        ``(...)``: one R-hat per parameter.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> mixed = random.normal(random.key(0), (4, 1000))             # 4 agreeing chains
        >>> stuck = mixed + torch.arange(4.0)[:, None]                  # 4 disagreeing ones
        >>> bool(rhat(mixed) < 1.01), bool(rhat(stuck) > 1.5)
        (True, True)
    """
    x = _check(samples, "rhat", 4)
    half = x.shape[1] // 2
    split = torch.cat([x[:, :half], x[:, -half:]])  # (2C, N/2, ...): drops a middle draw
    within, pooled = _variances(split)
    return (pooled / within).sqrt()


def effective_sample_size(samples: Tensor) -> Tensor:
    """The effective sample size of the chains' mean (Stan's estimator; Geyer's initial
    monotone sequence): ``chains * draws / tau`` with the integrated autocorrelation time
    ``tau = -1 + 2 sum_k (rho_2k + rho_2k+1)``, the pair sums cut at the first negative
    one and made non-increasing, and ``rho_t`` the autocorrelation combined over chains
    through ``var+`` (so disagreeing chains count as correlated).

    Args:
        samples: ``(chains, draws, ...)`` draws, ``draws >= 4``.

    Returns:
        ``(...)``: one effective sample size per parameter (``chains * draws`` for
        independent draws; an AR(1) chain with coefficient ``phi`` gives about
        ``chains * draws * (1 - phi) / (1 + phi)``).

    Example::

        >>> from torchfn import random
        >>> iid = random.normal(random.key(0), (4, 1000))
        >>> 3600 < float(effective_sample_size(iid)) < 4400
        True
    """
    x = _check(samples, "effective_sample_size", 4)
    C, N = x.shape[:2]
    centred = x - x.mean(1, keepdim=True)
    size = 1 << (2 * N - 1).bit_length()  # zero-padded FFT: no circular wrap
    spectrum = torch.fft.rfft(centred, n=size, dim=1)
    acov = torch.fft.irfft(spectrum * spectrum.conj(), n=size, dim=1)[:, :N] / N  # (C, N, ...)
    within, pooled = _variances(x)
    rho = 1 - (within - acov.mean(0)) / pooled  # (N, ...)
    rho = torch.cat([torch.ones_like(rho[:1]), rho[1:]])
    even = N - N % 2
    pairs = rho[0:even:2] + rho[1:even:2]  # (N // 2, ...)
    # Geyer: stop at the first negative pair sum, and make the sums non-increasing
    pairs = torch.cat([pairs[:1], pairs[1:].clamp(min=0).cummin(0).values])
    tau = -1 + 2 * pairs.sum(0)
    return C * N / tau.clamp(min=1.0 / torch.log10(torch.tensor(float(C * N))))
