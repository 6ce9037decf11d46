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


def torchfn_sample():
    with torch.no_grad():
        return D.dpm_solver_sample(eps_fn, SCHEDULE, (N, 2), random.key(0), steps=STEPS)


def diffusers_sample():
    sched = diffusers.DPMSolverMultistepScheduler(num_train_timesteps=1000)
    sched.set_timesteps(STEPS)
    x = random.normal(random.split(random.key(0))[0], (N, 2))  # the sampler's x_T
    with torch.no_grad():
        for t in sched.timesteps:
            x = sched.step(eps_fn(x, t.repeat(N)), t, x).prev_sample
    return x


@pytest.mark.parametrize("impl", ["torchfn", "diffusers"])
def test_sample(benchmark, impl):
    fn = torchfn_sample if impl == "torchfn" else diffusers_sample
    torch.testing.assert_close(fn(), diffusers_sample(), rtol=1e-4, atol=1e-4)
    benchmark(fn)


def torchfn_euler():
    with torch.no_grad():
        return D.euler_sample(eps_float, SCHEDULE, (N, 2), random.key(0), steps=STEPS)


def diffusers_euler():
    sched = diffusers.EulerDiscreteScheduler(num_train_timesteps=1000)
    sched.set_timesteps(STEPS)
    x = random.normal(random.split(random.key(0))[0], (N, 2)) * sched.init_noise_sigma
    with torch.no_grad():
        for t in sched.timesteps:
            x = sched.step(eps_float(sched.scale_model_input(x, t), t.repeat(N)), t,
                           x).prev_sample
    return x


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
    sched = diffusers.UniPCMultistepScheduler(num_train_timesteps=1000)
    sched.set_timesteps(STEPS)
    x = random.normal(random.split(random.key(0))[0], (N, 2))
    with torch.no_grad():
        for t in sched.timesteps:
            x = sched.step(eps_fn(x, t.repeat(N)), t, x).prev_sample
    return x


@pytest.mark.parametrize("impl", ["torchfn", "diffusers"])
def test_unipc(benchmark, impl):
    """UniPC (bh2, order 2), 20 steps: ``unipc_sample`` against diffusers'
    ``UniPCMultistepScheduler`` loop."""
    fn = torchfn_unipc if impl == "torchfn" else diffusers_unipc
    torch.testing.assert_close(fn(), diffusers_unipc(), rtol=1e-4, atol=1e-4)
    benchmark(fn)
