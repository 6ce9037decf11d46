"""MCMC diagnostics: split R-hat against a loop over BDA3's formula, near 1 for agreeing
chains and large for disagreeing ones; the effective sample size against the closed
form of AR(1) chains, ``C N (1 - phi) / (1 + phi)``, and of independent draws; both
under vmap equal a loop. The rank-normalised R-hat and the bulk and tail ESS (Vehtari
et al., 2021) against a loop over Stan's algorithm with scipy's ranks and normal
quantiles; R-hat sees a chain of another scale, the bulk ESS ignores monotone
transforms and stays near ``C N`` for independent Cauchy draws."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats  # a torchfn dependency
from torch.func import vmap

from torchfn import random
from torchfn.transforms import bfmi, effective_sample_size, print_summary, rhat, summary


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


def _stan_ess(x):
    """Stan's ESS of ``x (C, N)`` (float64 numpy) as its loops run: autocovariances by
    direct sums, Geyer's initial positive then monotone sequence, the last even
    autocorrelation added once when positive."""
    C, N = x.shape
    if x.max() - x.min() < np.finfo(float).resolution:
        return float(C * N)
    acov = np.array([[np.dot(c[:N - t] - c.mean(), c[t:] - c.mean()) / N for t in range(N)]
                     for c in x])
    mean_var = acov[:, 0].mean() * N / (N - 1)
    var_plus = mean_var * (N - 1) / N + (x.mean(1).var(ddof=1) if C > 1 else 0.0)
    rho = np.zeros(N)
    rho[0], even, odd = 1.0, 1.0, 1.0 - (mean_var - acov[:, 1].mean()) / var_plus
    rho[1] = odd
    t = 1
    while t < N - 3 and even + odd > 0:
        even = 1.0 - (mean_var - acov[:, t + 1].mean()) / var_plus
        odd = 1.0 - (mean_var - acov[:, t + 2].mean()) / var_plus
        if even + odd >= 0:
            rho[t + 1], rho[t + 2] = even, odd
        t += 2
    max_t = t - 2
    if even > 0:
        rho[max_t + 1] = even
    t = 1
    while t <= max_t - 2:
        if rho[t + 1] + rho[t + 2] > rho[t - 1] + rho[t]:
            rho[t + 1] = rho[t + 2] = (rho[t - 1] + rho[t]) / 2
        t += 2
    tau = -1 + 2 * rho[:max_t + 1].sum() + rho[max_t + 1:max_t + 2].sum()
    return C * N / max(tau, 1 / np.log10(C * N))


def _split_halves(x):
    half = x.shape[1] // 2
    return np.concatenate([x[:, :half], x[:, -half:]])


def _z(x):
    ranks = stats.rankdata(x, method="average").reshape(x.shape)
    return stats.norm.ppf((ranks - 0.375) / (x.size + 0.25))


def _rhat(x):  # over already split chains
    n = x.shape[1]
    W = x.var(1, ddof=1).mean()
    return np.sqrt(((n - 1) / n * W + x.mean(1).var(ddof=1)) / W)


def _test_draws(key, chains, draws):
    """Four parameters: AR(1) chains, one chain of them 3x wider, rounded to integers
    (ties), and independent Cauchy draws."""
    ar = _ar1(key, chains, draws, 0.7)
    wide = ar * torch.tensor([1.0] * (chains - 1) + [3.0], dtype=torch.float64)[:, None]
    k1, k2 = random.split(random.fold_in(key, 1))
    cauchy = random.normal(k1, (chains, draws), dtype=torch.float64) / random.normal(
        k2, (chains, draws), dtype=torch.float64)
    return torch.stack([ar, wide, (3 * ar).round(), cauchy], -1)  # (C, N, 4)


@pytest.mark.parametrize("chains, draws", [(4, 300), (3, 101), (1, 40), (2, 7)])
def test_rank_normalised_diagnostics_equal_stans_loops(chains, draws):
    x = _test_draws(random.key(chains * 1000 + draws), chains, draws)
    r = rhat(x, method="rank")
    bulk = effective_sample_size(x, method="bulk")
    tail = effective_sample_size(x, method="tail")
    mean = effective_sample_size(x)  # unsplit
    for p in range(4):
        a = x[..., p].numpy()
        halves = _split_halves(a)
        want_r = max(_rhat(_z(halves)), _rhat(_z(np.abs(halves - np.median(halves)))))
        assert r[p].item() == pytest.approx(want_r, rel=1e-10)
        assert bulk[p].item() == pytest.approx(_stan_ess(_z(_split_halves(a))), rel=1e-8)
        if p != 3:  # the mean of Cauchy draws has no variance to estimate
            assert mean[p].item() == pytest.approx(_stan_ess(a), rel=1e-8)
        ends = [_stan_ess(_split_halves((a <= np.quantile(a, q)).astype(float)))
                for q in (0.05, 0.95)]
        assert tail[p].item() == pytest.approx(min(ends), rel=1e-8)


def test_rank_rhat_sees_scale_and_the_bulk_ignores_monotone_transforms():
    x = _test_draws(random.key(7), 4, 2000)
    split, rank = rhat(x), rhat(x, method="rank")
    assert split[1] < 1.05 < 1.1 < rank[1]  # same means, one chain 3x wider
    assert (rank[[0, 2, 3]] < 1.02).all()
    # a monotone transform keeps the ranks: the bulk is unchanged (the folded tails are
    # not, their distance to the median changes with the scale)
    torch.testing.assert_close(effective_sample_size(x ** 3, method="bulk"),
                               effective_sample_size(x, method="bulk"))
    # independent Cauchy draws: the bulk ESS is about C N; the mean has no variance
    assert 0.8 * 8000 < effective_sample_size(x[..., 3], method="bulk") < 1.2 * 8000


def test_rank_methods_under_vmap_equal_a_loop():
    x = torch.stack([_test_draws(random.key(s), 3, 60) for s in range(3)])  # (3, 3, 60, 4)
    for fn in (lambda s: rhat(s, method="rank"),
               lambda s: effective_sample_size(s, method="bulk"),
               lambda s: effective_sample_size(s, method="tail")):
        torch.testing.assert_close(vmap(fn)(x), torch.stack([fn(s) for s in x]))


@pytest.mark.parametrize("call, match", [
    (lambda: rhat(torch.zeros(2, 10), method="bulk"),
     "rhat: method must be 'split' or 'rank', got 'bulk'"),
    (lambda: effective_sample_size(torch.zeros(2, 10), method="rank"),
     "effective_sample_size: method must be 'mean', 'bulk' or 'tail', got 'rank'"),
    (lambda: rhat(torch.zeros(10)), r"samples must have shape \(chains, draws, ...\)"),
    (lambda: rhat(torch.zeros(2, 3)), "at least 4 draws"),
    (lambda: effective_sample_size(torch.zeros(2, 10, dtype=torch.long)),
     "samples must be a floating-point tensor"),
])
def test_bad_input_is_named(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call()


def test_summary_is_the_diagnostics_and_numpys_statistics_per_leaf(capsys):
    """Each column is its definition: numpy's mean, sd (ddof 1) and quantiles over all
    draws, ``sd / sqrt(ESS of the split chains)`` by Stan's loop, and the rank
    diagnostics; a pytree gives one entry per leaf, the table one row per scalar."""
    w = _test_draws(random.key(11), 3, 120)[..., :2]  # (3, 120, 2)
    b = _ar1(random.key(12), 3, 120, 0.3)  # (3, 120)
    stats = summary({"w": w, "b": b}, prob=0.8)
    assert set(stats) == {"w", "b"}
    for name, x in (("w", w), ("b", b[..., None])):
        cols = stats[name]
        for p in range(x.shape[-1]):
            a = x[..., p].numpy()
            got = {k: v.reshape(-1)[p].item() for k, v in cols.items()}
            assert got["mean"] == pytest.approx(a.mean(), rel=1e-12)
            assert got["sd"] == pytest.approx(a.std(ddof=1), rel=1e-12)
            for key, q in (("median", 0.5), ("low", 0.1), ("high", 0.9)):
                assert got[key] == pytest.approx(np.quantile(a, q), rel=1e-12, abs=1e-12)
            assert got["mcse_mean"] == pytest.approx(
                a.std(ddof=1) / np.sqrt(_stan_ess(_split_halves(a))), rel=1e-8)
            assert got["ess_bulk"] == pytest.approx(
                effective_sample_size(x[..., p], method="bulk").item(), rel=1e-12)
            assert got["r_hat"] == pytest.approx(rhat(x[..., p], method="rank").item(),
                                                 rel=1e-12)
    table = print_summary({"w": w, "b": b}, prob=0.8)
    assert capsys.readouterr().out.strip() == table.strip()
    lines = table.splitlines()
    assert "10.0%" in lines[0] and "90.0%" in lines[0] and "r_hat" in lines[0]
    assert [line.split()[0] for line in lines[1:]] == ["b", "w[0]", "w[1]"]
    with pytest.raises(ValueError, match=r"summary: prob must be a float in \(0, 1\)"):
        summary(w, prob=1.5)


def test_bfmi_is_its_formula_and_separates_mixing_from_stuck_energies():
    e = random.normal(random.key(13), (3, 50), dtype=torch.float64)
    got = bfmi(e)
    for c in range(3):
        a = e[c].tolist()
        mean = sum(a) / len(a)
        want = sum((a[i] - a[i - 1]) ** 2 for i in range(1, len(a))) / \
            sum((v - mean) ** 2 for v in a)
        assert got[c].item() == pytest.approx(want, rel=1e-12)
    iid = random.normal(random.key(14), (2, 20000), dtype=torch.float64)
    assert ((bfmi(iid) - 2).abs() < 0.05).all()  # E (E_n - E_n-1)^2 = 2 var
    walk = iid.cumsum(1)  # energies that drift: momentum resampling does not reach them
    assert (bfmi(walk) < 0.01).all()
    with pytest.raises(ValueError, match=r"bfmi: energy must have shape \(chains, draws\)"):
        bfmi(torch.zeros(2, 10, 3))
