"""EDM: levels, preconditioning and the Euler sampler equal diffusers' EDMEulerScheduler;
on Gaussian data with the exact denoiser, Heun converges at order 2 to the closed-form
flow, and the churned sampler's spread equals its closed form."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.func import vmap

from torchfn import random
from torchfn.transforms import diffusion as D

diffusers = pytest.importorskip("diffusers", reason="diffusers is the reference implementation")


def gaussian_denoiser(mu, s):
    """E[x0 | x0 + sigma eps = x] when x0 ~ N(mu, s^2 I)."""

    def denoise(x, sigma):
        return mu + (s**2 / (s**2 + sigma**2))[:, None] * (x - mu)

    return denoise


def exact_end(x_start, sigma_start, mu, s):
    """The probability flow of that denoiser: x(sigma) - mu scales as sqrt(s^2 + sigma^2)."""
    return mu + (x_start - mu) * (s / math.sqrt(s**2 + sigma_start**2))


@pytest.mark.parametrize("steps", [1, 2, 18, 40])
@pytest.mark.parametrize("rho", [7.0, 3.0])
def test_sigmas_equal_diffusers(steps, rho):
    ref = diffusers.EDMEulerScheduler(rho=rho)
    ref.set_timesteps(steps)
    got = D.edm_sigmas(steps, rho=rho)
    assert got.dtype == torch.float64 and got.shape == (steps + 1,)
    torch.testing.assert_close(got.float(), ref.sigmas, atol=1e-5, rtol=1e-6)


def test_scalings_equal_diffusers_preconditioning():
    ref = diffusers.EDMEulerScheduler(sigma_data=0.7)
    sigma = torch.tensor([0.01, 0.5, 3.0, 80.0], dtype=torch.float64)
    x, out = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    c_skip, c_out, c_in, c_noise = D.edm_scalings(sigma, 0.7)
    col = sigma[:, None]
    torch.testing.assert_close(c_in[:, None] * x, ref.precondition_inputs(x, col))
    torch.testing.assert_close(c_noise, ref.precondition_noise(sigma))
    torch.testing.assert_close(c_skip[:, None] * x + c_out[:, None] * out,
                               ref.precondition_outputs(x, out, col))


def net(x_in, c_noise):
    """A raw network: any function of the scaled input and the noise label."""
    return torch.tanh(x_in) * (1 + 0.1 * c_noise[:, None]) - 0.2


@pytest.mark.parametrize("steps", [1, 5, 18])
def test_euler_equals_the_diffusers_loop(steps):
    """diffusers' pipeline: model(scale_model_input(x, t), t) then step(); here the same
    network behind edm_denoiser."""
    denoise = D.edm_denoiser(net, sigma_data=0.5)
    chain = D.edm_sample(denoise, (16, 3), random.key(1), steps=steps, method="euler",
                         return_chain=True)
    assert chain.shape == (steps + 1, 16, 3)
    ref = diffusers.EDMEulerScheduler()
    ref.set_timesteps(steps)
    x = chain[0]
    torch.testing.assert_close(x, random.normal(random.split(random.key(1))[0], (16, 3)) * 80.0)
    for i, t in enumerate(ref.timesteps):
        out = net(ref.scale_model_input(x, t), t.repeat(16))
        x = ref.step(out, t, x).prev_sample
        torch.testing.assert_close(chain[i + 1], x, atol=2e-4, rtol=1e-5)


def _end_error(method, steps, mu=0.4, s=0.5):
    chain = D.edm_sample(gaussian_denoiser(mu, s), (64, 2), random.key(5), steps=steps,
                         method=method, dtype=torch.float64, return_chain=True)
    return (chain[-1] - exact_end(chain[0], 80.0, mu, s)).abs().max().item()


@pytest.mark.parametrize("method, order", [("euler", 1), ("heun", 2)])
def test_convergence_order_on_the_exact_gaussian_flow(method, order):
    e1, e2 = _end_error(method, 64), _end_error(method, 128)
    observed = math.log2(e1 / e2)
    assert abs(observed - order) < 0.2, (e1, e2, observed)


def test_heun_reaches_the_closed_form():
    assert _end_error("heun", 256) < 5e-4  # from x = 80 z


def _step_gain(method, s_hat, s_next, sd):
    """x_next - mu = gain (x_hat - mu) for the linear field (x - D) / sigma = k(sigma) (x - mu)."""
    k = lambda sig: sig / (sd**2 + sig**2)  # noqa: E731
    h = s_next - s_hat
    if method == "euler" or s_next == 0:
        return 1 + h * k(s_hat)
    return 1 + 0.5 * h * (k(s_hat) + k(s_next) * (1 + h * k(s_hat)))


@pytest.mark.parametrize("method", ["heun", "euler"])
def test_churned_spread_equals_its_closed_form(method):
    """Churn adds variance s_hat^2 - s^2, each step scales x - mu by a known gain, so the
    variance follows a^2 <- gain^2 (a^2 + (s_hat^2 - s^2) noise_scale^2) from a^2 = s_0^2."""
    mu, sd, steps = -0.3, 0.5, 32
    kw = dict(churn=40.0, churn_min=0.05, churn_max=50.0, noise_scale=1.003)
    x = D.edm_sample(gaussian_denoiser(mu, sd), (40_000, 2), random.key(7), steps=steps,
                     method=method, dtype=torch.float64, **kw)
    levels = D.edm_sigmas(steps).tolist()
    gamma = min(kw["churn"] / steps, 2**0.5 - 1)
    a2 = levels[0] ** 2
    for s, s_next in zip(levels[:-1], levels[1:]):
        g = gamma if kw["churn_min"] <= s <= kw["churn_max"] else 0.0
        s_hat = s * (1 + g)
        a2 = _step_gain(method, s_hat, s_next, sd) ** 2 * (a2 + (s_hat**2 - s**2) * 1.003**2)
    assert abs(x.mean().item() - mu) < 4 * math.sqrt(a2 / x.numel())
    assert x.std().item() == pytest.approx(math.sqrt(a2), rel=0.02)
    if method == "heun":  # near the data's spread (noise_scale > 1 widens it on purpose)
        assert math.sqrt(a2) == pytest.approx(sd, rel=0.1)


def test_vmap_over_keys_equals_a_loop():
    denoise = gaussian_denoiser(0.1, 0.5)
    keys = random.split(random.key(11), 3)

    def sample(k):
        return D.edm_sample(denoise, (8, 2), k, steps=6, churn=10.0)

    torch.testing.assert_close(vmap(sample)(keys), torch.stack([sample(k) for k in keys]))


def test_given_sigmas_are_used_as_they_are():
    seen = []

    def denoise(x, sigma):
        seen.append(float(sigma[0]))
        return torch.zeros_like(x)

    D.edm_sample(denoise, (4, 2), random.key(0), sigmas=[10.0, 1.0, 0.1, 0.0])
    assert seen == pytest.approx([10.0, 1.0, 1.0, 0.1, 0.1])  # Heun: twice but at the last


def test_denoiser_checks():
    denoise = D.edm_denoiser(lambda x, c: x[:, :1])
    with pytest.raises(ValueError, match=r"must return x's shape \(4, 2\), got \(4, 1\)"):
        denoise(torch.ones(4, 2), torch.ones(4))
    with pytest.raises(ValueError, match=r"sigma must have shape \(B,\) = \(4,\), got \(\)"):
        D.edm_denoiser(net)(torch.ones(4, 2), torch.tensor(1.0))
    with pytest.raises(TypeError, match="net_fn must be callable"):
        D.edm_denoiser(3)
    with pytest.raises(ValueError, match="sigma_data must be a float > 0"):
        D.edm_scalings(torch.ones(2), 0.0)


@pytest.mark.parametrize("kwargs, match", [
    ({"steps": 0}, "steps must be an int >= 1"),
    ({"sigma_min": 90.0}, "sigma_min must be < sigma_max"),
    ({"rho": -1.0}, "rho must be a float > 0"),
    ({"method": "dpm"}, "method must be one of"),
    ({"churn": -1.0}, "churn must be a float >= 0"),
    ({"sigmas": [1.0, 2.0, 0.0]}, "sigmas must be a decreasing"),
    ({"sigmas": [2.0, 1.0]}, "ending in 0"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        D.edm_sample(gaussian_denoiser(0.0, 0.5), (4, 2), random.key(0), **kwargs)


@given(steps=st.integers(1, 300), rho=st.floats(1.0, 10.0),
       lo=st.floats(1e-4, 0.5), span=st.floats(1.5, 2000.0))
def test_drawn_levels_equal_diffusers(steps, rho, lo, span):
    ref = diffusers.EDMEulerScheduler(sigma_min=lo, sigma_max=lo * span, rho=rho)
    ref.set_timesteps(steps)
    got = D.edm_sigmas(steps, sigma_min=lo, sigma_max=lo * span, rho=rho)
    torch.testing.assert_close(got.float(), ref.sigmas, atol=1e-6, rtol=2e-6)


@pytest.mark.parametrize("order", [1, 2, 3])
@pytest.mark.parametrize("steps", [1, 5, 18])
def test_dpm_solver_equals_diffusers(order, steps):
    denoise = D.edm_denoiser(net, sigma_data=0.5)
    chain = D.edm_sample(denoise, (16, 3), random.key(4), steps=steps, method="dpm_solver",
                         order=order, return_chain=True)
    ref = diffusers.EDMDPMSolverMultistepScheduler(solver_order=order)
    ref.set_timesteps(steps)
    x = chain[0]
    for i, t in enumerate(ref.timesteps):
        out = net(ref.scale_model_input(x, t), t.repeat(16))
        x = ref.step(out, t, x).prev_sample
        torch.testing.assert_close(chain[i + 1], x, atol=2e-4, rtol=1e-5)


def test_dpm_solver_beats_heun_at_equal_calls_on_the_gaussian_flow():
    """18 calls: DPM-Solver++(2M) at 18 levels against Heun's 10 levels (19 calls)."""
    dpm = _end_error_with(dict(steps=18, method="dpm_solver"))
    heun = _end_error_with(dict(steps=10, method="heun"))
    assert dpm < heun, (dpm, heun)


def _end_error_with(kw, mu=0.4, s=0.5):
    chain = D.edm_sample(gaussian_denoiser(mu, s), (64, 2), random.key(5), dtype=torch.float64,
                         return_chain=True, **kw)
    return (chain[-1] - exact_end(chain[0], 80.0, mu, s)).abs().max().item()
