"""Rectified-flow sampling: levels and whole runs equal diffusers' FlowMatch schedulers;
on Gaussian data with the exact velocity, Euler converges at order 1, Heun at order 2,
to the closed-form flow, and the stochastic sampler's spread equals its closed form."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.func import grad, vmap

from torchfn import random
from torchfn.transforms import diffusion as D

diffusers = pytest.importorskip("diffusers", reason="diffusers is the reference implementation")


def gaussian_velocity(mu, s, time_scale=1.0):
    """E[eps - x0 | x_sigma = x] when x0 ~ N(mu, s^2 I), x_sigma = (1 - sigma) x0 + sigma eps."""

    def v(x, t):
        sigma = t[0] / time_scale
        var = (1 - sigma) ** 2 * s**2 + sigma**2
        return (sigma - (1 - sigma) * s**2) / var * (x - (1 - sigma) * mu) - mu

    return v


def exact_end(x1, mu, s, start=None):
    """The flow of the exact field carries x at sigma = 1 to mu + s x at sigma = 0; from
    a first level s0 < 1 (DPM-Solver's), x is standardised at s0 first."""
    s0 = D._flow_matching._dpm_levels(start["steps"], 3.0, None, None, 1000)[0] \
        if start and start.get("method") == "dpm_solver" else 1.0
    var = (1 - s0) ** 2 * s**2 + s0**2
    return mu + s * (x1 - (1 - s0) * mu) / var**0.5


@pytest.mark.parametrize("shift", [1.0, 3.0])
@pytest.mark.parametrize("steps, T", [(1, 1000), (2, 1000), (28, 1000), (50, 1000), (7, 50)])
def test_sigmas_equal_diffusers(shift, steps, T):
    ref = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=T, shift=shift)
    ref.set_timesteps(steps)
    got = D.flow_sigmas(steps, shift=shift, T=T)
    assert got.dtype == torch.float64 and got.shape == (steps + 1,)
    torch.testing.assert_close(got.float(), ref.sigmas, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mu", [0.5, 1.15, 2.0])
def test_dynamic_shift_equals_diffusers(mu):
    ref = diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
    ref.set_timesteps(20, mu=mu)
    torch.testing.assert_close(D.flow_sigmas(20, mu=mu).float(), ref.sigmas, atol=1e-6, rtol=1e-6)


def test_terminal_equals_diffusers():
    ref = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0, shift_terminal=0.02)
    ref.set_timesteps(12)
    got = D.flow_sigmas(12, shift=3.0, terminal=0.02)
    torch.testing.assert_close(got.float(), ref.sigmas, atol=1e-6, rtol=1e-6)
    assert got[-2].item() == pytest.approx(0.02)


def test_resolution_shift_mu_is_linear_between_its_anchors():
    """diffusers' calculate_shift lives in the Flux pipeline, which needs transformers;
    its definition: base_shift at base_seq_len, max_shift at max_seq_len, linear between."""
    kw = dict(base_seq_len=100, max_seq_len=300, base_shift=0.2, max_shift=1.0)
    assert D.resolution_shift_mu(100, **kw) == pytest.approx(0.2)
    assert D.resolution_shift_mu(300, **kw) == pytest.approx(1.0)
    assert D.resolution_shift_mu(200, **kw) == pytest.approx(0.6)
    assert D.resolution_shift_mu(500, **kw) == pytest.approx(1.8)
    with pytest.raises(ValueError, match="max_seq_len must differ"):
        D.resolution_shift_mu(10, base_seq_len=5, max_seq_len=5)


def _record(fn, seen):
    def wrapped(x, t):
        seen.append(float(t[0]))
        return fn(x, t)

    return wrapped


@pytest.mark.parametrize("shift", [1.0, 3.0])
@pytest.mark.parametrize("steps", [1, 4, 28])
def test_euler_equals_the_diffusers_loop(shift, steps):
    v = gaussian_velocity(0.7, 0.4, time_scale=1000.0)
    seen = []
    chain = D.flow_sample(_record(v, seen), (16, 3), random.key(1), steps=steps, shift=shift,
                          time_scale=1000.0, return_chain=True)
    assert chain.shape == (steps + 1, 16, 3)
    ref = diffusers.FlowMatchEulerDiscreteScheduler(shift=shift)
    ref.set_timesteps(steps)
    x = chain[0]
    for i, t in enumerate(ref.timesteps):
        x = ref.step(v(x, t.repeat(16)), t, x).prev_sample
        torch.testing.assert_close(chain[i + 1], x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.tensor(seen), ref.timesteps, atol=1e-3, rtol=1e-6)


