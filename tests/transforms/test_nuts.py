"""NUTS: one transition from exact draws of a Gaussian leaves it invariant (and the
same check catches the end-point rule, which is not reversible); chains after warm-up
match the closed-form mean and covariance; a trajectory stops at its first U-turn, at a
divergence, or at ``2**max_depth - 1`` steps; chain ``c`` of a batch is the chain run
alone from ``split(key, C)[c]``."""

from __future__ import annotations

import math
import types

import pytest
import torch
from torch.func import vmap

from torchfn import random
from torchfn.transforms import NUTSInfo, _nuts, nuts, nuts_step

COV = torch.tensor([[1.0, 0.8], [0.8, 2.0]], dtype=torch.float64)
PRECISION = torch.linalg.inv(COV)
MEAN = torch.tensor([1.0, -2.0], dtype=torch.float64)


def gaussian(x):  # log N(x; MEAN, COV) up to a constant
    d = x - MEAN
    return -0.5 * d @ PRECISION @ d


def one_transition_from_exact_draws(n: int = 6000, **kwargs):
    L = torch.linalg.cholesky(COV)
    x0 = MEAN + random.normal(random.key(0), (n, 2), dtype=torch.float64) @ L.T
    x1, info = nuts_step(gaussian, x0, random.key(1), num_chains=n, **kwargs)
    return x0, x1, info


def moments_match(x1: torch.Tensor) -> bool:
    n = x1.shape[0]
    se_mean = (COV.diagonal() / n).sqrt()
    se_cov = ((COV ** 2 + COV.diagonal()[:, None] * COV.diagonal()[None]) / n).sqrt()
    return bool(((x1.mean(0) - MEAN).abs() < 4 * se_mean).all()
                and ((torch.cov(x1.T) - COV).abs() < 4 * se_cov).all())


@pytest.mark.parametrize("step_size, max_depth, pooled", [
    (0.9, 10, 10), (1.6, 10, 10), (0.3, 2, 10), (0.3, 10, 2)])
def test_one_transition_leaves_the_target_invariant(step_size, max_depth, pooled,
                                                    monkeypatch):
    """6000 exact draws, one transition each (batched as 6000 chains): mean and
    covariance stay the target's within 4 standard errors, at a step size with few
    rejections, one with many, a depth cap that cuts most trajectories short, and with
    the merge uniforms of doublings from depth 2 on drawn late (as past depth 10)."""
    monkeypatch.setattr(_nuts, "_POOLED_DEPTH", pooled)
    x0, x1, info = one_transition_from_exact_draws(step_size=step_size,
                                                   max_depth=max_depth)
    assert (x1 != x0).any(-1).double().mean() > 0.3  # it moves
    assert (info.tree_depth <= max_depth).all()
    assert moments_match(x1)


def test_the_energy_at_the_draw_carries_a_momentum_of_the_right_law():
    """At the multinomial pick ``(x, p)`` is distributed as ``exp(-H)``, so the kinetic
    energy ``energy + log_density`` of 6000 one-transition draws from a 2-d target has
    mean ``d / 2 = 1`` and variance ``d / 2`` (a chi-square with 2 degrees, halved)."""
    _, x1, info = one_transition_from_exact_draws(step_size=0.9, max_depth=10)
    kinetic = info.energy + info.log_density  # (6000,)
    torch.testing.assert_close(info.log_density, vmap(gaussian)(x1))
    assert (kinetic >= 0).all()
    assert abs(kinetic.mean().item() - 1.0) < 4 * (1.0 / 6000) ** 0.5
    assert abs(kinetic.var().item() - 1.0) < 0.1


def test_the_end_point_rule_would_be_caught(monkeypatch):
    """The same check on a sampler whose uniforms are all 0, so it always doubles forward
    and every merge takes the newest half (the naive end-point rule, not reversible),
    fails: the invariance test has the power to see a wrong pick."""
    _, x1, _ = one_transition_from_exact_draws(step_size=0.9, max_depth=10)
    assert moments_match(x1)

    def zeros(key, shape, dtype):
        return torch.zeros(shape, dtype=dtype)

    monkeypatch.setattr(_nuts, "random", types.SimpleNamespace(
        split=random.split, normal=random.normal, fold_in=random.fold_in, uniform=zeros))
    _, x1, _ = one_transition_from_exact_draws(step_size=0.9, max_depth=10)
    assert not moments_match(x1)


