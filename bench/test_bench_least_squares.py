"""Bench: ``transforms.least_squares`` (Levenberg-Marquardt) against
``scipy.optimize.least_squares(method="lm")`` (MINPACK), CPU, float64.

An exponential decay ``a exp(-b t) + c`` fitted to 60 noisy points:

* ``single``: one fit; scipy's residual is numpy (its Jacobian by finite differences,
  as its users usually have it), torchfn's is torch (``jacrev``).
* ``batch``: 256 fits to 256 datasets, one ``vmap`` against a loop of scipy calls.

The fitted parameters agree to 1e-6 before timing.

Run: ``pytest bench/test_bench_least_squares.py --benchmark-only
--benchmark-columns=min,median``.
"""

import numpy as np
import pytest
import torch
from scipy.optimize import least_squares as scipy_least_squares
from torch.func import vmap

from torchfn import random, transforms

T = torch.linspace(0, 4, 60, dtype=torch.float64)
T_NP = T.numpy()
N_FITS = 256
A = 1 + random.uniform(random.key(1), (N_FITS,), dtype=torch.float64) * 2
B = 0.5 + random.uniform(random.key(2), (N_FITS,), dtype=torch.float64) * 2
Y = A[:, None] * torch.exp(-B[:, None] * T) + 0.5 + 0.05 * random.normal(
    random.key(3), (N_FITS, 60), dtype=torch.float64)  # (N_FITS, 60)
P0 = {k: torch.tensor(1.0, dtype=torch.float64) for k in "abc"}


def decay(p, t, y):
    return p["a"] * torch.exp(-p["b"] * t) + p["c"] - y


def torchfn_fit(y):
    fit, _ = transforms.least_squares(decay, P0, T, y)
    return torch.stack([fit[k] for k in "abc"])


def scipy_fit(y):
    y = y.numpy()
    out = scipy_least_squares(lambda x: x[0] * np.exp(-x[1] * T_NP) + x[2] - y, np.ones(3),
                              method="lm")
    return torch.from_numpy(out.x)


def torchfn_batch(ys):
    return vmap(torchfn_fit)(ys)


def scipy_batch(ys):
    return torch.stack([scipy_fit(y) for y in ys])


@pytest.mark.parametrize("impl", ["torchfn", "scipy"])
def test_single(benchmark, impl):
    fn = torchfn_fit if impl == "torchfn" else scipy_fit
    torch.testing.assert_close(fn(Y[0]), scipy_fit(Y[0]), rtol=1e-6, atol=1e-6)
    benchmark(fn, Y[0])


@pytest.mark.parametrize("impl", ["torchfn_vmap", "scipy_loop"])
def test_batch(benchmark, impl):
    fn = torchfn_batch if impl == "torchfn_vmap" else scipy_batch
    torch.testing.assert_close(fn(Y[:8]), scipy_batch(Y[:8]), rtol=1e-6, atol=1e-6)
    benchmark(fn, Y)
