"""Langevin sampling: stationary law on Gaussians, keys, vmap, options and bad input."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torchfn import random
from torchfn.transforms import langevin


def quadratic(s):
    """E(x) = ||x||^2 / (2 s^2), written for one example."""
    return lambda x: 0.5 * (x**2).sum() / s**2


def mlp_energy(seed=0, d=3, h=16):
    g = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(h, d, generator=g) / d**0.5, torch.randn(h, generator=g) / h**0.5

    def energy(x):  # (d,) -> ()
        return (w2 * torch.nn.functional.silu(w1 @ x)).sum() + 0.1 * (x**2).sum()

    return energy


def test_ula_stationary_variance_on_gaussian():
    # ULA on E = x^2 / (2 s^2): x' = (1 - eta / s^2) x + sqrt(2 eta) z, whose stationary
    # variance is s^2 / (1 - eta / (2 s^2)) -- not s^2: the discretisation bias is visible.
    # From x0 = 0 the variance is v (1 - rho^(2k)) after k steps, rho = 1 - eta / s^2 = 0.7:
    # 30 steps mix to 1e-9.
    s, eta, n = 1.0, 0.3, 100_000
    x = langevin(quadratic(s), torch.zeros(n, 1), random.key(0), steps=30, step_size=eta)
    expect = s**2 / (1 - eta / (2 * s**2))
    var = x.var().item()
    assert abs(var / expect - 1) < 0.02, (var, expect)
    assert abs(var / s**2 - 1) > 0.03  # resolves the 5% bias of the discretisation
    assert abs(x.mean().item()) < 4 * (expect / n) ** 0.5


def test_decoupled_noise_stationary_variance():
    # x' = (1 - eta / s^2) x + sigma z  ->  Var = sigma^2 / (1 - (1 - eta / s^2)^2)
    s, eta, sigma, n = 1.0, 0.5, 0.3, 20_000
    x = langevin(
        quadratic(s), torch.zeros(n, 2), random.key(1), steps=30, step_size=eta, noise_std=sigma
    )
    rho = 1 - eta / s**2
    expect = sigma**2 / (1 - rho**2)
    assert (x.var(0) / expect - 1).abs().max() < 0.04, (x.var(0), expect)


def test_no_noise_is_gradient_descent_with_clip_and_clamp():
    energy = mlp_energy()
    x0 = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    out = langevin(
        energy,
        x0,
        random.key(0),
        steps=3,
        step_size=0.7,
        noise_std=0.0,
        grad_clip=0.05,
        clamp=(-0.9, 0.9),
    )
    x = x0.clone()
    for _ in range(3):
        g = torch.stack([torch.func.grad(energy)(xi) for xi in x])
        x = (x - 0.7 * g.clamp(-0.05, 0.05)).clamp(-0.9, 0.9)
    torch.testing.assert_close(out, x)
    assert out.abs().max() <= 0.9


@given(
    seed=st.integers(0, 2**31 - 1), steps=st.integers(1, 6), b=st.integers(1, 5), ula=st.booleans()
)
def test_vmap_over_keys_equals_loop(seed, steps, b, ula):
    energy = mlp_energy(seed % 7)
    x0 = torch.randn(b, 3, generator=torch.Generator().manual_seed(seed))
    kw = dict(steps=steps, step_size=0.05, noise_std=None if ula else 0.01)
    keys = random.split(random.key(seed), 3)
    looped = torch.stack([langevin(energy, x0, k, **kw) for k in keys])  # fast path
    batched = torch.func.vmap(lambda k: langevin(energy, x0, k, **kw))(keys)  # vmap(grad) path
    assert batched.shape == (3, b, 3)
    torch.testing.assert_close(batched, looped, rtol=1e-5, atol=1e-6)


def test_determinism_chain_and_prefix():
    energy = mlp_energy()
    x0 = torch.randn(7, 3, generator=torch.Generator().manual_seed(2))
    kw = dict(step_size=0.05)
    a = langevin(energy, x0, random.key(3), steps=10, **kw)
    assert torch.equal(a, langevin(energy, x0, random.key(3), steps=10, **kw))
    assert not torch.allclose(a, langevin(energy, x0, random.key(4), steps=10, **kw))
    chain = langevin(energy, x0, random.key(3), steps=10, return_chain=True, **kw)
    assert chain.shape == (11, 7, 3)
    assert torch.equal(chain[0], x0) and torch.equal(chain[-1], a)
    short = langevin(energy, x0, random.key(3), steps=4, return_chain=True, **kw)
    torch.testing.assert_close(short, chain[:5])
    assert torch.equal(langevin(energy, x0, random.key(3), steps=0, **kw), x0)


def test_no_gradient_reaches_the_energy_parameters():
    w = torch.tensor([1.5, -0.5, 2.0], requires_grad=True)
    energy = lambda x: (w * x**2).sum()
    x0 = torch.randn(4, 3, generator=torch.Generator().manual_seed(0), requires_grad=True)
    out = langevin(energy, x0, random.key(0), steps=3, step_size=0.01)
    assert not out.requires_grad and w.grad is None and x0.grad is None
    with torch.no_grad():  # sampling works inside no_grad too
        again = langevin(energy, x0, random.key(0), steps=3, step_size=0.01)
    torch.testing.assert_close(again, out)


def test_differentiable_chain_matches_finite_differences():
    x0 = torch.randn(4, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def run(w, x0):  # 3 noisy steps; the noise is fixed by the key
        energy = lambda x: (w * x**2).sum() + 0.3 * torch.sin(w * x).sum()
        out = langevin(energy, x0, random.key(5), steps=3, step_size=0.1, differentiable=True)
        return (out**2).sum()

    w = torch.tensor([1.5, 0.7], dtype=torch.float64)
    g = torch.func.grad(run)(w, x0)
    h = 1e-6
    fd = torch.stack(
        [(run(w + h * e, x0) - run(w - h * e, x0)) / (2 * h) for e in torch.eye(2, dtype=w.dtype)]
    )
    torch.testing.assert_close(g, fd, rtol=1e-6, atol=1e-8)
    # plain autograd reaches the parameters and x0 too
    wr, xr = w.clone().requires_grad_(True), x0.clone().requires_grad_(True)
    gw, gx = torch.autograd.grad(run(wr, xr), (wr, xr))
    torch.testing.assert_close(gw, g)
    assert gx.abs().sum() > 0
    # and the values equal the default (detached) chain
    energy = lambda x: (w * x**2).sum() + 0.3 * torch.sin(w * x).sum()
    kw = dict(steps=3, step_size=0.1)
    torch.testing.assert_close(
        langevin(energy, x0, random.key(5), differentiable=True, **kw).detach(),
        langevin(energy, x0, random.key(5), **kw),
    )


def test_batched_energy_equals_the_per_example_one():
    """``batched=True`` with the same energy written for the batch gives the same chains:
    the fast path, ``vmap`` over keys, and the differentiable chain's gradient."""
    g = torch.Generator().manual_seed(1)
    w1 = torch.randn(16, 3, generator=g, dtype=torch.float64)
    w2 = torch.randn(16, generator=g, dtype=torch.float64)

    def one(w2):
        return lambda x: (w2 * torch.nn.functional.silu(w1 @ x)).sum() + 0.1 * (x**2).sum()

    def batch(w2):  # (B, 3) -> (B,)
        return lambda x: (torch.nn.functional.silu(x @ w1.T) * w2).sum(-1) + 0.1 * (x**2).sum(-1)

    x0 = torch.randn(5, 3, generator=g, dtype=torch.float64)
    kw = dict(steps=4, step_size=0.05)
    per_example = langevin(one(w2), x0, random.key(1), **kw)
    batched = langevin(batch(w2), x0, random.key(1), batched=True, **kw)
    torch.testing.assert_close(batched, per_example, rtol=1e-12, atol=1e-12)
    assert not torch.equal(batched, x0)

    keys = random.split(random.key(2), 3)
    looped = torch.stack([langevin(one(w2), x0, k, **kw) for k in keys])
    mapped = torch.func.vmap(lambda k: langevin(batch(w2), x0, k, batched=True, **kw))(keys)
    torch.testing.assert_close(mapped, looped, rtol=1e-12, atol=1e-12)

    def loss(energy_of, batched):
        return lambda w2: langevin(energy_of(w2), x0, random.key(3), differentiable=True,
                                   batched=batched, **kw).square().sum()

    torch.testing.assert_close(torch.func.grad(loss(batch, True))(w2),
                               torch.func.grad(loss(one, False))(w2), rtol=1e-10, atol=1e-12)


