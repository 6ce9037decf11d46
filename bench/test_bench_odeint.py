"""Bench: ``transforms.odeint`` against torchdiffeq, a batched neural ODE, CPU.

``dy/dt = W2 tanh(W1 y + b1) + b2`` with y (64, 32) and hidden 64 (a batch solved as one
state, as torchdiffeq does), t = [0, 1], Dormand-Prince at rtol 1e-6, atol 1e-8, float32.
One call = the loss ``y(1).square().mean()`` and its gradient in the parameters:

* ``torchfn``: ``odeint`` (adjoint equations; ``torch.func.grad``);
* ``torchdiffeq_adjoint``: ``torchdiffeq.odeint_adjoint(method="dopri5")`` + ``backward``;
* ``torchdiffeq_backprop``: ``torchdiffeq.odeint`` (autograd through the steps).

A second pair runs the same loss on a fixed grid, 20 RK4 steps (``step_size=0.05``),
against ``torchdiffeq.odeint_adjoint(method="rk4", options={"step_size": 0.05})``
(torchdiffeq's "rk4" is the 3/8 rule: the same order, the same four evaluations a
step, so its gradient agrees with ours to the discretisation error, 1e-4 here).

The three gradients agree to 1e-3 before timing. torchdiffeq has no per-example
(``vmap``) solves: its ``odeint`` fails on an in-place op and ``odeint_adjoint`` on its
``autograd.Function`` (no ``setup_context``); torchfn's runs them with per-example steps.

Run: ``pytest bench/test_bench_odeint.py --benchmark-only --benchmark-columns=min,median``.
"""

import pytest
import torch
import torchdiffeq
from torch import nn
from torch.func import functional_call, grad

from torchfn import random, transforms

B, D, H = 64, 32, 64
RTOL, ATOL = 1e-6, 1e-8


class Field(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, t, y):  # torchdiffeq's (t, y) order
        return self.l2(torch.tanh(self.l1(y)))


def setup():
    field = Field()
    ks = random.split(random.key(0), 5)
    params = {"l1.weight": random.normal(ks[0], (H, D)) / D**0.5,
              "l1.bias": random.normal(ks[1], (H,)) * 0.1,
              "l2.weight": random.normal(ks[2], (D, H)) / H**0.5,
              "l2.bias": random.normal(ks[3], (D,)) * 0.1}
    field.load_state_dict(params)
    return field, params, random.normal(ks[4], (B, D)), torch.tensor([0.0, 1.0])


def torchfn_grad(field, params, y0, t, **fixed):
    def loss(p):
        ys = transforms.odeint(lambda y, s, p: functional_call(field, p, (s, y)), y0, t, p,
                               rtol=RTOL, atol=ATOL, **fixed)
        return ys[-1].square().mean()

    return grad(loss)(params)


def torchdiffeq_grad(solver, **kwargs):
    kwargs = kwargs or {"method": "dopri5"}

    def run(field, params, y0, t):
        field.zero_grad()
        ys = solver(field, y0, t, rtol=RTOL, atol=ATOL, **kwargs)
        ys[-1].square().mean().backward()
        return {k: v.grad.clone() for k, v in field.named_parameters()}

    return run


IMPLS = {"torchfn": torchfn_grad,
         "torchdiffeq_adjoint": torchdiffeq_grad(torchdiffeq.odeint_adjoint),
         "torchdiffeq_backprop": torchdiffeq_grad(torchdiffeq.odeint),
         # the fixed-grid pair: 20 RK4 steps, equal to the adaptive gradient to 1e-4
         "torchfn_rk4": lambda *a: torchfn_grad(*a, method="rk4", step_size=0.05),
         "torchdiffeq_adjoint_rk4": torchdiffeq_grad(torchdiffeq.odeint_adjoint, method="rk4",
                                                     options={"step_size": 0.05})}


@pytest.mark.parametrize("impl", list(IMPLS))
def test_neural_ode_gradient(benchmark, impl):
    field, params, y0, t = setup()
    want = torchdiffeq_grad(torchdiffeq.odeint)(field, params, y0, t)
    got = IMPLS[impl](field, params, y0, t)
    atol = 1e-4 if impl.endswith("rk4") else 1e-6
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-3, atol=atol)
    benchmark(IMPLS[impl], field, params, y0, t)
