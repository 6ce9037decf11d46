"""``transforms.fixed_point``: implicit derivatives equal closed forms and unrolled ones.

- a linear map ``z = A z + B th`` has the closed form ``z = (I - A)^-1 B th``: the
  solution and every derivative (first and second order, both modes, under vmap)
  equal it in float64;
- a DEQ layer ``z = tanh(W z + U x + b)``: implicit derivatives equal autodiff through
  a long unrolled iteration (which converges to the same point).
"""

import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vmap

from torchfn import random, transforms

F64 = torch.float64
METHODS = ["anderson", "iterate"]


def linear_problem(seed, d=5, contraction=0.5):
    ks = random.split(random.key(seed), 3)
    a = random.normal(ks[0], (d, d), dtype=F64)
    a = contraction * a / torch.linalg.matrix_norm(a, 2)
    return {"A": a, "B": random.normal(ks[1], (d, 3), dtype=F64),
            "th": random.normal(ks[2], (3,), dtype=F64)}


def linear_map(p, z):
    return p["A"] @ z + p["B"] @ p["th"]


def closed_form(p):
    eye = torch.eye(p["A"].shape[0], dtype=F64)
    return torch.linalg.solve(eye - p["A"], p["B"] @ p["th"])


def solve(p, method, f=linear_map, **kw):
    z0 = torch.zeros(p["A"].shape[0], dtype=F64) if "A" in p else torch.zeros(
        p["W"].shape[0], dtype=F64)
    return transforms.fixed_point(f, p, z0, method=method, tol=1e-13, max_iter=300, **kw)


def loss(z):
    return (z**2).sum() + z.sum()


def close(a, b, tol=1e-9):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("method", METHODS)
def test_linear_solution_and_first_order_equal_closed_form(method):
    p = linear_problem(0)
    close(solve(p, method), closed_form(p))
    g, want = grad(lambda p: loss(solve(p, method)))(p), grad(lambda p: loss(closed_form(p)))(p)
    for k in p:
        close(g[k], want[k])
    th_f = lambda th: solve({**p, "th": th}, method)  # noqa: E731
    th_c = lambda th: closed_form({**p, "th": th})  # noqa: E731
    close(jacrev(th_f)(p["th"]), jacrev(th_c)(p["th"]))
    close(jacfwd(th_f)(p["th"]), jacrev(th_c)(p["th"]))
    t = torch.ones(3, dtype=F64)
    close(jvp(th_f, (p["th"],), (t,))[1], jvp(th_c, (p["th"],), (t,))[1])


@pytest.mark.parametrize("method", METHODS)
def test_linear_second_order_equals_closed_form(method):
    """Exact second order needs plain iteration in the linear solves (the forward may
    still be Anderson's)."""
    p = linear_problem(1)
    f = lambda a: loss(solve({**p, "A": a}, method, adjoint_method="iterate"))  # noqa: E731
    want = hessian(lambda a: loss(closed_form({**p, "A": a})))(p["A"])
    close(hessian(f)(p["A"]), want, 1e-8)  # forward over reverse
    close(jacrev(jacrev(f))(p["A"]), want, 1e-8)  # reverse over reverse


@given(seed=st.integers(0, 2**16), d=st.integers(1, 6), batch=st.integers(1, 4))
def test_vmap_grad_equals_loop_and_closed_form(seed, d, batch):
    p = linear_problem(seed, d)
    ths = random.normal(random.key(seed + 1), (batch, 3), dtype=F64)
    f = lambda th: loss(solve({**p, "th": th}, "anderson"))  # noqa: E731
    batched = vmap(grad(f))(ths)
    looped = torch.stack([grad(f)(th) for th in ths])
    want = torch.stack([grad(lambda th: loss(closed_form({**p, "th": th})))(th) for th in ths])
    close(batched, looped)
    close(batched, want)


def deq_problem(seed, d=6, n_in=4):
    ks = random.split(random.key(seed), 4)
    w = random.normal(ks[0], (d, d), dtype=F64)
    return {"W": 0.6 * w / torch.linalg.matrix_norm(w, 2),
            "U": random.normal(ks[1], (d, n_in), dtype=F64),
            "b": random.normal(ks[2], (d,), dtype=F64),
            "x": random.normal(ks[3], (n_in,), dtype=F64)}


def deq_layer(p, z):
    return torch.tanh(p["W"] @ z + p["U"] @ p["x"] + p["b"])


def unrolled(p, steps=200):
    z = torch.zeros(p["W"].shape[0], dtype=F64)
    for _ in range(steps):
        z = deq_layer(p, z)
    return z


@pytest.mark.parametrize("method", METHODS)
def test_deq_implicit_equals_unrolled(method):
    p = deq_problem(2)
    ours = lambda p: loss(solve(p, method, f=deq_layer))  # noqa: E731
    ref = lambda p: loss(unrolled(p))  # noqa: E731
    g, want = grad(ours)(p), grad(ref)(p)
    for k in p:
        close(g[k], want[k])
    x_f = lambda x: solve({**p, "x": x}, method, f=deq_layer)  # noqa: E731
    close(jacfwd(x_f)(p["x"]), jacrev(lambda x: unrolled({**p, "x": x}))(p["x"]))
    # second order (Hessian in the input), forward over reverse
    ours2 = lambda p: loss(solve(p, method, f=deq_layer, adjoint_method="iterate"))  # noqa: E731
    close(hessian(lambda x: ours2({**p, "x": x}))(p["x"]),
          hessian(lambda x: ref({**p, "x": x}))(p["x"]), 1e-7)


