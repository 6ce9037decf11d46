"""DPM-Solver++ multistep: timesteps and whole sampling runs equal diffusers'
``DPMSolverMultistepScheduler``; on Gaussian data with the exact noise model, order 2
at 20 steps is closer to the data than DDIM at 20, and exact to 1% at 50."""

import pytest
import torch

from torchfn import random
from torchfn.transforms import diffusion as D

diffusers = pytest.importorskip("diffusers", reason="diffusers is the reference implementation")

PRED = {"eps": "epsilon", "x0": "sample", "v": "v_prediction"}


def gaussian_model(schedule, mu, sigma, prediction):
    """The exact posterior mean of eps (or x0, or v) when x0 ~ N(mu, sigma^2 I)."""
    abar = schedule.alphas_cumprod

    def model_fn(x, t):  # x: (B, D), t: (B,), every entry the same timestep
        a = float(abar[int(t[0])])
        eps = (x - a**0.5 * mu) * ((1 - a) ** 0.5 / (a * sigma**2 + 1 - a))
        x0 = (x - (1 - a) ** 0.5 * eps) / a**0.5
        return {"eps": eps, "x0": x0, "v": a**0.5 * eps - (1 - a) ** 0.5 * x0}[prediction]

    return model_fn


@pytest.mark.parametrize("spacing", ["linspace", "leading", "trailing"])
@pytest.mark.parametrize("T, steps", [(1000, 1), (1000, 4), (1000, 10), (1000, 25),
                                      (1000, 999), (10, 3), (37, 36)])
def test_timesteps_equal_diffusers(spacing, T, steps):
    ref = diffusers.DPMSolverMultistepScheduler(num_train_timesteps=T, timestep_spacing=spacing)
    ref.set_timesteps(steps)
    ts = D.dpm_solver_timesteps(T, steps, spacing)
    assert ts.dtype == torch.int64
    assert torch.equal(ts, ref.timesteps)


