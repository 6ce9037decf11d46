"""Optimizers equal torch.optim (and torchopt) after 100 steps; Lion equals its paper's rule."""

import optree
import pytest
import torch
import torchopt
from _optim_problem import (
    assert_trees_close,
    grads_at,
    loss_fn,
    make_data,
    run_ours,
    run_torch,
    run_torchopt,
)

from torchfn import optim

ORACLES = [
    ("adam", optim.adam(1e-2), torch.optim.Adam, dict(lr=1e-2)),
    (
        "adam_wd",
        optim.adam(3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
        torch.optim.Adam,
        dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    ),
    ("adamw", optim.adamw(1e-2, weight_decay=0.05), torch.optim.AdamW,
     dict(lr=1e-2, weight_decay=0.05)),
    ("sgd", optim.sgd(0.1), torch.optim.SGD, dict(lr=0.1)),
    ("sgd_momentum", optim.sgd(0.05, momentum=0.9), torch.optim.SGD,
     dict(lr=0.05, momentum=0.9)),
    ("sgd_dampening", optim.sgd(0.05, momentum=0.9, dampening=0.3), torch.optim.SGD,
     dict(lr=0.05, momentum=0.9, dampening=0.3)),
    ("sgd_nesterov_wd", optim.sgd(0.05, momentum=0.8, nesterov=True, weight_decay=0.01),
     torch.optim.SGD, dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.01)),
    ("sgd_wd", optim.sgd(0.1, weight_decay=0.1), torch.optim.SGD,
     dict(lr=0.1, weight_decay=0.1)),
    ("rmsprop", optim.rmsprop(1e-3), torch.optim.RMSprop, dict(lr=1e-3)),
    (
        "rmsprop_centered_momentum_wd",
        optim.rmsprop(1e-3, alpha=0.9, eps=1e-6, weight_decay=0.01, momentum=0.5, centered=True),
        torch.optim.RMSprop,
        dict(lr=1e-3, alpha=0.9, eps=1e-6, weight_decay=0.01, momentum=0.5, centered=True),
    ),
    ("adagrad", optim.adagrad(0.05), torch.optim.Adagrad, dict(lr=0.05)),
    (
        "adagrad_decay_init",
        optim.adagrad(0.05, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1),
        torch.optim.Adagrad,
        dict(lr=0.05, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1),
    ),
]


@pytest.mark.parametrize("name,tx,opt_cls,kwargs", ORACLES, ids=[o[0] for o in ORACLES])
def test_matches_torch_optim_after_100_steps(name, tx, opt_cls, kwargs):
    ours = run_ours(tx)
    ref = run_torch(opt_cls, **kwargs)
    start, _, _ = make_data()
    assert not torch.allclose(ref["w"], start["w"])  # the run moved the params
    assert_trees_close(ours, ref)


TORCHOPT = [
    ("adam", optim.adam(1e-2, weight_decay=0.01), torchopt.adam(1e-2, weight_decay=0.01)),
    ("adamw", optim.adamw(1e-2, weight_decay=0.05), torchopt.adamw(1e-2, weight_decay=0.05)),
    ("sgd_momentum", optim.sgd(0.05, momentum=0.9, nesterov=True),
     torchopt.sgd(0.05, momentum=0.9, nesterov=True)),
    ("adagrad", optim.adagrad(0.05, lr_decay=0.01), torchopt.adagrad(0.05, lr_decay=0.01)),
]


@pytest.mark.parametrize("name,ours,theirs", TORCHOPT, ids=[o[0] for o in TORCHOPT])
def test_matches_torchopt_functional(name, ours, theirs):
    # torchopt computes Adam's bias corrections in float32 (torch.optim and we use
    # float64), so after 100 steps it sits ~5e-6 from torch.optim; we sit ~1e-7 from it.
    ref = run_torch(torch.optim.Adam, lr=1e-2, weight_decay=0.01) if name == "adam" else None
    ours_p, theirs_p = run_ours(ours), run_torchopt(theirs)
    assert_trees_close(ours_p, theirs_p, rtol=1e-4, atol=2e-5)
    if ref is not None:
        assert_trees_close(ours_p, ref, rtol=1e-5, atol=1e-6)


