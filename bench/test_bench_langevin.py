"""Langevin sampling: torchfn ``langevin`` vs the plain autograd loop, same run.

Run (under a minute):
    .venv/bin/pytest bench/test_bench_langevin.py --benchmark-only -q -p no:randomly \\
        --benchmark-columns=min,median,mean

60 ULA steps on a batch of 128 chains through an MLP energy with SiLU, for two sizes:
2-128-128-1 (a 2-D toy) and 32-256-256-1. Entries per group:

- ``torchfn``: ``langevin(energy, x0, key, ...)`` with ``energy = lambda x:
  model.apply(params, x)`` written for one example (a ``torchfn.Model``); keyed noise.
- ``torchfn-module``: the same sampler on ``lambda x: net(x).squeeze(-1)`` (the
  ``nn.Module`` called directly), to separate the sampler from ``functional_call``.
- ``torchfn-batched`` / ``torchfn-module-batched``: the same two energies applied to the
  whole batch, ``langevin(..., batched=True)``: no ``vmap``.
- ``plain``: what one writes by hand -- ``x.requires_grad_()``, ``torch.autograd.grad(
  net(x).sum(), x)``, ``torch.randn`` noise, update.

The gap of the per-example entries is ``vmap``'s per-op overhead at these tiny sizes
(the keyed noise is drawn in blocks of steps: about 1 us a step); ``batched=True``
removes it.
"""

import pytest
import torch
from torch import nn

import torchfn
from torchfn import random
from torchfn.transforms import langevin

STEPS, BATCH, ETA = 60, 128, 0.01
SIZES = {"2-128-128-1": (2, 128), "32-256-256-1": (32, 256)}


def make_net(d, h):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, h), nn.SiLU(), nn.Linear(h, h), nn.SiLU(), nn.Linear(h, 1))


def plain_langevin(net, x0, steps, eta):
    x = x0.clone()
    for _ in range(steps):
        x.requires_grad_(True)
        (g,) = torch.autograd.grad(net(x).sum(), x)
        with torch.no_grad():
            x = x - eta * g + (2 * eta) ** 0.5 * torch.randn_like(x)
    return x.detach()


def run(impl, net, model, params, x0, key):
    if impl == "plain":
        return plain_langevin(net, x0, STEPS, ETA)
    if impl.startswith("torchfn-module"):
        energy = lambda x: net(x).squeeze(-1)
    else:
        energy = lambda x: model.apply(params, x).squeeze(-1)
    return langevin(energy, x0, key, steps=STEPS, step_size=ETA,
                    batched=impl.endswith("batched"))


IMPLS = ["torchfn", "torchfn-module", "torchfn-batched", "torchfn-module-batched", "plain"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("size", sorted(SIZES))
def test_langevin(benchmark, impl, size):
    benchmark.group = f"langevin {STEPS} steps, batch {BATCH}, MLP {size}"
    d, h = SIZES[size]
    net = make_net(d, h)
    for p in net.parameters():
        p.requires_grad_(False)
    model = torchfn.Model(net)
    params = model.init(random.key(0))
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(params[name])
    x0 = torch.randn(BATCH, d, generator=torch.Generator().manual_seed(1))
    out = benchmark.pedantic(
        run, args=(impl, net, model, params, x0, random.key(2)), rounds=5, warmup_rounds=1
    )
    assert out.shape == x0.shape and torch.isfinite(out).all()
    # same dynamics: the noise-free drift of one step agrees across implementations
    if impl != "plain":
        e = lambda x: model.apply(params, x).squeeze(-1)
        one = langevin(e, x0, random.key(2), steps=1, step_size=ETA, noise_std=0.0)
        xr = x0.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(net(xr).sum(), xr)
        torch.testing.assert_close(one, x0 - ETA * g, rtol=1e-5, atol=1e-6)
