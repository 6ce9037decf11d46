"""``transforms.odeint``: solutions and derivatives equal closed forms, scipy, and autodiff
through a fine fixed-step integration.

- ``y' = A y`` has ``y(t) = expm(A (t - t0)) y0``: values and every derivative (in y0,
  A and the times; both modes, second order, under vmap) equal it in float64;
- Lotka-Volterra and a small neural ODE: values equal scipy's DOP853, and the adjoint
  gradients equal autodiff through 4000 RK4 steps;
- under vmap each example keeps its own steps: the batched solve makes as many
  evaluations as its slowest example alone, and gives each example's eager values.
"""

import numpy as np
import pytest
import torch
from scipy.integrate import solve_ivp
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vmap

from torchfn import random, transforms

F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-12)


def normal(seed, *shape):
    return random.normal(random.key(seed), shape, dtype=F64)


def linear(y, t, a):
    return a @ y


def closed_form(y0, a, t):
    return torch.stack([torch.linalg.matrix_exp(a * (ti - t[0])) @ y0 for ti in t])


def linear_problem(seed, d=3):
    a = normal(seed, d, d) * 0.5 - torch.eye(d, dtype=F64)
    return a, normal(seed + 1, d), torch.tensor([0.0, 0.3, 1.1, 2.0], dtype=F64)


def close(a, b, tol=1e-8):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def loss(ys):
    return (ys**2).sum() + ys[-1].sum()


def test_linear_values_and_first_order():
    a, y0, t = linear_problem(0)
    ours = lambda y0, a, t: transforms.odeint(linear, y0, t, a, **TOL)  # noqa: E731
    close(ours(y0, a, t), closed_form(y0, a, t), 1e-10)
    for argnums in (0, 1, 2):
        g = grad(lambda *x: loss(ours(*x)), argnums=argnums)(y0, a, t)
        want = grad(lambda *x: loss(closed_form(*x)), argnums=argnums)(y0, a, t)
        close(g, want)
        want_jac = jacrev(closed_form, argnums=argnums)(y0, a, t)
        close(jacrev(ours, argnums=argnums)(y0, a, t), want_jac)
        close(jacfwd(ours, argnums=argnums)(y0, a, t), want_jac)
    tangents = (normal(5, 3), normal(6, 3, 3), normal(7, 4))
    close(jvp(ours, (y0, a, t), tangents)[1], jvp(closed_form, (y0, a, t), tangents)[1])


def test_linear_second_order():
    a, y0, t = linear_problem(1)
    f = lambda a: loss(transforms.odeint(linear, y0, t, a, **TOL))  # noqa: E731
    want = hessian(lambda a: loss(closed_form(y0, a, t)))(a)
    close(hessian(f)(a), want, 1e-7)  # forward over reverse
    close(jacrev(jacrev(f))(a), want, 1e-7)  # reverse over reverse


def test_vmap_grad_equals_loop():
    a, _, t = linear_problem(2)
    y0s = normal(8, 5, 3)
    f = lambda y0: loss(transforms.odeint(linear, y0, t, a, **TOL))  # noqa: E731
    close(vmap(grad(f))(y0s), torch.stack([grad(lambda y: loss(closed_form(y, a, t)))(y)
                                           for y in y0s]))


def lotka_volterra(y, t, p):  # y: (2,), p: {'a', 'b', 'c', 'd'}
    x, z = y[0], y[1]
    return torch.stack([p["a"] * x - p["b"] * x * z, p["c"] * x * z - p["d"] * z])


def rk4(func, y0, t, *args, steps=4000):
    """Autodiff-able reference: fixed-step RK4 between the output times."""
    out, y = [y0], y0
    for i in range(len(t) - 1):
        h = (t[i + 1] - t[i]) / steps
        s = t[i]
        for _ in range(steps):
            k1 = func(y, s, *args)
            k2 = func(y + h / 2 * k1, s + h / 2, *args)
            k3 = func(y + h / 2 * k2, s + h / 2, *args)
            k4 = func(y + h * k3, s + h, *args)
            y = y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
            s = s + h
        out.append(y)
    return torch.stack(out)


def test_nonlinear_values_equal_scipy_and_gradients_equal_fine_autodiff():
    p = {k: torch.tensor(v, dtype=F64) for k, v in dict(a=1.1, b=0.4, c=0.1, d=0.4).items()}
    y0 = torch.tensor([10.0, 5.0], dtype=F64)
    t = torch.tensor([0.0, 1.5, 4.0], dtype=F64)
    ys = transforms.odeint(lotka_volterra, y0, t, p, **TOL)
    ref = solve_ivp(lambda s, y: lotka_volterra(torch.tensor(y), s, p).numpy(), (0.0, 4.0),
                    y0.numpy(), method="DOP853", t_eval=t.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ys.numpy(), ref.y.T, rtol=1e-8)
    f = lambda p: loss(transforms.odeint(lotka_volterra, y0, t, p, **TOL))  # noqa: E731
    g = grad(f)(p)
    want = grad(lambda p: loss(rk4(lotka_volterra, y0, t, p, steps=500)))(p)  # 1e-10 apart
    for k in p:
        close(g[k], want[k], 1e-7)


