"""Bench: Hessian spectra (``transforms.eigsh``, ``hutchinson_trace``,
``spectral_quadrature`` on ``hessian_operator``) against PyHessian (Yao et al., 2020), CPU,
float32.

The loss: cross entropy of an MLP 64-128-128-10 (tanh; 26k params) on a batch of 512.

- ``hvp``: one Hessian-vector product: PyHessian's (``autograd.grad`` through the
  gradient's graph, recorded once), ``hvp`` (forward-over-reverse, recomputed each call)
  and ``hessian_operator`` (reverse-over-reverse on a graph recorded once).
- ``top1``: the top eigenvalue to a relative error below 1e-3: PyHessian's power
  iteration (its own stopping rule at ``tol=1e-5``: ``1e-4`` stops at 1.6e-3) against
  16 Lanczos steps. Setup (recording the gradient's graph) is timed in both.
- ``top5``: the top five: power iteration with deflation (``top_n=5``, ``tol=1e-4``)
  against 50 Lanczos steps, each checked to within 3% of a 120-step reference (the
  five are close together: 0.209-0.237).
- ``trace``: 100 Rademacher probes (PyHessian's ``tol=0`` makes it use all of them);
  torchfn's probes looped or under one ``vmap``.

PyHessian's ``density()`` (stochastic Lanczos quadrature) calls ``torch.eig``, removed in
torch 1.9: it no longer runs, so there is no density case.

Run: ``pytest bench/test_bench_spectrum.py --benchmark-only --benchmark-columns=min,median``.
"""

import pytest
import torch
from pyhessian import hessian as PyHessian
from torch import nn

import torchfn
from torchfn import random
from torchfn.transforms import (
    eigsh,
    hessian_operator,
    hutchinson_trace,
    hvp,
)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(),
                         nn.Linear(128, 10))


NET = _net()
X = random.normal(random.key(0), (512, 64))
Y = random.randint(random.key(1), (512,), 0, 10)
MODEL = torchfn.Model(_net())
PARAMS = {k: v.detach().clone() for k, v in NET.state_dict().items()}


def loss(params):
    return nn.functional.cross_entropy(MODEL.apply(params, X), Y)


@pytest.fixture(scope="module")
def reference():
    """The top five eigenvalues from 120 Lanczos steps (converged to ~1e-7)."""
    values, _ = eigsh(hessian_operator(loss, PARAMS), PARAMS, random.key(9), k=5, steps=120)
    return values


def _pyhessian():
    torch.manual_seed(0)  # its probes come from the global generator
    return PyHessian(NET, nn.CrossEntropyLoss(), data=(X, Y), cuda=False)


@pytest.mark.parametrize("how", ["pyhessian", "hvp", "hessian_operator"])
def test_hvp(benchmark, how):
    v = {k: random.normal(random.fold_in(random.key(2), i), p.shape)
         for i, (k, p) in enumerate(PARAMS.items())}
    if how == "pyhessian":
        h = _pyhessian()
        vs = [v[k] for k in PARAMS]
        got = benchmark(lambda: torch.autograd.grad(h.gradsH, h.params, grad_outputs=vs,
                                                    retain_graph=True))
        got = dict(zip(PARAMS, got))
    elif how == "hvp":
        got = benchmark(hvp, loss, PARAMS, v)
    else:
        H = hessian_operator(loss, PARAMS)
        got = benchmark(H, v)
    want = hvp(loss, PARAMS, v)
    for k in PARAMS:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("how", ["pyhessian", "torchfn"])
def test_top1(benchmark, how, reference):
    if how == "pyhessian":
        top = benchmark(lambda: _pyhessian().eigenvalues(maxIter=200, tol=1e-5)[0][0])
    else:
        top = benchmark(lambda: eigsh(hessian_operator(loss, PARAMS), PARAMS, random.key(3),
                                      steps=16)[0][0].item())
    assert abs(top - reference[0].item()) < 1e-3 * reference[0].item()


@pytest.mark.parametrize("how", ["pyhessian", "torchfn"])
def test_top5(benchmark, how, reference):
    if how == "pyhessian":
        top = benchmark.pedantic(
            lambda: _pyhessian().eigenvalues(maxIter=200, tol=1e-4, top_n=5)[0], rounds=3)
        top = torch.tensor(top)
    else:
        top = benchmark.pedantic(
            lambda: eigsh(hessian_operator(loss, PARAMS), PARAMS, random.key(3), k=5,
                          steps=50)[0], rounds=3)
    assert ((top - reference).abs() / reference).max() < 0.03


@pytest.mark.parametrize("how", ["pyhessian", "torchfn", "torchfn-vmap"])
def test_trace(benchmark, how):
    if how == "pyhessian":
        h = _pyhessian()
        estimate = benchmark.pedantic(lambda: sum(h.trace(maxIter=100, tol=0.0)) / 100,
                                      rounds=3)
    else:
        H = hessian_operator(loss, PARAMS)
        estimate = benchmark.pedantic(
            lambda: hutchinson_trace(H, PARAMS, random.key(4), samples=100,
                                     vectorized=how == "torchfn-vmap")[0].item(), rounds=3)
    # both estimate the same trace: within 5 standard errors of a 400-probe estimate
    truth, err = hutchinson_trace(hessian_operator(loss, PARAMS), PARAMS, random.key(5),
                                  samples=400, vectorized=True)
    assert abs(estimate - truth.item()) < 5 * 2 * err.item()
