"""MCMC diagnostics over chains: split R-hat and the effective sample size, Stan's
estimators as blackjax, numpyro and ArviZ compute them, and their rank-normalised forms
(Vehtari et al., 2021: ``method="rank"`` R-hat, ``"bulk"`` and ``"tail"`` ESS, ArviZ's
and Stan's defaults today), which also see chains that differ in scale or in the tails
and stay meaningful for heavy-tailed draws.

Both take draws ``(chains, draws, ...)`` (what ``vmap`` over :func:`hmc` returns) and
give one value per parameter ``(...)``; neither branches on values, so they run under
``vmap`` and ``torch.compile``.
"""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch import Tensor

__all__ = ["rhat", "effective_sample_size", "summary", "print_summary", "bfmi"]


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


def _split(x: Tensor) -> Tensor:
    """Each chain cut in two halves: ``(C, N, ...)`` -> ``(2C, N // 2, ...)`` (an odd
    ``N`` drops the middle draw)."""
    half = x.shape[1] // 2
    return torch.cat([x[:, :half], x[:, -half:]])


def _rhat_of(halves: Tensor) -> Tensor:
    """``sqrt(var+ / W)`` over already split chains."""
    within, pooled = _variances(halves)
    return (pooled / within).sqrt()


def _quantile(x: Tensor, q: float) -> Tensor:
    """The ``q`` quantile of all draws of ``x (C, N, ...)`` per parameter, interpolated
    linearly (R's type 7, numpy's default); by a sort, which has a ``vmap`` rule where
    ``torch.quantile`` has none."""
    ordered = x.reshape(-1, *x.shape[2:]).sort(0).values  # (S, ...)
    h = (ordered.shape[0] - 1) * q
    lo = int(h)
    hi = min(lo + 1, ordered.shape[0] - 1)
    return ordered[lo] + (h - lo) * (ordered[hi] - ordered[lo])


def _rank_normal(x: Tensor) -> Tensor:
    """The normal scores of the pooled ranks: ``Φ⁻¹((r - 3/8) / (S + 1/4))`` with ``r``
    the average rank (ties share it) among all ``S = C N`` draws, per parameter."""
    C, N = x.shape[:2]
    flat = x.reshape(C * N, -1).T.contiguous()  # (P, S)
    ordered = flat.sort(-1).values.contiguous()
    lo = torch.searchsorted(ordered, flat, side="left")
    hi = torch.searchsorted(ordered, flat, side="right")
    rank = (lo + hi + 1).to(x.dtype) / 2  # 1-based average rank
    z = torch.special.ndtri((rank - 0.375) / (C * N + 0.25))
    return z.T.reshape(x.shape)


def rhat(samples: Tensor, *, method: str = "split") -> Tensor:
    """Split R-hat (Gelman et al., *Bayesian Data Analysis*, 3rd ed., 11.4): each chain
    cut in two halves, ``sqrt(var+ / W)`` over the ``2 * chains`` halves. Near 1 when the
    chains agree; above 1.01 is Stan's warning sign.

    ``method="rank"`` is the rank-normalised R-hat of Vehtari et al. (2021), ArviZ's
    default: the larger of the split R-hat of the draws' normal scores (the bulk) and of
    the normal scores of their distance to the median (the tails), so chains with the
    same mean but different scales are caught; the bulk part is the same for any
    monotone transform of the draws.

    Args:
        samples: ``(chains, draws, ...)`` draws, ``draws >= 4``.
        method: ``"split"`` or ``"rank"``.

    Returns:
        ``(...)``: one R-hat per parameter.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> mixed = random.normal(random.key(0), (4, 1000))             # 4 agreeing chains
        >>> stuck = mixed + torch.arange(4.0)[:, None]                  # 4 disagreeing ones
        >>> bool(rhat(mixed) < 1.01), bool(rhat(stuck) > 1.5)
        (True, True)
        >>> wide = mixed * torch.tensor([1.0, 1.0, 1.0, 3.0])[:, None]  # one chain wider
        >>> bool(rhat(wide) < 1.05), bool(rhat(wide, method="rank") > 1.1)
        (True, True)
    """
    x = _check(samples, "rhat", 4)
    if method == "split":
        return _rhat_of(_split(x))
    if method != "rank":
        raise ValueError(f"rhat: method must be 'split' or 'rank', got {method!r}")
    # split first, then fold and rank (an odd chain's middle draw is left out), as
    # ArviZ; the median is numpy's (the mean of the middle two)
    halves = _split(x)
    bulk = _rhat_of(_rank_normal(halves))
    tail = _rhat_of(_rank_normal((halves - _quantile(halves, 0.5)).abs()))
    return torch.maximum(bulk, tail)