@pytest.mark.parametrize("shift", [1.0, 3.0])
@pytest.mark.parametrize("steps", [1, 2, 10])
def test_heun_equals_the_diffusers_loop(shift, steps):
    """diffusers' Heun scheduler takes 2 steps - 1 calls: a predictor and a corrector
    per level, and a lone Euler step to 0; the chain holds every other of its samples."""
    v = gaussian_velocity(-0.5, 1.3, time_scale=1000.0)
    seen = []
    chain = D.flow_sample(_record(v, seen), (16, 3), random.key(2), steps=steps, shift=shift,
                          method="heun", time_scale=1000.0, return_chain=True)
    ref = diffusers.FlowMatchHeunDiscreteScheduler(shift=shift)
    ref.set_timesteps(steps)
    assert len(seen) == len(ref.timesteps) == 2 * steps - 1
    x, outs = chain[0], []
    for t in ref.timesteps:
        x = ref.step(v(x, t.repeat(16)), t, x).prev_sample
        outs.append(x)
    # after the first call, samples at the corrector's end: indices 1, 3, ..., and the last
    ends = outs[1::2] + [outs[-1]] if steps > 1 else outs
    for i in range(steps):
        torch.testing.assert_close(chain[i + 1], ends[i], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.tensor(seen), ref.timesteps, atol=1e-3, rtol=1e-6)


def test_stochastic_equals_diffusers_given_the_same_noise(monkeypatch):
    """The key decides x at sigma = 1 (first half of split(key)) and each step's noise
    (a NoiseStream on the second half); given that noise diffusers' stochastic_sampling
    takes the same steps."""
    import diffusers.schedulers.scheduling_flow_match_euler_discrete as fm

    from torchfn.transforms._noise import NoiseStream

    steps, shape, key = 9, (16, 3), random.key(3)
    v = gaussian_velocity(0.2, 0.9, time_scale=1000.0)
    chain = D.flow_sample(v, shape, key, steps=steps, shift=3.0, stochastic=True,
                          time_scale=1000.0, return_chain=True)
    noise = NoiseStream(random.split(key)[1], shape, steps, torch.float32, None)
    step = iter(range(steps))
    monkeypatch.setattr(fm, "randn_tensor", lambda *a, **k: noise(next(step)))
    ref = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0, stochastic_sampling=True)
    ref.set_timesteps(steps)
    x = chain[0]
    for i, t in enumerate(ref.timesteps):
        x = ref.step(v(x, t.repeat(16)), t, x).prev_sample
        torch.testing.assert_close(chain[i + 1], x, atol=1e-5, rtol=1e-5)
    again = D.flow_sample(v, shape, key, steps=steps, shift=3.0, stochastic=True, time_scale=1000.0)
    assert torch.equal(again, chain[-1])


def shifted_grid(steps, shift):
    """Levels down to 0 itself: diffusers' grid stops at a fixed level (1/T, shifted
    twice), whose last Euler step leaves an error that more steps do not shrink."""
    u = torch.linspace(1, 0, steps + 1, dtype=torch.float64)
    return shift * u / (1 + (shift - 1) * u)


def _end_error(method, steps, mu=0.8, s=0.6, shift=1.0):
    v = gaussian_velocity(mu, s)
    chain = D.flow_sample(v, (64, 2), random.key(5), sigmas=shifted_grid(steps, shift),
                          method=method, dtype=torch.float64, return_chain=True)
    return (chain[-1] - exact_end(chain[0], mu, s)).abs().max().item()


@pytest.mark.parametrize("method, order", [("euler", 1), ("heun", 2)])
@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_convergence_order_on_the_exact_gaussian_flow(method, order, shift):
    e1, e2 = _end_error(method, 32, shift=shift), _end_error(method, 64, shift=shift)
    observed = math.log2(e1 / e2)
    assert abs(observed - order) < 0.15, (e1, e2, observed)


def test_heun_reaches_the_closed_form():
    assert _end_error("heun", 256) < 5e-5


def test_the_diffusers_grid_leaves_a_floor_set_by_its_last_level():
    """Heun on diffusers' own grid: the error stops falling at the Euler step from the
    last level (9e-3 with shift 3) to 0, as the scheduler's."""
    v = gaussian_velocity(0.8, 0.6)
    chain = D.flow_sample(v, (64, 2), random.key(5), steps=256, shift=3.0, method="heun",
                          dtype=torch.float64, return_chain=True)
    err = (chain[-1] - exact_end(chain[0], 0.8, 0.6)).abs().max().item()
    assert 1e-5 < err < 1e-3


