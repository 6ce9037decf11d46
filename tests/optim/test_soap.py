"""SOAP equals pytorch_optimizer's SOAP (the authors' algorithm) step for step, on
matrices, conv kernels, biases and scalars, through several basis refreshes; it
composes with vmap over an ensemble and with schedules; bad input is named."""

import math

import optree
import pytest
import torch
from _optim_problem import assert_trees_close
from hypothesis import assume, given
from hypothesis import strategies as st

from torchfn import optim

po = pytest.importorskip("pytorch_optimizer", reason="pytorch_optimizer is the reference")


def problem(seed=0, steps=25, shapes=None):
    gen = torch.Generator().manual_seed(seed)
    shapes = shapes or {"w": (6, 4), "conv": (5, 3, 2, 2), "b": (4,), "s": ()}
    params = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=gen) * (1 + 0.1 * t)
              for k, s in shapes.items()} for t in range(steps)]
    return params, grads


def run_both(kwargs, ours_kwargs=None, shapes=None, steps=25, seed=0):
    params, grads = problem(seed=seed, steps=steps, shapes=shapes)
    tx = optim.soap(**(ours_kwargs or kwargs))
    state, p = tx.init(params), params
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    ref = po.SOAP(list(leaves.values()), **kwargs)
    for g in grads:
        u, state = tx.update(g, state, p)
        p = optim.apply_updates(p, u)
        for k, leaf in leaves.items():
            leaf.grad = g[k].clone()
        ref.step()
        assert_trees_close(p, {k: v.detach() for k, v in leaves.items()}, rtol=2e-5, atol=2e-6)
    return p, params


@pytest.mark.parametrize("kwargs", [
    dict(lr=1e-2, precondition_frequency=4),
    dict(lr=1e-2, betas=(0.9, 0.99), shampoo_beta=0.8, weight_decay=0.1,
         precondition_frequency=3),
    dict(lr=1e-2, precondition_frequency=5, precondition_1d=True, eps=1e-6),
    dict(lr=1e-2, precondition_frequency=2, max_precondition_dim=4),
], ids=["defaults", "betas_wd", "precondition_1d", "max_dim"])
def test_matches_pytorch_optimizer_step_for_step(kwargs):
    final, start = run_both(kwargs)
    assert not torch.allclose(final["w"], start["w"], atol=1e-2)


def test_the_first_call_only_measures():
    params, grads = problem(steps=1)
    tx = optim.soap(weight_decay=0.1)
    u, state = tx.update(grads[0], tx.init(params), params)
    assert all(bool((x == 0).all()) for x in optree.tree_leaves(u))
    L, R = state.gg["w"]
    g = grads[0]["w"]
    torch.testing.assert_close(L, 0.05 * g @ g.T)
    torch.testing.assert_close(R, 0.05 * g.T @ g)
    QL = state.q["w"][0]
    torch.testing.assert_close(QL.T @ QL, torch.eye(6), atol=1e-5, rtol=0)
    assert state.gg["b"][0].numel() == 0 and state.q["s"] == ()


def test_on_a_diagonal_problem_it_is_adam():
    """When every gradient is diagonal in a fixed basis the eigenbases are that basis
    (up to order and sign), so SOAP's steps are Adam's, delayed by the measuring call."""
    gen = torch.Generator().manual_seed(1)
    gs = [{"w": torch.diag(torch.randn(5, generator=gen).abs() + 0.5) *
           (1 if t % 2 else -1)} for t in range(12)]
    p0 = {"w": torch.zeros(5, 5)}
    soap_tx = optim.soap(1e-2, betas=(0.9, 0.99), weight_decay=0.0, precondition_frequency=3)
    adam_tx = optim.adam(1e-2, betas=(0.9, 0.99))
    s1, s2, p1, p2 = soap_tx.init(p0), adam_tx.init(p0), p0, p0
    u, s1 = soap_tx.update(gs[0], s1, p1)
    for g in gs[1:]:
        u, s1 = soap_tx.update(g, s1, p1)
        p1 = optim.apply_updates(p1, u)
        v, s2 = adam_tx.update(g, s2, p2)
        p2 = optim.apply_updates(p2, v)
    torch.testing.assert_close(p1["w"], p2["w"], atol=1e-6, rtol=1e-5)


def test_schedule_and_tensor_lr_equal_float_lr():
    params, grads = problem(steps=8)
    out = []
    for lr in (1e-2, torch.tensor(1e-2), optim.constant(1e-2)):
        tx = optim.soap(lr, precondition_frequency=3)
        s, p = tx.init(params), params
        for g in grads:
            u, s = tx.update(g, s, p)
            p = optim.apply_updates(p, u)
        out.append(p)
    assert_trees_close(out[1], out[0], rtol=1e-6, atol=1e-7)
    assert_trees_close(out[2], out[0], rtol=1e-6, atol=1e-7)


