"""Gradient transformations: each equals the loop / reference it replaces."""

import optree
import pytest
import torch
from _optim_problem import assert_trees_close, grads_at, loss_fn, make_data
from hypothesis import given
from hypothesis import strategies as st

from torchfn import optim


def _grads(seed=0):
    params, xs, ys = make_data(seed)
    return params, grads_at(params, xs[0], ys[0])


# ------------------------------------------------------------------ clipping


@given(max_norm=st.floats(1e-3, 10.0), scale=st.floats(1e-2, 1e2), seed=st.integers(0, 100))
def test_clip_by_global_norm_equals_clip_grad_norm_(max_norm, scale, seed):
    params, grads = _grads(seed)
    grads = optree.tree_map(lambda g: g * scale, grads)
    tx = optim.clip_by_global_norm(max_norm)
    ours, _ = tx.update(grads, tx.init(params))
    leaves = [p.clone().requires_grad_(True) for p in optree.tree_leaves(params)]
    for p, g in zip(leaves, optree.tree_leaves(grads)):
        p.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(leaves, max_norm)
    torch.testing.assert_close(optim.global_norm(grads), total)
    for u, p in zip(optree.tree_leaves(ours), leaves):
        torch.testing.assert_close(u, p.grad, rtol=0, atol=0)


# ------------------------------------------------------------------ groups


def test_decay_mask_by_ndim_and_name():
    params = {
        "layers": [{"weight": torch.ones(3, 3), "bias": torch.ones(3)}],
        "norm": {"weight": torch.ones(3)},
        "embed_norm_proj": torch.ones(3, 3),
    }
    mask = optim.decay_mask(params)
    assert mask == {
        "layers": [{"weight": True, "bias": False}],
        "norm": {"weight": False},
        "embed_norm_proj": False,
    }
    assert optim.decay_mask(params, exclude=())["embed_norm_proj"] is True


def test_adamw_mask_equals_torch_param_groups():
    params, xs, ys = make_data()
    tx = optim.adamw(1e-2, weight_decay=0.1, mask=optim.decay_mask)
    p = params
    state = tx.init(p)
    for t in range(20):
        u, state = tx.update(grads_at(p, xs[t], ys[t]), state, p)
        p = optim.apply_updates(p, u)
    w, b, n = (x.clone().requires_grad_(True) for x in (params["w"], params["b"], params["net"][0]))
    opt = torch.optim.AdamW(
        [{"params": [w, n], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}], lr=1e-2
    )
    for t in range(20):
        opt.zero_grad()
        loss_fn({"w": w, "b": b, "net": [n]}, xs[t], ys[t]).backward()
        opt.step()
    assert_trees_close(p, {"w": w.detach(), "b": b.detach(), "net": [n.detach()]})


def test_masked_applies_inner_only_where_true():
    params, grads = _grads()
    mask = {"w": True, "b": False, "net": [True]}
    tx = optim.masked(optim.adam(1e-2), mask)
    u, state = tx.update(grads, tx.init(params), params)
    ref_tx = optim.adam(1e-2)
    sub = {"w": grads["w"], "net": grads["net"]}
    ref, _ = ref_tx.update(sub, ref_tx.init(sub))
    torch.testing.assert_close(u["w"], ref["w"])
    torch.testing.assert_close(u["net"][0], ref["net"][0])
    assert u["b"] is grads["b"]  # passed through untouched
    assert state.inner_state.mu["b"] is None  # no moments for masked-out leaves
    # a callable mask gives the same result
    u2, _ = optim.masked(optim.adam(1e-2), lambda p: optree.tree_map(lambda x: x.ndim >= 2, p)
                         ).update(grads, tx.init(params), params)
    assert_trees_close(u, u2, rtol=0, atol=0)


