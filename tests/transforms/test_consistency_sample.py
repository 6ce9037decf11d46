"""Consistency-model sampling: the variance-exploding sampler equals diffusers'
``CMStochasticIterativeScheduler`` loop given the same noise, and with the exact
consistency function of Gaussian data both samplers give the closed-form samples (one
step) and moments (several steps)."""

import math

import pytest
import torch
from torch.func import vmap

from torchfn import random
from torchfn.transforms import diffusion as D

M, S, SD, LO = 0.4, 0.3, 0.5, 0.002  # data N(M, S^2), sigma_data, sigma_min


def net(x_in, c_noise):
    """Any raw network of (x_in, c_noise), nonlinear in both."""
    return torch.tanh(2 * x_in) * (1 + c_noise[:, None] / 10) - 0.1 * x_in


def ve_exact(x, sigma):
    """The VE consistency function of N(M, S^2) data: the flow map to sigma_min."""
    k = math.sqrt(S * S + LO * LO) / (S * S + sigma[:, None] ** 2).sqrt()
    return M + (x - M) * k


def trig_var(t):
    return (t.cos() * S) ** 2 + (t.sin() * SD) ** 2


def trig_exact(x, t):
    """The TrigFlow consistency function of N(M, S^2) data with noise N(0, SD^2)."""
    t = t[:, None]
    return M + S * (x - t.cos() * M) / trig_var(t).sqrt()


@pytest.mark.parametrize("steps", [1, 2, 4])
@pytest.mark.parametrize("clip", [None, (-1.0, 1.0)])
def test_equals_the_diffusers_loop(monkeypatch, steps, clip):
    diffusers = pytest.importorskip("diffusers", reason="diffusers is the reference")
    import diffusers.schedulers.scheduling_consistency_models as cm

    from torchfn.transforms._noise import NoiseStream

    shape, key = (6, 3), random.key(3)
    ref = diffusers.CMStochasticIterativeScheduler(clip_denoised=clip is not None)
    ref.set_timesteps(steps)
    sigmas = ref.sigmas[:-1].double()
    f = D.consistency_function(net, sigma_min=LO, sigma_data=SD)
    chain = D.consistency_sample(f, shape, key, sigmas=sigmas, clip=clip, return_chain=True)
    noise = NoiseStream(random.split(key)[1], shape, max(1, steps - 1), torch.float32, None)
    draws = iter(range(steps))
    monkeypatch.setattr(cm, "randn_tensor", lambda *a, **k: noise(min(next(draws),
                                                                      max(0, steps - 2))))
    x = random.normal(random.split(key)[0], shape) * ref.init_noise_sigma
    for i, t in enumerate(ref.timesteps):
        out = net(ref.scale_model_input(x, t), (t / 1000).float().repeat(6))
        x = ref.step(out, t, x).prev_sample
        if i + 1 < steps:  # diffusers' sample is the re-noised x0; compare x0 itself
            lvl = float(ref.sigmas[i + 1])
            x0 = x - (lvl * lvl - LO * LO) ** 0.5 * noise(i)
            torch.testing.assert_close(chain[i], x0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chain[-1], x, rtol=1e-5, atol=1e-5)


def test_ve_one_step_with_the_exact_function_is_the_closed_form():
    key = random.key(4)
    x = D.consistency_sample(ve_exact, (512, 2), key, sigmas=(80.0,), dtype=torch.float64)
    z = random.normal(random.split(key)[0], (512, 2), dtype=torch.float64)
    want = M + (80.0 * z - M) * math.sqrt(S * S + LO * LO) / math.sqrt(S * S + 6400.0)
    torch.testing.assert_close(x, want, rtol=1e-12, atol=1e-12)


def test_ve_multistep_moments_follow_their_recursion():
    """Each map is affine, ``x0 = M + k(sigma) (x - M)``, and each re-noising adds
    ``sigma^2 - sigma_min^2`` of variance: the samples' mean and variance follow."""
    levels = [80.0, 2.0, 0.5]
    x = D.consistency_sample(ve_exact, (40_000, 2), random.key(5), sigmas=levels,
                             dtype=torch.float64)
    mean, var = 0.0, levels[0] ** 2
    for i, lvl in enumerate(levels):
        if i > 0:
            var += lvl * lvl - LO * LO
        k = math.sqrt(S * S + LO * LO) / math.sqrt(S * S + lvl * lvl)
        mean, var = M + k * (mean - M), k * k * var
    assert x.mean().item() == pytest.approx(mean, abs=4 * (var / x.numel()) ** 0.5)
    assert x.var().item() == pytest.approx(var, rel=0.03)