def neural_ode(y, t, params):  # y: {'x': (2,), 'v': (2,)}, params: a 2-layer MLP
    h = torch.tanh(params["w1"] @ torch.cat([y["x"], y["v"], t[None]]) + params["b1"])
    return {"x": y["v"], "v": params["w2"] @ h}


def test_pytree_state_and_params():
    params = {"w1": normal(10, 8, 5) / 2, "b1": normal(11, 8) / 2, "w2": normal(12, 2, 8) / 3}
    y0 = {"x": normal(13, 2), "v": normal(14, 2)}
    t = torch.tensor([0.0, 0.5, 1.0], dtype=F64)
    f = lambda params: transforms.odeint(neural_ode, y0, t, params, **TOL)  # noqa: E731
    ys = f(params)
    assert ys["x"].shape == (3, 2) and ys["v"].shape == (3, 2)
    flat = lambda y, t, params: torch.cat(list(neural_ode(  # noqa: E731
        {"x": y[:2], "v": y[2:]}, t, params).values()))
    ref = rk4(flat, torch.cat([y0["x"], y0["v"]]), t, params, steps=500)
    close(torch.cat([ys["x"], ys["v"]], -1), ref, 1e-9)
    g = grad(lambda p: f(p)["x"][-1].sum())(params)
    want = grad(lambda p: rk4(flat, torch.cat([y0["x"], y0["v"]]), t, p, steps=500)[-1, :2]
                .sum())(params)
    for k in params:
        close(g[k], want[k], 1e-8)


def test_vmap_keeps_each_examples_steps():
    """Three decay rates 100x apart over one interval: the batched solve makes as many
    evaluations as the stiffest example alone, and each lane equals its eager solve.
    (Over several output times it makes the sum over intervals of the slowest lane's.)"""
    calls = []

    def decay(y, t, k):
        calls.append(1)
        return -k * y

    ks = torch.tensor([0.1, 1.0, 10.0], dtype=F64)
    y0, t = torch.ones(2, dtype=F64), torch.tensor([0.0, 3.0], dtype=F64)
    batched = vmap(lambda k: transforms.odeint(decay, y0, t, k, **TOL))(ks)
    n_batched = len(calls)
    per_lane = []
    for i, k in enumerate(ks):
        calls.clear()
        close(batched[i], transforms.odeint(decay, y0, t, k, **TOL), 1e-13)
        per_lane.append(len(calls))
        close(batched[i, :, 0], torch.exp(-k * t), 1e-9)
    assert n_batched == max(per_lane) > min(per_lane)


def test_compile_of_grad_equals_eager(fresh_dynamo):
    a, y0, t = linear_problem(3)
    f = grad(lambda a: loss(transforms.odeint(linear, y0, t, a, **TOL)))
    close(torch.compile(f)(a), f(a), 1e-12)


def test_float32_defaults():
    a, y0, t = (x.float() for x in linear_problem(4))
    ys = transforms.odeint(linear, y0, t, a)
    torch.testing.assert_close(ys, closed_form(y0.double(), a.double(), t.double()).float(),
                               rtol=1e-5, atol=1e-6)


def test_bad_input_gets_clear_errors():
    a, y0, t = linear_problem(5)
    with pytest.raises(ValueError, match="t must be strictly increasing"):
        transforms.odeint(linear, y0, t.flip(0), a)
    with pytest.raises(ValueError, match=r"t must be a 1-d tensor of at least 2 times, got "
                                         r"shape \(1,\)"):
        transforms.odeint(linear, y0, t[:1], a)
    with pytest.raises(TypeError, match="y0 must be a pytree of floating-point tensors, got "
                                        "a tensor of dtype torch.int64"):
        transforms.odeint(linear, torch.ones(3, dtype=torch.long), t, a)
    with pytest.raises(TypeError, match="func must return y's structure"):
        transforms.odeint(lambda y, t, a: (a @ y,), y0, t, a)
    with pytest.raises(ValueError, match=r"func's leaf 0 is \(2,\); y's is \(3,\)"):
        transforms.odeint(lambda y, t, a: (a @ y)[:2], y0, t, a)
    with pytest.raises(RuntimeError, match="mxstep=5 steps did not reach t=0.3"):
        transforms.odeint(linear, y0, t, a * 1000, mxstep=5)
    with pytest.raises(ValueError, match="rtol must be a non-negative number"):
        transforms.odeint(linear, y0, t, a, rtol=-1.0)