def test_chains_after_warmup_match_the_closed_form():
    """4 chains from scattered starts, 400 draws each after 150 warm-up transitions:
    mean and covariance within 10% (of the scale) of the target's, no divergence, an
    acceptance near the 0.8 target (a little above, as in Stan), the learned mass near
    the target's variances; R-hat near 1."""
    from torchfn.transforms import rhat

    inits = random.normal(random.key(3), (4, 2), dtype=torch.float64) * 3
    samples, info, adapted = nuts(gaussian, inits, random.key(2), num_samples=400,
                                  num_warmup=150, num_chains=4)
    assert samples.shape == (4, 400, 2) and info.num_steps.shape == (4, 400)
    draws = samples.reshape(-1, 2)
    assert ((draws.mean(0) - MEAN).abs() < 0.1 * COV.diagonal().sqrt()).all()
    torch.testing.assert_close(torch.cov(draws.T), COV, rtol=0.1, atol=0.1)
    assert not info.diverging.any()
    assert 0.7 < info.accept_prob.mean().item() < 0.98
    torch.testing.assert_close(adapted["inverse_mass"].mean(0), COV.diagonal(), rtol=0.3,
                               atol=0)
    assert (rhat(samples) < 1.05).all()  # chains first, as rhat takes them


def test_chains_in_a_batch_are_the_chains_alone_and_pytrees_work():
    """Chain ``c`` of a batch of 3 (whose trees stop at different depths, so the batch
    runs masked steps for the others) equals the chain run alone from ``split(key, 3)[c]``;
    a pytree position keeps its structure."""
    def logp(p):  # independent N(0, 1) and N(3, 0.5^2)
        return -0.5 * (p["a"] ** 2).sum() - 0.5 * ((p["b"] - 3) / 0.5) ** 2

    inits = {"a": torch.randn(3, 2, dtype=torch.float64, generator=torch.Generator()
                              .manual_seed(0)), "b": torch.zeros(3, dtype=torch.float64)}
    key = random.key(4)
    batched, info, adapted = nuts(logp, inits, key, num_samples=20, num_warmup=30,
                                  num_chains=3)
    assert batched["a"].shape == (3, 20, 2) and batched["b"].shape == (3, 20)
    assert adapted["step_size"].shape == (3,) and adapted["inverse_mass"]["a"].shape == (3, 2)
    assert len(set(info.tree_depth.flatten().tolist())) > 1  # depths differ
    for c, k in enumerate(random.split(key, 3)):
        one, one_info, one_adapted = nuts(logp, {n: v[c] for n, v in inits.items()}, k,
                                          num_samples=20, num_warmup=30)
        assert one["a"].shape == (20, 2) and one_info.num_steps.shape == (20,)
        for name in one:
            torch.testing.assert_close(batched[name][c], one[name], rtol=1e-12,
                                       atol=1e-12)
        assert torch.equal(info.num_steps[c], one_info.num_steps)
        torch.testing.assert_close(adapted["step_size"][c], one_adapted["step_size"])


def test_a_trajectory_stops_at_its_first_u_turn():
    """A 1-d standard Gaussian is a harmonic oscillator of period 2π: with step 0.02 a
    trajectory that did not stop at a U-turn would run the 1023 steps ``max_depth``
    allows, lapping the orbit 3 times; every one stops within one period (< 2π / 0.02
    = 314 steps, earlier when it starts near a turning point); the Metropolis probability
    of so small a step is ~1."""
    def std(x):
        return -0.5 * (x ** 2).sum()

    x0 = random.normal(random.key(8), (64, 1), dtype=torch.float64)
    _, info = nuts_step(std, x0, random.key(9), step_size=0.02, num_chains=64)
    assert (info.num_steps < 2 * math.pi / 0.02).all()
    assert (info.tree_depth < 10).all() and info.num_steps.double().mean() > 50
    assert (info.accept_prob > 0.999).all()


