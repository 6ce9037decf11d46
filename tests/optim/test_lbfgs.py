"""L-BFGS: the two-loop recursion equals the dense BFGS inverse-Hessian update, each
line-search step satisfies Armijo's condition, the optimizer solves quadratics and
Rosenbrock as torch.optim.LBFGS does, and vmap runs one L-BFGS per problem."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.func import grad_and_value, vmap

from torchfn import optim, random

F64 = torch.float64


def normal(seed, *shape):
    return random.normal(random.key(seed), shape, dtype=F64)


def dense_inverse_hessian(pairs, gamma, n):
    """BFGS's inverse-Hessian update applied pair by pair to gamma I (N&W 6.17)."""
    H = gamma * torch.eye(n, dtype=F64)
    for s, y in pairs:
        rho = 1.0 / (s @ y)
        V = torch.eye(n, dtype=F64) - rho * torch.outer(y, s)
        H = V.T @ H @ V + rho * torch.outer(s, s)
    return H


@given(seed=st.integers(0, 2**16), n=st.integers(2, 6), steps=st.integers(1, 7),
       memory=st.integers(1, 4))
def test_two_loop_equals_the_dense_bfgs_update_of_the_last_m_pairs(seed, n, steps, memory):
    """On a convex quadratic every pair has positive curvature, so the memory holds the
    last m of them, and H g must equal the dense update of gamma I by those pairs."""
    m = normal(seed, n, n)
    A = m @ m.T + n * torch.eye(n, dtype=F64)  # positive definite
    grad = lambda x: A @ x  # f = x A x / 2
    xs = [normal(seed + 1 + i, n) for i in range(steps + 1)]  # arbitrary visited points
    tx = optim.scale_by_lbfgs(memory_size=memory)
    state = tx.init({"x": xs[0]})
    for x in xs:
        u, state = tx.update({"x": grad(x)}, state, {"x": x})
    pairs = [(b - a, grad(b) - grad(a)) for a, b in zip(xs[:-1], xs[1:])][-memory:]
    s, y = pairs[-1]
    H = dense_inverse_hessian(pairs, (s @ y) / (y @ y), n)
    torch.testing.assert_close(u["x"], H @ grad(xs[-1]), rtol=1e-9, atol=1e-11)


def run(f, params, tx, steps, extra=True):
    state = tx.init(params)
    history = []
    for _ in range(steps):
        g, v = grad_and_value(f)(params)
        kw = {"value": v, "grad": g, "value_fn": f} if extra else {}
        u, state = tx.update(g, state, params, **kw)
        params = optim.apply_updates(params, u)
        history.append((v, g, u))
    return params, state, history


def test_each_step_satisfies_armijo():
    f = rosenbrock
    p0 = {"x": torch.full((6,), -1.2, dtype=F64)}
    params, _, history = run(f, p0, optim.lbfgs(), 30)
    p = p0
    for v, g, u in history:
        new = optim.apply_updates(p, u)
        slope = (g["x"] * u["x"]).sum()  # the step taken: t <g, d>
        assert slope < 0
        assert f(new) <= v + 1e-4 * slope + 1e-15
        p = new
    assert f(params) < f(p0) * 1e-3


def rosenbrock(p):
    x = p["x"]
    return (100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2).sum()


def test_solves_a_quadratic():
    """To 1e-7: near the minimum f changes by less than its rounding, where a search on
    function values stops making progress (torch's L-BFGS stops there too)."""
    n = 8
    m = normal(3, n, n)
    A = m @ m.T + torch.eye(n, dtype=F64)
    b = normal(4, n)
    f = lambda p: 0.5 * p["x"] @ A @ p["x"] - b @ p["x"]
    params, _, _ = run(f, {"x": torch.zeros(n, dtype=F64)}, optim.lbfgs(memory_size=n), 4 * n)
    torch.testing.assert_close(params["x"], torch.linalg.solve(A, b), rtol=1e-7, atol=1e-8)