def test_partition_equals_separate_optimizers_and_torch_param_groups():
    params, xs, ys = make_data()
    labels = {"w": "body", "b": "body", "net": ["head"]}
    tx = optim.partition({"body": optim.sgd(0.05, momentum=0.9), "head": optim.adam(1e-2)}, labels)
    p, state = params, tx.init(params)
    for t in range(20):
        u, state = tx.update(grads_at(p, xs[t], ys[t]), state, p)
        p = optim.apply_updates(p, u)
    w, b, n = (x.clone().requires_grad_(True) for x in (params["w"], params["b"], params["net"][0]))
    sgd = torch.optim.SGD([w, b], lr=0.05, momentum=0.9)
    adam = torch.optim.Adam([n], lr=1e-2)
    for t in range(20):
        sgd.zero_grad()
        adam.zero_grad()
        loss_fn({"w": w, "b": b, "net": [n]}, xs[t], ys[t]).backward()
        sgd.step()
        adam.step()
    assert_trees_close(p, {"w": w.detach(), "b": b.detach(), "net": [n.detach()]})


def test_freeze_zeroes_frozen_updates():
    params, grads = _grads()
    tx = optim.chain(optim.freeze({"w": True, "b": False, "net": [False]}), optim.adam(1e-2))
    u, _ = tx.update(grads, tx.init(params), params)
    assert torch.count_nonzero(u["w"]) == 0
    assert torch.count_nonzero(u["b"]) == u["b"].numel()


def test_group_bad_input():
    params, grads = _grads()
    with pytest.raises(ValueError, match="mask must be a tree of bools with the params' struct"):
        optim.masked(optim.sgd(0.1), {"w": True}).init(params)
    with pytest.raises(TypeError, match="mask leaves must be Python bools"):
        optim.freeze(optree.tree_map(lambda p: 1, params)).init(params)
    with pytest.raises(ValueError, match=r"labels \['x'\] have no transformation"):
        optim.partition({"a": optim.sgd(0.1)}, optree.tree_map(lambda p: "x", params)).init(params)
    with pytest.raises(TypeError, match="transforms must be a non-empty dict"):
        optim.partition({}, {})
    with pytest.raises(TypeError, match="inner must be a GradientTransformation"):
        optim.masked(lambda g: g, {})


# ------------------------------------------------------------------ accumulation


@pytest.mark.parametrize("k", [1, 3])
def test_multi_steps_equals_big_batch_adam(k):
    """K micro-batches of 8 == one step on the batch of 8K, for 4 big steps."""
    params, xs, ys = make_data(steps=4 * k)
    big_x = xs.reshape(4, k * 16, 6)
    big_y = ys.reshape(4, k * 16, 3)
    ref_tx, ref_p = optim.adam(1e-2), params
    ref_state = ref_tx.init(params)
    for t in range(4):
        u, ref_state = ref_tx.update(grads_at(ref_p, big_x[t], big_y[t]), ref_state)
        ref_p = optim.apply_updates(ref_p, u)
    tx, p = optim.multi_steps(optim.adam(1e-2), every_k=k), params
    state = tx.init(params)
    for t in range(4 * k):
        u, state = tx.update(grads_at(p, xs[t], ys[t]), state)
        emitted = (t + 1) % k == 0
        assert bool(torch.count_nonzero(u["w"]) > 0) == emitted
        p = optim.apply_updates(p, u)
    assert int(state.gradient_step) == 4 and int(state.mini_step) == 0
    assert_trees_close(p, ref_p, rtol=1e-5, atol=1e-6)


def test_multi_steps_bad_every_k():
    with pytest.raises(ValueError, match="every_k must be >= 1, got 0"):
        optim.multi_steps(optim.adam(), every_k=0)
    with pytest.raises(TypeError, match="every_k must be an int"):
        optim.multi_steps(optim.adam(), every_k=2.0)


# ------------------------------------------------------------------ non-finite


