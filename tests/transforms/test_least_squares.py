"""``transforms.least_squares`` (Levenberg-Marquardt): the fits scipy's MINPACK finds, the
linear solution in closed form, and per-problem fits under vmap equal to a loop."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy.optimize import least_squares as scipy_least_squares
from torch.func import vmap

from torchfn import random, transforms

F64 = torch.float64
T = torch.linspace(0, 4, 60, dtype=F64)


def decay_data(seed, a=2.0, b=1.3, c=0.5):
    noise = 0.05 * random.normal(random.key(seed), (60,), dtype=F64)
    return a * torch.exp(-b * T) + c + noise


def decay(p, t, y):  # residuals (60,)
    return p["a"] * torch.exp(-p["b"] * t) + p["c"] - y


P0 = {k: torch.tensor(1.0, dtype=F64) for k in "abc"}


# decays the 60 noisy points determine: with a small, slow decay the noise leaves a
# flat valley (b -> 0, a -> inf, c -> -inf) where any two solvers stop apart
@given(seed=st.integers(0, 2**16), a=st.floats(1, 3), b=st.floats(0.6, 3),
       c=st.floats(-1, 1))
def test_equals_scipy_minpack(seed, a, b, c):
    y = decay_data(seed, a, b, c)
    tight = dict(ftol=1e-15, xtol=1e-15, gtol=1e-15)  # as scipy's below
    fit, info = transforms.least_squares(decay, P0, T, y, **tight)
    t, yy = T.numpy(), y.numpy()
    ref = scipy_least_squares(lambda x: x[0] * np.exp(-x[1] * t) + x[2] - yy, np.ones(3),
                              method="lm", xtol=1e-15, ftol=1e-15, gtol=1e-15)
    got = np.array([float(fit[k]) for k in "abc"])
    # a slow decay makes a and c nearly collinear: 1e-7 is the problem's own precision
    np.testing.assert_allclose(got, ref.x, rtol=1e-6, atol=1e-7)
    assert float(info.cost) == pytest.approx(ref.cost, rel=1e-9)


def test_linear_least_squares_is_lstsq():
    """Pytree params of any shape: a (3, 2) weight and a (2,) bias."""
    X = random.normal(random.key(1), (40, 3), dtype=F64)
    Y = random.normal(random.key(2), (40, 2), dtype=F64)
    p0 = {"w": torch.zeros(3, 2, dtype=F64), "b": torch.zeros(2, dtype=F64)}
    fit, info = transforms.least_squares(lambda p: X @ p["w"] + p["b"] - Y, p0)
    Xb = torch.cat([X, torch.ones(40, 1, dtype=F64)], 1)
    sol = torch.linalg.lstsq(Xb, Y).solution  # (4, 2)
    torch.testing.assert_close(fit["w"], sol[:3], rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(fit["b"], sol[3], rtol=1e-9, atol=1e-10)
    assert fit["w"].shape == (3, 2) and bool(info.converged)


@pytest.mark.parametrize("jacobian", ["rev", "fwd"])
def test_rosenbrock(jacobian):
    residual = lambda x: torch.stack([10 * (x[1] - x[0] ** 2), 1 - x[0]])
    fit, info = transforms.least_squares(residual, torch.tensor([-1.2, 1.0], dtype=F64),
                                         jacobian=jacobian)
    torch.testing.assert_close(fit, torch.ones(2, dtype=F64), rtol=1e-10, atol=1e-10)
    assert bool(info.converged) and float(info.cost) < 1e-20


def test_vmap_fits_each_dataset_as_alone():
    ys = torch.stack([decay_data(s, a=1 + 0.3 * s, b=0.5 + 0.2 * s) for s in range(5)])
    fits, infos = vmap(lambda y: transforms.least_squares(decay, P0, T, y))(ys)
    for i in range(5):
        fit, info = transforms.least_squares(decay, P0, T, ys[i])
        # batched solves round differently, and each run stops within its tolerance
        for k in "abc":
            torch.testing.assert_close(fits[k][i], fit[k], rtol=1e-7, atol=1e-8)
        assert abs(int(infos.steps[i]) - int(info.steps)) <= 1
    assert bool(infos.converged.all())
    assert len(set(infos.steps.tolist())) > 1  # each problem stopped on its own


def test_bad_input():
    with pytest.raises(TypeError, match="residual_fn must be callable, got int"):
        transforms.least_squares(3, P0)
    with pytest.raises(TypeError, match="params must be a non-empty pytree of floating-point"):
        transforms.least_squares(decay, {"a": torch.tensor(1)}, T, T)
    with pytest.raises(ValueError, match="jacobian must be 'rev' or 'fwd', got 'auto'"):
        transforms.least_squares(decay, P0, T, T, jacobian="auto")
    with pytest.raises(ValueError, match="max_steps must be an int >= 1, got 0"):
        transforms.least_squares(decay, P0, T, T, max_steps=0)


def test_implicit_derivative_of_a_linear_fit_is_the_pseudo_inverse():
    """theta*(y) = (X^T X)^-1 X^T y: d(w . theta*)/dy = X (X^T X)^-1 w, in every mode."""
    X = random.normal(random.key(1), (30, 4), dtype=F64)
    y = random.normal(random.key(2), (30,), dtype=F64)
    w = random.normal(random.key(3), (4,), dtype=F64)
    p0 = torch.zeros(4, dtype=F64)

    def out(y):
        fit, _ = transforms.least_squares(lambda p, y: X @ p - y, p0, y)
        return fit @ w

    want = X @ torch.linalg.solve(X.T @ X, w)  # (30,)
    torch.testing.assert_close(torch.func.grad(out)(y), want, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(torch.func.jacfwd(out)(y), want, rtol=1e-9, atol=1e-11)
    ys = torch.stack([y, 2 * y, y + 1])
    per = vmap(torch.func.grad(out))(ys)  # the same for every dataset (linear)
    torch.testing.assert_close(per, want.expand(3, 30), rtol=1e-9, atol=1e-11)


def test_implicit_derivative_of_a_nonlinear_fit_equals_finite_differences():
    y = decay_data(7)
    w = torch.tensor([1.0, -2.0, 0.5], dtype=F64)
    tight = dict(ftol=1e-15, xtol=1e-15, gtol=1e-15)

    def out(y):
        fit, _ = transforms.least_squares(decay, P0, T, y, **tight)
        return torch.stack([fit[k] for k in "abc"]) @ w

    v = random.normal(random.key(8), (60,), dtype=F64)

    def central(eps):
        return (out(y + eps * v) - out(y - eps * v)) / (2 * eps)

    # The fits stop at ftol = 1e-15 on the cost, so their parameters are good to ~1e-8,
    # not to rounding: divided by a step of 1e-5 that error showed up at 2e-4 on one
    # machine (Intel) and not on another (AMD). A larger step with Richardson's
    # extrapolation (truncation O(eps^4)) keeps the solver's error below 1e-5.
    eps = 2e-3
    fd = (4 * central(eps / 2) - central(eps)) / 3
    torch.testing.assert_close(torch.func.grad(out)(y) @ v, fd, rtol=1e-5, atol=1e-7)
    y_req = y.clone().requires_grad_()
    out(y_req).backward()  # plain autograd takes the same rule
    torch.testing.assert_close(y_req.grad, torch.func.grad(out)(y))


def test_a_differentiated_closure_is_refused():
    """The implicit rule differentiates args only: a residual that closes over a tensor
    being differentiated would silently get no gradient, so it raises."""
    y = decay_data(0)

    def out(scale):
        fit, _ = transforms.least_squares(lambda p, t: decay(p, t, y * scale), P0, T)
        return fit["a"]

    with pytest.raises(ValueError, match="not one of its arguments"):
        torch.func.grad(out)(torch.tensor(1.0, dtype=F64))


def test_integer_args_pass_through_under_transforms():
    """An index tensor among args (a subset of the points to fit) under grad and vmap."""
    idx = torch.arange(0, 60, 2)
    y = decay_data(3)

    def out(y, idx):
        fit, _ = transforms.least_squares(lambda p, t, y, i: decay(p, t, y)[i], P0, T, y, idx)
        return fit["b"]

    g = torch.func.grad(out)(y, idx)
    assert (g[1::2] == 0).all() and (g[::2] != 0).any()  # the unused points do not count
    per = vmap(torch.func.grad(out), in_dims=(0, None))(torch.stack([y, y]), idx)
    torch.testing.assert_close(per[0], g)