def effective_sample_size(samples: Tensor, *, method: str = "mean") -> Tensor:
    """The effective sample size of the chains' mean (Stan's estimator; Geyer's initial
    monotone sequence): ``chains * draws / tau`` with the integrated autocorrelation time
    ``tau = -1 + 2 sum_k (rho_2k + rho_2k+1)``, the pair sums cut at the first negative
    one and made non-increasing, and ``rho_t`` the autocorrelation combined over chains
    through ``var+`` (so disagreeing chains count as correlated).

    ``method="bulk"`` and ``"tail"`` are Vehtari et al.'s (2021), ArviZ's and Stan's
    ``ess_bulk`` / ``ess_tail``, on split chains as theirs: the ESS of the draws' normal
    scores (for the centre of the distribution, finite for heavy tails), and the smaller
    ESS of the indicators of the draws below their 5% and 95% quantiles (for interval
    ends).

    Args:
        samples: ``(chains, draws, ...)`` draws, ``draws >= 4``.
        method: ``"mean"``, ``"bulk"`` or ``"tail"``.

    Returns:
        ``(...)``: one effective sample size per parameter (``chains * draws`` for
        independent draws; an AR(1) chain with coefficient ``phi`` gives about
        ``chains * draws * (1 - phi) / (1 + phi)``).

    Example::

        >>> from torchfn import random
        >>> iid = random.normal(random.key(0), (4, 1000))
        >>> 3600 < float(effective_sample_size(iid)) < 4400
        True
        >>> heavy = iid / random.normal(random.key(1), (4, 1000))        # Cauchy draws
        >>> 3600 < float(effective_sample_size(heavy, method="bulk")) < 4400
        True
    """
    x = _check(samples, "effective_sample_size", 4)
    if method == "mean":
        return _ess(x)
    if method == "bulk":
        return _ess(_rank_normal(_split(x)))
    if method != "tail":
        raise ValueError(f"effective_sample_size: method must be 'mean', 'bulk' or 'tail', "
                         f"got {method!r}")
    low, high = _quantile(x, 0.05), _quantile(x, 0.95)
    return torch.minimum(_ess(_split((x <= low).to(x.dtype))),
                         _ess(_split((x <= high).to(x.dtype))))


def _ess(x: Tensor) -> Tensor:
    """``C N / tau`` of ``x (C, N, ...)``, as Stan's and ArviZ's ``_ess``: autocorrelation
    pairs ``P_k = rho_2k + rho_2k+1`` summed up to the first non-positive one (or the last
    pair their loop reaches, ``k = (N - 3) // 2``), made non-increasing, and the even
    autocorrelation of that stopping pair added once (a negative one only when the pair
    sum is not negative), as their loops do."""
    C, N = x.shape[:2]
    centred = x - x.mean(1, keepdim=True)
    size = 1 << (2 * N - 1).bit_length()  # zero-padded FFT: no circular wrap
    spectrum = torch.fft.rfft(centred, n=size, dim=1)
    acov = torch.fft.irfft(spectrum * spectrum.conj(), n=size, dim=1)[:, :N] / N  # (C, N, ...)
    within, pooled = _variances(x)
    rho = 1 - (within - acov.mean(0)) / pooled  # (N, ...)
    rho = torch.cat([torch.ones_like(rho[:1]), rho[1:]])
    K = (N - 3) // 2
    floor = 1.0 / torch.log10(torch.tensor(float(C * N), dtype=x.dtype, device=x.device))
    if K == 0:  # too few draws for one pair: Stan's tau is 0, clamped below
        return torch.where(pooled > 0, C * N / floor, float(C * N))
    even, odd = rho[0:2 * K + 1:2], rho[1:2 * K + 2:2]  # (K + 1, ...) each
    pairs = even + odd
    bad = pairs[1:] <= 0
    bad[-1] = True  # the loop stops at the last pair it reaches
    seen = bad.long().cumsum(0)
    kept = seen == 0  # pairs 1..K before the first bad one
    first = bad & (seen == 1)
    monotone = pairs.cummin(0).values  # Geyer: non-increasing
    # the stopping pair's even term, once: as it is when Stan kept the pair (sum >= 0),
    # else only when positive
    last = torch.where(pairs[1:] >= 0, even[1:], even[1:].clamp(min=0))
    tau = -1 + 2 * (pairs[0] + (monotone[1:] * kept).sum(0)) + (last * first).sum(0)
    tau = torch.where(pairs[0] > 0, tau, 0.0)  # rho_1 <= -1 (a few draws): Stan stops at once
    # constant draws (an indicator never true in a short run): C N, as Stan and ArviZ
    return torch.where(pooled > 0, C * N / torch.maximum(tau, floor), float(C * N))


