"""Spectra from matrix-vector products: ``eigsh`` against the dense float64
eigendecomposition of an MLP loss's Hessian (and of drawn matrices with repeated
eigenvalues and low rank); stochastic Lanczos quadrature is a Gauss quadrature (exact
moments up to degree 2 steps - 1, its nodes the spectrum at steps = n); Hutchinson's
trace is exact on diagonal operators and within its error elsewhere; all three under
``vmap`` equal a loop."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import vmap

import torchfn
from torchfn import random
from torchfn.models import MLP
from torchfn.transforms import (
    eigsh,
    gauss_newton_vp,
    hessian_operator,
    hutchinson_trace,
    hvp,
    spectral_density,
    spectral_quadrature,
)


def _flat(tree):
    return torch.cat([tree[k].reshape(-1) for k in sorted(tree)])


def _unflat(vec, like):
    out, i = {}, 0
    for k in sorted(like):
        n = like[k].numel()
        out[k] = vec[i:i + n].reshape(like[k].shape)
        i += n
    return out


def _mlp_problem():
    """A float64 MLP's loss on 16 points; its Hessian (n, n) formed column by column."""
    model = torchfn.Model(MLP(3, (6,), 2))
    params = torchfn.tree.map(lambda p: p.double(), model.init(random.key(0)))
    x = random.normal(random.key(1), (16, 3), dtype=torch.float64)
    y = random.normal(random.key(2), (16, 2), dtype=torch.float64)

    def loss(p):
        return ((model.apply(p, x).tanh() - y) ** 2).mean()

    n = sum(v.numel() for v in params.values())
    eye = torch.eye(n, dtype=torch.float64)
    H = torch.stack([_flat(hvp(loss, params, _unflat(e, params))) for e in eye], 1)
    return loss, params, H


@pytest.fixture(scope="module")
def mlp():
    return _mlp_problem()


@pytest.mark.parametrize("which", ["largest", "smallest", "magnitude"])
def test_eigsh_with_n_steps_is_the_dense_eigendecomposition(mlp, which):
    loss, params, H = mlp
    n = H.shape[0]
    want = torch.linalg.eigvalsh(H)  # ascending
    values, vectors = eigsh(lambda v: hvp(loss, params, v), params, random.key(3), k=4,
                            steps=n, which=which)
    if which == "largest":
        expected = want.flip(0)[:4]
    elif which == "smallest":
        expected = want[:4]
    else:
        expected = want[want.abs().argsort(descending=True)[:4]]
    torch.testing.assert_close(values, expected, rtol=1e-8, atol=1e-10)
    V = torch.stack([_flat({k: vectors[k][i] for k in vectors}) for i in range(4)])
    torch.testing.assert_close(V @ V.T, torch.eye(4, dtype=torch.float64), atol=1e-8,
                               rtol=0)
    torch.testing.assert_close(V @ H, values[:, None] * V, atol=1e-8, rtol=0)


def test_eigsh_top_eigenvalue_converges_in_fewer_steps_than_n(mlp):
    loss, params, H = mlp
    top = torch.linalg.eigvalsh(H)[-1]
    values, _ = eigsh(lambda v: hvp(loss, params, v), params, random.key(4), steps=20)
    assert H.shape[0] == 38
    torch.testing.assert_close(values[0], top, rtol=1e-6, atol=0)


def test_the_gauss_newton_matrix_is_positive_semidefinite_where_the_hessian_is_not(mlp):
    loss, params, H = mlp
    model = torchfn.Model(MLP(3, (6,), 2))
    x = random.normal(random.key(1), (16, 3), dtype=torch.float64)
    y = random.normal(random.key(2), (16, 2), dtype=torch.float64)

    def ggn(v):
        return gauss_newton_vp(lambda p: model.apply(p, x).tanh(),
                               lambda z: ((z - y) ** 2).mean(), params, v)

    smallest, _ = eigsh(ggn, params, random.key(5), steps=H.shape[0], which="smallest")
    assert smallest.item() > -1e-10
    assert torch.linalg.eigvalsh(H)[0] < -1e-4