def test_stochastic_spread_equals_its_closed_form():
    """x0 = E[x0 | x] re-noised to the next level: the mean stays mu and the variance
    follows a_next^2 = (1 - s')^2 ((1 - s) s_d^2 / V)^2 a^2 + s'^2 (V = (1 - s)^2 s_d^2 + s^2),
    ending at ((1 - s) s_d^2 / V)^2 a^2. The posterior mean is narrower than the
    posterior, so the spread ends below the data's, at any number of steps."""
    mu, sd, steps = 1.5, 0.5, 100
    x = D.flow_sample(gaussian_velocity(mu, sd), (40_000, 2), random.key(7), steps=steps,
                      stochastic=True, dtype=torch.float64)
    levels = D.flow_sigmas(steps).tolist()
    a2 = 1.0
    for s, s_next in zip(levels[:-1], levels[1:]):
        gain = (1 - s) * sd**2 / ((1 - s) ** 2 * sd**2 + s**2)
        a2 = (1 - s_next) ** 2 * gain**2 * a2 + s_next**2
    n = x.numel()
    assert abs(x.mean().item() - mu) < 4 * math.sqrt(a2 / n)
    assert x.std().item() == pytest.approx(math.sqrt(a2), rel=0.02)
    assert math.sqrt(a2) < 0.8 * sd


def test_vmap_over_keys_equals_a_loop():
    v = gaussian_velocity(0.3, 0.7)
    keys = random.split(random.key(11), 4)

    def sample(k):
        return D.flow_sample(v, (8, 2), k, steps=6, stochastic=True)

    torch.testing.assert_close(vmap(sample)(keys), torch.stack([sample(k) for k in keys]))


def test_gradient_through_the_sampler_is_the_flow_map_derivative():
    """The exact flow maps x1 to mu + s x1, so d mean(x) / d mu = 1 and d mean(x) / d s =
    mean(x1); Heun at 64 steps, differentiated through every call."""
    key = random.key(13)
    x1 = random.normal(random.split(key)[0], (32, 2), dtype=torch.float64)

    def mean_sample(params):
        v = gaussian_velocity(params["mu"], params["s"])
        return D.flow_sample(v, (32, 2), key, sigmas=shifted_grid(64, 1.0), method="heun",
                             dtype=torch.float64).mean()

    g = grad(mean_sample)({"mu": torch.tensor(0.4, dtype=torch.float64),
                           "s": torch.tensor(0.9, dtype=torch.float64)})
    assert g["mu"].item() == pytest.approx(1.0, abs=1e-5)
    assert g["s"].item() == pytest.approx(x1.mean().item(), abs=1e-5)


def test_given_sigmas_are_used_as_they_are():
    seen = []
    v = gaussian_velocity(0.0, 1.0)
    D.flow_sample(_record(v, seen), (4, 2), random.key(0), sigmas=[0.9, 0.5, 0.1, 0.0])
    assert seen == pytest.approx([0.9, 0.5, 0.1])


