"""Curvature utilities against torch.autograd.functional in float64: jacobian, hessian,
hvp (and hvp == H @ v, also on a params pytree), Gauss-Newton products, empirical NTK."""

import pytest
import torch
import torch.autograd.functional as AF
from hypothesis import given
from hypothesis import strategies as st
from torch.func import vmap

import torchfn
from torchfn import random
from torchfn.models import MLP
from torchfn.transforms import gauss_newton_vp, hessian, hessian_operator, hvp, jacobian, ntk


def problem(seed, d):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(4, d, generator=g, dtype=torch.float64)
    a = torch.randn(4, generator=g, dtype=torch.float64)
    x = torch.randn(d, generator=g, dtype=torch.float64)
    v = torch.randn(d, generator=g, dtype=torch.float64)

    def f(x):  # (d,) -> ()
        return (a * torch.tanh(w @ x)).sum() + (x**3).sum() / 6

    return f, x, v


@given(seed=st.integers(0, 2**16), d=st.integers(1, 5))
def test_hessian_and_hvp_equal_autograd_functional(seed, d):
    f, x, v = problem(seed, d)
    H = hessian(f)(x)
    torch.testing.assert_close(H, AF.hessian(f, x), rtol=1e-12, atol=1e-12)
    Hv = hvp(f, x, v)
    torch.testing.assert_close(Hv, AF.hvp(f, x, v)[1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(Hv, H @ v, rtol=1e-12, atol=1e-12)


@given(seed=st.integers(0, 2**16), d=st.integers(1, 4),
       mode=st.sampled_from(["reverse", "forward"]))
def test_jacobian_equals_autograd_functional(seed, d, mode):
    _, x, _ = problem(seed, d)
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(3, d, generator=g, dtype=torch.float64)
    fn = lambda x: torch.sin(w @ x) * x.sum()  # noqa: E731 -- (d,) -> (3,)
    torch.testing.assert_close(jacobian(fn, mode=mode)(x), AF.jacobian(fn, x), rtol=1e-12,
                               atol=1e-12)


def _flat(tree):
    return torch.cat([t.reshape(-1) for t in tree.values()])


def _unflat(vec, like):
    out, i = {}, 0
    for k, t in like.items():
        out[k] = vec[i:i + t.numel()].reshape(t.shape)
        i += t.numel()
    return out


def test_hvp_on_params_pytree_equals_flat_hessian_times_v():
    g = torch.Generator().manual_seed(0)
    p = {"w": torch.randn(3, 2, generator=g, dtype=torch.float64),
         "b": torch.randn(3, generator=g, dtype=torch.float64)}
    v = {k: torch.randn(t.shape, generator=g, dtype=torch.float64) for k, t in p.items()}
    x = torch.randn(5, 2, generator=g, dtype=torch.float64)
    loss = lambda p: torch.tanh(x @ p["w"].T + p["b"]).square().sum()  # noqa: E731
    H = AF.hessian(lambda vec: loss(_unflat(vec, p)), _flat(p))  # (P, P)
    ours = hvp(loss, p, v)
    torch.testing.assert_close(_flat(ours), H @ _flat(v), rtol=1e-12, atol=1e-12)
    # a direction whose dict lists the keys in another order is the same direction
    swapped = hvp(loss, p, {"b": v["b"], "w": v["w"]})
    assert all(torch.equal(swapped[k], ours[k]) for k in p)
    Hd = hessian(loss)(p)  # nested dict of blocks
    torch.testing.assert_close(Hd["w"]["b"].reshape(6, 3), H[:6, 6:], rtol=1e-12, atol=1e-12)


def test_hessian_operator_equals_hvp_for_many_directions_and_under_vmap():
    """One recorded gradient graph, many products: each equals ``hvp``; ``vmap`` over the
    directions, and over a batch of points, equals a loop."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 2, generator=g, dtype=torch.float64)
    loss = lambda p: torch.tanh(x @ p["w"].T + p["b"]).square().sum()  # noqa: E731
    p = {"w": torch.randn(3, 2, generator=g, dtype=torch.float64),
         "b": torch.randn(3, generator=g, dtype=torch.float64)}
    V = {k: torch.randn(4, *t.shape, generator=g, dtype=torch.float64) for k, t in p.items()}
    H = hessian_operator(loss, p)
    batched = vmap(H)(V)
    for i in range(4):
        v = {k: V[k][i] for k in V}
        want = hvp(loss, p, v)
        for k in p:
            torch.testing.assert_close(H(v)[k], want[k], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(batched[k][i], want[k], rtol=1e-12, atol=1e-12)
    points = {k: torch.randn(3, *t.shape, generator=g, dtype=torch.float64)
              for k, t in p.items()}
    v = {k: V[k][0] for k in V}
    per_point = vmap(lambda q: hessian_operator(loss, q)(v))(points)
    for i in range(3):
        want = hvp(loss, {k: points[k][i] for k in p}, v)
        for k in p:
            torch.testing.assert_close(per_point[k][i], want[k], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="v must have the structure of x"):
        H({"w": v["w"]})


def test_gauss_newton_vp_equals_explicit_jt_h_j():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, generator=g, dtype=torch.float64)
    y = torch.randint(0, 2, (4,), generator=g)
    p = torch.randn(2, 3, generator=g, dtype=torch.float64).reshape(-1)  # flat params (6,)
    v = torch.randn(6, generator=g, dtype=torch.float64)
    apply_fn = lambda p: torch.tanh(x @ p.reshape(2, 3).T)  # noqa: E731 -- (4, 2)
    loss_fn = lambda z: torch.nn.functional.cross_entropy(z, y)  # noqa: E731
    J = AF.jacobian(apply_fn, p).reshape(8, 6)
    HL = AF.hessian(loss_fn, apply_fn(p)).reshape(8, 8)
    torch.testing.assert_close(gauss_newton_vp(apply_fn, loss_fn, p, v), J.T @ HL @ J @ v,
                               rtol=1e-12, atol=1e-12)


def _loop_jacobians(model, params, xs):
    """(N, O, P): per-example Jacobians of the flattened output w.r.t. all params."""
    names = list(params)
    rows = []
    for x in xs:
        f = lambda *leaves: model.apply(dict(zip(names, leaves)), x).reshape(-1)  # noqa: E731,B023
        jac = AF.jacobian(f, tuple(params[n] for n in names))
        rows.append(torch.cat([j.reshape(j.shape[0], -1) for j in jac], dim=1))
    return torch.stack(rows)


@given(seed=st.integers(0, 2**16), n=st.integers(1, 3), m=st.integers(1, 3),
       out=st.sampled_from([1, 2]))
def test_ntk_equals_loop_of_per_example_jacobians(seed, n, m, out):
    model = torchfn.Model(MLP(3, (4,), out, activation="tanh"))
    params = {k: v.double() for k, v in model.init(random.key(seed)).items()}
    g = torch.Generator().manual_seed(seed)
    x1 = torch.randn(n, 3, generator=g, dtype=torch.float64)
    x2 = torch.randn(m, 3, generator=g, dtype=torch.float64)
    J1, J2 = _loop_jacobians(model, params, x1), _loop_jacobians(model, params, x2)
    full = torch.einsum("nap,mbp->nmab", J1, J2)  # J1 J2^T per output pair
    torch.testing.assert_close(ntk(model.apply, params, x1, x2), full, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ntk(model.apply, params, x1, x2, compute="trace"),
                               full.diagonal(dim1=2, dim2=3).sum(-1), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ntk(model.apply, params, x1, x2, compute="diagonal"),
                               full.diagonal(dim1=2, dim2=3), rtol=1e-10, atol=1e-12)


def test_ntk_scalar_output_is_n_by_m_and_symmetric_psd():
    model = torchfn.Model(MLP(2, (5,), 1))
    params = {k: v.double() for k, v in model.init(random.key(0)).items()}
    x = torch.randn(4, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    scalar = lambda p, x: model.apply(p, x)[0]  # noqa: E731 -- (2,) -> ()
    K = ntk(scalar, params, x)
    assert K.shape == (4, 4)
    torch.testing.assert_close(K, K.T)
    assert torch.linalg.eigvalsh(K).min() > -1e-10
    torch.testing.assert_close(K, ntk(model.apply, params, x).reshape(4, 4))


def test_bad_input():
    f, x, v = problem(0, 3)
    with pytest.raises(ValueError, match=r"v must have the shapes of x: leaf 0 is \(2,\)"):
        hvp(f, x, v[:2])
    with pytest.raises(ValueError, match="v must have the structure of x"):
        hvp(lambda p: p["a"].sum(), {"a": x}, {"b": x})
    with pytest.raises(ValueError, match=r"hessian: f must return a scalar .* got shape \(3,\)"):
        hessian(lambda x: x * 2)(x)
    with pytest.raises(ValueError, match="mode must be one of"):
        jacobian(f, mode="central")
    model = torchfn.Model(MLP(3, (4,), 2))
    params = model.init(random.key(0))
    with pytest.raises(ValueError, match="compute must be one of"):
        ntk(model.apply, params, torch.ones(2, 3), compute="all")
    with pytest.raises(ValueError, match=r"x2's examples must have x1's example shape \(3,\)"):
        ntk(model.apply, params, torch.ones(2, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"apply_fn must return one example's output of shape"):
        ntk(lambda p, x: model.apply(p, x)[None, :], params, torch.ones(2, 3))