def _lion_reference(steps, lr, b1, b2, wd):
    params, xs, ys = make_data(steps=steps, dtype=torch.float64)
    m = optree.tree_map(torch.zeros_like, params)
    for t in range(steps):
        g = grads_at(params, xs[t], ys[t])

        def step(p, m_, g_):
            c = b1 * m_ + (1 - b1) * g_
            return p - lr * (torch.sign(c) + wd * p)

        params, m = (
            optree.tree_map(step, params, m, g),
            optree.tree_map(lambda m_, g_: b2 * m_ + (1 - b2) * g_, m, g),
        )
    return params


def test_lion_matches_float64_reference():
    steps, lr, b1, b2, wd = 100, 1e-3, 0.9, 0.99, 0.1
    params, xs, ys = make_data(steps=steps, dtype=torch.float64)
    tx = optim.lion(lr, betas=(b1, b2), weight_decay=wd)
    state = tx.init(params)
    for t in range(steps):
        updates, state = tx.update(grads_at(params, xs[t], ys[t]), state, params)
        params = optim.apply_updates(params, updates)
    assert_trees_close(params, _lion_reference(steps, lr, b1, b2, wd), rtol=1e-12, atol=1e-12)


def test_schedule_lr_matches_torch_scheduler():
    sched = optim.step_lr(1e-2, step_size=10, gamma=0.5)
    ours = run_ours(optim.adam(sched))
    ref = run_torch(
        torch.optim.Adam,
        lr=1e-2,
        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=10, gamma=0.5),
    )
    assert_trees_close(ours, ref)


@pytest.mark.parametrize("make", [optim.adam, optim.sgd, optim.rmsprop, optim.adagrad, optim.lion])
def test_tensor_lr_equals_float_lr(make):
    a = run_ours(make(torch.tensor(1e-3)), steps=10)
    b = run_ours(make(1e-3), steps=10)
    assert_trees_close(a, b, rtol=1e-6, atol=1e-7)


def test_update_is_pure():
    params, xs, ys = make_data()
    grads = grads_at(params, xs[0], ys[0])
    for tx in [optim.adamw(1e-2), optim.sgd(0.1, momentum=0.9, weight_decay=0.1),
               optim.rmsprop(1e-2, momentum=0.5, centered=True), optim.adagrad(0.1),
               optim.lion(1e-3, weight_decay=0.1)]:
        state = tx.init(params)
        _, state = tx.update(grads, state, params)  # non-zero moments
        snapshot = [x.clone() for x in optree.tree_leaves((params, grads, state))]
        updates, new_state = tx.update(grads, state, params)
        new_params = optim.apply_updates(params, updates)
        after = optree.tree_leaves((params, grads, state))
        assert all(torch.equal(a, b) for a, b in zip(snapshot, after))
        assert not torch.equal(new_params["w"], params["w"])
        assert int(new_state.count) == 2


def test_chain_with_torchopt_transforms_both_ways():
    params, xs, ys = make_data()
    grads = grads_at(params, xs[0], ys[0])
    g_before = [x.clone() for x in optree.tree_leaves(grads)]
    ours = optim.chain(optim.clip_by_global_norm(0.1), torchopt.transform.scale(-0.5))
    u, _ = ours.update(grads, ours.init(params), params)
    clipped, _ = optim.clip_by_global_norm(0.1).update(grads, ())
    assert_trees_close(u, optree.tree_map(lambda g: -0.5 * g, clipped), rtol=1e-6, atol=0)
    # torchopt's chain (which passes inplace=True) with our transform inside
    theirs = torchopt.chain(torchopt.transform.scale(2.0), optim.sgd(0.1))
    u2, _ = theirs.update(grads, theirs.init(params), params=params, inplace=False)
    assert_trees_close(u2, optree.tree_map(lambda g: -0.2 * g, grads), rtol=1e-6, atol=0)
    assert isinstance(optim.adam(), torchopt.base.GradientTransformation)
    # the torchopt transform inside our chain did not mutate the caller's grads
    assert all(torch.equal(a, b) for a, b in zip(g_before, optree.tree_leaves(grads)))


def test_chain_method_and_state_layout():
    tx = optim.clip_by_global_norm(1.0).chain(optim.adam(1e-3))
    params, xs, ys = make_data()
    state = tx.init(params)
    assert isinstance(state, tuple) and isinstance(state[1], optim.AdamState)
    u, _ = tx.update(grads_at(params, xs[0], ys[0]), state, params)
    assert optree.tree_structure(u) == optree.tree_structure(params)


