"""HMC: one transition from exact draws of a Gaussian leaves it exactly invariant (the
Metropolis rule, at a step size that rejects often); chains after warm-up match the
target's closed-form mean and covariance; dual averaging reaches the target acceptance
and the mass matrix the target's scales; vmap over chains equals a loop of chains."""

from __future__ import annotations

import pytest
import torch
from torch.func import vmap

from torchfn import random
from torchfn.transforms import HMCInfo, hmc, hmc_step

COV = torch.tensor([[1.0, 0.8], [0.8, 2.0]], dtype=torch.float64)
PRECISION = torch.linalg.inv(COV)
MEAN = torch.tensor([1.0, -2.0], dtype=torch.float64)


def gaussian(x):  # log N(x; MEAN, COV) up to a constant
    d = x - MEAN
    return -0.5 * d @ PRECISION @ d


@pytest.mark.parametrize("num_steps, step_size, inverse_mass", [
    (1, 1.2, None), (5, 1.35, None), (12, 1.35, None), (5, 0.9, (3.0, 0.5))])
def test_one_transition_leaves_the_target_invariant(num_steps, step_size, inverse_mass):
    """From 20000 exact draws, one transition each (a third to a half rejected at these
    step sizes), with a unit or another mass: the mean and covariance stay the target's,
    within 4 standard errors."""
    n = 20000
    L = torch.linalg.cholesky(COV)
    x0 = MEAN + random.normal(random.key(0), (n, 2), dtype=torch.float64) @ L.T
    keys = random.split(random.key(1), n)
    inv_mass = None if inverse_mass is None else torch.tensor(inverse_mass,
                                                               dtype=torch.float64)
    x1, info = vmap(lambda x, k: hmc_step(gaussian, x, k, step_size=step_size,
                                          num_steps=num_steps, inverse_mass=inv_mass))(
        x0, keys)
    accept = info.accepted.double().mean().item()
    assert 0.2 < accept < 0.9  # the correction is at work
    moved = (x1 != x0).any(-1).double().mean().item()
    assert moved == pytest.approx(accept, abs=1e-12)
    se_mean = (COV.diagonal() / n).sqrt()
    assert ((x1.mean(0) - MEAN).abs() < 4 * se_mean).all()
    cov = torch.cov(x1.T)
    se_cov = ((COV ** 2 + COV.diagonal()[:, None] * COV.diagonal()[None]) / n).sqrt()
    assert ((cov - COV).abs() < 4 * se_cov).all()


def test_a_wrong_correction_would_be_caught():
    """The same check on a transition that skips the final half momentum step (a common
    bug, no longer reversible) fails: the invariance test above has the power to see it."""
    from torchfn.transforms import _hmc

    n = 20000
    L = torch.linalg.cholesky(COV)
    x0 = MEAN + random.normal(random.key(0), (n, 2), dtype=torch.float64) @ L.T
    keys = random.split(random.key(1), n)
    original = _hmc._transition

    def broken(target, x, logp, g, key, step_size, num_steps, inv_mass):
        k_m, k_a = random.split(key)
        p = random.normal(k_m, x.shape, dtype=x.dtype)
        h0 = -logp + 0.5 * (p * p).sum()
        x1 = x + step_size * (p + 0.5 * step_size * g)
        g1, logp1 = target.grad_and_value(x1)
        p1 = p + 0.5 * step_size * g  # the second half step forgotten
        h1 = -logp1 + 0.5 * (p1 * p1).sum()
        acc = random.uniform(k_a, (), dtype=x.dtype) < (h0 - h1).clamp(max=0).exp()
        return (torch.where(acc, x1, x), torch.where(acc, logp1, logp),
                torch.where(acc, g1, g), HMCInfo(acc.double(), acc, logp1))

    _hmc._transition = broken
    try:
        x1, _ = vmap(lambda x, k: hmc_step(gaussian, x, k, step_size=1.2,
                                           num_steps=1))(x0, keys)
    finally:
        _hmc._transition = original
    cov = torch.cov(x1.T)
    se_cov = ((COV ** 2 + COV.diagonal()[:, None] * COV.diagonal()[None]) / n).sqrt()
    assert ((cov - COV).abs() > 4 * se_cov).any()


def test_chains_after_warmup_match_the_closed_form():
    """32 chains under vmap from scattered starts, 300 draws each after 200 warm-up
    transitions: mean and covariance within 10% (of the scale) of the target's."""
    keys = random.split(random.key(2), 32)
    inits = random.normal(random.key(3), (32, 2), dtype=torch.float64) * 3

    def chain(x0, key):
        return hmc(gaussian, x0, key, num_samples=300, num_warmup=200, num_steps=5)

    samples, info, adapted = vmap(chain)(inits, keys)  # (32, 300, 2)
    draws = samples.reshape(-1, 2)
    assert ((draws.mean(0) - MEAN).abs() < 0.1 * COV.diagonal().sqrt()).all()
    torch.testing.assert_close(torch.cov(draws.T), COV, rtol=0.1, atol=0.1)


