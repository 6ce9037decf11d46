"""Bench: ``transforms.hmc`` against Pyro's ``HMC`` kernel, CPU, float32.

The target: a Bayesian logistic regression (N(0, 1) prior on 65 weights) on the 360
digits that are 0 or 1, 64 pixels plus a bias. Fixed step size 0.02, 10 leapfrog steps,
200 draws, no warm-up in either (adaptation differs between the two; the transitions
are the same algorithm).

- ``one_chain``: Pyro's ``MCMC(HMC(potential_fn=...))`` against ``transforms.hmc``.
- ``16_chains``: Pyro runs chains one after another in a process (its parallel chains
  are separate processes); torchfn runs 16 under one ``vmap``. Time per chain is the
  number to compare.

Run: ``pytest bench/test_bench_hmc.py --benchmark-only --benchmark-columns=min,median``.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.func import vmap

from torchfn import random
from torchfn.data import load_digits
from torchfn.transforms import hmc

_x, _y = load_digits()
_keep = _y <= 1
X = torch.cat([_x[_keep], torch.ones(int(_keep.sum()), 1)], 1)  # (360, 65)
Y = _y[_keep].float()
DRAWS, STEP, LEAPFROG = 200, 0.02, 10


def log_density(w):  # (65,) -> ()
    return -F.binary_cross_entropy_with_logits(X @ w, Y, reduction="sum") - 0.5 * (w ** 2).sum()


def _pyro_chain(seed):
    import pyro
    from pyro.infer import HMC, MCMC

    pyro.set_rng_seed(seed)
    kernel = HMC(potential_fn=lambda p: -log_density(p["w"]), step_size=STEP,
                 num_steps=LEAPFROG, adapt_step_size=False, adapt_mass_matrix=False)
    mcmc = MCMC(kernel, num_samples=DRAWS, warmup_steps=0,
                initial_params={"w": torch.zeros(65)}, disable_progbar=True)
    mcmc.run()
    return mcmc.get_samples()["w"]  # (DRAWS, 65)


def _torchfn_chain(key):
    samples, _, _ = hmc(log_density, torch.zeros(65), key, num_samples=DRAWS, num_warmup=0,
                        step_size=STEP, num_steps=LEAPFROG)
    return samples


def _check(samples):  # the chains found the posterior: it classifies the digits
    w = samples.reshape(-1, samples.shape[-1])[-50:].mean(0)
    assert ((X @ w > 0).float() == Y).float().mean() > 0.98


@pytest.mark.parametrize("how", ["pyro", "torchfn"])
def test_one_chain(benchmark, how):
    run = (lambda: _pyro_chain(0)) if how == "pyro" else (lambda: _torchfn_chain(random.key(0)))
    _check(benchmark.pedantic(run, rounds=3))


@pytest.mark.parametrize("how", ["pyro", "torchfn"])
def test_16_chains(benchmark, how):
    if how == "pyro":
        def run():
            return torch.stack([_pyro_chain(s) for s in range(16)])
    else:
        keys = random.split(random.key(1), 16)

        def run():
            return vmap(_torchfn_chain)(keys)
    samples = benchmark.pedantic(run, rounds=1)
    assert samples.shape == (16, DRAWS, 65)
    _check(samples)
