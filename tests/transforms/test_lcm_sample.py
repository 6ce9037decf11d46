"""LCM and TCD sampling equal diffusers' ``LCMScheduler`` / ``TCDScheduler`` loops (their
timesteps, the timesteps the model sees, every step) given the same noise, for each
prediction type; and each LCM step is affine for Gaussian data's exact x0 predictor,
so the samples' moments follow a closed-form recursion. TCD with gamma = 0 is DDIM on
those timesteps."""

import pytest
import torch
from torch.func import vmap

from torchfn import random
from torchfn.transforms import diffusion as D

diffusers = pytest.importorskip("diffusers", reason="diffusers is the reference implementation")
PRED = {"eps": "epsilon", "v": "v_prediction", "x0": "sample"}


def sd_schedule():
    """Stable Diffusion's "scaled_linear" betas, LCMScheduler's default."""
    return D.schedule_from_betas(torch.linspace(0.00085**0.5, 0.012**0.5, 1000,
                                                dtype=torch.float64) ** 2)


def net(x, t):
    """Any model of (x, t), nonlinear in both."""
    return torch.tanh(x) * (1 + t[:, None] / 1000) - 0.1


@pytest.mark.parametrize("steps", [1, 4, 8, 50])
@pytest.mark.parametrize("original", [50, 100])
def test_timesteps_equal_diffusers(steps, original):
    ref = diffusers.LCMScheduler(original_inference_steps=original)
    ref.set_timesteps(steps)
    assert D.lcm_timesteps(1000, steps, original) == ref.timesteps.tolist()


