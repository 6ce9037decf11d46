"""Conjugate gradients: the solution equals ``torch.linalg.solve`` (float64, drawn SPD
systems, pytrees, preconditioned, warm-started); each iterate equals scipy's CG; the
implicit derivatives in ``b`` and in the operator's ``args`` equal differentiating the
dense solve under ``grad``, ``jvp`` and ``hessian``; ``vmap`` solves each system to its
own tolerance and equals a loop."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import scipy.sparse.linalg as sla
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import grad, hessian, jvp, vmap

from torchfn import random
from torchfn.transforms import cg


def _spd(seed, n, cond=50.0):
    U = random.orthogonal(random.key(seed), n, dtype=torch.float64)
    eig = torch.logspace(0, float(np.log10(cond)), n, dtype=torch.float64)
    return U @ torch.diag(eig) @ U.T


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 12), cond=st.floats(1.0, 1e3),
       precondition=st.booleans())
def test_solution_equals_the_dense_solve(seed, n, cond, precondition):
    A = _spd(seed, n, cond)
    b = random.normal(random.key(seed + 1), (n,), dtype=torch.float64)
    M = (lambda v: v / A.diagonal()) if precondition else None
    x = cg(lambda v: A @ v, b, tol=1e-12, M=M)
    torch.testing.assert_close(x, torch.linalg.solve(A, b), rtol=1e-8, atol=1e-10)


def test_pytree_right_hand_side_and_warm_start():
    A = _spd(0, 7)
    b = random.normal(random.key(1), (7,), dtype=torch.float64)
    want = torch.linalg.solve(A, b)

    def matvec(v):  # {"w": (2, 2), "c": (3,)} as one vector of 7
        flat = torch.cat([v["c"], v["w"].reshape(-1)])
        out = A @ flat
        return {"c": out[:3], "w": out[3:].reshape(2, 2)}

    tree_b = {"c": b[:3], "w": b[3:].reshape(2, 2)}
    x = cg(matvec, tree_b, tol=1e-12)
    torch.testing.assert_close(torch.cat([x["c"], x["w"].reshape(-1)]), want)
    close = {k: v + 1e-3 for k, v in {"c": want[:3], "w": want[3:].reshape(2, 2)}.items()}
    warm = cg(matvec, tree_b, x0=close, tol=1e-12)
    torch.testing.assert_close(torch.cat([warm["c"], warm["w"].reshape(-1)]), want)


@pytest.mark.parametrize("k", [1, 2, 5])
def test_each_iterate_equals_scipys(k):
    A = _spd(3, 10, 100.0)
    b = random.normal(random.key(4), (10,), dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # k iterations do not converge
        ours = cg(lambda v: A @ v, b, tol=1e-14, maxiter=k)
    theirs, _ = sla.cg(A.numpy(), b.numpy(), rtol=1e-14, maxiter=k)
    np.testing.assert_allclose(ours.numpy(), theirs, rtol=1e-9, atol=1e-12)


def _system(theta):
    """``A(theta) = L Lᵀ + I`` with ``L`` lower-triangular from ``theta`` (6,): SPD, 3x3."""
    L = torch.zeros(3, 3, dtype=theta.dtype)
    L = L.index_put((torch.tensor([0, 1, 1, 2, 2, 2]), torch.tensor([0, 0, 1, 0, 1, 2])),
                    theta)
    return L @ L.T + torch.eye(3, dtype=theta.dtype)


def _matvec(v, theta):
    return _system(theta) @ v


def test_derivatives_in_b_and_args_equal_the_dense_solves():
    theta = random.normal(random.key(5), (6,), dtype=torch.float64)
    b = random.normal(random.key(6), (3,), dtype=torch.float64)
    c = random.normal(random.key(7), (3,), dtype=torch.float64)

    def ours(theta, b):
        return (c * cg(_matvec, b, args=(theta,), tol=1e-13) ** 2).sum()

    def dense(theta, b):
        return (c * torch.linalg.solve(_system(theta), b) ** 2).sum()

    for argnums in (0, 1):
        torch.testing.assert_close(grad(ours, argnums)(theta, b),
                                   grad(dense, argnums)(theta, b), rtol=1e-8, atol=1e-10)
    t_theta = random.normal(random.key(8), (6,), dtype=torch.float64)
    t_b = random.normal(random.key(9), (3,), dtype=torch.float64)
    torch.testing.assert_close(jvp(ours, (theta, b), (t_theta, t_b))[1],
                               jvp(dense, (theta, b), (t_theta, t_b))[1], rtol=1e-8,
                               atol=1e-10)
    torch.testing.assert_close(hessian(ours)(theta, b), hessian(dense)(theta, b),
                               rtol=1e-6, atol=1e-8)


def test_under_vmap_each_system_stops_at_its_own_tolerance():
    """Systems of different conditioning, solved loosely (tol 1e-3): the batched solve
    equals a loop of solves, each stopped where its own would (a lane that ran on would
    move by about 1e-3; CG's rounding in batched matmuls moves it by about 1e-6)."""
    n = 30
    As = torch.stack([_spd(10, n, 1.0), _spd(11, n, 300.0), _spd(12, n, 30.0)])  # (3, n, n)
    bs = random.normal(random.key(13), (3, n), dtype=torch.float64)

    def solve(A, b, tol=1e-3):
        return cg(lambda v, A: A @ v, b, args=(A,), tol=tol)

    got = vmap(solve)(As, bs)
    tight = vmap(lambda A, b: solve(A, b, 1e-12))(As, bs)
    for i in range(3):
        torch.testing.assert_close(got[i], solve(As[i], bs[i]), rtol=0, atol=1e-5)
        torch.testing.assert_close(tight[i], torch.linalg.solve(As[i], bs[i]), rtol=1e-8,
                                   atol=1e-10)
    assert (tight[1:] - got[1:]).abs().max() > 1e-4  # the loose solves did stop early
    def residual(i, x):
        return ((bs[i] - As[i] @ x).norm() / bs[i].norm()).item()

    for i in range(3):  # each lane's residual is its own solve's, not a later iterate's
        one = residual(i, solve(As[i], bs[i]))
        assert one <= 1e-3 and 0.9 * one <= residual(i, got[i]) <= 1.1 * one + 1e-14
    # per-example gradients through the solve: A⁻¹ 1
    g = vmap(grad(lambda A, b: solve(A, b, 1e-12).sum(), argnums=1))(As, bs)
    for i in range(3):
        torch.testing.assert_close(g[i], torch.linalg.solve(As[i], torch.ones(
            n, dtype=torch.float64)), rtol=1e-7, atol=1e-9)


def test_a_solve_that_runs_out_of_iterations_warns():
    A = _spd(14, 20, 1e4)
    b = random.normal(random.key(15), (20,), dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="cg did not converge.*maxiter=3"):
        cg(lambda v: A @ v, b, maxiter=3)


@pytest.mark.parametrize("call, match", [
    (lambda A, b: cg(A, b), "matvec must be callable"),
    (lambda A, b: cg(lambda v: A @ v, b.long()), "b must be a floating-point tensor"),
    (lambda A, b: cg(lambda v: A @ v, b, args=[A]), "args must be a tuple"),
    (lambda A, b: cg(lambda v: A @ v, b, x0=b[:2]), r"x0 must have b's structure and "
     r"shapes \[\(3,\)\], got \[\(2,\)\]"),
    (lambda A, b: cg(lambda v: (A @ v)[:2], b), r"matvec must return b's structure"),
    (lambda A, b: cg(lambda v: A @ v, b, tol=-1.0), "tol must be a non-negative number"),
    (lambda A, b: cg(lambda v: A @ v, b, maxiter=0), "maxiter must be a positive int"),
    (lambda A, b: cg(lambda v: A @ v, b, M=3.0), "M must be callable or None"),
])
def test_bad_input_is_named(call, match):
    A, b = torch.eye(3), torch.ones(3)
    with pytest.raises((TypeError, ValueError), match=match):
        call(A, b)
