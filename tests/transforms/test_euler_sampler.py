"""Euler and Euler-ancestral sampling of VP models equal diffusers' EulerDiscrete /
EulerAncestralDiscrete scheduler loops (levels, timesteps the model sees, every step),
and on Gaussian data with the exact noise model Euler reaches the data's spread."""

import numpy as np
import pytest
import torch
from torch.func import vmap

from torchfn import random
from torchfn.transforms import diffusion as D

diffusers = pytest.importorskip("diffusers", reason="diffusers is the reference implementation")
PRED = {"eps": "epsilon", "v": "v_prediction"}


def net(x, t):
    """Any model of (x, t), nonlinear in both."""
    return torch.tanh(x) * (1 + t[:, None] / 1000) - 0.1


@pytest.mark.parametrize("spacing", ["linspace", "leading", "trailing"])
@pytest.mark.parametrize("karras", [False, True])
@pytest.mark.parametrize("steps", [1, 7, 30])
def test_levels_equal_diffusers(spacing, karras, steps):
    ref = diffusers.EulerDiscreteScheduler(timestep_spacing=spacing, use_karras_sigmas=karras)
    ref.set_timesteps(steps)
    ts, levels = D.euler_levels(D.linear_schedule(1000), steps, spacing, karras)
    # diffusers' level table is float32 (from float32 abar): Karras's interpolated
    # timesteps differ from these (float64) by ~5e-5 relative
    torch.testing.assert_close(ts.float(), ref.timesteps, rtol=1e-4, atol=1e-3)
    tol = 1e-4 if karras else 1e-6  # Karras's extremes come from that float32 table too
    torch.testing.assert_close(levels.float(), ref.sigmas, rtol=tol, atol=1e-6)


@pytest.mark.parametrize("spacing", ["linspace", "leading"])
@pytest.mark.parametrize("karras", [False, True])
@pytest.mark.parametrize("prediction", ["eps", "v"])
def test_euler_equals_the_diffusers_loop(spacing, karras, prediction):
    s = D.linear_schedule(1000)
    seen = []

    def model(x, t):
        seen.append(float(t[0]))
        return net(x, t)

    chain = D.euler_sample(model, s, (8, 3), random.key(1), steps=12, spacing=spacing,
                           karras=karras, prediction=prediction, return_chain=True)
    ref = diffusers.EulerDiscreteScheduler(timestep_spacing=spacing, use_karras_sigmas=karras,
                                           prediction_type=PRED[prediction])
    ref.set_timesteps(12)
    x = random.normal(random.split(random.key(1))[0], (8, 3)) * ref.init_noise_sigma
    for i, t in enumerate(ref.timesteps):
        x = ref.step(net(ref.scale_model_input(x, t), t.repeat(8)), t, x).prev_sample
        scale = (float(ref.sigmas[i + 1]) ** 2 + 1) ** 0.5
        torch.testing.assert_close(chain[i + 1], x / scale, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(seen, ref.timesteps.numpy(), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("prediction", ["eps", "v"])
def test_euler_ancestral_equals_diffusers_given_the_same_noise(monkeypatch, prediction):
    import diffusers.schedulers.scheduling_euler_ancestral_discrete as ea

    from torchfn.transforms._noise import NoiseStream

    s, steps, shape, key = D.linear_schedule(1000), 10, (8, 3), random.key(2)
    out = D.euler_sample(net, s, shape, key, steps=steps, ancestral=True, prediction=prediction)
    noise = NoiseStream(random.split(key)[1], shape, steps, torch.float32, None)
    step = iter(range(steps))
    monkeypatch.setattr(ea, "randn_tensor", lambda *a, **k: noise(next(step)))
    ref = diffusers.EulerAncestralDiscreteScheduler(prediction_type=PRED[prediction])
    ref.set_timesteps(steps)
    x = random.normal(random.split(key)[0], shape) * ref.init_noise_sigma
    for t in ref.timesteps:
        x = ref.step(net(ref.scale_model_input(x, t), t.repeat(8)), t, x).prev_sample
    torch.testing.assert_close(out, x, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ancestral", [False, True])
def test_gaussian_data_spread_equals_its_closed_form(ancestral):
    """x0 ~ N(m, s^2) and the exact eps at each (interpolated) level: each step is affine
    in x, x <- A x + b with A = 1 + (sigma' - sigma) c / sqrt(sigma^2 + 1) (sigma' the
    next level, or sigma_down with the ancestral noise sigma_up added), so the samples'
    mean and variance follow a recursion; the samples match it, and it tends to the
    data's as the steps grow (Euler is first order: 0.274, 0.293, 0.298 at 50, 200,
    999 steps for s = 0.3)."""
    sched = D.linear_schedule(1000)
    abar = sched.alphas_cumprod.double().numpy()
    table = ((1 - abar) / abar) ** 0.5
    m, sd, steps = 0.5, 0.3, 100

    def coefficient(sig):  # eps = c (x_vp - sqrt(a) m) at level sig, a = 1 / (sig^2 + 1)
        a = 1 / (sig * sig + 1)
        return (1 - a) ** 0.5 / (a * sd * sd + 1 - a), a

    def exact(x, t):
        c, a = coefficient(float(np.interp(float(t[0]), np.arange(1000), table)))
        return (x - a**0.5 * m) * c

    x = D.euler_sample(exact, sched, (20_000, 2), random.key(3), steps=steps,
                       ancestral=ancestral, dtype=torch.float64)
    _, levels = D.euler_levels(sched, steps)
    levels = levels.tolist()
    mean, var = 0.0, levels[0] ** 2
    for sig, nxt in zip(levels[:-1], levels[1:]):
        c, a = coefficient(sig)
        up = (nxt**2 * (sig**2 - nxt**2) / sig**2) ** 0.5 if ancestral else 0.0
        target = (nxt**2 - up**2) ** 0.5
        A = 1 + (target - sig) * c / (sig * sig + 1) ** 0.5
        mean, var = A * mean - (target - sig) * c * a**0.5 * m, A * A * var + up * up
    assert x.mean().item() == pytest.approx(mean, abs=4 * (var / x.numel()) ** 0.5)
    assert x.std().item() == pytest.approx(var**0.5, rel=0.015)
    assert var**0.5 == pytest.approx(sd, rel=0.1)


def test_vmap_over_keys_equals_a_loop():
    s = D.linear_schedule(100)
    keys = random.split(random.key(4), 3)

    def sample(k):
        return D.euler_sample(net, s, (4, 2), k, steps=5, ancestral=True)

    torch.testing.assert_close(vmap(sample)(keys), torch.stack([sample(k) for k in keys]))


def test_bad_arguments():
    s = D.linear_schedule(100)
    with pytest.raises(ValueError, match=r"steps must be an int in \[1, T\]"):
        D.euler_sample(net, s, (2, 2), random.key(0), steps=0)
    with pytest.raises(ValueError, match="spacing must be one of"):
        D.euler_sample(net, s, (2, 2), random.key(0), spacing="even")
    with pytest.raises(ValueError, match="prediction must be 'eps' or 'v'"):
        D.euler_sample(net, s, (2, 2), random.key(0), prediction="x0")
