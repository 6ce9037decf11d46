"""DDPM / DDIM samplers: step-by-step equal to diffusers, and the closed form on Gaussian data."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torchfn import random
from torchfn.transforms import diffusion as D

diffusers = pytest.importorskip("diffusers", reason="diffusers is the reference implementation")

_DIFFUSERS_PRED = {"eps": "epsilon", "x0": "sample", "v": "v_prediction"}


def gaussian_eps_fn(schedule, mu, sigma):
    """The exact E[eps | x_t] when x0 ~ N(mu, sigma^2 I)."""
    abar = schedule.alphas_cumprod

    def eps_fn(x, t):  # x: (B, D), t: (B,), every entry the same timestep (as samplers call it)
        a = float(abar[int(t[0])])
        return (x - a**0.5 * mu) * ((1 - a) ** 0.5 / (a * sigma**2 + 1 - a))

    return eps_fn


# ----------------------------------------------------------------------------- vs diffusers


@given(
    seed=st.integers(0, 2**31 - 1),
    t=st.integers(0, 999),
    variance=st.sampled_from(["fixed_small", "fixed_large"]),
    prediction=st.sampled_from(["eps", "x0", "v"]),
    clip=st.sampled_from([None, 1.0]),
)
def test_ddpm_step_equals_diffusers(seed, t, variance, prediction, clip):
    T = 1000
    ref = diffusers.DDPMScheduler(
        num_train_timesteps=T,
        variance_type=variance,
        prediction_type=_DIFFUSERS_PRED[prediction],
        clip_sample=clip is not None,
        clip_sample_range=clip or 1.0,
    )
    g = torch.Generator().manual_seed(seed)
    x, out = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
    expect = ref.step(out, t, x, generator=torch.Generator().manual_seed(seed + 1)).prev_sample
    noise = torch.randn(4, 3, generator=torch.Generator().manual_seed(seed + 1))
    got = D.ddpm_step(
        D.linear_schedule(T),
        x,
        t,
        out,
        noise,
        prediction=prediction,
        variance=variance,
        clip_x0=clip,
    )
    torch.testing.assert_close(got, expect, atol=1e-4, rtol=1e-4)


@given(
    seed=st.integers(0, 2**31 - 1),
    i=st.integers(0, 49),
    eta=st.sampled_from([0.0, 0.5, 1.0]),
    prediction=st.sampled_from(["eps", "x0", "v"]),
)
def test_ddim_step_equals_diffusers(seed, i, eta, prediction):
    T, steps = 1000, 50
    ref = diffusers.DDIMScheduler(
        num_train_timesteps=T,
        timestep_spacing="trailing",
        prediction_type=_DIFFUSERS_PRED[prediction],
        clip_sample=False,
    )
    ref.set_timesteps(steps)
    ts = D.ddim_timesteps(T, steps, "trailing")
    assert torch.equal(ts, ref.timesteps)
    g = torch.Generator().manual_seed(seed)
    x, out, noise = (torch.randn(4, 3, generator=g) for _ in range(3))
    t = int(ts[i])
    t_prev = int(ts[i + 1]) if i + 1 < steps else -1
    expect = ref.step(out, t, x, eta=eta, variance_noise=noise).prev_sample
    got = D.ddim_step(
        D.linear_schedule(T), x, t, t_prev, out, noise, prediction=prediction, eta=eta
    )
    torch.testing.assert_close(got, expect, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("spacing", ["trailing", "leading", "linspace"])
@pytest.mark.parametrize(
    "T, steps",
    [(1000, 1), (1000, 3), (1000, 7), (1000, 50), (1000, 250), (1000, 1000), (10, 4), (37, 36)],
)
def test_ddim_timesteps_equal_diffusers(spacing, T, steps):
    ref = diffusers.DDIMScheduler(num_train_timesteps=T, timestep_spacing=spacing)
    ref.set_timesteps(steps)
    ts = D.ddim_timesteps(T, steps, spacing)
    assert ts.dtype == torch.int64
    assert torch.equal(ts, ref.timesteps)


@pytest.mark.parametrize("spacing", ["trailing", "leading"])
def test_ddim_sample_equals_diffusers_loop(spacing):
    T, steps = 1000, 20
    s = D.linear_schedule(T)
    eps_fn = gaussian_eps_fn(s, 0.8, 0.6)
    chain = D.ddim_sample(
        eps_fn, s, (64, 2), random.key(4), steps=steps, spacing=spacing, return_chain=True
    )
    assert chain.shape == (steps + 1, 64, 2)
    ref = diffusers.DDIMScheduler(
        num_train_timesteps=T, timestep_spacing=spacing, clip_sample=False
    )
    ref.set_timesteps(steps)
    x = chain[0]
    for t in ref.timesteps:
        x = ref.step(eps_fn(x, t.repeat(64)), int(t), x).prev_sample
    torch.testing.assert_close(chain[-1], x, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- closed form


GAUSS_MU, GAUSS_SIGMA = 1.5, 0.5


def _check_moments(x, mu, sigma, name):
    n = x.shape[0]
    assert (x.mean(0) - mu).abs().max() < 4 * sigma / math.sqrt(n), (name, x.mean(0), mu)
    assert (x.var(0) / sigma**2 - 1).abs().max() < 0.05, (name, x.var(0), sigma**2)


def test_ddim_reproduces_gaussian_data_float64():
    # x0 ~ N(mu, sigma^2) with the exact posterior-mean eps: only the discretisation
    # (and the schedule's nonzero terminal SNR) separates the samples from the data.
    s = D.linear_schedule(1000)
    eps_fn = gaussian_eps_fn(s, GAUSS_MU, GAUSS_SIGMA)
    x = D.ddim_sample(eps_fn, s, (20000, 1), random.key(11), steps=250, dtype=torch.float64)
    assert x.dtype == torch.float64 and x.shape == (20000, 1)
    _check_moments(x, GAUSS_MU, GAUSS_SIGMA, "ddim250")


@pytest.mark.parametrize("variance", ["fixed_small", "fixed_large"])
def test_ddpm_reproduces_gaussian_data_exactly(variance):
    # With the Gaussian-optimal eps every ancestral step is x' = A x + b + sigma_t z, so the
    # law of ddpm_sample's output is N(m, v) with (m, v) propagated exactly from N(0, 1):
    # no Monte Carlo error (test_ddpm_sample_reproduces_gaussian_data_float64 samples it).
    T, n = 1000, 20000
    s = D.linear_schedule(T)
    eps_fn = gaussian_eps_fn(s, GAUSS_MU, GAUSS_SIGMA)
    m, v = 0.0, 1.0
    xs = torch.tensor([[0.0], [1.0]], dtype=torch.float64)
    for t in range(T - 1, -1, -1):
        zero = torch.zeros_like(xs)
        one = torch.ones_like(xs)
        out = eps_fn(xs, torch.full((2,), t))
        base = D.ddpm_step(s, xs, t, out, zero if t else None, variance=variance)
        b, A = float(base[0, 0]), float(base[1, 0] - base[0, 0])
        sd = float(D.ddpm_step(s, xs, t, out, one, variance=variance)[0, 0]) - b if t else 0.0
        m, v = A * m + b, A * A * v + sd * sd
    assert abs(m - GAUSS_MU) < 4 * GAUSS_SIGMA / math.sqrt(n), m
    assert abs(v / GAUSS_SIGMA**2 - 1) < 0.05, v


def test_ddpm_sample_is_the_step_loop():
    s = D.linear_schedule(40)
    eps_fn = gaussian_eps_fn(s, GAUSS_MU, GAUSS_SIGMA)
    key = random.key(5)
    chain = D.ddpm_sample(eps_fn, s, (6, 2), key, dtype=torch.float64, return_chain=True)
    x = chain[0]
    for i, t in enumerate(range(39, -1, -1)):
        # recover the step's noise from the chain, check it is standard normal-ish and
        # that the step reproduces the next state exactly
        nxt = D.ddpm_step(
            s, x, t, eps_fn(x, torch.full((6,), t)), torch.zeros_like(x) if t else None
        )
        if t:
            z = (chain[i + 1] - nxt) / s.posterior_variance[t].sqrt()
            assert z.abs().max() < 6 and z.std() > 0.3
            nxt = nxt + s.posterior_variance[t].sqrt() * z
        torch.testing.assert_close(chain[i + 1], nxt, rtol=1e-12, atol=1e-12)
        x = chain[i + 1]
    # the noise of different steps differs
    assert not torch.allclose(chain[1] - chain[0], chain[2] - chain[1])


@pytest.mark.parametrize("variance", ["fixed_small", "fixed_large"])
def test_ddpm_sample_reproduces_gaussian_data_float64(variance):
    s = D.linear_schedule(1000)
    eps_fn = gaussian_eps_fn(s, GAUSS_MU, GAUSS_SIGMA)
    x = D.ddpm_sample(eps_fn, s, (20000, 1), random.key(12), dtype=torch.float64, variance=variance)
    _check_moments(x, GAUSS_MU, GAUSS_SIGMA, variance)


def _ddim_affine(s, mu, sigma, steps, spacing="trailing"):
    """DDIM with the Gaussian-optimal eps is affine in x_T: run x_T = 0 and 1 exactly."""
    eps_fn = gaussian_eps_fn(s, mu, sigma)
    xs = torch.tensor([[0.0], [1.0]], dtype=torch.float64)
    ts = D.ddim_timesteps(s.num_timesteps, steps, spacing).tolist()
    for i, t in enumerate(ts):
        t_prev = ts[i + 1] if i + 1 < steps else -1
        xs = D.ddim_step(s, xs, t, t_prev, eps_fn(xs, torch.full((2,), t)))
    return float(xs[0, 0]), float(xs[1, 0] - xs[0, 0])  # offset b, slope A: x0 = A x_T + b


@pytest.mark.parametrize("spacing", ["trailing", "leading", "linspace"])
def test_ddim_variance_error_falls_with_steps(spacing):
    # exact (no Monte Carlo): Var(x0) = A^2 since x_T ~ N(0, 1)
    s = D.linear_schedule(1000)
    errs = [
        abs(_ddim_affine(s, 1.0, 0.5, k, spacing)[1] ** 2 / 0.25 - 1)
        for k in (10, 25, 50, 100, 250)
    ]
    assert all(a > b for a, b in zip(errs, errs[1:])), errs
    assert errs[-1] < 0.03, errs


def test_prediction_types_give_the_same_samples():
    s = D.cosine_schedule(200)
    eps_fn = gaussian_eps_fn(s, 0.3, 0.7)
    x0_fn = lambda x, t: D.predict_x0_from_eps(s, x, t, eps_fn(x, t))

    def v_fn(x, t):
        x0 = x0_fn(x, t)
        return D.velocity(s, x0, t, eps_fn(x, t))

    kw = dict(dtype=torch.float64)
    base = D.ddim_sample(eps_fn, s, (32, 2), random.key(1), steps=20, eta=0.5, **kw)
    for pred, fn in (("x0", x0_fn), ("v", v_fn)):
        out = D.ddim_sample(fn, s, (32, 2), random.key(1), steps=20, eta=0.5, prediction=pred, **kw)
        torch.testing.assert_close(out, base, rtol=1e-8, atol=1e-8)
    base = D.ddpm_sample(eps_fn, s, (32, 2), random.key(2), **kw)
    out = D.ddpm_sample(v_fn, s, (32, 2), random.key(2), prediction="v", **kw)
    torch.testing.assert_close(out, base, rtol=1e-8, atol=1e-8)


# ----------------------------------------------------------------------------- keys, vmap


def test_determinism_and_keys():
    s = D.linear_schedule(50)
    eps_fn = gaussian_eps_fn(s, 0.0, 1.0)
    a = D.ddpm_sample(eps_fn, s, (16, 3), random.key(0))
    b = D.ddpm_sample(eps_fn, s, (16, 3), random.key(0))
    c = D.ddpm_sample(eps_fn, s, (16, 3), random.key(1))
    assert torch.equal(a, b) and not torch.allclose(a, c)
    a = D.ddim_sample(eps_fn, s, (16, 3), random.key(0), steps=10, eta=1.0)
    assert torch.equal(a, D.ddim_sample(eps_fn, s, (16, 3), random.key(0), steps=10, eta=1.0))


@pytest.mark.parametrize("sampler", ["ddpm", "ddim"])
def test_vmap_over_keys_equals_loop(sampler):
    s = D.linear_schedule(30)
    eps_fn = gaussian_eps_fn(s, 0.5, 0.5)
    if sampler == "ddpm":
        run = lambda k: D.ddpm_sample(eps_fn, s, (8, 2), k, variance="fixed_large")
    else:
        run = lambda k: D.ddim_sample(eps_fn, s, (8, 2), k, steps=10, eta=0.7)
    keys = random.split(random.key(7), 3)
    batched = torch.func.vmap(run)(keys)
    looped = torch.stack([run(k) for k in keys])
    assert batched.shape == (3, 8, 2)
    torch.testing.assert_close(batched, looped)


def test_return_chain_and_clip():
    s = D.linear_schedule(20)
    eps_fn = lambda x, t: -x  # a bad model, so x0 predictions blow past the clip range
    chain = D.ddpm_sample(eps_fn, s, (5, 2), random.key(0), return_chain=True)
    assert chain.shape == (21, 5, 2)
    torch.testing.assert_close(chain[-1], D.ddpm_sample(eps_fn, s, (5, 2), random.key(0)))
    x = D.ddim_sample(eps_fn, s, (5, 2), random.key(0), steps=5, clip_x0=0.5)
    assert x.abs().max() <= 0.5 + 1e-6  # the last step returns x0_hat itself
    assert D.ddim_sample(eps_fn, s, (5, 2), random.key(0), steps=5).abs().max() > 0.5


# ----------------------------------------------------------------------------- bad input


def test_sampler_bad_input():
    s = D.linear_schedule(20)
    f = lambda x, t: x
    k = random.key(0)
    with pytest.raises(ValueError, match="variance must be one of"):
        D.ddpm_sample(f, s, (2, 2), k, variance="learned")
    with pytest.raises(ValueError, match="spacing must be one of"):
        D.ddim_sample(f, s, (2, 2), k, steps=5, spacing="karras")
    with pytest.raises(ValueError, match="prediction must be one of"):
        D.ddim_sample(f, s, (2, 2), k, steps=5, prediction="score")
    with pytest.raises(ValueError, match=r"steps must be an int in \[1, T\] = \[1, 20\], got 21"):
        D.ddim_sample(f, s, (2, 2), k, steps=21)
    with pytest.raises(ValueError, match="eta must be >= 0"):
        D.ddim_sample(f, s, (2, 2), k, steps=5, eta=-0.1)
    with pytest.raises(ValueError, match="clip_x0 must be None, a float > 0 or a DynamicThreshold"):
        D.ddpm_sample(f, s, (2, 2), k, clip_x0=0.0)
    with pytest.raises(ValueError, match="shape must be"):
        D.ddpm_sample(f, s, (0, 2), k)
    with pytest.raises(
        ValueError, match=r"model_fn\(x, t\) must return x's shape \(2, 2\), got \(2,\)"
    ):
        D.ddpm_sample(lambda x, t: x.sum(1), s, (2, 2), k)
    with pytest.raises(ValueError, match=r"t must lie in \[0, T-1\] = \[0, 19\], got 20"):
        D.ddpm_step(s, torch.ones(2), 20, torch.ones(2), torch.ones(2))
    with pytest.raises(ValueError, match="t_prev must be < t"):
        D.ddim_step(s, torch.ones(2), 5, 5, torch.ones(2))
    with pytest.raises(ValueError, match="noise is required"):
        D.ddpm_step(s, torch.ones(2), 5, torch.ones(2))
    with pytest.raises(TypeError, match="dtype must be a floating dtype"):
        D.ddpm_sample(f, s, (2, 2), k, dtype=torch.int64)


@pytest.mark.parametrize("scheduler", ["ddpm", "ddim"])
@pytest.mark.parametrize("ratio, max_value", [(0.995, 1.0), (0.8, 2.0)])
def test_dynamic_threshold_equals_diffusers_thresholding(scheduler, ratio, max_value):
    """``clip_x0=DynamicThreshold(...)`` is diffusers' ``thresholding=True`` (Imagen)."""
    T, t = 1000, 600
    g = torch.Generator().manual_seed(0)
    x, out, noise = (3 * torch.randn(8, 3, 4, generator=g) for _ in range(3))
    kw = dict(num_train_timesteps=T, thresholding=True, dynamic_thresholding_ratio=ratio,
              sample_max_value=max_value)
    threshold = D.DynamicThreshold(ratio, max_value)
    if scheduler == "ddpm":
        expect = diffusers.DDPMScheduler(**kw).step(
            out, t, x, generator=torch.Generator().manual_seed(1)).prev_sample
        noise = torch.randn(8, 3, 4, generator=torch.Generator().manual_seed(1))
        got = D.ddpm_step(D.linear_schedule(T), x, t, out, noise, clip_x0=threshold)
    else:
        ref = diffusers.DDIMScheduler(timestep_spacing="trailing", **kw)
        ref.set_timesteps(10)
        expect = ref.step(out, t, x).prev_sample
        got = D.ddim_step(D.linear_schedule(T), x, t, t - T // 10, out, clip_x0=threshold)
    torch.testing.assert_close(got, expect, atol=1e-4, rtol=1e-4)


def test_bad_threshold():
    s = D.linear_schedule(10)
    with pytest.raises(ValueError, match="a DynamicThreshold needs ratio in"):
        D.ddim_step(s, torch.ones(2, 2), 5, 3, torch.zeros(2, 2),
                    clip_x0=D.DynamicThreshold(ratio=1.5))