def test_warmup_tunes_the_step_size_and_learns_the_scales():
    """A 50-d Gaussian with scales 0.5..3: dual averaging brings the acceptance near its
    0.8 target (the averaged step lands a little above it, as in Stan), from a start of
    0.1 that would accept nearly everything; the mass matrix learns the scales."""
    scales = torch.linspace(0.5, 3.0, 50, dtype=torch.float64)

    def logp(x):
        return -0.5 * ((x / scales) ** 2).sum()

    keys = random.split(random.key(6), 4)
    inits = random.normal(random.key(7), (4, 50), dtype=torch.float64)
    _, info, adapted = vmap(lambda x0, k: hmc(logp, x0, k, num_samples=100, num_warmup=300,
                                              num_steps=5, step_size=0.1))(inits, keys)
    assert 0.7 < info.accept_prob.mean().item() < 0.95
    learned = adapted["inverse_mass"].mean(0).sqrt() / scales  # (50,)
    assert abs(learned.mean().item() - 1) < 0.1 and learned.min() > 0.6
    _, fixed, _ = hmc(logp, inits[0], keys[0], num_samples=100, num_warmup=0, step_size=0.1,
                      num_steps=5)
    assert fixed.accept_prob.mean() > 0.98


def test_vmap_over_chains_equals_a_loop_and_pytree_positions_work():
    def logp(p):  # a pytree target: independent N(0, 1) and N(3, 0.5^2)
        return -0.5 * (p["a"] ** 2).sum() - 0.5 * ((p["b"] - 3) / 0.5) ** 2

    inits = {"a": torch.zeros(3, 2, dtype=torch.float64),
             "b": torch.zeros(3, dtype=torch.float64)}
    keys = random.split(random.key(4), 3)

    def chain(init, key):
        return hmc(logp, init, key, num_samples=20, num_warmup=30, num_steps=3)

    batched, info, adapted = vmap(chain)(inits, keys)
    assert batched["a"].shape == (3, 20, 2) and batched["b"].shape == (3, 20)
    for c in range(3):
        one, one_info, one_adapted = chain({k: v[c] for k, v in inits.items()}, keys[c])
        for k in one:
            torch.testing.assert_close(batched[k][c], one[k])
        torch.testing.assert_close(info.accept_prob[c], one_info.accept_prob)
        torch.testing.assert_close(adapted["step_size"][c], one_adapted["step_size"])


def test_without_warmup_the_step_size_is_kept():
    samples, info, adapted = hmc(gaussian, torch.zeros(2, dtype=torch.float64),
                                 random.key(5), num_samples=5, num_warmup=0, step_size=0.3)
    assert adapted["step_size"].item() == pytest.approx(0.3)
    assert samples.shape == (5, 2) and info.accepted.shape == (5,)


@pytest.mark.parametrize("call, match", [
    (lambda: hmc_step(3.0, torch.zeros(2), random.key(0), step_size=0.1),
     "logdensity_fn must be callable"),
    (lambda: hmc_step(lambda x: x, torch.zeros(2), random.key(0), step_size=0.1),
     r"logdensity_fn must return a scalar \(shape \(\)\), got \(2,\)"),
    (lambda: hmc_step(gaussian, torch.zeros(2, dtype=torch.long), random.key(0),
                      step_size=0.1), "position must be a floating-point tensor"),
    (lambda: hmc_step(gaussian, torch.zeros(2), random.key(0), step_size=0.0),
     "step_size must be a positive float"),
    (lambda: hmc_step(gaussian, torch.zeros(2), random.key(0), step_size=0.1, num_steps=0),
     "num_steps must be an int >= 1"),
    (lambda: hmc_step(gaussian, torch.zeros(2), random.key(0), step_size=0.1,
                      inverse_mass=torch.ones(3)),
     r"inverse_mass must have position's structure and shapes \[\(2,\)\]"),
    (lambda: hmc(gaussian, torch.zeros(2), random.key(0), num_samples=0),
     "num_samples must be an int >= 1"),
    (lambda: hmc(gaussian, torch.zeros(2), random.key(0), num_samples=5, target_accept=1.5),
     r"target_accept must be a float in \(0, 1\)"),
])
def test_bad_input_is_named(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call()


def test_dense_mass_keeps_the_target_and_chains_under_vmap_are_chains_alone():
    """One transition with a dense ``M⁻¹`` from exact draws keeps the mean and covariance;
    ``hmc(dense_mass=True)`` under ``vmap`` (the Cholesky, triangular solves and the
    step-size search batched) equals each chain alone and learns the covariance."""
    n = 20000
    L = torch.linalg.cholesky(COV)
    x0 = MEAN + random.normal(random.key(0), (n, 2), dtype=torch.float64) @ L.T
    dense = torch.tensor([[2.0, -0.6], [-0.6, 0.7]], dtype=torch.float64)
    x1, info = vmap(lambda x, k: hmc_step(gaussian, x, k, step_size=1.0, num_steps=3,
                                          inverse_mass=dense, dense_mass=True))(
        x0, random.split(random.key(1), n))
    assert 0.2 < info.accepted.double().mean() < 0.95
    se_cov = ((COV ** 2 + COV.diagonal()[:, None] * COV.diagonal()[None]) / n).sqrt()
    assert ((torch.cov(x1.T) - COV).abs() < 4 * se_cov).all()

    keys = random.split(random.key(3), 3)
    inits = random.normal(random.key(4), (3, 2), dtype=torch.float64)

    def chain(x0, key):
        return hmc(gaussian, x0, key, num_samples=40, num_warmup=150, num_steps=5,
                   dense_mass=True)

    samples, _, adapted = vmap(chain)(inits, keys)
    assert adapted["inverse_mass"].shape == (3, 2, 2)
    torch.testing.assert_close(adapted["inverse_mass"].mean(0), COV, rtol=0.4, atol=0.3)
    for c in range(3):
        one, _, one_adapted = chain(inits[c], keys[c])
        torch.testing.assert_close(samples[c], one)
        torch.testing.assert_close(adapted["inverse_mass"][c], one_adapted["inverse_mass"])
