"""Schedules and the forward process against diffusers' DDPMScheduler (the external reference)."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torchfn.transforms import diffusion as D

diffusers = pytest.importorskip("diffusers", reason="diffusers is the reference implementation")

# diffusers computes the schedule in float32: a cumulative product over 1000 steps
# accumulates ~1000 float32 roundings (<= 1000 * 6e-8), hence this tolerance.
F32_CUMPROD_ATOL = 1e-6


@pytest.mark.parametrize(
    "name, ours",
    [
        ("linear", lambda T: D.linear_schedule(T)),
        ("squaredcos_cap_v2", lambda T: D.cosine_schedule(T)),
    ],
)
@pytest.mark.parametrize("T", [1, 10, 1000])
def test_schedule_equals_diffusers(name, ours, T):
    ref = diffusers.DDPMScheduler(num_train_timesteps=T, beta_schedule=name)
    s = ours(T)
    assert s.betas.dtype == torch.float64 and s.num_timesteps == T
    torch.testing.assert_close(s.betas, ref.betas.double(), atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(
        s.alphas_cumprod, ref.alphas_cumprod.double(), atol=F32_CUMPROD_ATOL, rtol=0
    )


@pytest.mark.parametrize("make", [D.linear_schedule, D.cosine_schedule, D.sigmoid_schedule])
def test_schedule_coefficients_consistent(make):
    s = make(200)
    b = s.betas
    abar = torch.cumprod(1 - b, 0)
    torch.testing.assert_close(s.alphas_cumprod, abar)
    assert (b > 0).all() and (b < 1).all()
    assert (s.alphas_cumprod[1:] < s.alphas_cumprod[:-1]).all()
    torch.testing.assert_close(s.alphas_cumprod_prev[1:], abar[:-1])
    assert s.alphas_cumprod_prev[0] == 1
    torch.testing.assert_close(s.snr, abar / (1 - abar))
    torch.testing.assert_close(
        s.sqrt_alphas_cumprod**2 + s.sqrt_one_minus_alphas_cumprod**2, torch.ones_like(b)
    )
    # posterior q(x_{t-1} | x_t, x0): coefficients from Bayes' rule on the two Gaussians
    pv = b * (1 - s.alphas_cumprod_prev) / (1 - abar)
    torch.testing.assert_close(s.posterior_variance, pv)
    assert s.posterior_variance[0] == 0
    torch.testing.assert_close(s.posterior_log_variance_clipped[1:], pv[1:].log())
    torch.testing.assert_close(s.posterior_log_variance_clipped[0], pv[1].log())


def test_posterior_mean_is_exact_on_gaussians():
    # For x0 fixed, E[x_{t-1} | x_t, x0] from joint Gaussian algebra, computed independently.
    s = D.linear_schedule(50)
    t = torch.arange(1, 50)
    abar, abar_prev, alpha = s.alphas_cumprod[t], s.alphas_cumprod_prev[t], s.alphas[t]
    # Cov(x_{t-1}, x_t | x0) = sqrt(alpha_t) (1 - abar_{t-1}); Var(x_t | x0) = 1 - abar_t
    x0, xt = 0.7, -1.3
    cond_mean = abar_prev.sqrt() * x0 + alpha.sqrt() * (1 - abar_prev) / (1 - abar) * (
        xt - abar.sqrt() * x0
    )
    cond_var = (1 - abar_prev) - alpha * (1 - abar_prev) ** 2 / (1 - abar)
    mean, var, logvar = D.q_posterior(
        s,
        torch.full((49, 1), x0, dtype=torch.float64),
        torch.full((49, 1), xt, dtype=torch.float64),
        t,
    )
    torch.testing.assert_close(mean[:, 0], cond_mean)
    torch.testing.assert_close(var[:, 0], cond_var)
    torch.testing.assert_close(logvar[:, 0], cond_var.log())


def test_cosine_matches_closed_form():
    T, s_ = 100, 0.008
    f = lambda u: math.cos((u + s_) / (1 + s_) * math.pi / 2) ** 2
    # abar_t = f((t + 1) / T) / f(0) as long as no beta hit max_beta
    expect = torch.tensor([f(t / T) / f(0) for t in range(1, T + 1)], dtype=torch.float64)
    s = D.cosine_schedule(T)
    unclipped = s.betas < 0.999
    torch.testing.assert_close(s.alphas_cumprod[unclipped], expect[unclipped])


def test_sigmoid_schedule_definition():
    T, start, end, tau = 50, -3.0, 3.0, 0.7
    sig = lambda z: 1 / (1 + math.exp(-z))
    f = lambda u: (
        (sig(end / tau) - sig(((end - start) * u + start) / tau))
        / (sig(end / tau) - sig(start / tau))
    )
    s = D.sigmoid_schedule(T, start, end, tau)
    expect = torch.tensor([f(t / T) for t in range(1, T)], dtype=torch.float64)
    torch.testing.assert_close(s.alphas_cumprod[:-1], expect)
    assert s.betas[-1] == 0.999  # abar(1) = 0 is capped


@given(
    seed=st.integers(0, 2**31 - 1),
    B=st.integers(1, 6),
    shape=st.sampled_from([(2,), (3, 4)]),
    name=st.sampled_from(["linear", "squaredcos_cap_v2"]),
)
def test_q_sample_equals_diffusers_add_noise(seed, B, shape, name):
    T = 1000
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn((B, *shape), generator=g)
    noise = torch.randn((B, *shape), generator=g)
    t = torch.randint(0, T, (B,), generator=g)
    ref = diffusers.DDPMScheduler(num_train_timesteps=T, beta_schedule=name).add_noise(x0, noise, t)
    s = D.linear_schedule(T) if name == "linear" else D.cosine_schedule(T)
    out = D.q_sample(s, x0, t, noise)
    assert out.dtype == torch.float32 and out.shape == x0.shape
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


def test_q_sample_float64_and_single_example():
    s = D.cosine_schedule(100)
    x0 = torch.linspace(-1, 1, 6, dtype=torch.float64).reshape(2, 3)
    noise = torch.linspace(2, 0.5, 6, dtype=torch.float64).reshape(2, 3)
    t = torch.tensor([3, 97])
    out = D.q_sample(s, x0, t, noise)
    a = s.alphas_cumprod[t][:, None]
    torch.testing.assert_close(out, a.sqrt() * x0 + (1 - a).sqrt() * noise, rtol=1e-14, atol=1e-14)
    # one example: t of shape ()
    one = D.q_sample(s, x0[1], t[1], noise[1])
    torch.testing.assert_close(one, out[1], rtol=1e-14, atol=1e-14)
    # under vmap, writing for one example
    torch.testing.assert_close(
        torch.func.vmap(lambda a, b, c: D.q_sample(s, a, b, c))(x0, t, noise), out
    )


@given(seed=st.integers(0, 2**31 - 1), t=st.integers(0, 999))
def test_prediction_conversions_roundtrip(seed, t):
    s = D.linear_schedule(1000)
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(3, 4, generator=g, dtype=torch.float64)
    eps = torch.randn(3, 4, generator=g, dtype=torch.float64)
    tt = torch.full((3,), t)
    xt = D.q_sample(s, x0, tt, eps)
    v = D.velocity(s, x0, tt, eps)
    kw = dict(rtol=1e-7, atol=1e-7 * float(s.sqrt_recip_alphas_cumprod[t]))
    torch.testing.assert_close(D.predict_x0_from_eps(s, xt, tt, eps), x0, **kw)
    torch.testing.assert_close(D.predict_x0_from_v(s, xt, tt, v), x0, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(D.predict_eps_from_v(s, xt, tt, v), eps, rtol=1e-10, atol=1e-10)
    if t > 0:  # at t = 0 eps is barely identifiable from (x_t, x0)
        torch.testing.assert_close(D.predict_eps_from_x0(s, xt, tt, x0), eps, rtol=1e-6, atol=1e-6)


def test_velocity_equals_diffusers():
    T = 1000
    g = torch.Generator().manual_seed(3)
    x0, noise = torch.randn(5, 3, generator=g), torch.randn(5, 3, generator=g)
    t = torch.tensor([0, 10, 500, 900, 999])
    ref = diffusers.DDPMScheduler(num_train_timesteps=T).get_velocity(x0, noise, t)
    torch.testing.assert_close(
        D.velocity(D.linear_schedule(T), x0, t, noise), ref, atol=2e-6, rtol=1e-5
    )


# ----------------------------------------------------------------------------- bad input


def test_bad_T_and_betas():
    with pytest.raises(ValueError, match="T must be >= 1, got 0"):
        D.linear_schedule(0)
    with pytest.raises(TypeError, match="T must be an int"):
        D.cosine_schedule(10.0)
    with pytest.raises(ValueError, match="beta_end must lie in"):
        D.linear_schedule(10, beta_end=1.5)
    with pytest.raises(ValueError, match=r"betas must lie in the open interval \(0, 1\)"):
        D.schedule_from_betas(torch.tensor([0.1, 0.0]))
    with pytest.raises(ValueError, match=r"betas must lie in the open interval \(0, 1\)"):
        D.schedule_from_betas(torch.tensor([0.1, 1.0]))
    with pytest.raises(ValueError, match="max_beta"):
        D.cosine_schedule(10, max_beta=1.0)
    with pytest.raises(ValueError, match="tau must be > 0"):
        D.sigmoid_schedule(10, tau=0.0)


def test_bad_timesteps():
    s = D.linear_schedule(100)
    x0 = torch.ones(3, 2)
    with pytest.raises(
        ValueError, match=r"t must lie in \[0, T-1\] = \[0, 99\], got values in \[0, 100\]"
    ):
        D.q_sample(s, x0, torch.tensor([0, 5, 100]), x0)
    with pytest.raises(ValueError, match=r"got values in \[-1, 5\]"):
        D.q_sample(s, x0, torch.tensor([-1, 5, 2]), x0)
    with pytest.raises(TypeError, match="t must be an integer tensor"):
        D.q_sample(s, x0, torch.tensor([1.0, 2.0, 3.0]), x0)
    with pytest.raises(ValueError, match="t must have shape equal to the leading dims"):
        D.q_sample(s, x0, torch.tensor([1, 2]), x0)
    with pytest.raises(ValueError, match="noise must have the shape of x0"):
        D.q_sample(s, x0, torch.tensor([1, 2, 3]), torch.ones(3, 1))
    with pytest.raises(TypeError, match="schedule must be a Schedule"):
        D.q_sample(s.betas, x0, torch.tensor([1, 2, 3]), x0)


def test_schedule_is_a_pytree():
    from torchfn import tree

    s = D.linear_schedule(10)
    s32 = tree.map(lambda a: a.float(), s)
    assert isinstance(s32, D.Schedule) and s32.betas.dtype == torch.float32
    assert len(tree.leaves(s)) == len(D.Schedule._fields)
