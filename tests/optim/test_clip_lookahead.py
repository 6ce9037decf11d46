"""Value clipping equals ``clip_grad_value_``, AGC equals its per-unit formula (timm's),
and Lookahead equals its algorithm run by hand, in float64."""

import optree
import pytest
import torch
from _optim_problem import assert_trees_close, grads_at, make_data, run_ours
from hypothesis import given
from hypothesis import strategies as st

from torchfn import optim


@given(seed=st.integers(0, 2**16), max_delta=st.floats(0.0, 2.0))
def test_clip_equals_clip_grad_value(seed, max_delta):
    gen = torch.Generator().manual_seed(seed)
    grads = {"a": torch.randn(5, 3, generator=gen), "b": [torch.randn(4, generator=gen)]}
    ours, _ = optim.clip(max_delta).update(grads, ())
    leaves = [torch.zeros_like(g, requires_grad=True) for g in optree.tree_leaves(grads)]
    for p, g in zip(leaves, optree.tree_leaves(grads)):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_value_(leaves, max_delta)
    assert_trees_close(ours, optree.tree_unflatten(optree.tree_structure(grads),
                                                   [p.grad for p in leaves]), rtol=0, atol=0)


def _agc_reference(g, p, clipping, eps):
    """Per output unit: g * min(1, clipping * max(||p_u||, eps) / ||g_u||)."""
    if g.ndim <= 1:
        units_g, units_p = [g.reshape(-1)], [p.reshape(-1)]
    else:
        units_g, units_p = list(g.reshape(g.shape[0], -1)), list(p.reshape(p.shape[0], -1))
    rows = []
    for gu, pu in zip(units_g, units_p):
        max_norm = clipping * max(float(pu.norm()), eps)
        gn = float(gu.norm())
        rows.append(gu if gn < max_norm else gu * (max_norm / max(gn, 1e-6)))
    return torch.stack(rows).reshape(g.shape)


@given(seed=st.integers(0, 2**16), clipping=st.floats(0.001, 1.0))
def test_adaptive_grad_clip_equals_per_unit_formula(seed, clipping):
    gen = torch.Generator().manual_seed(seed)
    shapes = {"conv": (4, 3, 2, 2), "linear": (5, 6), "bias": (5,), "scalar": ()}
    params = {k: torch.randn(s, generator=gen, dtype=torch.float64) for k, s in shapes.items()}
    params["linear"][0] = 0.0  # a dead unit: its norm is floored at eps
    grads = {k: torch.randn(s, generator=gen, dtype=torch.float64) * 3 for k, s in shapes.items()}
    tx = optim.adaptive_grad_clip(clipping, eps=1e-3)
    ours, _ = tx.update(grads, tx.init(params), params)
    for k in shapes:
        torch.testing.assert_close(ours[k], _agc_reference(grads[k], params[k], clipping, 1e-3))


def _lookahead_reference(steps, lr, momentum, k, alpha):
    params, xs, ys = make_data(steps=steps, dtype=torch.float64)
    slow = optree.tree_map(torch.clone, params)
    buf = optree.tree_map(torch.zeros_like, params)
    for t in range(1, steps + 1):
        g = grads_at(params, xs[t - 1], ys[t - 1])
        first = t == 1
        buf = optree.tree_map(lambda b, g_, f=first: g_.clone() if f else momentum * b + g_,
                              buf, g)
        params = optree.tree_map(lambda p, b: p - lr * b, params, buf)
        if t % k == 0:
            slow = optree.tree_map(lambda s, p: s + alpha * (p - s), slow, params)
            params = optree.tree_map(torch.clone, slow)
    return params


@pytest.mark.parametrize("k,alpha", [(5, 0.5), (3, 0.8), (1, 1.0)])
def test_lookahead_equals_its_algorithm(k, alpha):
    steps, lr, momentum = 23, 0.05, 0.9  # 23: ends between two syncs
    params, xs, ys = make_data(steps=steps, dtype=torch.float64)
    tx = optim.lookahead(optim.sgd(lr, momentum=momentum), sync_period=k, slow_step_size=alpha)
    state = tx.init(params)
    for t in range(steps):
        updates, state = tx.update(grads_at(params, xs[t], ys[t]), state, params)
        params = optim.apply_updates(params, updates)
    assert_trees_close(params, _lookahead_reference(steps, lr, momentum, k, alpha),
                       rtol=1e-12, atol=1e-12)
    if k == 1 and alpha == 1.0:  # lookahead with k = 1, alpha = 1 is the inner optimizer
        plain = run_ours(optim.sgd(lr, momentum=momentum), steps=steps)
        ours = run_ours(optim.lookahead(optim.sgd(lr, momentum=momentum), 1, 1.0), steps=steps)
        assert_trees_close(ours, plain, rtol=1e-6, atol=1e-6)


def test_lookahead_vmaps_and_compiles():
    params, xs, ys = make_data(steps=6)
    tx = optim.lookahead(optim.adam(1e-2), sync_period=2)
    stack = lambda trees: optree.tree_map(lambda *x: torch.stack(x), *trees)  # noqa: E731
    members = [optree.tree_map(lambda p, i=i: p * (1 + 0.1 * i), params) for i in range(2)]
    states = [tx.init(m) for m in members]
    p_stack, s_stack = stack(members), stack(states)

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optim.apply_updates(p, u), s

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    for t in range(6):
        grads = [grads_at(m, xs[t], ys[t]) for m in members]
        p_stack, s_stack = torch.vmap(step)(p_stack, s_stack, stack(grads))
        members[0], states[0] = compiled(members[0], states[0], grads[0])
        members[1], states[1] = step(members[1], states[1], grads[1])
    assert_trees_close(p_stack, stack(members), rtol=1e-6, atol=1e-6)


def test_bad_input():
    with pytest.raises(ValueError, match="max_delta must be >= 0"):
        optim.clip(-1.0)
    with pytest.raises(ValueError, match="clipping must be >= 0"):
        optim.adaptive_grad_clip(-0.1)
    with pytest.raises(ValueError, match="adaptive_grad_clip needs params"):
        tx = optim.adaptive_grad_clip()
        tx.update({"w": torch.ones(2)}, tx.init(None))
    with pytest.raises(ValueError, match="sync_period must be >= 1, got 0"):
        optim.lookahead(optim.sgd(0.1), sync_period=0)
    with pytest.raises(ValueError, match=r"slow_step_size must be in \[0, 1\], got 1.5"):
        optim.lookahead(optim.sgd(0.1), slow_step_size=1.5)
    with pytest.raises(TypeError, match="inner must be a gradient transformation, got float"):
        optim.lookahead(0.1)
    tx = optim.lookahead(optim.sgd(0.1))
    with pytest.raises(ValueError, match="lookahead needs params"):
        tx.update({"w": torch.ones(2)}, tx.init({"w": torch.ones(2)}))