@pytest.mark.parametrize("kwargs, match", [
    ({"steps": 0}, "steps must be an int >= 1"),
    ({"shift": 0.0}, "shift must be a float > 0"),
    ({"shift": 2.0, "mu": 1.0}, "give shift or mu"),
    ({"terminal": 1.5}, "terminal must lie in"),
    ({"method": "rk4"}, "method must be one of"),
    ({"method": "heun", "stochastic": True}, "method must be 'euler'"),
    ({"sigmas": [0.2, 0.5, 0.0]}, "sigmas must be a decreasing"),
    ({"sigmas": [1.0, 0.5]}, "ending in 0"),
    ({"sigmas": [1.0, 0.0], "shift": 3.0}, "used as given"),
    ({"time_scale": 0}, "time_scale must be"),
    ({"order": 3}, "order is the multistep solvers'"),
    ({"method": "dpm_solver", "order": 4}, "order must be 1, 2 or 3"),
    ({"method": "dpm_solver", "terminal": 0.02}, "terminal is not used"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        D.flow_sample(gaussian_velocity(0.0, 1.0), (4, 2), random.key(0), **kwargs)


def test_model_with_the_wrong_shape():
    with pytest.raises(ValueError, match=r"must return x's shape \(4, 2\), got \(4,\)"):
        D.flow_sample(lambda x, t: x.sum(1), (4, 2), random.key(0), steps=2)
    with pytest.raises(TypeError, match="velocity_fn must be callable"):
        D.flow_sample(None, (4, 2), random.key(0))


@given(steps=st.integers(1, 200), shift=st.floats(0.3, 8.0), T=st.integers(10, 2000),
       terminal=st.one_of(st.none(), st.floats(0.005, 0.2)))
def test_drawn_levels_equal_diffusers(steps, shift, T, terminal):
    if terminal is not None and steps == 1:  # diffusers divides 0 by 0 there
        with pytest.raises(ValueError, match="it needs steps >= 2"):
            D.flow_sigmas(steps, shift=shift, T=T, terminal=terminal)
        return
    ref = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=T, shift=shift,
                                                    shift_terminal=terminal)
    ref.set_timesteps(steps)
    got = D.flow_sigmas(steps, shift=shift, T=T, terminal=terminal)
    torch.testing.assert_close(got.float(), ref.sigmas, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("order", [1, 2, 3])
@pytest.mark.parametrize("steps, shift", [(1, 1.0), (3, 3.0), (10, 1.0), (20, 3.0)])
def test_dpm_solver_equals_diffusers_with_flow_sigmas(order, steps, shift):
    """diffusers' DPM-Solver++ for flow models (SANA's), on its own levels; diffusers
    hands the model int(sigma T), so both models here read sigma itself."""
    ref = diffusers.DPMSolverMultistepScheduler(use_flow_sigmas=True, flow_shift=shift,
                                                prediction_type="flow_prediction",
                                                solver_order=order)
    ref.set_timesteps(steps)
    v = gaussian_velocity(0.5, 0.8, time_scale=1000.0)
    chain = D.flow_sample(v, (16, 3), random.key(6), steps=steps, shift=shift,
                          method="dpm_solver", order=order, time_scale=1000.0,
                          return_chain=True)
    x = chain[0]
    for i, t in enumerate(ref.timesteps):
        out = v(x, torch.full((16,), float(ref.sigmas[i]) * 1000.0))
        x = ref.step(out, t, x).prev_sample
        torch.testing.assert_close(chain[i + 1], x, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("order", [2, 3])
@pytest.mark.parametrize("calls", [20, 40])
def test_dpm_solver_beats_euler_at_equal_calls(order, calls):
    """On the exact Gaussian flow (shift 3), DPM-Solver++ against as many Euler steps,
    each on its own default levels, the error against the flow from each sampler's first
    level. (Against Heun it wins at 20 calls and loses at 10 and 40: bench/RESULTS.md.)"""
    v = gaussian_velocity(0.8, 0.6)
    errs = {}
    for name, kw in [("euler", dict(steps=calls)),
                     ("dpm", dict(steps=calls, method="dpm_solver", order=order))]:
        chain = D.flow_sample(v, (64, 2), random.key(5), shift=3.0, dtype=torch.float64,
                              return_chain=True, **kw)
        errs[name] = (chain[-1] - exact_end(chain[0], 0.8, 0.6, start=kw)).abs().max().item()
    assert errs["dpm"] < 0.2 * errs["euler"], errs


@pytest.mark.parametrize("order", [1, 2, 3])
@pytest.mark.parametrize("steps, shift", [(1, 1.0), (4, 3.0), (12, 5.0)])
def test_unipc_equals_diffusers_with_flow_sigmas(order, steps, shift):
    """Wan's sampler: UniPC on diffusers' UniPC flow levels; both models read sigma."""
    ref = diffusers.UniPCMultistepScheduler(use_flow_sigmas=True, flow_shift=shift,
                                            prediction_type="flow_prediction",
                                            solver_order=order)
    ref.set_timesteps(steps)
    v = gaussian_velocity(0.5, 0.8, time_scale=1000.0)
    chain = D.flow_sample(v, (16, 3), random.key(7), steps=steps, shift=shift,
                          method="unipc", order=order, time_scale=1000.0, return_chain=True)
    x = chain[0]
    for i, t in enumerate(ref.timesteps):
        out = v(x, torch.full((16,), float(ref.sigmas[i]) * 1000.0))
        x = ref.step(out, t, x).prev_sample
        torch.testing.assert_close(chain[i + 1], x, atol=1e-5, rtol=1e-5)