# ------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: optim.adam(-0.1), "lr must be >= 0, got -0.1"),
        (lambda: optim.sgd(-1.0), "lr must be >= 0"),
        (lambda: optim.adam(betas=(0.9, 1.0)), r"betas\[1\] must be in \[0, 1\)"),
        (lambda: optim.adam(betas=0.9), "betas must be a pair"),
        (lambda: optim.adamw(weight_decay=-1), "weight_decay must be >= 0"),
        (lambda: optim.sgd(0.1, momentum=1.5), r"momentum must be in \[0, 1\)"),
        (lambda: optim.sgd(0.1, nesterov=True), "nesterov=True needs momentum > 0"),
        (lambda: optim.rmsprop(alpha=-0.1), "alpha must be in"),
        (lambda: optim.adagrad(eps=-1.0), "eps must be >= 0"),
        (lambda: optim.lion(betas=(1.2, 0.9)), r"betas\[0\]"),
        (lambda: optim.adam(torch.ones(2)), "lr must be a scalar"),
    ],
)
def test_bad_hyperparameters(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_hyperparameter_type():
    with pytest.raises(TypeError, match="lr must be a real number"):
        optim.adam("0.1")


def test_mismatched_grads_name_both_structures():
    params = {"w": torch.ones(2), "b": torch.ones(2)}
    tx = optim.adam()
    state = tx.init(params)
    with pytest.raises(ValueError, match="different tree structures") as err:
        tx.update({"w": torch.ones(2), "x": torch.ones(2)}, state)
    assert "'x'" in str(err.value) and "'b'" in str(err.value)
    with pytest.raises(ValueError, match="params and grads have different tree structures"):
        optim.sgd(0.1, weight_decay=0.1).update(params, optim.sgd(0.1, weight_decay=0.1)
                                                .init(params), {"w": torch.ones(2)})
    with pytest.raises(ValueError, match="updates and params have different"):
        optim.apply_updates(params, {"w": torch.ones(2)})


def test_weight_decay_without_params_is_an_error():
    tx = optim.adamw(1e-3, weight_decay=0.1)
    g = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match="needs params"):
        tx.update(g, tx.init(g))


def test_wrong_state_is_an_error():
    g = {"w": torch.ones(2)}
    with pytest.raises(TypeError, match="state must be a AdamState"):
        optim.adam().update(g, optim.sgd().init(g))
    with pytest.raises(ValueError, match="state tuple of length 2"):
        optim.chain(optim.scale(1.0), optim.scale(2.0)).update(g, ())
    with pytest.raises(TypeError, match="chain\\(\\) argument 1"):
        optim.chain(optim.scale(1.0), object())


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_differentiable_through_update_like_torchopt(name):
    """d loss(theta - step(theta)) / d theta through our update equals the same through
    torchopt's differentiable update, with autograd (foreach path) and torch.func.grad."""
    params, xs, ys = make_data(dtype=torch.float64)
    ours = optim.sgd(0.1, momentum=0.9) if name == "sgd" else optim.adam(0.1)
    theirs = torchopt.sgd(0.1, momentum=0.9) if name == "sgd" else torchopt.adam(0.1)

    def inner_then_loss(p, tx, apply):
        state = tx.init(p)
        for t in range(2):
            g = torch.func.grad(loss_fn)(p, xs[t], ys[t])
            u, state = tx.update(g, state, params=p, **({} if apply is optim.apply_updates
                                                         else {"inplace": False}))
            p = apply(p, u) if apply is optim.apply_updates else apply(p, u, inplace=False)
        return loss_fn(p, xs[2], ys[2])

    ref = torch.func.grad(inner_then_loss)(params, theirs, torchopt.apply_updates)
    got_func = torch.func.grad(inner_then_loss)(params, ours, optim.apply_updates)
    leaves = optree.tree_map(lambda x: x.clone().requires_grad_(True), params)
    got_autograd = torch.autograd.grad(
        inner_then_loss(leaves, ours, optim.apply_updates), optree.tree_leaves(leaves)
    )
    # torchopt's Adam bias corrections are float32 even for float64 params (~5e-5 relative)
    tol = dict(rtol=1e-9, atol=1e-12) if name == "sgd" else dict(rtol=2e-4, atol=1e-8)
    assert_trees_close(got_func, ref, **tol)
    for a, b in zip(got_autograd, optree.tree_leaves(got_func)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)
