"""SGLD and SGHMC: on a Gaussian potential with exact gradients their iterates are a
linear recursion whose stationary variance has a closed form (SGLD's
``σ² T / (1 - lr / (2σ²))``; SGHMC's from the discrete Lyapunov equation), which 20000
independent chains match; temperature 0 is SGD (with momentum); a run replays from its
key and vmap over keys equals a loop of chains."""

from __future__ import annotations

import pytest
import torch
from torch.func import vmap

from torchfn import optim, random


def _run(tx, sigma, steps, n=20000):
    theta = torch.zeros(n, dtype=torch.float64)
    state = tx.init(theta)
    for _ in range(steps):
        updates, state = tx.update(theta / sigma ** 2, state)  # ∇U for U = θ² / (2σ²)
        theta = optim.apply_updates(theta, updates)
    return theta


@pytest.mark.parametrize("lr, sigma, temperature", [(0.05, 1.0, 1.0), (0.2, 1.5, 1.0),
                                                     (0.1, 2.0, 0.3)])
def test_sgld_stationary_variance_is_the_closed_form(lr, sigma, temperature):
    """``θ' = (1 - lr/σ²) θ + sqrt(2 lr T) ξ``: variance ``2 lr T / (1 - (1 - lr/σ²)²)``."""
    theta = _run(optim.sgld(lr, random.key(0), temperature=temperature), sigma, 400)
    a = 1 - lr / sigma ** 2
    want = 2 * lr * temperature / (1 - a ** 2)
    assert theta.var().item() == pytest.approx(want, rel=0.03)
    assert abs(theta.mean().item()) < 4 * (want / theta.numel()) ** 0.5


def _sghmc_variance(lr, friction, temperature, sigma):
    """The stationary var of θ for z = (θ, v): z' = A z + b ξ, Σ = A Σ Aᵀ + b bᵀ."""
    k = 1 / sigma ** 2
    A = torch.tensor([[1 - lr * k, 1 - friction], [-lr * k, 1 - friction]],
                     dtype=torch.float64)
    s = (2 * friction * lr * temperature) ** 0.5
    b = torch.tensor([s, s], dtype=torch.float64)
    lhs = torch.eye(4, dtype=torch.float64) - torch.kron(A, A)
    Sigma = torch.linalg.solve(lhs, torch.outer(b, b).reshape(4)).reshape(2, 2)
    return Sigma[0, 0].item()


@pytest.mark.parametrize("lr, friction, sigma", [(0.01, 0.1, 1.0), (0.05, 0.3, 1.5)])
def test_sghmc_stationary_variance_is_the_closed_form(lr, friction, sigma):
    theta = _run(optim.sghmc(lr, random.key(1), friction=friction), sigma, 500)
    want = _sghmc_variance(lr, friction, 1.0, sigma)
    assert theta.var().item() == pytest.approx(want, rel=0.04)
    assert want == pytest.approx(sigma ** 2, rel=0.1)  # near σ² at these small steps


def test_psgld_samples_each_scale_and_at_temperature_zero_is_bias_corrected_rmsprop():
    scales = torch.tensor([0.5, 2.0], dtype=torch.float64)
    tx = optim.psgld(0.02, random.key(5), beta=0.9999)
    theta = random.normal(random.key(6), (5000, 2), dtype=torch.float64) * scales
    state = tx.init(theta)
    for _ in range(1500):
        updates, state = tx.update(theta / scales ** 2, state)
        theta = optim.apply_updates(theta, updates)
    torch.testing.assert_close(theta.std(0) / scales, torch.ones(2, dtype=torch.float64),
                               rtol=0.05, atol=0)
    g = {"w": torch.tensor([1.0, -2.0], dtype=torch.float64)}
    cold = optim.psgld(0.1, random.key(7), beta=0.9, eps=1e-8, temperature=0.0)
    s, v = cold.init(g), torch.zeros(2, dtype=torch.float64)
    for t in range(1, 4):
        u, s = cold.update(g, s)
        v = 0.9 * v + 0.1 * g["w"] ** 2
        want = -0.1 * g["w"] / (1e-8 + (v / (1 - 0.9 ** t)).sqrt())
        torch.testing.assert_close(u["w"], want)


def test_temperature_zero_is_sgd_and_sgd_with_momentum():
    g = {"w": torch.tensor([1.0, -2.0]), "b": torch.tensor(0.5)}
    for tx, ref in [(optim.sgld(0.1, random.key(2), temperature=0.0), optim.sgd(0.1)),
                    (optim.sghmc(0.1, random.key(2), friction=0.25, temperature=0.0),
                     optim.sgd(0.1, momentum=0.75))]:
        s, r = tx.init(g), ref.init(g)
        for _ in range(3):
            u, s = tx.update(g, s)
            w, r = ref.update(g, r)
            for k in g:
                torch.testing.assert_close(u[k], w[k])


def test_a_run_replays_from_its_key_and_vmap_over_keys_is_a_loop_of_chains():
    def chain(key):
        tx = optim.sgld(0.05, key)
        theta = {"a": torch.zeros(3), "b": torch.zeros(())}
        state = tx.init(theta)
        for _ in range(5):
            grads = {"a": theta["a"], "b": theta["b"] - 1}
            updates, state = tx.update(grads, state)
            theta = optim.apply_updates(theta, updates)
        return theta

    keys = random.split(random.key(3), 4)
    batched = vmap(chain)(keys)
    for i in range(4):
        one = chain(keys[i])
        for k in one:
            torch.testing.assert_close(batched[k][i], one[k])
    again = chain(keys[0])
    assert all(torch.equal(again[k], chain(keys[0])[k]) for k in again)
    assert not torch.equal(batched["a"][0], batched["a"][1])


@pytest.mark.parametrize("call, match", [
    (lambda: optim.sgld(0.1, 3), r"key must be a torchfn.random key"),
    (lambda: optim.sgld(-0.1, random.key(0)), "lr"),
    (lambda: optim.sgld(0.1, random.key(0), temperature=-1.0), "temperature"),
    (lambda: optim.sghmc(0.1, random.key(0), friction=0.0), r"friction must be in \(0, 1\]"),
    (lambda: optim.psgld(0.1, random.key(0), beta=1.5), "beta"),
])
def test_bad_input_is_named(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call()
