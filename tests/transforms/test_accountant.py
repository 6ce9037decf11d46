"""RDP accountant == Opacus 1.6 (compute_rdp, get_privacy_spent, get_noise_multiplier)."""

import math
import warnings

import mpmath as mp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from opacus.accountants.analysis import rdp as opacus_rdp
from opacus.accountants.utils import get_noise_multiplier
from scipy import special

from torchfn.transforms import (
    DEFAULT_ORDERS,
    compute_rdp,
    noise_multiplier_for,
    rdp_epsilon,
    rdp_to_epsilon,
)
from torchfn.transforms._accountant import _log_erfc

sigmas = st.floats(0.3, 4.0)  # Opacus's Python series slows down with sigma
rates = st.floats(1e-4, 1.0, exclude_max=False)
steps_st = st.integers(1, 5000)
deltas = st.floats(1e-9, 1e-2)


def test_default_orders_are_the_usual_ones():
    assert list(DEFAULT_ORDERS) == [1 + x / 10 for x in range(1, 100)] + list(range(12, 64))


@given(sigma=sigmas, q=rates, steps=steps_st, delta=deltas)
def test_rdp_and_epsilon_match_opacus(sigma, q, steps, delta):
    ours = compute_rdp(sigma, q, steps)
    ref = opacus_rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=DEFAULT_ORDERS)
    # atol: Opacus's sequential log-space sums lose ~1e-15 absolute on log A ~ 1e-8 (tiny q);
    # test_matches_high_precision_series shows ours is the closer one there
    np.testing.assert_allclose(np.array(ours), ref, rtol=1e-7, atol=1e-13 * steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # both warn when the best order is at an end
        ref_eps, ref_order = opacus_rdp.get_privacy_spent(orders=DEFAULT_ORDERS, rdp=ref,
                                                          delta=delta)
        eps = rdp_epsilon(sigma, q, steps, delta)
        _, order = rdp_to_epsilon(DEFAULT_ORDERS, ours, delta)
    assert math.isclose(eps, float(ref_eps), rel_tol=1e-8, abs_tol=1e-12)
    assert order == float(ref_order)


def _mp_rdp(sigma, q, alpha):
    """RDP of one step by the same truncated series in 50-digit arithmetic (mpmath)."""
    mp.mp.dps = 50
    s, q, a = mp.mpf(sigma), mp.mpf(q), mp.mpf(alpha)
    z0 = s**2 * mp.log(1 / q - 1) + mp.mpf(0.5)
    total, i = mp.mpf(0), 0
    while True:
        c, j = mp.binomial(a, i), a - i
        t0 = c * q**i * (1 - q) ** j * mp.e ** ((i * i - i) / (2 * s * s)) * mp.erfc(
            (i - z0) / (mp.sqrt(2) * s)) / 2
        t1 = c * q**j * (1 - q) ** i * mp.e ** ((j * j - j) / (2 * s * s)) * mp.erfc(
            (z0 - j) / (mp.sqrt(2) * s)) / 2
        total += t0 + t1
        i += 1
        if max(mp.log(abs(t)) if t != 0 else -mp.inf for t in (t0, t1)) < -30:
            return float(mp.log(total) / (a - 1))


@pytest.mark.parametrize("sigma,q,alpha", [(0.5, 1e-4, 1.1), (1.1, 0.01, 2.5), (2.0, 0.3, 7.7),
                                           (0.8, 0.05, 10.9)])
def test_matches_high_precision_series(sigma, q, alpha):
    (ours,) = compute_rdp(sigma, q, 1, orders=[alpha])
    assert math.isclose(ours, _mp_rdp(sigma, q, alpha), rel_tol=1e-8)


@given(sigma=sigmas, steps=steps_st, alpha=st.sampled_from(DEFAULT_ORDERS))
def test_full_batch_is_the_gaussian_mechanism(sigma, steps, alpha):
    (rdp,) = compute_rdp(sigma, 1.0, steps, orders=[alpha])
    assert math.isclose(rdp, steps * alpha / (2 * sigma**2), rel_tol=1e-14)


@given(sigma=sigmas, q=st.floats(1e-3, 0.5), steps=st.integers(1, 2000))
def test_epsilon_is_monotone(sigma, q, steps):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = rdp_epsilon(sigma, q, steps, 1e-5)
        assert rdp_epsilon(sigma * 1.5, q, steps, 1e-5) <= e  # more noise, less epsilon
        assert rdp_epsilon(sigma, q, steps * 2, 1e-5) >= e  # more steps, more epsilon
        assert rdp_epsilon(sigma, min(1.0, q * 2), steps, 1e-5) >= e


@settings(max_examples=3)  # each case runs Opacus's search (~1-3 s)
@given(eps=st.floats(1.0, 8.0), q=st.floats(1e-3, 0.05), steps=st.integers(10, 2000),
       delta=st.floats(1e-7, 1e-4))
def test_noise_multiplier_matches_opacus(eps, q, steps, delta):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = get_noise_multiplier(target_epsilon=eps, target_delta=delta, sample_rate=q,
                                   steps=steps, epsilon_tolerance=0.01)
        same = noise_multiplier_for(eps, q, steps, delta, epsilon_tolerance=0.01)
        assert math.isclose(same, ref, rel_tol=1e-9)  # same bisection path
        sigma = noise_multiplier_for(eps, q, steps, delta)  # default tolerance 1e-3
        got = rdp_epsilon(sigma, q, steps, delta)
    assert eps - 1e-3 <= got <= eps
    assert sigma <= ref + 1e-12


def test_log_erfc_matches_scipy():
    x = torch.tensor([-3.0, 0.0, 1.0, 10.0, 24.9, 25.0, 25.1, 40.0, 300.0], dtype=torch.float64)
    ref = math.log(2) + special.log_ndtr(-x.numpy() * 2**0.5)
    np.testing.assert_allclose(_log_erfc(x).numpy(), ref, rtol=1e-12, atol=1e-14)


def test_no_noise_is_no_privacy():
    assert rdp_epsilon(0.0, 0.1, 10, 1e-5) == math.inf


def test_bad_input():
    with pytest.raises(ValueError, match="delta must be in"):
        rdp_epsilon(1.0, 0.1, 10, 0.0)
    with pytest.raises(ValueError, match="delta must be in"):
        rdp_epsilon(1.0, 0.1, 10, 1.0)
    with pytest.raises(ValueError, match="sample_rate must be in"):
        rdp_epsilon(1.0, 0.0, 10, 1e-5)
    with pytest.raises(ValueError, match="sample_rate must be in"):
        rdp_epsilon(1.0, 1.01, 10, 1e-5)
    with pytest.raises(ValueError, match="noise_multiplier must be"):
        rdp_epsilon(-0.5, 0.1, 10, 1e-5)
    with pytest.raises(ValueError, match="steps must be"):
        rdp_epsilon(1.0, 0.1, -1, 1e-5)
    with pytest.raises(ValueError, match="steps must be"):
        rdp_epsilon(1.0, 0.1, 2.5, 1e-5)
    with pytest.raises(ValueError, match="orders must be"):
        rdp_epsilon(1.0, 0.1, 10, 1e-5, orders=[1.0, 2.0])
    with pytest.raises(ValueError, match="epsilon must be"):
        noise_multiplier_for(0.0, 0.1, 10, 1e-5)
    with pytest.raises(ValueError, match="delta must be in"):
        noise_multiplier_for(1.0, 0.1, 10, 2.0)
    with pytest.raises(ValueError, match="steps must be"):
        noise_multiplier_for(1.0, 0.1, 0, 1e-5)
    with pytest.raises(ValueError, match="unreachable"):
        noise_multiplier_for(1e-6, 1.0, 10, 1e-5, max_sigma=100.0)
    with pytest.raises(ValueError, match="same length"):
        rdp_to_epsilon([2.0, 3.0], [0.1], 1e-5)
