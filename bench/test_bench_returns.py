"""Bench: ``transforms.gae`` (a reverse parallel scan over time) against the backward loop
a PPO implementation writes (CleanRL's and TRL's PPO compute GAE so), CPU, float32.

Rewards, values and discounts (B, T) with B = 64 environments (or completions), T in
{128, 1024}, episodes ending inside (10% of the steps). Both give the same advantages
(tests/transforms/test_returns.py checks the scan against this loop).

Run: ``pytest bench/test_bench_returns.py --benchmark-only --benchmark-columns=min,median``.
"""

import pytest
import torch

from torchfn import random
from torchfn.transforms import gae


def loop_gae(rewards, values, discounts, bootstrap, lam):  # (B, T) -> (B, T)
    adv, last = torch.empty_like(rewards), torch.zeros_like(bootstrap)
    nxt = bootstrap
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + discounts[:, t] * nxt - values[:, t]
        last = delta + discounts[:, t] * lam * last
        adv[:, t] = last
        nxt = values[:, t]
    return adv


@pytest.mark.parametrize("t", [128, 1024])
@pytest.mark.parametrize("how", ["torchfn", "loop"])
def test_gae(benchmark, how, t):
    k = random.split(random.key(0), 4)
    rewards, values = random.normal(k[0], (64, t)), random.normal(k[1], (64, t))
    discounts = torch.where(random.bernoulli(k[2], 0.1, (64, t)), 0.0, 0.99)
    bootstrap = random.normal(k[3], (64,))
    fn = gae if how == "torchfn" else loop_gae
    out = benchmark(lambda: fn(rewards, values, discounts, bootstrap, lam=0.95) if how ==
                    "torchfn" else fn(rewards, values, discounts, bootstrap, 0.95))
    torch.testing.assert_close(out, loop_gae(rewards, values, discounts, bootstrap, 0.95),
                               rtol=1e-4, atol=1e-4)