@given(pattern=st.lists(st.booleans(), min_size=1, max_size=12), max_err=st.integers(0, 3))
def test_apply_if_finite_skips_and_counts(pattern, max_err):
    """Equals a Python loop that applies sgd-momentum only on accepted steps."""
    params, grads = _grads()
    tx = optim.apply_if_finite(optim.sgd(0.1, momentum=0.9), max_consecutive_errors=max_err)
    ref = optim.sgd(0.1, momentum=0.9)
    state, ref_state = tx.init(params), ref.init(params)
    consecutive = total = 0
    for finite in pattern:
        g = grads if finite else optree.tree_map(lambda x: x.clone().fill_(float("nan")), grads)
        u, state = tx.update(g, state)
        consecutive = 0 if finite else consecutive + 1
        total += not finite
        if finite or consecutive > max_err:
            ref_u, ref_state = ref.update(g, ref_state)
            assert_trees_close(u, ref_u, rtol=0, atol=0, equal_nan=True)
        else:
            assert all(torch.count_nonzero(x) == 0 for x in optree.tree_leaves(u))
        assert int(state.notfinite_count) == consecutive
        assert int(state.total_notfinite) == total
        assert bool(state.last_finite) == finite


# ------------------------------------------------------------------ hyperparams


def test_inject_hyperparams_equals_plain_and_can_be_changed():
    params, xs, ys = make_data()
    tx = optim.inject_hyperparams(optim.adam)(lr=1e-2, betas=(0.9, 0.99))
    ref = optim.adam(1e-2, betas=(0.9, 0.99))
    s, rs = tx.init(params), ref.init(params)
    assert set(s.hyperparams) == {"lr", "betas"}
    g = grads_at(params, xs[0], ys[0])
    u, s = tx.update(g, s)
    ru, rs = ref.update(g, rs)
    assert_trees_close(u, ru, rtol=2e-5, atol=1e-8)  # float32 hyperparameters
    s = s._replace(hyperparams={**s.hyperparams, "lr": torch.tensor(2e-2)})
    u, s = tx.update(g, s)
    ru, rs = ref.update(g, rs)
    assert_trees_close(u, optree.tree_map(lambda x: 2 * x, ru), rtol=2e-5, atol=1e-8)


def test_inject_hyperparams_schedule_is_stored():
    tx = optim.inject_hyperparams(optim.sgd)(lr=optim.exponential_lr(1.0, 0.5), momentum=0.5)
    g = {"w": torch.ones(2)}
    s = tx.init(g)
    for t in range(3):
        u, s = tx.update(g, s)
        assert float(s.hyperparams["lr"]) == 0.5**t
    assert int(s.count) == 3


def test_inject_hyperparams_vmap_ensemble_equals_loop():
    """vmap over a stacked state with different lrs == a Python loop over members."""
    lrs = torch.tensor([1e-3, 1e-2, 3e-2])
    params, xs, ys = make_data()
    members = [optree.tree_map(lambda p, i=i: p * (1 + 0.1 * i), params) for i in range(3)]
    tx = optim.inject_hyperparams(optim.adamw)(lr=1e-3, weight_decay=0.01)

    def member_state(i):
        s = tx.init(members[i])
        return s._replace(hyperparams={**s.hyperparams, "lr": lrs[i]})

    states = [member_state(i) for i in range(3)]
    stack = lambda trees: optree.tree_map(lambda *x: torch.stack(x), *trees)  # noqa: E731
    p_stack, s_stack = stack(members), stack(states)

    def step(p, s, x, y):
        u, s = tx.update(grads_of(p, x, y), s, p)
        return optim.apply_updates(p, u), s

    grads_of = torch.func.grad(loss_fn)
    for t in range(3):
        vstep = torch.vmap(step, in_dims=(0, 0, None, None))
        p_stack, s_stack = vstep(p_stack, s_stack, xs[t], ys[t])
        for i in range(3):
            members[i], states[i] = step(members[i], states[i], xs[t], ys[t])
    assert_trees_close(p_stack, stack(members), rtol=1e-6, atol=1e-7)
    assert_trees_close(s_stack, stack(states), rtol=1e-6, atol=1e-7)
    assert not torch.allclose(p_stack["w"][0] / 1.0, p_stack["w"][2] / 1.2)  # lrs differed