def test_vmap_over_an_ensemble_equals_a_loop():
    tx = optim.soap(1e-2, precondition_frequency=2)
    members = [problem(seed=s, steps=5, shapes={"w": (4, 3), "b": (3,)}) for s in range(3)]
    stack = lambda trees: optree.tree_map(lambda *x: torch.stack(x), *trees)  # noqa: E731

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optim.apply_updates(p, u), s

    params = [m[0] for m in members]
    states = [tx.init(p) for p in params]
    p_stack, s_stack = stack(params), stack(states)
    for t in range(5):
        p_stack, s_stack = torch.vmap(step)(p_stack, s_stack, stack([m[1][t] for m in members]))
        for i in range(3):
            params[i], states[i] = step(params[i], states[i], members[i][1][t])
    assert_trees_close(p_stack, stack(params), rtol=1e-5, atol=1e-6)


def test_members_at_different_steps_are_refused_under_vmap():
    tx = optim.soap()
    p, grads = problem(steps=1, shapes={"w": (3, 2)})
    s = tx.init(p)
    states = optree.tree_map(lambda *x: torch.stack(x), s, tx.update(grads[0], s, p)[1])
    ps = optree.tree_map(lambda x: torch.stack([x, x]), p)
    gs = optree.tree_map(lambda x: torch.stack([x, x]), grads[0])
    with pytest.raises(ValueError, match="every member's step count must be the same"):
        torch.vmap(lambda p, s, g: tx.update(g, s, p))(ps, states, gs)


@pytest.mark.parametrize("make,match", [
    (lambda: optim.soap(precondition_frequency=0), "precondition_frequency must be >= 1"),
    (lambda: optim.soap(shampoo_beta=1.0), r"shampoo_beta must be in \[0, 1\)"),
    (lambda: optim.soap(max_precondition_dim=0), "max_precondition_dim must be >= 1"),
])
def test_bad_hyperparameters(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_weight_decay_needs_params():
    tx = optim.soap(weight_decay=0.1)
    g = {"w": torch.ones(2, 2)}
    with pytest.raises(ValueError, match="soap with weight_decay"):
        tx.update(g, tx.init(g))


def test_resume_from_a_checkpoint_equals_the_uninterrupted_run(tmp_path):
    """The state (bases, statistics, empty stand-ins, the counter) round-trips through
    torchfn.save / load, and the resumed run is the same to the bit."""
    import torchfn

    params, grads = problem(steps=12)
    tx = optim.soap(1e-2, precondition_frequency=3)

    def run(p, s, gs):
        for g in gs:
            u, s = tx.update(g, s, p)
            p = optim.apply_updates(p, u)
        return p, s

    straight, _ = run(params, tx.init(params), grads)
    p, s = run(params, tx.init(params), grads[:7])
    torchfn.save(tmp_path / "soap.safetensors", {"params": p, "opt": s})
    back = torchfn.load(tmp_path / "soap.safetensors", like={"params": p, "opt": s})
    resumed, _ = run(back["params"], back["opt"], grads[7:])
    assert all(torch.equal(a, b) for a, b in
               zip(optree.tree_leaves(resumed), optree.tree_leaves(straight)))


@given(shape=st.lists(st.integers(1, 5), min_size=0, max_size=4),
       max_dim=st.integers(1, 6), one_d=st.booleans(), freq=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_any_rank_and_dimension_cap_matches_pytorch_optimizer(shape, max_dim, one_d, freq,
                                                              seed):
    """Leaves of rank 0 to 4, any dims against the cap: still the reference's steps.

    Leaves where a preconditioned dim is longer than the product of the others are left
    out: that dim's first Gram matrix is singular (rank <= the product), so the
    eigenvectors of its null space, and with them the step, are set by rounding noise,
    and two correct implementations part there (hypothesis found (1, 5), and (5,) with
    precondition_1d, differing by 0.4% from the first step)."""
    dims = shape if len(shape) > 1 or (one_d and len(shape) == 1) else []
    size = math.prod(shape)
    assume(not any(1 < d <= max_dim and d > size // d for d in dims))
    run_both(dict(lr=1e-2, precondition_frequency=freq, max_precondition_dim=max_dim,
                  precondition_1d=one_d), shapes={"x": tuple(shape), "w": (3, 2)}, steps=7,
             seed=seed)