def test_rosenbrock_as_torch_lbfgs():
    """Both reach the minimum (1, ..., 1); torchfn's backtracking L-BFGS within about the
    iterations torch's strong-Wolfe L-BFGS takes (measured: 71 against 78)."""
    p0 = {"x": torch.full((10,), -1.0, dtype=F64)}
    params, _, history = run(rosenbrock, p0, optim.lbfgs(), 120)
    torch.testing.assert_close(params["x"], torch.ones(10, dtype=F64), rtol=1e-7, atol=1e-7)
    x = p0["x"].clone().requires_grad_()
    opt = torch.optim.LBFGS([x], lr=1, max_iter=120, history_size=10,
                            line_search_fn="strong_wolfe", tolerance_grad=1e-10,
                            tolerance_change=0)

    def closure():
        opt.zero_grad()
        loss = rosenbrock({"x": x})
        loss.backward()
        return loss

    opt.step(closure)
    torch.testing.assert_close(x.detach(), params["x"], rtol=1e-6, atol=1e-6)
    ours = next(i for i, (v, g, u) in enumerate(history) if g["x"].norm() < 1e-8)
    assert ours <= 1.5 * opt.state[x]["n_iter"]


def test_vmap_runs_one_lbfgs_per_problem():
    """A batch of least-squares problems, each with its own step sizes and memory:
    vmap over the whole loop equals solving each alone."""
    n, batch = 5, 4
    A = normal(0, 12, n)
    bs = normal(1, batch, 12)

    def solve(b):
        f = lambda p: ((A @ p["x"] - b) ** 2).sum() + 0.1 * (p["x"] ** 4).sum()
        params, state, _ = run(f, {"x": torch.zeros(n, dtype=F64)}, optim.lbfgs(), 25)
        return params["x"]

    xs = vmap(solve)(bs)
    for i in range(batch):
        # batched matmuls round differently from single ones: equal to rounding (near
        # the minimum each search's accept test then sees rounding noise)
        torch.testing.assert_close(xs[i], solve(bs[i]), rtol=1e-8, atol=1e-9)


def test_fixed_learning_rate_needs_no_value_fn():
    f = lambda p: ((p["x"] - 3.0) ** 2).sum()
    params, _, _ = run(f, {"x": torch.zeros(3, dtype=F64)}, optim.lbfgs(learning_rate=1.0),
                       10, extra=False)
    torch.testing.assert_close(params["x"], torch.full((3,), 3.0, dtype=F64))


def test_bad_input():
    with pytest.raises(ValueError, match="memory_size must be an int >= 1, got 0"):
        optim.scale_by_lbfgs(memory_size=0)
    with pytest.raises(ValueError, match="decrease_factor is out of range, got 1.5"):
        optim.scale_by_backtracking_linesearch(decrease_factor=1.5)
    with pytest.raises(ValueError, match="give learning_rate or linesearch, not both"):
        optim.lbfgs(learning_rate=0.1, linesearch=optim.scale_by_backtracking_linesearch())
    tx = optim.lbfgs()
    p = {"x": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"needs value=f\(params\), grad=df/dparams and "
                                         r"value_fn=f as keywords; missing \['value_fn'\]"):
        tx.update(p, tx.init(p), p, value=torch.tensor(0.0), grad=p)
    with pytest.raises(ValueError, match="scale_by_lbfgs"):
        optim.scale_by_lbfgs().update(p, optim.scale_by_lbfgs().init(p))  # no params