def test_inject_hyperparams_bad_input():
    with pytest.raises(ValueError, match="lr must be >= 0"):
        optim.inject_hyperparams(optim.adam)(lr=-1.0)
    with pytest.raises(TypeError, match="opt_factory must be a callable"):
        optim.inject_hyperparams(3)
    with pytest.raises(TypeError, match="argument 'mask' is callable, so it is treated as a sch"):
        optim.inject_hyperparams(optim.adamw)(mask=optim.decay_mask)


# ------------------------------------------------------------------ elementary + ema


def test_ema_params_equals_torch_swa_utils():
    params, xs, ys = make_data()
    avg = optree.tree_map(torch.clone, params)
    ema_fn = torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
    ref = [p.clone() for p in optree.tree_leaves(params)]
    for t in range(5):
        params = optree.tree_map(lambda p, t=t: p + 0.1 * xs[t, 0, 0], params)
        avg = optim.ema_params(avg, params, decay=0.9)
        ema_fn(ref, optree.tree_leaves(params), torch.tensor(t))
    for a, r in zip(optree.tree_leaves(avg), ref):
        torch.testing.assert_close(a, r)


def test_ema_transform_debiased_equals_mean_of_constant_stream():
    g = {"w": torch.tensor([1.0, -2.0])}
    tx = optim.ema(0.7, debias=True)
    s = tx.init(g)
    for _ in range(4):
        u, s = tx.update(g, s)
        torch.testing.assert_close(u["w"], g["w"])  # the debiased EMA of a constant is it
    u_raw, _ = optim.ema(0.7, debias=False).update(g, optim.ema(0.7).init(g))
    torch.testing.assert_close(u_raw["w"], 0.3 * g["w"])


def test_chain_of_parts_equals_sgd_with_schedule_and_l2():
    params, xs, ys = make_data()
    sched = optim.cosine_annealing(0.1, t_max=20)
    parts = optim.chain(
        optim.add_decayed_weights(0.01), optim.scale_by_schedule(sched), optim.scale(-1.0)
    )
    whole = optim.sgd(sched, weight_decay=0.01)
    p1 = p2 = params
    s1, s2 = parts.init(params), whole.init(params)
    for t in range(10):
        u1, s1 = parts.update(grads_at(p1, xs[t], ys[t]), s1, p1)
        u2, s2 = whole.update(grads_at(p2, xs[t], ys[t]), s2, p2)
        p1, p2 = optim.apply_updates(p1, u1), optim.apply_updates(p2, u2)
    assert_trees_close(p1, p2, rtol=1e-6, atol=1e-7)


def test_elementary_bad_input():
    with pytest.raises(ValueError, match=r"decay must be in \[0, 1\), got 1.0"):
        optim.ema(1.0)
    with pytest.raises(ValueError, match="decay must be in"):
        optim.ema_params({}, {}, decay=-0.1)
    with pytest.raises(ValueError, match="max_norm must be >= 0"):
        optim.clip_by_global_norm(-1.0)
    with pytest.raises(TypeError, match="schedule must be a function"):
        optim.scale_by_schedule(0.1)
    with pytest.raises(ValueError, match="max_consecutive_errors must be >= 0"):
        optim.apply_if_finite(optim.sgd(), -1)


def test_groups_accept_torchopt_transforms():
    import torchopt

    params, grads = _grads()
    labels = {"w": "a", "b": "b", "net": ["a"]}
    tx = optim.partition({"a": torchopt.adam(1e-2), "b": optim.sgd(0.1)}, labels)
    u, _ = tx.update(grads, tx.init(params), params)
    ref = torchopt.adam(1e-2)
    ru, _ = ref.update(grads, ref.init(params), inplace=False)
    torch.testing.assert_close(u["w"], ru["w"])
    torch.testing.assert_close(u["b"], -0.1 * grads["b"])
