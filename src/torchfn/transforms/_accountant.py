"""RDP accountant for the sampled Gaussian mechanism (DP-SGD with Poisson sampling).

Renyi DP of one step at order ``alpha`` (Mironov, Talwar, Zhang 2019, "Renyi
Differential Privacy of the Sampled Gaussian Mechanism", Sec. 3.3): integer
orders by the binomial closed form, fractional orders by the erfc series, as
in TF-Privacy's / Opacus's ``_compute_rdp``. ``T`` steps compose additively,
and the RDP curve converts to ``(epsilon, delta)`` by Balle et al. 2020 (Thm 21):

    eps = min_alpha  rdp(alpha) - (log(delta) + log(alpha)) / (alpha - 1)
                     + log((alpha - 1) / alpha)

Computed in float64 (torch), no SciPy. Checked against Opacus 1.6 in the tests::

    >>> from torchfn.transforms import rdp_epsilon, noise_multiplier_for
    >>> eps = rdp_epsilon(1.1, sample_rate=256 / 60000, steps=10_000, delta=1e-5)
    >>> round(eps, 2)
    2.16
    >>> sigma = noise_multiplier_for(eps, sample_rate=256 / 60000, steps=10_000, delta=1e-5)
    >>> abs(sigma - 1.1) < 1e-2
    True
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch

__all__ = [
    "DEFAULT_ORDERS",
    "compute_rdp",
    "rdp_to_epsilon",
    "rdp_epsilon",
    "noise_multiplier_for",
]

DEFAULT_ORDERS: tuple[float, ...] = tuple(
    [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
)


def _log_erfc(x: torch.Tensor) -> torch.Tensor:
    """log(erfc(x)) in float64, accurate where erfc underflows (as SciPy's log_ndtr)."""
    return math.log(2.0) + torch.special.log_ndtr(-x * math.sqrt(2.0))


def _log_a_int(q: float, sigma: float, alphas: list[int]) -> torch.Tensor:
    """log A_alpha for integer orders: log sum_i binom(a, i) q^i (1-q)^(a-i) e^{(i^2-i)/2s^2}."""
    a = torch.tensor(alphas, dtype=torch.float64)[:, None]  # (A, 1)
    i = torch.arange(max(alphas) + 1, dtype=torch.float64)[None, :]  # (1, K)
    log_coef = torch.lgamma(a + 1) - torch.lgamma(i + 1) - torch.lgamma((a - i).clamp(min=0) + 1)
    log_s = log_coef + i * math.log(q) + (a - i) * math.log1p(-q) + (i * i - i) / (2 * sigma**2)
    log_s = torch.where(i <= a, log_s, -math.inf)  # (A, K)
    return torch.logsumexp(log_s, -1)


def _log_a_frac(q: float, sigma: float, alphas: list[float]) -> torch.Tensor:
    """log A_alpha for fractional orders: the two erfc series of Mironov et al. Sec. 3.3.

    Per order, the series runs up to and including the first ``i`` whose two
    terms are both below ``e^-30`` (TF-Privacy's / Opacus's stopping rule).
    Terms are evaluated in blocks of ``i`` for all unfinished orders at once;
    the signed sums are kept as running ``(max, scaled sum)`` pairs.
    """
    a_all = torch.tensor(alphas, dtype=torch.float64)  # (A,)
    n = a_all.numel()
    z0 = sigma**2 * math.log(1 / q - 1) + 0.5
    log_q, log_1mq, s2, two_s2 = math.log(q), math.log1p(-q), math.sqrt(2) * sigma, 2 * sigma**2
    log_half = math.log(0.5)
    big_m = torch.full((2, n), -math.inf, dtype=torch.float64)  # running max of log terms
    big_s = torch.zeros((2, n), dtype=torch.float64)  # running sum of sign * exp(term - max)
    active = torch.arange(n)
    lo, size = 0, 64
    while active.numel():
        if lo > 2**24:
            raise RuntimeError(f"RDP series did not converge (q={q}, sigma={sigma})")
        a = a_all[active][:, None]  # (A', 1)
        i = torch.arange(lo, lo + size, dtype=torch.float64)[None, :]  # (1, K)
        j = a - i  # (A', K)
        log_coef = torch.lgamma(a + 1) - torch.lgamma(i + 1) - torch.lgamma(j + 1)  # log|binom|
        log_s0 = (
            log_coef
            + i * log_q
            + j * log_1mq
            + (i * i - i) / two_s2
            + log_half
            + _log_erfc((i - z0) / s2)
        )
        log_s1 = (
            log_coef
            + j * log_q
            + i * log_1mq
            + (j * j - j) / two_s2
            + log_half
            + _log_erfc((z0 - j) / s2)
        )
        stop = torch.maximum(log_s0, log_s1) < -30  # (A', K)
        done = stop.any(-1)  # (A',)
        first = torch.where(done, stop.to(torch.int64).argmax(-1), size)  # (A',)
        keep = torch.arange(size)[None, :] <= first[:, None]  # (A', K)
        # binom(a, i) < 0 iff an odd number of the factors (a - m), m < i, are negative
        n_neg = (i - torch.floor(a) - 1).clamp(min=0)
        sign = torch.where(n_neg % 2 == 0, 1.0, -1.0).to(torch.float64)  # (A', K)
        for r, log_s in enumerate((log_s0, log_s1)):
            log_s = torch.where(keep, log_s, -math.inf)
            m_old = big_m[r, active]
            m_new = torch.maximum(m_old, log_s.amax(-1))  # (A',)
            scale = torch.where(m_old == -math.inf, 0.0, torch.exp(m_old - m_new))
            block = (sign * torch.exp(log_s - m_new[:, None])).sum(-1)
            big_s[r, active] = big_s[r, active] * scale + block
            big_m[r, active] = m_new
        active = active[~done]
        lo, size = lo + size, size * 2
    log_a = big_m + torch.log(big_s)  # (2, A)
    return torch.logaddexp(log_a[0], log_a[1])


def _rdp_one_step(q: float, sigma: float, orders: Sequence[float]) -> list[float]:
    """RDP of one step of the sampled Gaussian mechanism at each order."""
    if sigma == 0:
        return [math.inf] * len(orders)
    if q == 1.0:
        return [a / (2 * sigma**2) for a in orders]  # plain Gaussian mechanism
    out = [math.inf] * len(orders)
    ints = [n for n, a in enumerate(orders) if math.isfinite(a) and float(a).is_integer()]
    fracs = [n for n, a in enumerate(orders) if math.isfinite(a) and not float(a).is_integer()]
    for idx, fn, cast in ((ints, _log_a_int, int), (fracs, _log_a_frac, float)):
        if idx:
            log_a = fn(q, sigma, [cast(orders[n]) for n in idx]).tolist()
            for n, la in zip(idx, log_a):
                out[n] = la / (orders[n] - 1)
    return out


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check(noise_multiplier=None, sample_rate=None, steps=None, delta=None, orders=None):
    if noise_multiplier is not None and (
        not _is_num(noise_multiplier) or math.isnan(noise_multiplier) or noise_multiplier < 0
    ):
        raise ValueError(f"noise_multiplier must be a number >= 0, got {noise_multiplier!r}")
    if sample_rate is not None and (not _is_num(sample_rate) or not 0.0 < sample_rate <= 1.0):
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
    if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 0):
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    if delta is not None and (not _is_num(delta) or not 0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    if orders is not None:
        if len(orders) == 0 or not all(_is_num(a) and a > 1 for a in orders):
            raise ValueError(f"orders must be a non-empty sequence of numbers > 1, got {orders!r}")


def compute_rdp(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    orders: Sequence[float] = DEFAULT_ORDERS,
) -> list[float]:
    """RDP ``steps * rdp_SGM(alpha)`` at each order of the sampled Gaussian mechanism.

    Args:
        noise_multiplier: ``sigma``, noise std / L2 sensitivity.
        sample_rate: ``q`` in (0, 1], Poisson sampling probability.
        steps: number of steps ``T``.
        orders: RDP orders ``alpha > 1``.

    Returns:
        one RDP value per order (``inf`` when ``sigma == 0``). Sum the lists of
        several phases to compose them, then call :func:`rdp_to_epsilon`.

    Example::

        >>> from torchfn.transforms import compute_rdp
        >>> compute_rdp(2.0, sample_rate=1.0, steps=10, orders=(2, 4))   # 10 * a / (2 sigma^2)
        [2.5, 5.0]
        >>> phase1 = compute_rdp(1.0, sample_rate=0.01, steps=500, orders=(2, 4))
        >>> phase2 = compute_rdp(2.0, sample_rate=0.01, steps=500, orders=(2, 4))
        >>> total = [a + b for a, b in zip(phase1, phase2)]     # compose the two phases
        >>> len(total), all(t > 0 for t in total)
        (2, True)
    """
    _check(noise_multiplier, sample_rate, steps, None, orders)
    return [steps * r for r in _rdp_one_step(sample_rate, noise_multiplier, list(orders))]


def rdp_to_epsilon(
    orders: Sequence[float], rdp: Sequence[float], delta: float
) -> tuple[float, float]:
    """Convert an RDP curve to ``(epsilon, best_order)`` at ``delta`` (Balle et al. 2020).

    Example::

        >>> from torchfn.transforms import DEFAULT_ORDERS, compute_rdp, rdp_epsilon, rdp_to_epsilon
        >>> rdp = compute_rdp(1.0, sample_rate=0.01, steps=1000, orders=DEFAULT_ORDERS)
        >>> eps, order = rdp_to_epsilon(DEFAULT_ORDERS, rdp, delta=1e-5)
        >>> eps == rdp_epsilon(1.0, sample_rate=0.01, steps=1000, delta=1e-5), order > 1
        (True, True)
    """
    _check(delta=delta, orders=orders)
    if len(orders) != len(rdp):
        raise ValueError(
            f"orders and rdp must have the same length, got {len(orders)} and {len(rdp)}"
        )
    best, best_i = math.inf, None
    for i, (a, r) in enumerate(zip(orders, rdp)):
        eps = r - (math.log(delta) + math.log(a)) / (a - 1) + math.log((a - 1) / a)
        if not math.isnan(eps) and (best_i is None or eps < best):
            best, best_i = eps, i
    if best_i is None:
        return math.inf, math.nan
    if len(orders) > 1 and best_i in (0, len(orders) - 1) and math.isfinite(best):
        warnings.warn(
            f"the optimal RDP order is the {'smallest' if best_i == 0 else 'largest'} one "
            f"({orders[best_i]}); widen `orders` for a tighter epsilon",
            stacklevel=3,
        )
    return best, float(orders[best_i])


def rdp_epsilon(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    orders: Sequence[float] | None = None,
) -> float:
    """``epsilon`` of ``steps`` DP-SGD steps with Poisson rate ``q`` and noise ``sigma``.

    Args:
        noise_multiplier: ``sigma >= 0``.
        sample_rate: ``q`` in (0, 1] (expected batch size / dataset size).
        steps: number of noisy updates ``T >= 0``.
        delta: target ``delta`` in (0, 1), typically < 1 / dataset size.
        orders: RDP orders; default :data:`DEFAULT_ORDERS` (1.1..10.9 and 12..63).

    Example::

        >>> from torchfn.transforms import rdp_epsilon
        >>> round(rdp_epsilon(1.0, sample_rate=0.01, steps=1000, delta=1e-5), 2)
        2.1
        >>> rdp_epsilon(2.0, 0.01, 1000, 1e-5) < rdp_epsilon(1.0, 0.01, 1000, 1e-5)   # more noise
        True
    """
    orders = DEFAULT_ORDERS if orders is None else tuple(orders)
    _check(noise_multiplier, sample_rate, steps, delta, orders)
    rdp = compute_rdp(noise_multiplier, sample_rate, steps, orders)
    return rdp_to_epsilon(orders, rdp, delta)[0]


def noise_multiplier_for(
    epsilon: float,
    sample_rate: float,
    steps: int,
    delta: float,
    orders: Sequence[float] | None = None,
    *,
    epsilon_tolerance: float = 1e-3,
    max_sigma: float = 1e6,
) -> float:
    """Smallest (to ``epsilon_tolerance``) ``sigma`` whose :func:`rdp_epsilon` is <= ``epsilon``.

    Bisection as in Opacus's ``get_noise_multiplier``: double ``sigma_high``
    from 20 until ``eps(sigma_high) <= epsilon``, then bisect on ``[0,
    sigma_high]`` until ``epsilon - eps(sigma_high) <= epsilon_tolerance``.
    The result always satisfies the budget: ``rdp_epsilon(result, ...) <= epsilon``.

    Example::

        >>> from torchfn.transforms import noise_multiplier_for, rdp_epsilon
        >>> orders = range(2, 64)                       # integer orders: a quick search
        >>> sigma = noise_multiplier_for(2.0, 0.01, 1000, 1e-5, orders)
        >>> round(sigma, 2)
        1.02
        >>> rdp_epsilon(sigma, 0.01, 1000, 1e-5, orders) <= 2.0
        True
    """
    if not _is_num(epsilon) or not epsilon > 0 or math.isinf(epsilon):
        raise ValueError(f"epsilon must be a finite number > 0, got {epsilon!r}")
    if not _is_num(epsilon_tolerance) or not epsilon_tolerance > 0:
        raise ValueError(f"epsilon_tolerance must be > 0, got {epsilon_tolerance!r}")
    orders = DEFAULT_ORDERS if orders is None else tuple(orders)
    _check(None, sample_rate, steps, delta, orders)
    if steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")

    def eps(sigma: float) -> float:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return rdp_epsilon(sigma, sample_rate, steps, delta, orders)

    lo, hi, eps_hi = 0.0, 10.0, math.inf
    while eps_hi > epsilon:
        hi *= 2
        eps_hi = eps(hi)
        if hi > max_sigma:
            raise ValueError(
                f"epsilon={epsilon} is unreachable with noise_multiplier <= {max_sigma} "
                f"(sample_rate={sample_rate}, steps={steps}, delta={delta})"
            )
    while epsilon - eps_hi > epsilon_tolerance:
        mid = (lo + hi) / 2
        e = eps(mid)
        if e < epsilon:
            hi, eps_hi = mid, e
        else:
            lo = mid
    return hi
