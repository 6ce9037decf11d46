"""Bench: K-FAC-preconditioned SGD (``transforms.kfac_curvature`` / ``kfac_precondition``)
against Adam, CPU, float32, full batch.

The digits MLP (64-128-10, tanh) from a keyed init, 100 full-batch steps on the 1797
digits: Adam at lr 3e-2 (the best final loss over 3e-3, 1e-2, 3e-2, 6e-2, 1e-1) against
SGD with momentum 0.9 at lr 0.03 on the K-FAC direction (MC Fisher, a fresh key each
step, damping 1e-3, inverses every 10 steps; the best over damping 1e-3, 1e-2, 1e-1 x lr
0.03, 0.1, 0.3, 1 x momentum 0, 0.9). No K-FAC library for PyTorch installs here
(kfac-pytorch is not in the registry), so the peer is the optimizer people use.
Reported: wall time of the 100 steps (pytest-benchmark), and the training loss they
reach (in ``extra_info``; each case checks it fell below a tenth of the start).

Run: ``pytest bench/test_bench_natural_gradient.py --benchmark-only
--benchmark-columns=min,median``.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchfn
from torchfn import optim, random
from torchfn.data import load_digits
from torchfn.transforms import kfac_curvature, kfac_precondition

X, Y = load_digits()
MODEL = torchfn.Model(nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10)))
STEPS = 100


def loss(p):
    return F.cross_entropy(MODEL(p, X), Y)


def _adam():
    params = MODEL.init(random.key(0))
    tx = optim.adam(3e-2)
    state = tx.init(params)
    for _ in range(STEPS):
        updates, state = tx.update(torch.func.grad(loss)(params), state, params)
        params = optim.apply_updates(params, updates)
    return params


def _kfac():
    params = MODEL.init(random.key(0))
    tx = optim.sgd(0.03, momentum=0.9)
    opt, curv = tx.init(params), None
    for step in range(STEPS):
        curv = kfac_curvature(curv, MODEL, params, X, key=random.fold_in(random.key(1), step),
                              damping=1e-3, inverse_every=10)
        updates, opt = tx.update(kfac_precondition(curv, torch.func.grad(loss)(params)), opt,
                                 params)
        params = optim.apply_updates(params, updates)
    return params


@pytest.mark.parametrize("how", ["adam", "kfac_sgd"])
def test_100_steps(benchmark, how):
    params = benchmark.pedantic(_adam if how == "adam" else _kfac, rounds=3)
    final = float(loss(params))
    benchmark.extra_info["final_loss"] = final
    assert final < 0.1 * float(loss(MODEL.init(random.key(0))))