@pytest.mark.parametrize("order", [1, 2, 3])
@pytest.mark.parametrize("steps", [1, 2, 3, 10, 16])  # < 15 and >= 15: diffusers' last-step rules
@pytest.mark.parametrize("prediction", ["eps", "x0", "v"])
def test_sample_equals_the_diffusers_loop(order, steps, prediction):
    s = D.linear_schedule(1000)
    model_fn = gaussian_model(s, 0.8, 0.6, prediction)
    chain = D.dpm_solver_sample(model_fn, s, (16, 3), random.key(4), steps=steps, order=order,
                                prediction=prediction, return_chain=True)
    assert chain.shape == (steps + 1, 16, 3)
    ref = diffusers.DPMSolverMultistepScheduler(num_train_timesteps=1000, solver_order=order,
                                                prediction_type=PRED[prediction])
    ref.set_timesteps(steps)
    x = chain[0]
    for i, t in enumerate(ref.timesteps):
        x = ref.step(model_fn(x, t.repeat(16)), t, x).prev_sample
        # float32, and x0 = (x - s eps) / a with a = 0.006 at t = 999: 1e-4, as for DDIM
        torch.testing.assert_close(chain[i + 1], x, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("order", [1, 2, 3])
@pytest.mark.parametrize("steps", [5, 20])
def test_karras_levels_equal_diffusers(order, steps):
    """"DPM++ 2M Karras": the timesteps the model sees and every step's sample."""
    s = D.linear_schedule(1000)
    model_fn = gaussian_model(s, 0.8, 0.6, "eps")
    chain = D.dpm_solver_sample(model_fn, s, (16, 3), random.key(2), steps=steps, order=order,
                                karras=True, return_chain=True)
    ref = diffusers.DPMSolverMultistepScheduler(num_train_timesteps=1000, solver_order=order,
                                                use_karras_sigmas=True)
    ref.set_timesteps(steps)
    seen = []
    x = chain[0]
    for i, t in enumerate(ref.timesteps):
        x = ref.step(model_fn(x, t.repeat(16)), t, x).prev_sample
        torch.testing.assert_close(chain[i + 1], x, atol=1e-4, rtol=1e-4)
        seen.append(int(t))

    calls = []
    D.dpm_solver_sample(lambda x, t: calls.append(int(t[0])) or model_fn(x, t), s, (16, 3),
                        random.key(2), steps=steps, order=order, karras=True)
    assert calls == seen


@pytest.mark.parametrize("order", [1, 2])
@pytest.mark.parametrize("karras", [False, True])
def test_stochastic_equals_diffusers_sde_dpmsolver_given_the_same_noise(order, karras):
    """The key decides x_T and each step's noise (split(key): x_T from the first half,
    the steps' noise from a NoiseStream on the second); given that noise, each step
    equals diffusers' "sde-dpmsolver++"."""
    from torchfn.transforms._noise import NoiseStream

    s, steps, shape = D.linear_schedule(1000), 12, (16, 3)
    model_fn = gaussian_model(s, 0.8, 0.6, "eps")
    key = random.key(3)
    chain = D.dpm_solver_sample(model_fn, s, shape, key, steps=steps, order=order,
                                karras=karras, stochastic=True, return_chain=True)
    noise = NoiseStream(random.split(key)[1], shape, steps, torch.float32, None)
    ref = diffusers.DPMSolverMultistepScheduler(
        num_train_timesteps=1000, solver_order=order, algorithm_type="sde-dpmsolver++",
        use_karras_sigmas=karras)
    ref.set_timesteps(steps)
    x = chain[0]
    for i, t in enumerate(ref.timesteps):
        x = ref.step(model_fn(x, t.repeat(16)), t, x, variance_noise=noise(i)).prev_sample
        torch.testing.assert_close(chain[i + 1], x, atol=1e-4, rtol=1e-4)
    again = D.dpm_solver_sample(model_fn, s, shape, key, steps=steps, order=order,
                                karras=karras, stochastic=True)
    assert torch.equal(again, chain[-1])


def test_order_one_is_ddim_on_the_same_timesteps():
    s = D.cosine_schedule(200)
    model_fn = gaussian_model(s, -0.3, 1.2, "eps")
    got = D.dpm_solver_sample(model_fn, s, (32, 2), random.key(0), steps=7, order=1,
                              dtype=torch.float64, return_chain=True)
    ts = D.dpm_solver_timesteps(200, 7).tolist() + [-1]
    x = got[0]
    for i in range(7):
        tt = torch.full((32,), ts[i], dtype=torch.int64)
        x = D.ddim_step(s, x, ts[i], ts[i + 1], model_fn(x, tt))
        torch.testing.assert_close(got[i + 1], x, rtol=1e-12, atol=1e-12)


def test_gaussian_data_closer_than_ddim_at_the_same_steps():
    """The data's std is the hard moment for few steps; the mean is off only by the
    schedule's nonzero terminal SNR, the same for every sampler."""
    s = D.linear_schedule(1000)
    mu, sigma = 1.5, 0.5
    model_fn = gaussian_model(s, mu, sigma, "eps")
    shape, key = (20_000, 2), random.key(1)

    def std_error(x):
        return abs(float(x.std()) / sigma - 1)

    ddim20 = D.ddim_sample(model_fn, s, shape, key, steps=20, dtype=torch.float64)
    dpm20 = D.dpm_solver_sample(model_fn, s, shape, key, steps=20, dtype=torch.float64)
    dpm50 = D.dpm_solver_sample(model_fn, s, shape, key, steps=50, dtype=torch.float64)
    assert std_error(dpm20) < std_error(ddim20) / 2, (std_error(dpm20), std_error(ddim20))
    assert std_error(dpm50) < 0.01
    for x in (ddim20, dpm20, dpm50):
        assert abs(float(x.mean()) - mu) < 0.02


def test_bad_input():
    s = D.linear_schedule(10)
    fn = lambda x, t: torch.zeros_like(x)
    with pytest.raises(ValueError, match="order must be 1, 2 or 3, got 4"):
        D.dpm_solver_sample(fn, s, (2, 2), random.key(0), steps=3, order=4)
    with pytest.raises(ValueError, match=r"steps must be an int in \[1, T - 1\] = \[1, 9\], "
                                         "got 10"):
        D.dpm_solver_sample(fn, s, (2, 2), random.key(0), steps=10)
    with pytest.raises(ValueError, match="order must be 1 or 2 with stochastic=True"):
        D.dpm_solver_sample(fn, s, (2, 2), random.key(0), steps=3, order=3, stochastic=True)
    with pytest.raises(ValueError, match="spacing must be one of"):
        D.dpm_solver_timesteps(10, 3, "uniform")
    with pytest.raises(ValueError, match=r"model_fn\(x, t\) must return x's shape \(2, 2\), "
                                         r"got \(2,\)"):
        D.dpm_solver_sample(lambda x, t: x[:, 0], s, (2, 2), random.key(0), steps=3)


@pytest.mark.parametrize("ratio, max_value", [(0.995, 1.0), (0.9, 1.5)])
def test_dynamic_thresholding_equals_diffusers(ratio, max_value):
    """Imagen's thresholding of each x0 prediction (here it binds: data at +-2)."""
    s = D.linear_schedule(1000)
    model_fn = gaussian_model(s, 2.0, 0.5, "eps")
    kw = dict(thresholding=True, dynamic_thresholding_ratio=ratio, sample_max_value=max_value)
    chain = D.dpm_solver_sample(model_fn, s, (16, 3, 2), random.key(6), steps=8,
                                return_chain=True,
                                clip_x0=D.DynamicThreshold(ratio, max_value))
    ref = diffusers.DPMSolverMultistepScheduler(num_train_timesteps=1000, **kw)
    ref.set_timesteps(8)
    x = chain[0]
    for i, t in enumerate(ref.timesteps):
        x = ref.step(model_fn(x.reshape(16, -1), t.repeat(16)).reshape(x.shape), t, x).prev_sample
        torch.testing.assert_close(chain[i + 1], x, atol=1e-4, rtol=1e-4)
    assert chain[-1].abs().max() <= max_value + 1e-6  # the last step is x0 itself
