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


@given(seed=st.integers(0, 2**16), a=st.floats(0.5, 3), b=st.floats(0.3, 3),
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