def test_the_depth_cap_and_a_divergence():
    """A step too small to turn within 2**4 - 1 = 15 steps reaches exactly the cap;
    a step so large the energy explodes is divergent at once: one step, no move, an
    acceptance of 0."""
    x0 = torch.tensor([0.5, -1.0], dtype=torch.float64)
    _, info = nuts_step(gaussian, x0, random.key(0), step_size=1e-3, max_depth=4)
    assert info.tree_depth.item() == 4 and info.num_steps.item() == 2 ** 4 - 1
    assert isinstance(info, NUTSInfo) and info.tree_depth.shape == ()
    x1, info = nuts_step(gaussian, x0, random.key(0), step_size=1e3)
    assert info.diverging.item() and info.num_steps.item() == 1
    assert torch.equal(x1, x0) and info.accept_prob.item() == 0


def test_without_warmup_the_step_size_and_a_unit_mass_are_kept():
    samples, info, adapted = nuts(gaussian, torch.zeros(2, dtype=torch.float64),
                                  random.key(5), num_samples=5, num_warmup=0,
                                  step_size=0.3)
    assert adapted["step_size"].item() == pytest.approx(0.3)
    assert torch.equal(adapted["inverse_mass"], torch.ones(2, dtype=torch.float64))
    assert samples.shape == (5, 2) and info.diverging.shape == (5,)


@pytest.mark.parametrize("call, error, match", [
    (lambda: nuts_step(3.0, torch.zeros(2), random.key(0), step_size=0.1), TypeError,
     "nuts_step: logdensity_fn must be callable"),
    (lambda: nuts_step(lambda x: x, torch.zeros(2), random.key(0), step_size=0.1),
     ValueError, r"logdensity_fn must return a scalar \(shape \(\)\), got \(2,\)"),
    (lambda: nuts_step(gaussian, torch.zeros(2, dtype=torch.long), random.key(0),
                       step_size=0.1), TypeError, "init must be a floating-point tensor"),
    (lambda: nuts_step(gaussian, torch.zeros(2), random.key(0), step_size=-1.0),
     ValueError, "step_size must be a positive float"),
    (lambda: nuts_step(gaussian, torch.zeros(2), random.key(0), step_size=0.1,
                       max_depth=0), ValueError, "max_depth must be an int >= 1"),
    (lambda: nuts_step(gaussian, torch.zeros(2), random.key(0), step_size=0.1,
                       max_depth=17), ValueError, "max_depth must be <= 16"),
    (lambda: nuts_step(gaussian, torch.zeros(2), random.split(random.key(0), 3),
                       step_size=0.1), ValueError, r"key must be one key of shape \(2,\)"),
    (lambda: nuts_step(gaussian, torch.zeros(4, 2), random.key(0), step_size=0.1,
                       num_chains=3), ValueError,
     r"with num_chains=3, every leaf of init must have a leading dim of 3, got \[\(4, 2\)\]"),
    (lambda: nuts_step(gaussian, torch.zeros(2), random.key(0), step_size=0.1,
                       inverse_mass=torch.ones(3)), ValueError,
     r"inverse_mass must have init's structure and shapes \[\(2,\)\]"),
    (lambda: nuts(gaussian, torch.zeros(2), random.key(0), num_samples=0), ValueError,
     "num_samples must be an int >= 1"),
    (lambda: nuts(gaussian, torch.zeros(2), random.key(0), num_samples=5,
                  target_accept=1.0), ValueError, r"target_accept must be a float in \(0, 1\)"),
])
def test_bad_input_is_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


DENSE = torch.tensor([[2.0, -0.6], [-0.6, 0.7]], dtype=torch.float64)  # an SPD M⁻¹


def test_one_transition_with_a_dense_mass_leaves_the_target_invariant():
    """The invariance check of the diagonal case, with a dense ``M⁻¹`` (momenta
    ``L⁻ᵀ z``, velocities ``M⁻¹ p``); the same mass as a wrong diagonal (its diagonal
    only) is still a valid sampler, so both pass: the test reads the dense path."""
    x0, x1, info = one_transition_from_exact_draws(step_size=0.8, inverse_mass=DENSE,
                                                   dense_mass=True)
    assert (x1 != x0).any(-1).double().mean() > 0.3
    assert moments_match(x1)