def _matrix(seed, n, spectrum):
    """``U diag(spectrum) Uᵀ`` with a random orthogonal ``U``, float64."""
    U = random.orthogonal(random.key(seed), n, dtype=torch.float64)
    return U @ torch.diag(torch.tensor(spectrum, dtype=torch.float64)) @ U.T


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6),
       spectrum=st.lists(st.sampled_from([-2.0, 0.0, 0.0, 1.0, 3.0, 3.0, 5.5]),
                         min_size=1, max_size=9))
def test_lanczos_closing_early_still_finds_every_eigenvalue(seed, spectrum):
    """Repeated eigenvalues and low rank close the Krylov space before n steps; the
    restarts keep going, so at steps = n the nodes are the whole spectrum."""
    n = len(spectrum)
    A = _matrix(seed, n, spectrum)
    nodes, weights = spectral_quadrature(lambda v: A @ v, torch.zeros(n, dtype=torch.float64),
                                         random.key(seed), steps=n, runs=2)
    want = torch.tensor(sorted(spectrum), dtype=torch.float64)
    for r in range(2):
        torch.testing.assert_close(nodes[r].sort().values, want, atol=1e-8, rtol=0)
        assert abs(weights[r].sum().item() - 1) < 1e-10 and weights[r].min() > -1e-12
    values, _ = eigsh(lambda v: A @ v, torch.zeros(n, dtype=torch.float64), random.key(seed),
                      steps=n, k=n)
    torch.testing.assert_close(values, want.flip(0), atol=1e-8, rtol=0)


def test_a_multiple_of_the_identity_closes_at_once_without_nans():
    """``A = 2I``: the first residual is exactly 0, every further vector a restart."""
    like = torch.zeros(5, dtype=torch.float64)
    nodes, weights = spectral_quadrature(lambda v: 2 * v, like, random.key(0), steps=5, runs=1)
    torch.testing.assert_close(nodes, torch.full((1, 5), 2.0, dtype=torch.float64))
    torch.testing.assert_close(weights.sum(), torch.tensor(1.0, dtype=torch.float64))
    values, vectors = eigsh(lambda v: 2 * v, like, random.key(1), k=3, steps=5)
    torch.testing.assert_close(values, torch.full((3,), 2.0, dtype=torch.float64))
    assert torch.isfinite(vectors).all()


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), steps=st.integers(1, 5))
def test_quadrature_moments_are_exact_up_to_degree_2_steps_minus_1(seed, steps):
    """Gauss quadrature: ``sum_i w_i θ_i^p = vᵀ A^p v`` for ``p <= 2 steps - 1``, the right
    side read from the steps = n run from the same start vector (same key)."""
    n = 10
    A = _matrix(seed, n, [float(x) for x in torch.linspace(-1, 2, n)])
    like = torch.zeros(n, dtype=torch.float64)
    full_nodes, full_weights = spectral_quadrature(lambda v: A @ v, like, random.key(seed),
                                                   steps=n, runs=1)
    nodes, weights = spectral_quadrature(lambda v: A @ v, like, random.key(seed),
                                         steps=steps, runs=1)
    for p in range(2 * steps):
        got = (weights * nodes ** p).sum()
        want = (full_weights * full_nodes ** p).sum()
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)


def test_hutchinson_is_exact_on_a_diagonal_and_within_its_error_elsewhere(mlp):
    d = torch.tensor([1.0, -2.0, 5.0, 0.5], dtype=torch.float64)
    est, err = hutchinson_trace(lambda v: d * v, torch.zeros(4, dtype=torch.float64),
                                random.key(6), samples=8)
    assert est.item() == pytest.approx(d.sum().item(), abs=1e-12) and err.item() < 1e-12
    loss, params, H = mlp
    for seed in range(3):
        est, err = hutchinson_trace(lambda v: hvp(loss, params, v), params, random.key(seed),
                                    samples=200)
        assert abs(est.item() - H.trace().item()) < 4 * err.item()
    vec, _ = hutchinson_trace(lambda v: hvp(loss, params, v), params, random.key(7),
                              samples=16, vectorized=True)
    loop, _ = hutchinson_trace(lambda v: hvp(loss, params, v), params, random.key(7),
                               samples=16)
    torch.testing.assert_close(vec, loop)


