"""Bench: ``transforms.sdeint`` against torchsde 0.2.6, CPU.

Geometric Brownian motion ``dX = 0.5 X dt + 0.8 X dW`` for 4096 paths, t = [0, 1],
100 steps, float32, and the gradient of the mean endpoint in the drift (pathwise):

* ``torchfn_batched``: one state of 4096 (diagonal noise, one key);
* ``torchfn_vmap``: one path per key, ``vmap`` over 4096 keys;
* ``torchsde``: ``torchsde.sdeint(method="euler")`` on the (4096, 1) batch, which draws
  from torch's global generator (it fails under ``vmap``: "called random operation
  while in randomness error mode").

Run: ``pytest bench/test_bench_sdeint.py --benchmark-only --benchmark-columns=min,median``.
"""

import pytest
import torch
import torchsde
from torch.func import grad, vmap

from torchfn import random, transforms

N, DT = 4096, 0.01
T = torch.tensor([0.0, 1.0])


def ours_batched(mu):
    ys = transforms.sdeint(lambda y, s, mu: mu * y, lambda y, s, mu: 0.8 * y, torch.ones(N), T,
                           random.key(0), mu, dt=DT)
    return ys[-1].mean()


def ours_vmap(mu):
    def one(k):
        return transforms.sdeint(lambda y, s, mu: mu * y, lambda y, s, mu: 0.8 * y,
                                 torch.ones(()), T, k, mu, dt=DT)[-1]
    return vmap(one)(random.split(random.key(0), N)).mean()


class GBM(torch.nn.Module):
    noise_type, sde_type = "diagonal", "ito"

    def __init__(self, mu):
        super().__init__()
        self.mu = mu

    def f(self, t, y):
        return self.mu * y

    def g(self, t, y):
        return 0.8 * y


def theirs(mu):
    torch.manual_seed(0)
    return torchsde.sdeint(GBM(mu), torch.ones(N, 1), T, dt=DT, method="euler")[-1].mean()


IMPLS = {"torchfn_batched": grad(ours_batched), "torchfn_vmap": grad(ours_vmap)}


@pytest.mark.parametrize("impl", ["torchfn_batched", "torchfn_vmap", "torchsde"])
def test_gbm_mean_gradient(benchmark, impl):
    mu = torch.tensor(0.5)
    if impl == "torchsde":
        def run(mu):
            m = mu.clone().requires_grad_()
            (g,) = torch.autograd.grad(theirs(m), m)
            return g
    else:
        run = IMPLS[impl]
    g = run(mu)  # d/dmu E[X_1] = exp(mu) = 1.65; 4096 paths: within a few percent
    assert abs(float(g) - 1.6487) < 0.15
    benchmark(run, mu)
