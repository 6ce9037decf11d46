"""MCMC diagnostics: split R-hat against a loop over BDA3's formula, near 1 for agreeing
chains and large for disagreeing ones; the effective sample size against the closed
form of AR(1) chains, ``C N (1 - phi) / (1 + phi)``, and of independent draws; both
under vmap equal a loop."""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import vmap

from torchfn import random
from torchfn.transforms import effective_sample_size, rhat


def _ar1(key, chains, draws, phi):
    """AR(1) chains with unit stationary variance, started in the stationary law."""
    eps = random.normal(key, (chains, draws), dtype=torch.float64)
    x = torch.empty_like(eps)
    x[:, 0] = eps[:, 0]
    for t in range(1, draws):
        x[:, t] = phi * x[:, t - 1] + math.sqrt(1 - phi ** 2) * eps[:, t]
    return x


def test_rhat_equals_bda3s_formula():
    x = random.normal(random.key(0), (3, 11, 2), dtype=torch.float64)
    x = x + torch.tensor([0.0, 0.5, -0.3], dtype=torch.float64)[:, None, None]
    got = rhat(x)
    for p in range(2):
        halves = []
        for c in range(3):
            chain = x[c, :, p].tolist()
            halves += [chain[:5], chain[-5:]]  # 11 draws: the middle one is dropped
        n, m = 5, len(halves)
        means = [sum(h) / n for h in halves]
        grand = sum(means) / m
        B = n / (m - 1) * sum((mu - grand) ** 2 for mu in means)
        W = sum(sum((v - mu) ** 2 for v in h) / (n - 1) for h, mu in zip(halves, means)) / m
        want = math.sqrt(((n - 1) / n * W + B / n) / W)
        assert got[p].item() == pytest.approx(want, rel=1e-12)


def test_rhat_separates_agreeing_from_disagreeing_chains():
    agree = random.normal(random.key(1), (4, 2000), dtype=torch.float64)
    assert rhat(agree).item() < 1.01
    offset = agree + 0.5 * torch.arange(4, dtype=torch.float64)[:, None]
    assert rhat(offset).item() > 1.05
    trending = agree + torch.linspace(0, 2, 2000, dtype=torch.float64)  # not stationary:
    assert rhat(trending).item() > 1.1  # the split halves disagree


@pytest.mark.parametrize("phi", [0.0, 0.5, 0.9, -0.3])
def test_ess_of_ar1_chains_is_the_closed_form(phi):
    x = _ar1(random.key(2), 8, 4000, phi)
    want = 8 * 4000 * (1 - phi) / (1 + phi)
    assert effective_sample_size(x).item() == pytest.approx(want, rel=0.15)


def test_ess_counts_disagreeing_chains_as_correlated():
    x = random.normal(random.key(3), (4, 1000), dtype=torch.float64)
    shifted = x + 2.0 * torch.arange(4, dtype=torch.float64)[:, None]
    assert effective_sample_size(shifted).item() < 0.1 * effective_sample_size(x).item()


def test_per_parameter_and_under_vmap():
    x = torch.stack([_ar1(random.key(4), 4, 1000, 0.0), _ar1(random.key(5), 4, 1000, 0.8)],
                    -1)  # (4, 1000, 2): two parameters
    ess, r = effective_sample_size(x), rhat(x)
    assert ess.shape == (2,) and r.shape == (2,)
    assert ess[0] > 3 * ess[1]
    for p in range(2):
        torch.testing.assert_close(ess[p], effective_sample_size(x[..., p]))
        torch.testing.assert_close(r[p], rhat(x[..., p]))
    batched = vmap(effective_sample_size, in_dims=-1)(x)
    torch.testing.assert_close(batched, ess)


@pytest.mark.parametrize("call, match", [
    (lambda: rhat(torch.zeros(10)), r"samples must have shape \(chains, draws, ...\)"),
    (lambda: rhat(torch.zeros(2, 3)), "at least 4 draws"),
    (lambda: effective_sample_size(torch.zeros(2, 10, dtype=torch.long)),
     "samples must be a floating-point tensor"),
])
def test_bad_input_is_named(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call()