def test_trigflow_one_step_with_the_exact_network_is_the_closed_form():
    """The raw network ``F = (cos(t) x - f*(x, t)) / (sin(t) sd)`` wrapped by
    ``trigflow_consistency`` maps ``sd z`` at ``t`` to ``f*(sd z, t)``."""

    def F(x_in, t):
        x, c = SD * x_in, t[:, None]
        return (c.cos() * x - trig_exact(x, t)) / (c.sin() * SD)

    key, t = random.key(6), D._consistency.SCM_T_MAX
    f = D.trigflow_consistency(F, sigma_data=SD)
    x = D.trigflow_sample(f, (256, 3), key, sigma_data=SD, dtype=torch.float64)
    z = random.normal(random.split(key)[0], (256, 3), dtype=torch.float64)
    want = M + S * (SD * z - math.cos(t) * M) / math.sqrt(
        (math.cos(t) * S) ** 2 + (math.sin(t) * SD) ** 2)
    torch.testing.assert_close(x, want, rtol=1e-10, atol=1e-10)


def test_trigflow_two_steps_have_the_datas_moments():
    """Exact maps keep the data's law: after sCM's two steps at (pi/2, 1.1) the samples
    are N(M, S^2) exactly (their recursion starts at f*(sd z, pi/2) = M + S z)."""
    x = D.trigflow_sample(trig_exact, (40_000, 2), random.key(7), times=(math.pi / 2, 1.1),
                          sigma_data=SD, dtype=torch.float64)
    assert x.mean().item() == pytest.approx(M, abs=4 * S / x.numel() ** 0.5)
    assert x.std().item() == pytest.approx(S, rel=0.015)


def test_vmap_over_keys_equals_a_loop():
    f = D.consistency_function(net)
    keys = random.split(random.key(8), 3)

    def sample(k):
        return D.consistency_sample(f, (4, 2), k, sigmas=(80.0, 1.0, 0.2))

    torch.testing.assert_close(vmap(sample)(keys), torch.stack([sample(k) for k in keys]))


def test_levels_follow_icts_curriculum():
    """N doubles over floor(log2(1280 / 10)) + 1 = 8 equal stages from 11 to 1281; the
    levels run from sigma_min to sigma_max evenly in sigma^(1/7)."""
    total = 8000
    ns = [len(D.consistency_levels(k, total)) for k in range(0, total, 1000)]
    assert ns == [11, 21, 41, 81, 161, 321, 641, 1281]
    s = D.consistency_levels(total - 1, total)
    assert s[0].item() == pytest.approx(0.002) and s[-1].item() == pytest.approx(80.0)
    gaps = (s ** (1 / 7)).diff()
    torch.testing.assert_close(gaps, gaps[:1].expand_as(gaps), rtol=1e-9, atol=0)
    assert len(D.consistency_levels(10**6, total)) == 1281


def test_bad_arguments():
    f, key = D.consistency_function(net), random.key(0)
    with pytest.raises(ValueError, match="sigmas must be a strictly decreasing"):
        D.consistency_sample(f, (2, 2), key, sigmas=(1.0, 2.0))
    with pytest.raises(ValueError, match="sigmas must be a strictly decreasing"):
        D.consistency_sample(f, (2, 2), key, sigmas=(80.0, 0.001))
    with pytest.raises(ValueError, match="times must be a strictly decreasing"):
        D.trigflow_sample(f, (2, 2), key, times=(2.0,))
    with pytest.raises(ValueError, match="clip must be None or"):
        D.consistency_sample(f, (2, 2), key, clip=(1.0, -1.0))
    with pytest.raises(ValueError, match="sigma must have shape"):
        f(torch.ones(2, 2), torch.ones(3))
    with pytest.raises(ValueError, match="sigma_data must be a float > 0"):
        D.consistency_function(net, sigma_data=0.0)
    with pytest.raises(ValueError, match="total_steps must be an int >= 1"):
        D.consistency_levels(0, 0)
    with pytest.raises(ValueError, match="s1 must be >= s0"):
        D.consistency_levels(0, 10, s0=20, s1=10)
