"""Bench: ``transforms.fixed_point`` implicit gradients against backprop through the solver, CPU.

A DEQ layer ``z = tanh(z W^T + x U^T + b)`` on a batch (B = 64, D = 256, input 128),
W scaled to spectral norm 0.6. One call = the loss gradient in (W, U, b):

* ``implicit_iterate``: ``fixed_point(method="iterate", max_iter=30, tol=0)`` (30
  forward iterations without a graph, then the adjoint solve, 30 iterations of
  vector-Jacobian products);
* ``implicit_anderson``: Anderson acceleration, stopping at tol = 1e-5 (both solves);
* ``unrolled`` (the peer, what one writes without implicit differentiation): the same
  30 iterations recorded by autograd and backpropagated. Its memory grows with the
  iterations; the implicit ones keep one step's.

Both reach the same gradient to the solve's tolerance (checked before timing).

Run: ``pytest bench/test_bench_fixed_point.py --benchmark-only --benchmark-columns=min,median``.
"""

import pytest
import torch
from torch.func import grad

from torchfn import random, transforms

B, D, N_IN, STEPS = 64, 256, 128, 30


def problem():
    ks = random.split(random.key(0), 4)
    w = random.normal(ks[0], (D, D))
    params = {"W": 0.6 * w / torch.linalg.matrix_norm(w, 2),
              "U": random.normal(ks[1], (D, N_IN)) / N_IN**0.5,
              "b": random.normal(ks[2], (D,)) * 0.1}
    return params, random.normal(ks[3], (B, N_IN))


def layer(p, z, x):  # z: (B, D), x: (B, N_IN)
    return torch.tanh(z @ p["W"].T + x @ p["U"].T + p["b"])


def loss_implicit(method, tol):
    def loss(p, x):
        z = transforms.fixed_point(lambda p, z: layer(p, z, x), p, torch.zeros(B, D),
                                   method=method, max_iter=STEPS, tol=tol)
        return z.square().mean()

    return loss


def loss_unrolled(p, x):
    z = torch.zeros(B, D)
    for _ in range(STEPS):
        z = layer(p, z, x)
    return z.square().mean()


IMPLS = {
    "implicit_iterate": loss_implicit("iterate", 0.0),
    "implicit_anderson": loss_implicit("anderson", 1e-5),
    "unrolled": loss_unrolled,
}


@pytest.mark.parametrize("impl", list(IMPLS))
def test_deq_gradient(benchmark, impl):
    params, x = problem()
    g = grad(IMPLS[impl])
    want = grad(loss_unrolled)(params, x)
    for k, v in g(params, x).items():
        torch.testing.assert_close(v, want[k], rtol=1e-3, atol=1e-6)
    benchmark(g, params, x)