@pytest.mark.parametrize("prediction", ["eps", "v", "x0"])
@pytest.mark.parametrize("steps", [1, 2, 4, 8])
def test_equals_the_diffusers_loop(monkeypatch, prediction, steps):
    import diffusers.schedulers.scheduling_lcm as lcm

    from torchfn.transforms._noise import NoiseStream

    shape, key = (6, 3), random.key(steps)
    seen = []

    def model(x, t):
        seen.append(int(t[0]))
        return net(x, t)

    chain = D.lcm_sample(model, sd_schedule(), shape, key, steps=steps, prediction=prediction,
                         return_chain=True)
    noise = NoiseStream(random.split(key)[1], shape, max(1, steps - 1), torch.float32, None)
    draws = iter(range(steps))
    monkeypatch.setattr(lcm, "randn_tensor", lambda *a, **k: noise(next(draws)))
    ref = diffusers.LCMScheduler(prediction_type=PRED[prediction])
    ref.set_timesteps(steps)
    x = random.normal(random.split(key)[0], shape)
    for i, t in enumerate(ref.timesteps):
        x, denoised = ref.step(net(x, t.repeat(6)), t, x, return_dict=False)
        torch.testing.assert_close(chain[i], denoised, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(chain[-1], x, rtol=1e-4, atol=1e-4)
    assert seen == ref.timesteps.tolist()


def test_custom_timesteps_and_clipping_equal_diffusers(monkeypatch):
    import diffusers.schedulers.scheduling_lcm as lcm

    from torchfn.transforms._noise import NoiseStream

    shape, key, ts = (4, 2), random.key(9), [999, 499, 259]
    out = D.lcm_sample(net, sd_schedule(), shape, key, timesteps=ts, prediction="x0",
                       clip_x0=0.05)
    noise = NoiseStream(random.split(key)[1], shape, 2, torch.float32, None)
    draws = iter(range(2))
    monkeypatch.setattr(lcm, "randn_tensor", lambda *a, **k: noise(next(draws)))
    ref = diffusers.LCMScheduler(prediction_type="sample", clip_sample=True,
                                 clip_sample_range=0.05)
    ref.set_timesteps(timesteps=ts)
    x = random.normal(random.split(key)[0], shape)
    for t in ref.timesteps:
        x = ref.step(net(x, t.repeat(4)), t, x).prev_sample
    torch.testing.assert_close(out, x, rtol=1e-4, atol=1e-4)


def test_gaussian_moments_follow_their_recursion():
    """Data N(m, s^2) and its exact x0 predictor E[x0 | x_t] = m + c_t (x_t - sqrt(a) m),
    c_t = sqrt(a) s^2 / (a s^2 + 1 - a): each step is affine in x, so the mean and
    variance of the samples follow f = A x + b and the forward re-noising. (The
    posterior mean is a diffusion model's x0, not a distilled consistency function: at
    4 steps the samples' spread is 0.17, not the data's 0.4.)"""
    sched, m, s, steps = sd_schedule(), 0.7, 0.4, 4
    abar = sched.alphas_cumprod.double().tolist()

    def exact(x, t):
        a = abar[int(t[0])]
        return m + a**0.5 * s * s / (a * s * s + 1 - a) * (x - a**0.5 * m)

    x = D.lcm_sample(exact, sched, (40_000, 2), random.key(3), steps=steps, prediction="x0",
                     dtype=torch.float64)
    ts = D.lcm_timesteps(1000, steps)
    mean, var = 0.0, 1.0
    for i, t in enumerate(ts):
        a = abar[t]
        c = a**0.5 * s * s / (a * s * s + 1 - a)
        sc = t * 10.0
        c_skip, c_out = 0.25 / (sc * sc + 0.25), sc / (sc * sc + 0.25) ** 0.5
        mean = c_out * (m + c * (mean - a**0.5 * m)) + c_skip * mean
        var = (c_out * c + c_skip) ** 2 * var
        if i + 1 < len(ts):
            a2 = abar[ts[i + 1]]
            mean, var = a2**0.5 * mean, a2 * var + 1 - a2
    assert x.mean().item() == pytest.approx(mean, abs=4 * (var / x.numel()) ** 0.5)
    assert x.var().item() == pytest.approx(var, rel=0.03)


@pytest.mark.parametrize("prediction", ["eps", "v", "x0"])
@pytest.mark.parametrize("steps,gamma", [(1, 0.3), (4, 0.3), (8, 0.7), (4, 0.0), (4, 1.0)])
def test_tcd_equals_the_diffusers_loop(monkeypatch, prediction, steps, gamma):
    import diffusers.schedulers.scheduling_tcd as tcd

    from torchfn.transforms._noise import NoiseStream

    shape, key = (6, 3), random.key(20 + steps)
    seen = []

    def model(x, t):
        seen.append(int(t[0]))
        return net(x, t)

    chain = D.tcd_sample(model, sd_schedule(), shape, key, steps=steps, gamma=gamma,
                         prediction=prediction, return_chain=True)
    noise = NoiseStream(random.split(key)[1], shape, max(1, steps - 1), torch.float32, None)
    draws = iter(range(steps))
    monkeypatch.setattr(tcd, "randn_tensor", lambda *a, **k: noise(next(draws)))
    ref = diffusers.TCDScheduler(prediction_type=PRED[prediction])
    ref.set_timesteps(steps)
    x = random.normal(random.split(key)[0], shape)
    for i, t in enumerate(ref.timesteps):
        x, noised = ref.step(net(x, t.repeat(6)), t, x, eta=gamma, return_dict=False)
        torch.testing.assert_close(chain[i], noised, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(chain[-1], x, rtol=1e-4, atol=1e-4)
    assert seen == ref.timesteps.tolist()


def test_tcd_without_stochasticity_is_ddim_on_its_timesteps():
    s, key = sd_schedule(), random.key(5)
    ts = D.lcm_timesteps(1000, 6)
    a = D.tcd_sample(net, s, (5, 2), key, steps=6, gamma=0.0, dtype=torch.float64)
    x = random.normal(random.split(key)[0], (5, 2), dtype=torch.float64)
    for t, nxt in zip(ts, ts[1:] + [0]):  # DDIM (eta = 0) from t to the next, then to 0
        x = D.ddim_step(s, x, t, nxt, net(x, torch.full((5,), t)))
    torch.testing.assert_close(a, x)


def test_vmap_over_keys_equals_a_loop():
    keys = random.split(random.key(4), 3)

    def sample(k):
        return D.lcm_sample(net, sd_schedule(), (4, 2), k, steps=3)

    torch.testing.assert_close(vmap(sample)(keys), torch.stack([sample(k) for k in keys]))


def test_bad_arguments():
    s, key = sd_schedule(), random.key(0)
    with pytest.raises(ValueError, match=r"steps must be an int in \[1, original_steps\]"):
        D.lcm_sample(net, s, (2, 2), key, steps=60)
    with pytest.raises(ValueError, match="timesteps must be decreasing integers"):
        D.lcm_sample(net, s, (2, 2), key, timesteps=[10, 500])
    with pytest.raises(ValueError, match="timesteps must be decreasing integers"):
        D.lcm_sample(net, s, (2, 2), key, timesteps=[1000, 5])
    with pytest.raises(ValueError, match="prediction must be one of"):
        D.lcm_sample(net, s, (2, 2), key, prediction="score")
    with pytest.raises(ValueError, match="original_steps must be <= T"):
        D.lcm_timesteps(100, 4, 200)
    with pytest.raises(ValueError, match=r"gamma must be a float in \[0, 1\]"):
        D.tcd_sample(net, s, (2, 2), key, gamma=1.5)
    with pytest.raises(ValueError, match="timesteps must be decreasing integers"):
        D.tcd_sample(net, s, (2, 2), key, timesteps=[999.5, 500])
