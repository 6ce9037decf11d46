"""Bench: ``diffusion.dpm_solver_sample`` against diffusers' ``DPMSolverMultistepScheduler``
loop, CPU, float32.

DPM-Solver++(2M), 20 steps, T = 1000 (linear schedule), 4096 samples of a 2-D
distribution, the noise model a 2-layer MLP (2 + 1 -> 128 -> 2): one call draws the
samples. Both produce the same samples (checked to 1e-4 first); the ratio is the
sampler's own overhead around 20 model calls. One torch thread: with two, both
samplers' times jumped between two modes from run to run.

Run: ``pytest bench/test_bench_dpm_solver.py --benchmark-only
--benchmark-columns=min,median``.
"""

import diffusers
import pytest
import torch

from torchfn import random
from torchfn.transforms import diffusion as D

torch.set_num_threads(1)  # the 2-core timings were bimodal (18 or 38 ms) with two threads
SCHEDULE = D.linear_schedule(1000)
STEPS, N = 20, 4096
W1 = random.normal(random.key(1), (3, 128)) / 3**0.5
W2 = random.normal(random.key(2), (128, 2)) / 128**0.5


def eps_fn(x, t):  # x: (N, 2), t: (N,) int64
    h = torch.cat([x, (t.float() / 1000)[:, None]], 1) @ W1
    return torch.tanh(h) @ W2


def diffusers_loop(sched, steps, model, scaled=False, **step_kwargs):
    """diffusers' own loop from the torchfn samplers' start (``split(key(0))[0]``):
    ``model(x, t)`` per timestep, on ``scale_model_input(x)`` where ``scaled``."""
    sched.set_timesteps(steps)
    x = random.normal(random.split(random.key(0))[0], (N, 2)) * sched.init_noise_sigma
    with torch.no_grad():
        for t in sched.timesteps:
            inp = sched.scale_model_input(x, t) if scaled else x
            x = sched.step(model(inp, t.repeat(N)), t, x, **step_kwargs).prev_sample
    return x


def torchfn_sample():
    with torch.no_grad():
        return D.dpm_solver_sample(eps_fn, SCHEDULE, (N, 2), random.key(0), steps=STEPS)


def diffusers_sample():
    return diffusers_loop(diffusers.DPMSolverMultistepScheduler(num_train_timesteps=1000),
                          STEPS, eps_fn)


@pytest.mark.parametrize("impl", ["torchfn", "diffusers"])
def test_sample(benchmark, impl):
    fn = torchfn_sample if impl == "torchfn" else diffusers_sample
    torch.testing.assert_close(fn(), diffusers_sample(), rtol=1e-4, atol=1e-4)
    benchmark(fn)


def torchfn_euler():
    with torch.no_grad():
        return D.euler_sample(eps_float, SCHEDULE, (N, 2), random.key(0), steps=STEPS)


def diffusers_euler():
    return diffusers_loop(diffusers.EulerDiscreteScheduler(num_train_timesteps=1000), STEPS,
                          eps_float, scaled=True)


def eps_float(x, t):  # the same MLP, fractional timesteps
    h = torch.cat([x, (t / 1000)[:, None]], 1) @ W1
    return torch.tanh(h) @ W2


@pytest.mark.parametrize("impl", ["torchfn", "diffusers"])
def test_euler(benchmark, impl):
    """Euler ("Euler" in SD UIs), 20 steps: ``euler_sample`` against diffusers'
    ``EulerDiscreteScheduler`` loop."""
    fn = torchfn_euler if impl == "torchfn" else diffusers_euler
    torch.testing.assert_close(fn(), diffusers_euler(), rtol=1e-4, atol=1e-4)
    benchmark(fn)


def torchfn_unipc():
    with torch.no_grad():
        return D.unipc_sample(eps_fn, SCHEDULE, (N, 2), random.key(0), steps=STEPS)


def diffusers_unipc():
    return diffusers_loop(diffusers.UniPCMultistepScheduler(num_train_timesteps=1000), STEPS,
                          eps_fn)


@pytest.mark.parametrize("impl", ["torchfn", "diffusers"])
def test_unipc(benchmark, impl):
    """UniPC (bh2, order 2), 20 steps: ``unipc_sample`` against diffusers'
    ``UniPCMultistepScheduler`` loop."""
    fn = torchfn_unipc if impl == "torchfn" else diffusers_unipc
    torch.testing.assert_close(fn(), diffusers_unipc(), rtol=1e-4, atol=1e-4)
    benchmark(fn)