def test_image_shaped_input_and_float64():
    energy = lambda x: (x.mean(dim=(1, 2)) ** 2).sum() + 0.5 * (x**2).mean()  # (C, H, W) -> ()
    x0 = torch.rand(3, 2, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = langevin(
        energy, x0, random.key(0), steps=5, step_size=0.01, noise_std=0.005, clamp=(0.0, 1.0)
    )
    assert out.shape == x0.shape and out.dtype == torch.float64
    assert 0 <= out.min() and out.max() <= 1


def test_bad_input():
    e = quadratic(1.0)
    x0, k = torch.zeros(4, 2), random.key(0)
    with pytest.raises(
        ValueError, match=r"energy_fn must return one example's scalar energy.*\(2,\)"
    ):
        langevin(lambda x: x**2, x0, k, steps=1, step_size=0.1)
    with pytest.raises(ValueError, match=r"shape \(1,\)"):
        langevin(lambda x: x.sum(0, keepdim=True), x0, k, steps=1, step_size=0.1)
    with pytest.raises(ValueError, match=r"with batched=True, energy_fn must return one energy "
                       r"per example, shape \(4,\) .* got shape \(\)"):
        langevin(e, x0, k, steps=1, step_size=0.1, batched=True)  # per-example energy
    with pytest.raises(TypeError, match="batched must be a bool, got int"):
        langevin(e, x0, k, steps=1, step_size=0.1, batched=1)
    with pytest.raises(ValueError, match="step_size must be > 0, got -0.1"):
        langevin(e, x0, k, steps=1, step_size=-0.1)
    with pytest.raises(ValueError, match="step_size must be > 0, got 0"):
        langevin(e, x0, k, steps=1, step_size=0)
    with pytest.raises(ValueError, match="steps must be an int >= 0, got -1"):
        langevin(e, x0, k, steps=-1, step_size=0.1)
    with pytest.raises(ValueError, match="noise_std must be None or >= 0"):
        langevin(e, x0, k, steps=1, step_size=0.1, noise_std=-1.0)
    with pytest.raises(ValueError, match="grad_clip must be None or > 0"):
        langevin(e, x0, k, steps=1, step_size=0.1, grad_clip=0.0)
    with pytest.raises(ValueError, match="clamp must be None or"):
        langevin(e, x0, k, steps=1, step_size=0.1, clamp=(1.0, -1.0))
    with pytest.raises(TypeError, match="x0 must be a floating-point Tensor"):
        langevin(e, torch.zeros(4, 2, dtype=torch.int64), k, steps=1, step_size=0.1)
    with pytest.raises(TypeError, match="energy_fn must be callable"):
        langevin(None, x0, k, steps=1, step_size=0.1)