def test_density_is_the_smoothed_quadrature_and_integrates_to_one():
    A = _matrix(1, 8, [0.0, 0.5, 1.0, 1.0, 2.0, 3.0, 3.5, 4.0])
    nodes, weights = spectral_quadrature(lambda v: A @ v, torch.zeros(8, dtype=torch.float64),
                                         random.key(8), steps=6, runs=3)
    grid = torch.linspace(-2, 6, 4001, dtype=torch.float64)
    density = spectral_density(nodes, weights, grid, sigma=0.1)
    assert torch.trapezoid(density, grid).item() == pytest.approx(1.0, abs=1e-6)
    g = 1234
    want = sum(weights[r, i] * torch.exp(-0.5 * ((grid[g] - nodes[r, i]) / 0.1) ** 2)
               for r in range(3) for i in range(6)) / (3 * 0.1 * (2 * torch.pi) ** 0.5)
    torch.testing.assert_close(density[g], want)


def test_under_vmap_each_member_of_an_ensemble_gets_its_own_spectrum():
    """The sharpness of 3 quadratic losses at once equals each one's."""
    scales = torch.tensor([[1.0, 2.0, 3.0], [5.0, 0.5, 1.0], [2.0, 2.0, 7.0]],
                          dtype=torch.float64)

    def top(s):  # loss = sum s_i w_i^2: Hessian diag(2 s)
        def loss(w):
            return (s * w ** 2).sum()
        w = torch.ones(3, dtype=torch.float64)
        values, _ = eigsh(hessian_operator(loss, w), w, random.key(9), steps=3)
        trace, _ = hutchinson_trace(lambda v: hvp(loss, w, v), w, random.key(9), samples=4)
        nodes, _ = spectral_quadrature(lambda v: hvp(loss, w, v), w, random.key(9), steps=3,
                                       runs=1)
        return values[0], trace, nodes[0]

    got = vmap(top)(scales)
    for i in range(3):
        want = top(scales[i])
        for g, w in zip(got, want):
            torch.testing.assert_close(g[i], w)
    torch.testing.assert_close(got[0], 2 * scales.max(-1).values)


@pytest.mark.parametrize("call, match", [
    (lambda A: eigsh(A, torch.zeros(3), random.key(0)), "matvec must be callable"),
    (lambda A: eigsh(lambda v: A @ v, torch.zeros(3, dtype=torch.long), random.key(0)),
     "like must be a floating-point tensor or a pytree"),
    (lambda A: eigsh(lambda v: A @ v, torch.zeros(3), random.key(0), k=4),
     r"k must be an int in \[1, 3\], got 4"),
    (lambda A: eigsh(lambda v: A @ v, torch.zeros(3), random.key(0), k=2, steps=1),
     r"steps must be an int in \[2, 3\], got 1"),
    (lambda A: eigsh(lambda v: A @ v, torch.zeros(3), random.key(0), which="top"),
     "which must be one of"),
    (lambda A: eigsh(lambda v: (A @ v)[:2], torch.zeros(3), random.key(0)),
     r"matvec's output must have like's structure and shapes \[\(3,\)\], got \[\(2,\)\]"),
    (lambda A: hutchinson_trace(lambda v: A @ v, torch.zeros(3), random.key(0), samples=1),
     "samples must be an int >= 2"),
    (lambda A: spectral_quadrature(lambda v: A @ v, torch.zeros(3), random.key(0), runs=0),
     "runs must be an int >= 1"),
    (lambda A: spectral_density(torch.zeros(2, 3), torch.zeros(2, 2), torch.zeros(5),
                                sigma=0.1), r"weights must have nodes' shape \(2, 3\)"),
    (lambda A: spectral_density(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(5),
                                sigma=0.0), "sigma must be a positive float"),
])
def test_bad_input_is_named(call, match):
    A = torch.eye(3)
    with pytest.raises((ValueError, TypeError), match=match):
        call(A)