def _noise_of(key, steps):
    """diffusers' ``randn_tensor`` replaced by the torchfn sampler's noise stream."""
    from torchfn.transforms._noise import NoiseStream

    stream = NoiseStream(random.split(key)[1], (N, 2), max(1, steps - 1), torch.float32, None)
    draws = iter(range(10**6))
    return lambda *a, **k: stream(min(next(draws), max(0, steps - 2)))


LCM_SCHEDULE = D.schedule_from_betas(torch.linspace(0.00085**0.5, 0.012**0.5, 1000,
                                                    dtype=torch.float64) ** 2)
LCM_STEPS, CM_STEPS = 8, 4


def torchfn_lcm():
    with torch.no_grad():
        return D.lcm_sample(eps_fn, LCM_SCHEDULE, (N, 2), random.key(0), steps=LCM_STEPS)


def diffusers_lcm():
    return diffusers_loop(diffusers.LCMScheduler(), LCM_STEPS, eps_fn)


@pytest.mark.parametrize("impl", ["torchfn", "diffusers"])
def test_lcm(benchmark, impl, monkeypatch):
    """LCM, 8 steps: ``lcm_sample`` against diffusers' ``LCMScheduler`` loop (equal
    given the same noise, checked first; then each draws its own)."""
    import diffusers.schedulers.scheduling_lcm as lcm

    with monkeypatch.context() as m:
        m.setattr(lcm, "randn_tensor", _noise_of(random.key(0), LCM_STEPS))
        torch.testing.assert_close(torchfn_lcm(), diffusers_lcm(), rtol=1e-4, atol=1e-4)
    benchmark(torchfn_lcm if impl == "torchfn" else diffusers_lcm)


# the network sees 250 log(sigma), as diffusers' pipelines pass OpenAI's checkpoints
CM_F = D.consistency_function(lambda x_in, c: eps_float(x_in, 1000 * c))


def torchfn_cm(sigmas):
    with torch.no_grad():
        return D.consistency_sample(CM_F, (N, 2), random.key(0), sigmas=sigmas,
                                    clip=(-1.0, 1.0))  # diffusers' default clip_denoised


def diffusers_cm():  # its timesteps are float64: the MLP sees them as float32
    return diffusers_loop(diffusers.CMStochasticIterativeScheduler(), CM_STEPS,
                          lambda x, t: eps_float(x, t.float()), scaled=True)


@pytest.mark.parametrize("impl", ["torchfn", "diffusers"])
def test_consistency(benchmark, impl, monkeypatch):
    """Multistep consistency sampling, 4 levels: ``consistency_sample`` against
    diffusers' ``CMStochasticIterativeScheduler`` loop (equal given the same noise)."""
    import diffusers.schedulers.scheduling_consistency_models as cm

    ref = diffusers.CMStochasticIterativeScheduler()
    ref.set_timesteps(CM_STEPS)
    sigmas = ref.sigmas[:-1].double()
    with monkeypatch.context() as m:
        m.setattr(cm, "randn_tensor", _noise_of(random.key(0), CM_STEPS))
        torch.testing.assert_close(torchfn_cm(sigmas), diffusers_cm(), rtol=1e-4, atol=1e-4)
    if impl == "torchfn":
        benchmark(torchfn_cm, sigmas)
    else:
        benchmark(diffusers_cm)


def torchfn_tcd():
    with torch.no_grad():
        return D.tcd_sample(eps_fn, LCM_SCHEDULE, (N, 2), random.key(0), steps=LCM_STEPS)


def diffusers_tcd():
    return diffusers_loop(diffusers.TCDScheduler(), LCM_STEPS, eps_fn, eta=0.3)


@pytest.mark.parametrize("impl", ["torchfn", "diffusers"])
def test_tcd(benchmark, impl, monkeypatch):
    """TCD, 8 steps, gamma = 0.3: ``tcd_sample`` against diffusers' ``TCDScheduler`` loop
    (equal given the same noise, checked first)."""
    import diffusers.schedulers.scheduling_tcd as tcd

    with monkeypatch.context() as m:
        m.setattr(tcd, "randn_tensor", _noise_of(random.key(0), LCM_STEPS))
        torch.testing.assert_close(torchfn_tcd(), diffusers_tcd(), rtol=1e-4, atol=1e-4)
    benchmark(torchfn_tcd if impl == "torchfn" else diffusers_tcd)