def bfmi(energy: Tensor) -> Tensor:
    """The energy Bayesian fraction of missing information (Betancourt, 2016), Stan's
    E-BFMI: per chain, ``sum_n (E_n - E_{n-1})^2 / sum_n (E_n - mean E)^2`` over the
    Hamiltonian at successive draws (:class:`NUTSInfo`'s ``energy``). Near 1 or above
    when momentum resampling moves the chain across energy levels as fast as the target
    spreads them (2 for independent energies); below 0.3 is Stan's warning: the chain
    explores the tails slowly (a funnel, heavy tails).

    Args:
        energy: ``(chains, draws)``, ``draws >= 4``.

    Returns:
        ``(chains,)``.

    Example::

        >>> from torchfn import random
        >>> iid = random.normal(random.key(0), (2, 4000))
        >>> [round(v, 1) for v in bfmi(iid).tolist()]
        [2.0, 2.0]
    """
    e = _check(energy, "bfmi", 4)
    if e.dim() != 2:
        raise ValueError(f"bfmi: energy must have shape (chains, draws), got "
                         f"{tuple(e.shape)}")
    steps = (e[:, 1:] - e[:, :-1]).pow(2).sum(1)
    return steps / (e - e.mean(1, keepdim=True)).pow(2).sum(1)


_COLUMNS = ("mean", "sd", "median", "low", "high", "mcse_mean", "ess_bulk", "ess_tail",
            "r_hat")


def summary(samples: Any, *, prob: float = 0.9) -> dict[str, dict[str, Tensor]]:
    """Per-parameter statistics of chains, NumPyro's ``summary`` with ArviZ's modern
    diagnostics: ``mean``, ``sd``, ``median``, the central ``prob`` interval's ends
    ``low`` and ``high`` (quantiles, interpolated as numpy's), ``mcse_mean`` (``sd`` over
    the square root of the split-chain ESS of the mean, ArviZ's), ``ess_bulk``,
    ``ess_tail`` and the rank-normalised ``r_hat``.

    Args:
        samples: a tensor or a pytree of tensors ``(chains, draws, ...)`` (what
            :func:`nuts` with ``num_chains`` and ``vmap`` over :func:`hmc` return).
        prob: the interval's mass, in (0, 1).

    Returns:
        ``{name: {column: (...)}}``, one entry per leaf named by its path (``"x"`` for
        a lone tensor).

    Example::

        >>> from torchfn import random
        >>> draws = {"mu": random.normal(random.key(0), (4, 500)) + 3.0}
        >>> s = summary(draws)
        >>> round(float(s["mu"]["mean"]), 1), bool(s["mu"]["r_hat"] < 1.01)
        (3.0, True)
    """
    if not isinstance(prob, float) or not 0 < prob < 1:
        raise ValueError(f"summary: prob must be a float in (0, 1), got {prob!r}")
    paths, leaves, _ = optree.tree_flatten_with_path(samples)
    out = {}
    for path, x in zip(paths, leaves):
        name = ".".join(str(p) for p in path) or "x"
        x = _check(x, f"summary ({name})", 4)
        pooled = x.reshape(-1, *x.shape[2:])
        sd = pooled.std(0)
        out[name] = {
            "mean": pooled.mean(0), "sd": sd, "median": _quantile(x, 0.5),
            "low": _quantile(x, (1 - prob) / 2), "high": _quantile(x, (1 + prob) / 2),
            "mcse_mean": sd / _ess(_split(x)).sqrt(),
            "ess_bulk": effective_sample_size(x, method="bulk"),
            "ess_tail": effective_sample_size(x, method="tail"),
            "r_hat": rhat(x, method="rank"),
        }
    return out


def print_summary(samples: Any, *, prob: float = 0.9) -> str:
    """:func:`summary` as a table, one row per scalar parameter (``name[i, j]``);
    printed, and returned.

    Example::

        >>> from torchfn import random
        >>> table = print_summary({"w": random.normal(random.key(0), (2, 100, 2))})
        ... # doctest: +ELLIPSIS
                     mean       sd   median     5.0%    95.0% mcse_mean ...
        ...
    """
    stats = summary(samples, prob=prob)
    pct = f"{100 * (1 - prob) / 2:.1f}%", f"{100 * (1 + prob) / 2:.1f}%"
    heads = ["mean", "sd", "median", *pct, "mcse_mean", "ess_bulk", "ess_tail", "r_hat"]
    rows = []
    for name, cols in stats.items():
        shape = cols["mean"].shape
        for index in (torch.cartesian_prod(*(torch.arange(d) for d in shape)).reshape(
                -1, len(shape)).tolist() if shape else [[]]):
            label = name + (f"[{', '.join(map(str, index))}]" if index else "")
            rows.append((label, [float(cols[c][tuple(index)]) for c in _COLUMNS]))
    width = max([len(r[0]) for r in rows] + [4])
    lines = [" " * width + "".join(f"{h:>10}" for h in heads)]
    for label, values in rows:
        cells = [f"{v:10.3f}" for v in values[:6]] + [f"{v:10.0f}" for v in values[6:8]]
        lines.append(f"{label:>{width}}" + "".join(cells) + f"{values[8]:10.3f}")
    table = "\n".join(lines)
    print(table)
    return table
