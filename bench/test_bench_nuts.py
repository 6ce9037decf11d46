"""Bench: ``transforms.nuts`` against Pyro's ``NUTS`` kernel, CPU, float32.

The target of ``test_bench_hmc.py``: a Bayesian logistic regression (N(0, 1) prior on
65 weights) on the 360 digits that are 0 or 1. Fixed step size 0.02, ``max_depth`` 10,
100 draws after 20 transitions from the origin to reach the posterior, no adaptation in
either (adaptation schedules differ; the transitions are the same algorithm, up to
Stan's extra U-turn checks, which torchfn runs and Pyro does not). Trees differ in
size between the two, so each case also counts the log-density calls (leapfrog steps)
and the number to compare is the time per call, printed with ``-s``.

- ``one_chain``: Pyro's ``MCMC(NUTS(potential_fn=...))`` against ``transforms.nuts``.
- ``8_chains``: Pyro runs chains one after another in a process (its parallel chains
  are separate processes); torchfn runs 8 in lockstep with ``num_chains=8``.

Run: ``pytest bench/test_bench_nuts.py --benchmark-only -s --benchmark-columns=min,median``.
"""

import time

import pytest
import torch
import torch.nn.functional as F

from torchfn import random
from torchfn.data import load_digits
from torchfn.transforms import nuts

_x, _y = load_digits()
_keep = _y <= 1
X = torch.cat([_x[_keep], torch.ones(int(_keep.sum()), 1)], 1)  # (360, 65)
Y = _y[_keep].float()
DRAWS, BURN, STEP = 100, 20, 0.02
CALLS = {"n": 0}


def log_density(w):  # (65,) -> ()
    CALLS["n"] += 1
    return -F.binary_cross_entropy_with_logits(X @ w, Y, reduction="sum") - 0.5 * (w ** 2).sum()


def _pyro_chain(seed):
    import pyro
    from pyro.infer import MCMC, NUTS

    pyro.set_rng_seed(seed)
    kernel = NUTS(potential_fn=lambda p: -log_density(p["w"]), step_size=STEP,
                  adapt_step_size=False, adapt_mass_matrix=False, max_tree_depth=10)
    mcmc = MCMC(kernel, num_samples=DRAWS, warmup_steps=BURN,
                initial_params={"w": torch.zeros(65)}, disable_progbar=True)
    mcmc.run()
    return mcmc.get_samples()["w"]  # (DRAWS, 65)


def _torchfn_chains(key, num_chains=None):
    init = torch.zeros(65) if num_chains is None else torch.zeros(num_chains, 65)
    samples, info, _ = nuts(log_density, init, key, num_samples=DRAWS + BURN,
                            num_warmup=0, step_size=STEP, num_chains=num_chains)
    return samples[..., BURN:, :]  # (DRAWS, 65) or (C, DRAWS, 65)


def _check(samples):  # the chains found the posterior: it classifies the digits
    w = samples.reshape(-1, samples.shape[-1]).mean(0)
    assert ((X @ w > 0).float() == Y).float().mean() > 0.98


def _timed(benchmark, run, rounds):
    CALLS["n"] = 0
    start = time.perf_counter()
    out = benchmark.pedantic(run, rounds=rounds)
    per_call = (time.perf_counter() - start) / max(CALLS["n"], 1)
    print(f"\n  {CALLS['n'] // rounds} log-density calls per round, "
          f"{per_call * 1e6:.0f} us per call")
    return out


@pytest.mark.parametrize("how", ["pyro", "torchfn"])
def test_one_chain(benchmark, how):
    if how == "pyro":
        def run():
            return _pyro_chain(0)
    else:
        def run():
            return _torchfn_chains(random.key(0))
    _check(_timed(benchmark, run, rounds=3))


@pytest.mark.parametrize("how", ["pyro", "torchfn"])
def test_8_chains(benchmark, how):
    if how == "pyro":
        def run():
            return torch.stack([_pyro_chain(s) for s in range(8)])
    else:
        def run():
            return _torchfn_chains(random.key(1), num_chains=8)
    samples = _timed(benchmark, run, rounds=1)
    assert samples.shape == (8, DRAWS, 65)
    _check(samples)
