"""``transforms.odeint(method=..., step_size=...)``, the fixed grids: each method equals its
Butcher tableau written out as a loop, converges at its order to the closed form, and
its adjoint and tangent solves converge at the same order to the exact derivatives."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.func import grad, jvp, vmap

from torchfn import random, transforms

F64 = torch.float64
ORDER = {"euler": 1, "midpoint": 2, "heun": 2, "rk4": 4}


def normal(seed, *shape):
    return random.normal(random.key(seed), shape, dtype=F64)


def pendulum(y, t, w):  # y: (2,), w: (2,) a nonlinear field with a time term
    return torch.stack([y[1], -w[0] * torch.sin(y[0]) - w[1] * y[1] + 0.1 * torch.cos(t)])


def step(method, f, y, t, h):
    """One step of ``method``, each written out as in a textbook."""
    if method == "euler":
        return y + h * f(y, t)
    if method == "midpoint":
        return y + h * f(y + h / 2 * f(y, t), t + h / 2)
    if method == "heun":
        k1 = f(y, t)
        return y + h / 2 * (k1 + f(y + h * k1, t + h))
    k1 = f(y, t)
    k2 = f(y + h / 2 * k1, t + h / 2)
    k3 = f(y + h / 2 * k2, t + h / 2)
    k4 = f(y + h * k3, t + h)
    return y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)


def loop(method, f, y0, t, step_size):
    out, y = [y0], y0
    for t0, t1 in zip(t[:-1], t[1:]):
        n = 1 if step_size is None else math.ceil(float(t1 - t0) / step_size - 1e-9)
        h = (t1 - t0) / n
        for j in range(n):
            y = step(method, f, y, t0 + j * h, h)
        out.append(y)
    return torch.stack(out)


@given(method=st.sampled_from(list(ORDER)), step_size=st.sampled_from([None, 0.1, 0.07, 0.5]),
       seed=st.integers(0, 2**16))
def test_each_method_equals_its_tableau_written_out(method, step_size, seed):
    w = normal(seed, 2).abs() + 0.5
    y0 = normal(seed + 1, 2)
    t = torch.tensor([0.0, 0.25, 0.6, 1.3], dtype=F64)
    got = transforms.odeint(pendulum, y0, t, w, method=method, step_size=step_size)
    want = loop(method, lambda y, s: pendulum(y, s, w), y0, t, step_size)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)


def linear_problem():
    a = torch.tensor([[0.0, 1.0], [-2.0, -0.3]], dtype=F64)
    y0 = torch.tensor([1.0, -0.5], dtype=F64)
    return a, y0, torch.tensor([0.0, 0.7, 1.5], dtype=F64)


def exact(a, y0, t):
    return torch.stack([torch.linalg.matrix_exp(a * ti) @ y0 for ti in t])


@pytest.mark.parametrize("method", list(ORDER))
def test_values_and_derivatives_converge_at_the_methods_order(method):
    """Halving the step divides each error by 2^order (within 30%): the solution, the
    adjoint gradient in the matrix and y0, and the forward-mode tangent."""
    a, y0, t = linear_problem()
    p = ORDER[method]

    def solve(a, y0, h):
        return transforms.odeint(lambda y, s, a: a @ y, y0, t, a, method=method, step_size=h)

    def loss(fn):
        return lambda a, y0: (fn(a, y0) * torch.tensor([1.0, -2.0], dtype=F64)).sum()

    truth_loss = loss(lambda a, y0: exact(a, y0, t)[-1])
    ga_true, gy_true = grad(truth_loss, argnums=(0, 1))(a, y0)
    ta, ty0 = torch.ones_like(a) * 0.1, torch.tensor([0.3, 0.2], dtype=F64)
    tan_true = jvp(lambda a, y0: exact(a, y0, t), (a, y0), (ta, ty0))[1]
    errors = []
    h0 = 0.1 if p < 4 else 0.2
    for h in (h0, h0 / 2):
        ga, gy = grad(loss(lambda a, y0, h=h: solve(a, y0, h)[-1]), argnums=(0, 1))(a, y0)
        tan = jvp(lambda a, y0, h=h: solve(a, y0, h), (a, y0), (ta, ty0))[1]
        errors.append([
            (solve(a, y0, h) - exact(a, y0, t)).abs().max(),
            (ga - ga_true).abs().max(), (gy - gy_true).abs().max(),
            (tan - tan_true).abs().max(),
        ])
    for coarse, fine in zip(*errors):
        assert 0.7 * 2**p < coarse / fine < 1.3 * 2**p, (method, coarse, fine)


def test_per_example_gradients_under_vmap_equal_a_loop():
    w = torch.tensor([1.5, 0.2], dtype=F64)
    y0s = normal(3, 4, 2)
    t = torch.tensor([0.0, 0.5, 1.0], dtype=F64)

    def loss(w, y0):
        return transforms.odeint(pendulum, y0, t, w, method="rk4", step_size=0.1)[-1, 0]

    batched = vmap(grad(loss), in_dims=(None, 0))(w, y0s)
    for i in range(4):
        torch.testing.assert_close(batched[i], grad(loss)(w, y0s[i]))


def test_the_fixed_grid_costs_what_it_says():
    """ceil(length / step_size) steps per interval, stages per step as the tableau:
    rk4 over [0, 1] and [1, 1.25] at 0.1 is (10 + 3) steps of 4 evaluations."""
    calls = []

    def counted(y, t):
        calls.append(1)
        return -y

    t = torch.tensor([0.0, 1.0, 1.25], dtype=F64)
    transforms.odeint(counted, torch.ones(2, dtype=F64), t, method="rk4", step_size=0.1)
    assert len(calls) == 13 * 4


def test_bad_input():
    y0, t = torch.ones(2), torch.tensor([0.0, 1.0])
    f = lambda y, t: -y
    with pytest.raises(ValueError, match=r"method must be one of \['dopri5', 'euler', "
                                         r"'midpoint', 'heun', 'rk4'\], got 'rk45'"):
        transforms.odeint(f, y0, t, method="rk45")
    with pytest.raises(ValueError, match="step_size must be a number > 0 or None, got -0.1"):
        transforms.odeint(f, y0, t, method="rk4", step_size=-0.1)
    with pytest.raises(ValueError, match="method='dopri5' chooses its own steps"):
        transforms.odeint(f, y0, t, step_size=0.1)