def test_pytree_state():
    """z as a dict of two blocks coupled through f."""
    p = deq_problem(3)

    def f(p, z):  # z: {'a': (3,), 'b': (3,)}
        full = deq_layer(p, torch.cat([z["a"], z["b"]]))
        return {"a": full[:3], "b": full[3:]}

    z0 = {"a": torch.zeros(3, dtype=F64), "b": torch.zeros(3, dtype=F64)}
    z = transforms.fixed_point(f, p, z0, tol=1e-13, max_iter=300)
    close(torch.cat([z["a"], z["b"]]), unrolled(p))
    g = grad(lambda x: transforms.fixed_point(f, {**p, "x": x}, z0, tol=1e-13,
                                              max_iter=300)["b"].sum())(p["x"])
    close(g, grad(lambda x: unrolled({**p, "x": x})[3:].sum())(p["x"]))


def test_compile_of_grad_equals_eager(fresh_dynamo):
    p = deq_problem(4)
    f = grad(lambda x: loss(solve({**p, "x": x}, "anderson", f=deq_layer)))
    close(torch.compile(f, backend="aot_eager")(p["x"]), f(p["x"]))  # (dynamo's part)


def test_compile_with_backward_solves_once(fresh_dynamo):
    """Under torch.compile (outside transforms) the solve runs eagerly, once: as many
    layer calls as in eager mode, and the same gradient."""
    p = deq_problem(7)
    calls = []

    def counted(p, z):
        calls.append(1)
        return deq_layer(p, z)

    def run(x):
        return loss(transforms.fixed_point(counted, {**p, "x": x}, torch.zeros(6, dtype=F64)))

    x = p["x"].clone().requires_grad_()
    run(x).backward()
    eager, want = len(calls), x.grad
    calls.clear()
    x = p["x"].clone().requires_grad_()
    torch.compile(run, backend="aot_eager")(x).backward()  # graph breaks: dynamo's part
    assert len(calls) == eager
    close(x.grad, want)


def test_float32_default_tolerance_converges_quietly():
    p = {k: v.float() for k, v in deq_problem(5).items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        z = transforms.fixed_point(deq_layer, p, torch.zeros(6))
        grad(lambda x: transforms.fixed_point(deq_layer, {**p, "x": x}, torch.zeros(6)).sum())(
            p["x"])
    torch.testing.assert_close(deq_layer(p, z), z, rtol=1e-4, atol=1e-5)


def test_not_converging_warns():
    p = linear_problem(6, contraction=1.5)  # spectral radius > 1 for iteration
    with pytest.warns(RuntimeWarning, match=r"did not converge: relative residual .* after "
                                            r"max_iter=5 iterations"):
        transforms.fixed_point(linear_map, p, torch.zeros(5, dtype=F64), method="iterate",
                               max_iter=5)


def test_bad_input_gets_clear_errors():
    p = linear_problem(7)
    z0 = torch.zeros(5, dtype=F64)
    with pytest.raises(ValueError, match="method must be one of"):
        transforms.fixed_point(linear_map, p, z0, method="broyden")
    with pytest.raises(ValueError, match="adjoint_method must be one of"):
        transforms.fixed_point(linear_map, p, z0, adjoint_method="cg")
    with pytest.raises(ValueError, match="max_iter must be a positive int, got 0"):
        transforms.fixed_point(linear_map, p, z0, max_iter=0)
    with pytest.raises(ValueError, match=r"damping must be in \(0, 1\], got 2"):
        transforms.fixed_point(linear_map, p, z0, damping=2)
    with pytest.raises(TypeError, match="z0 must be a pytree of floating-point tensors, got "
                                        "Tensor of dtype torch.int64"):
        transforms.fixed_point(linear_map, p, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"leaf 0 has shape \(4,\) .* z has \(5,\)"):
        transforms.fixed_point(lambda p, z: linear_map(p, z)[:4], p, z0)
    with pytest.raises(TypeError, match="must return z's structure"):
        transforms.fixed_point(lambda p, z: (linear_map(p, z),), p, z0)


@pytest.mark.parametrize("method", METHODS)
def test_vmap_stops_when_every_lane_has_converged(method):
    """As JAX's batched while_loop: the lanes iterate until all are done, and a lane done
    early keeps its value."""
    calls = []

    def f(p, z):
        calls.append(1)
        return linear_map(p, z)

    ps = [linear_problem(s, contraction=c) for s, c in ((10, 0.1), (11, 0.5), (12, 0.9))]
    batch = {k: torch.stack([p[k] for p in ps]) for k in ps[0]}
    z0 = torch.zeros(3, 5, dtype=F64)
    out = vmap(lambda p, z: transforms.fixed_point(f, p, z, method=method, tol=1e-12,
                                                   max_iter=400))(batch, z0)
    n_batched = len(calls)
    for i, p in enumerate(ps):
        close(out[i], closed_form(p))
    per_lane = []
    for p in ps:
        calls.clear()
        transforms.fixed_point(f, p, z0[0], method=method, tol=1e-12, max_iter=400)
        per_lane.append(len(calls))
    assert n_batched == max(per_lane) < 400  # the slowest lane's iterations, no more
