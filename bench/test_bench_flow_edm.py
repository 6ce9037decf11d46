"""Bench: ``diffusion.flow_sample`` and ``diffusion.edm_sample`` against diffusers'
``FlowMatchEulerDiscreteScheduler``, ``FlowMatchHeunDiscreteScheduler`` and
``EDMEulerScheduler`` loops, and the OT pairing's cost in ``flow_matching_loss``; CPU,
float32.

Sampling: 28 steps (SD3's default; shift 3; DPM-Solver++(2M) on diffusers' flow levels
as SANA samples), 4096 samples of a 2-D distribution, the
model a 2-layer MLP (2 + 1 -> 128 -> 2). Each pair produces the same samples (checked
first); the ratio is the sampler's overhead around the same model calls. One torch
thread, as in ``test_bench_dpm_solver.py``.

The loss pair: one gradient of ``flow_matching_loss`` for the same MLP on a batch of
256, with random pairing and with ``coupling="ot"`` (exact assignment on the host).

Run: ``pytest bench/test_bench_flow_edm.py --benchmark-only
--benchmark-columns=min,median``.
"""

import diffusers
import pytest
import torch

from torchfn import losses, random
from torchfn.transforms import diffusion as D

torch.set_num_threads(1)
STEPS, N = 28, 4096
W1 = random.normal(random.key(1), (3, 128)) / 3**0.5
W2 = random.normal(random.key(2), (128, 2)) / 128**0.5


def model(x, t):  # x: (N, 2), t: (N,) float
    h = torch.cat([x, (t / 1000)[:, None]], 1) @ W1
    return torch.tanh(h) @ W2


def start(scale=1.0):
    return random.normal(random.split(random.key(0))[0], (N, 2)) * scale  # the samplers' start


def torchfn_flow(method):
    with torch.no_grad():
        return D.flow_sample(model, (N, 2), random.key(0), steps=STEPS, shift=3.0,
                             method=method, time_scale=1000.0)


def diffusers_flow(method):
    if method == "dpm_solver":  # SANA's: DPM-Solver++(2M) on flow levels
        sched = diffusers.DPMSolverMultistepScheduler(use_flow_sigmas=True, flow_shift=3.0,
                                                      prediction_type="flow_prediction")
    else:
        cls = {"euler": diffusers.FlowMatchEulerDiscreteScheduler,
               "heun": diffusers.FlowMatchHeunDiscreteScheduler}[method]
        sched = cls(shift=3.0)
    sched.set_timesteps(STEPS)
    x = start()
    with torch.no_grad():
        for i, t in enumerate(sched.timesteps):
            # the model reads sigma * 1000 (DPM-Solver's own timesteps are int(sigma T))
            tt = sched.sigmas[i] * 1000 if method == "dpm_solver" else t
            x = sched.step(model(x, tt.repeat(N)), t, x).prev_sample
    return x


def net(x_in, c_noise):
    return model(x_in, 250.0 * c_noise)


def torchfn_edm():
    with torch.no_grad():
        return D.edm_sample(D.edm_denoiser(net), (N, 2), random.key(0), steps=STEPS,
                            method="euler")


def diffusers_edm():
    sched = diffusers.EDMEulerScheduler()
    sched.set_timesteps(STEPS)
    x = start(80.0)
    with torch.no_grad():
        for t in sched.timesteps:
            x = sched.step(net(sched.scale_model_input(x, t), t.repeat(N)), t, x).prev_sample
    return x


@pytest.mark.parametrize("impl", ["torchfn", "diffusers"])
@pytest.mark.parametrize("method", ["euler", "heun", "dpm_solver"])
def test_flow_sample(benchmark, impl, method):
    fn = torchfn_flow if impl == "torchfn" else diffusers_flow
    torch.testing.assert_close(fn(method), diffusers_flow(method), rtol=1e-4, atol=1e-4)
    benchmark(fn, method)


@pytest.mark.parametrize("impl", ["torchfn", "diffusers"])
def test_edm_euler(benchmark, impl):
    fn = torchfn_edm if impl == "torchfn" else diffusers_edm
    torch.testing.assert_close(fn(), diffusers_edm(), rtol=1e-4, atol=2e-4)
    benchmark(fn)


@pytest.mark.parametrize("coupling", ["independent", "ot"])
def test_flow_matching_loss_grad(benchmark, coupling):
    x0 = random.normal(random.key(3), (256, 2))
    params = {"w1": W1.clone(), "w2": W2.clone()}

    def loss(p, key):
        def v(x, t):
            h = torch.cat([x, t[:, None]], 1) @ p["w1"]
            return torch.tanh(h) @ p["w2"]
        return losses.flow_matching_loss(v, x0, key, coupling=coupling)

    g = torch.func.grad(loss)
    benchmark(g, params, random.key(4))