@pytest.mark.parametrize("search", ["backtracking", "zoom"])
def test_value_and_grad_from_state_reuses_the_accepted_trial_to_the_bit(search):
    """value_and_grad_from_state hands over the search's value and gradient at the
    accepted point, which are the next params': the iterates stay the same, with one
    evaluation fewer per iteration."""
    make = {"backtracking": lambda **kw: optim.scale_by_backtracking_linesearch(**kw),
            "zoom": lambda **kw: optim.scale_by_zoom_linesearch(**kw)}[search]
    p0 = {"x": torch.full((5,), -1.0, dtype=F64)}
    plain, _, _ = run(rosenbrock, p0, optim.lbfgs(linesearch=make()), 20)
    tx = optim.lbfgs(linesearch=make(store_grad=True) if search == "backtracking" else make())
    calls = []
    f = lambda p: calls.append(1) or rosenbrock(p)
    value_and_grad = optim.value_and_grad_from_state(f)
    p, state = p0, tx.init(p0)
    for _ in range(20):
        v, g = value_and_grad(p, state=state)
        u, state = tx.update(g, state, p, value=v, grad=g, value_fn=f)
        p = optim.apply_updates(p, u)
    assert torch.equal(p["x"], plain["x"])
    assert len(calls) == int(state[1][1].evaluations) + 1  # the searches' and the first
    with pytest.raises(ValueError, match="one line search made with store_grad=True"):
        optim.value_and_grad_from_state(f)(p0, state=optim.lbfgs(learning_rate=1.0).init(p0))


@given(seed=st.integers(0, 2**16), n=st.integers(2, 6))
def test_zoom_steps_satisfy_the_strong_wolfe_conditions(seed, n):
    """Every accepted step on Rosenbrock from a random start: sufficient decrease and
    |slope| <= 0.9 |initial slope|, the curvature s.y > 0 that follows from it."""
    p = {"x": normal(seed, n)}
    tx = optim.lbfgs()
    state = tx.init(p)
    for _ in range(15):
        g, v = grad_and_value(rosenbrock)(p)
        if g["x"].norm() < 1e-8:
            break
        u, state = tx.update(g, state, p, value=v, grad=g, value_fn=rosenbrock)
        new = optim.apply_updates(p, u)
        slope0 = (g["x"] * u["x"]).sum()  # t <g, d>
        g_new = grad_and_value(rosenbrock)(new)[0]
        assert rosenbrock(new) <= v + 1e-4 * slope0 + 1e-12
        assert (g_new["x"] * u["x"]).sum().abs() <= 0.9 * slope0.abs() + 1e-12
        assert ((new["x"] - p["x"]) @ (g_new["x"] - g["x"])) > 0
        p = new


def test_zoom_takes_fewer_evaluations_than_backtracking():
    p0 = {"x": torch.full((10,), -1.0, dtype=F64)}
    counts = {}
    for name, search in (("zoom", optim.scale_by_zoom_linesearch()),
                         ("backtracking", optim.scale_by_backtracking_linesearch())):
        params, state, history = run(rosenbrock, p0, optim.lbfgs(linesearch=search), 150)
        torch.testing.assert_close(params["x"], torch.ones(10, dtype=F64), rtol=1e-7,
                                   atol=1e-7)
        done = next(i for i, (v, g, u) in enumerate(history) if g["x"].norm() < 1e-8)
        counts[name] = done
    assert counts["zoom"] <= counts["backtracking"], counts


def test_scale_by_lbfgs_compiles_whole(fresh_dynamo):
    """The memory and the compact-form product are plain tensor ops: one graph."""
    tx = optim.chain(optim.scale_by_lbfgs(memory_size=3), optim.scale(-0.1))
    p = {"w": normal(0, 4), "b": normal(1, 2)}
    step = torch.compile(lambda g, s, p: tx.update(g, s, p), fullgraph=True,
                         backend="aot_eager")
    s_eager = s_comp = tx.init(p)
    for i in range(4):
        g = {"w": normal(2 + i, 4), "b": normal(9 + i, 2)}
        u_comp, s_comp = step(g, s_comp, p)
        u_eager, s_eager = tx.update(g, s_eager, p)
        for k in p:
            torch.testing.assert_close(u_comp[k], u_eager[k], rtol=1e-12, atol=1e-12)
        p = optim.apply_updates(p, u_eager)