def test_a_dense_mass_learns_a_correlated_target_and_shortens_the_trees():
    """A Gaussian with correlation 0.98 and scales 1 and 5: the dense warm-up learns
    ``M⁻¹`` near the covariance, after which the target looks isotropic: trajectories
    of at most 6 steps on average (a diagonal mass, which cannot undo the correlation,
    needs 9.4 here with its trees capped at 15, and 12.6 capped at 31), and the draws
    have the target's covariance."""
    cov = torch.tensor([[1.0, 4.9], [4.9, 25.0]], dtype=torch.float64)
    precision = torch.linalg.inv(cov)

    def logp(x):
        return -0.5 * x @ precision @ x

    inits = random.normal(random.key(5), (3, 2), dtype=torch.float64)
    samples, info, adapted = nuts(logp, inits, random.key(6), num_samples=120,
                                  num_warmup=200, num_chains=3, max_depth=4,
                                  dense_mass=True)
    assert adapted["inverse_mass"].shape == (3, 2, 2)
    torch.testing.assert_close(adapted["inverse_mass"].mean(0), cov, rtol=0.3, atol=0.3)
    assert info.num_steps.double().mean() <= 6
    torch.testing.assert_close(torch.cov(samples.reshape(-1, 2).T), cov, rtol=0.25,
                               atol=0.25)


def test_dense_mass_bad_input_is_named():
    with pytest.raises(ValueError, match=r"with dense_mass=True, inverse_mass must be a "
                                         r"float tensor of shape \(2, 2\)"):
        nuts_step(gaussian, torch.zeros(2), random.key(0), step_size=0.1,
                  inverse_mass=torch.ones(2), dense_mass=True)
    with pytest.raises(ValueError, match="inverse_mass must be symmetric positive definite"):
        nuts_step(gaussian, torch.zeros(2), random.key(0), step_size=0.1,
                  inverse_mass=torch.tensor([[1.0, 2.0], [2.0, 1.0]]), dense_mass=True)


def test_vmap_over_keys_is_num_chains_and_each_chain_alone():
    """``vmap`` over starts and keys (as for ``hmc``) runs every lane's doublings until
    all lanes' trees end, finished lanes masked: each lane's chain is the chain run
    alone from its key, and ``num_chains`` gives the same chains."""
    inits = random.normal(random.key(3), (3, 2), dtype=torch.float64) * 2
    keys = random.split(random.key(4), 3)

    def chain(x0, key):
        return nuts(gaussian, x0, key, num_samples=15, num_warmup=40)

    samples, info, adapted = vmap(chain)(inits, keys)
    assert samples.shape == (3, 15, 2) and info.num_steps.shape == (3, 15)
    assert len(set(info.tree_depth.flatten().tolist())) > 1  # lanes' depths differ
    for c in range(3):
        one, one_info, one_adapted = chain(inits[c], keys[c])
        torch.testing.assert_close(samples[c], one, rtol=1e-12, atol=1e-12)
        assert torch.equal(info.num_steps[c], one_info.num_steps)
        torch.testing.assert_close(adapted["step_size"][c], one_adapted["step_size"])
    x1, step_info = vmap(lambda x, k: nuts_step(gaussian, x, k, step_size=0.7))(inits, keys)
    for c in range(3):
        one, one_info = nuts_step(gaussian, inits[c], keys[c], step_size=0.7)
        torch.testing.assert_close(x1[c], one, rtol=1e-12, atol=1e-12)
        assert step_info.num_steps[c] == one_info.num_steps


def test_per_chain_randomness_is_the_same_by_loop_or_vmap(monkeypatch):
    """A few CPU chains draw their keys' randomness in a Python loop (faster), more
    chains by ``vmap``: the chains are the same either way."""
    inits = random.normal(random.key(3), (3, 2), dtype=torch.float64)
    loop = nuts(gaussian, inits, random.key(2), num_samples=10, num_warmup=30,
                num_chains=3)
    monkeypatch.setattr(_nuts, "_per_chain", lambda fn, keys: vmap(fn)(keys))
    batched = nuts(gaussian, inits, random.key(2), num_samples=10, num_warmup=30,
                   num_chains=3)
    assert torch.equal(loop[0], batched[0])
    assert torch.equal(loop[1].num_steps, batched[1].num_steps)
