"""NAdam, RAdam, Adamax, Adadelta, Adafactor and Muon equal torch.optim's; LAMB equals
its float64 formula (optax's); all of them (and the schedule-free pair) compose with
vmap, compile, schedules and tensor lrs."""

import math

import optree
import pytest
import torch
from _optim_problem import (
    assert_trees_close,
    grads_at,
    loss_fn,
    make_data,
    random_tree,
    run_ours,
    run_torch,
)
from hypothesis import given
from hypothesis import strategies as st

from torchfn import optim

ORACLES = [
    ("nadam", optim.nadam(1e-2), torch.optim.NAdam, dict(lr=1e-2)),
    ("nadam_l2", optim.nadam(1e-2, betas=(0.8, 0.99), weight_decay=0.1, momentum_decay=0.01),
     torch.optim.NAdam,
     dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1, momentum_decay=0.01)),
    ("nadamw", optim.nadam(1e-2, weight_decay=0.1, decoupled_weight_decay=True),
     torch.optim.NAdam, dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)),
    ("radam", optim.radam(1e-2), torch.optim.RAdam, dict(lr=1e-2)),
    ("radam_l2", optim.radam(1e-2, eps=1e-6, weight_decay=0.05), torch.optim.RAdam,
     dict(lr=1e-2, eps=1e-6, weight_decay=0.05)),
    ("radamw", optim.radam(1e-2, betas=(0.9, 0.99), weight_decay=0.1,
                           decoupled_weight_decay=True),
     torch.optim.RAdam,
     dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, decoupled_weight_decay=True)),
    ("adamax", optim.adamax(1e-2), torch.optim.Adamax, dict(lr=1e-2)),
    ("adamax_l2", optim.adamax(1e-2, betas=(0.8, 0.9), eps=1e-4, weight_decay=0.01),
     torch.optim.Adamax, dict(lr=1e-2, betas=(0.8, 0.9), eps=1e-4, weight_decay=0.01)),
    ("adadelta", optim.adadelta(), torch.optim.Adadelta, dict()),
    ("adadelta_l2", optim.adadelta(0.5, rho=0.8, eps=1e-5, weight_decay=0.01),
     torch.optim.Adadelta, dict(lr=0.5, rho=0.8, eps=1e-5, weight_decay=0.01)),
    ("adafactor", optim.adafactor(), torch.optim.Adafactor, dict()),
    ("adafactor_wd", optim.adafactor(0.05, beta2_decay=-0.5, eps=(1e-20, 1e-3), d=2.0,
                                     weight_decay=0.1),
     torch.optim.Adafactor,
     dict(lr=0.05, beta2_decay=-0.5, eps=(1e-20, 1e-3), d=2.0, weight_decay=0.1)),
]


@pytest.mark.parametrize("name,tx,opt_cls,kwargs", ORACLES, ids=[o[0] for o in ORACLES])
def test_matches_torch_optim_after_100_steps(name, tx, opt_cls, kwargs):
    ours = run_ours(tx)
    ref = run_torch(opt_cls, **kwargs)
    start, _, _ = make_data()
    assert not torch.allclose(ref["w"], start["w"], atol=1e-2)  # the run moved the params
    assert_trees_close(ours, ref, rtol=1e-5, atol=1e-5)


def _run_against_torch(tx, opt, params, grads_seq):
    """Our updates and ``opt.step()`` on clones of ``params``; both final params."""
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    torch_opt = opt(list(leaves.values()))
    state = tx.init(params)
    for grads in grads_seq:
        updates, state = tx.update(grads, state, params)
        params = optim.apply_updates(params, updates)
        for k, p in leaves.items():
            p.grad = grads[k].clone()
        torch_opt.step()
    return params, {k: v.detach() for k, v in leaves.items()}


def test_adafactor_factors_trailing_dims_of_conv_weights_and_keeps_scalars_full():
    shapes = {"conv": (3, 2, 4, 5), "scalar": (), "vec": (7,)}
    params, grads = random_tree(0, 10, shapes)
    tx = optim.adafactor(0.05, weight_decay=0.01)
    state = tx.init(params)
    assert state.row["conv"].shape == (3, 2, 4, 1) and state.col["conv"].shape == (3, 2, 1, 5)
    assert state.nu["conv"].numel() == 0 and state.nu["vec"].shape == (7,)
    ours, ref = _run_against_torch(
        tx, lambda ps: torch.optim.Adafactor(ps, lr=0.05, weight_decay=0.01), params, grads)
    assert_trees_close(ours, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(momentum=0.9, nesterov=False, weight_decay=0.01, adjust_lr="match_rms_adamw"),
    dict(ns_steps=3, ns_coefficients=(2.0, -1.5, 0.5), adjust_lr=None),
], ids=["default", "no_nesterov_moonshot", "cubic"])
def test_muon_matches_torch_muon_with_stacked_matrices(kwargs):
    # "a" and "c" share a shape, so ours orthogonalises them as one batch; torch one by one
    shapes = {"a": (6, 4), "b": (4, 6), "c": (6, 4), "d": (5, 5)}
    params, grads = random_tree(1, 20, shapes)
    torch_kwargs = {("adjust_lr_fn" if k == "adjust_lr" else k): v for k, v in kwargs.items()}
    ours, ref = _run_against_torch(
        optim.muon(0.02, **kwargs), lambda ps: torch.optim.Muon(ps, lr=0.02, **torch_kwargs),
        params, grads)
    assert max(float((ref[k] - params[k]).abs().max()) for k in params) > 0.05
    # both iterate in bf16; ours in batched matmuls, so the bf16 roundings may differ
    assert_trees_close(ours, ref, rtol=1e-4, atol=1e-4)


def _newton_schulz_reference(x, steps, a, b, c, eps):
    """The quintic iteration on one float64 matrix, written plainly."""
    y = x.T if x.shape[0] > x.shape[1] else x
    y = y / max(float(torch.linalg.norm(y)), eps)
    for _ in range(steps):
        gram = y @ y.T
        y = a * y + (b * gram + c * gram @ gram) @ y
    return y.T if x.shape[0] > x.shape[1] else y


def test_muon_in_float64_equals_its_formula():
    shapes = {"a": (6, 4), "b": (4, 6), "c": (6, 4)}
    params, grads = random_tree(2, 15, shapes)
    params = optree.tree_map(torch.Tensor.double, params)
    grads = optree.tree_map(torch.Tensor.double, grads)
    lr, mom, wd = 0.02, 0.9, 0.1
    tx = optim.muon(lr, mom, wd, ns_dtype=None)
    state, ours = tx.init(params), params
    ref, bufs = dict(params), {k: torch.zeros_like(v) for k, v in params.items()}
    for g in grads:
        updates, state = tx.update(g, state, ours)
        ours = optim.apply_updates(ours, updates)
        for k in ref:
            bufs[k] = mom * bufs[k] + (1 - mom) * g[k]
            o = _newton_schulz_reference(g[k] + mom * (bufs[k] - g[k]), 5,
                                         *optim._muon.NS_COEFFICIENTS, 1e-7)
            scale = math.sqrt(max(1.0, ref[k].shape[0] / ref[k].shape[1]))
            ref[k] = ref[k] * (1 - lr * wd) - lr * scale * o
    assert_trees_close(ours, ref, rtol=1e-10, atol=1e-12)


@given(rows=st.integers(1, 24), cols=st.integers(1, 24), batch=st.integers(0, 3),
       seed=st.integers(0, 2**16))
def test_newton_schulz_brings_singular_values_near_one(rows, cols, batch, seed):
    shape = (batch, rows, cols) if batch else (rows, cols)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    y = optim.newton_schulz(x, dtype=None)
    assert y.shape == x.shape and y.dtype == x.dtype
    s = torch.linalg.svdvals(y)
    # the quintic's fixed band; a random Gaussian matrix has no tiny singular values here,
    # except a rare near-singular draw, which the iteration cannot lift in 5 steps
    s_in = torch.linalg.svdvals(x)
    ok = s_in / s_in.amax(-1, keepdim=True) > 1e-2
    assert bool(((s > 0.6) & (s < 1.25))[ok].all()), s
    # orthogonalisation keeps the singular vectors: y = U f(S) V^T with x = U S V^T
    u, _, vh = torch.linalg.svd(x, full_matrices=False)
    core = u.mT @ y @ vh.mT  # (…, k, k): diagonal
    off = core - torch.diag_embed(torch.diagonal(core, dim1=-2, dim2=-1))
    assert float(off.abs().max()) < 1e-8


def _lamb_reference(steps, lr, b1, b2, eps, wd, decay_keys):
    params, xs, ys = make_data(steps=steps, dtype=torch.float64)
    m = optree.tree_map(torch.zeros_like, params)
    v = optree.tree_map(torch.zeros_like, params)
    for t in range(1, steps + 1):
        g = grads_at(params, xs[t - 1], ys[t - 1])
        m = optree.tree_map(lambda m_, g_: b1 * m_ + (1 - b1) * g_, m, g)
        v = optree.tree_map(lambda v_, g_: b2 * v_ + (1 - b2) * g_ * g_, v, g)
        new = {}
        for k in params:
            p_, m_, v_ = (params[k], m[k], v[k]) if k != "net" else (
                params[k][0], m[k][0], v[k][0])
            u = (m_ / (1 - b1**t)) / (torch.sqrt(v_ / (1 - b2**t)) + eps)
            if k in decay_keys:
                u = u + wd * p_
            pn, un = float(torch.linalg.norm(p_)), float(torch.linalg.norm(u))
            ratio = 1.0 if pn == 0 or un == 0 else pn / un
            p_new = p_ - lr * ratio * u
            new[k] = [p_new] if k == "net" else p_new
        params = new
    return params


def test_lamb_matches_float64_formula_with_masked_decay():
    steps, lr, b1, b2, eps, wd = 60, 1e-2, 0.9, 0.99, 1e-6, 0.1
    mask = {"w": True, "b": False, "net": [True]}
    params, xs, ys = make_data(steps=steps, dtype=torch.float64)
    tx = optim.lamb(lr, betas=(b1, b2), eps=eps, weight_decay=wd, mask=mask)
    state = tx.init(params)
    for t in range(steps):
        updates, state = tx.update(grads_at(params, xs[t], ys[t]), state, params)
        params = optim.apply_updates(params, updates)
    ref = _lamb_reference(steps, lr, b1, b2, eps, wd, {"w", "net"})
    assert_trees_close(params, ref, rtol=1e-12, atol=1e-12)


def test_trust_ratio_is_one_where_a_norm_is_zero_and_lars_chain_runs():
    tx = optim.scale_by_trust_ratio(trust_coefficient=0.5)
    p = {"zero_p": torch.zeros(3), "zero_u": torch.ones(3), "both": torch.full((2,), 3.0)}
    u = {"zero_p": torch.ones(3), "zero_u": torch.zeros(3), "both": torch.ones(2)}
    out, _ = tx.update(u, tx.init(p), p)
    torch.testing.assert_close(out["zero_p"], u["zero_p"])
    torch.testing.assert_close(out["zero_u"], u["zero_u"])
    torch.testing.assert_close(out["both"], 0.5 * 3.0 * torch.ones(2))
    lars = optim.chain(optim.add_decayed_weights(1e-4), optim.scale_by_trust_ratio(
        trust_coefficient=1e-3), optim.sgd(0.1, momentum=0.9))
    moved = run_ours(lars, steps=5)
    assert not torch.allclose(moved["w"], make_data()[0]["w"])


NEW = [
    ("nadam", lambda lr: optim.nadam(lr, weight_decay=0.01, decoupled_weight_decay=True)),
    ("radam", lambda lr: optim.radam(lr, weight_decay=0.01)),
    ("adamax", lambda lr: optim.adamax(lr)),
    ("adadelta", lambda lr: optim.adadelta(lr, weight_decay=0.01)),
    ("adafactor", lambda lr: optim.adafactor(lr, weight_decay=0.01)),
    ("lamb", lambda lr: optim.lamb(lr, weight_decay=0.01)),
    ("schedule_free_adamw",
     lambda lr: optim.schedule_free_adamw(lr, weight_decay=0.01, warmup_steps=3)),
    ("schedule_free_sgd", lambda lr: optim.schedule_free_sgd(lr, weight_decay=0.01, r=1.0)),
    ("prodigy", lambda lr: optim.prodigy(lr, weight_decay=0.01, use_bias_correction=True)),
]


@pytest.mark.parametrize("name,make", NEW, ids=[n for n, _ in NEW])
def test_tensor_lr_and_schedule_equal_float_lr(name, make):
    a = run_ours(make(torch.tensor(1e-2)), steps=10)
    b = run_ours(make(1e-2), steps=10)
    c = run_ours(make(optim.constant(1e-2)), steps=10)
    assert_trees_close(a, b, rtol=1e-6, atol=1e-7)
    assert_trees_close(c, b, rtol=1e-6, atol=1e-7)


def _matrix_problem():
    """2-D leaves only (Muon's domain), shared by the purity / vmap / compile tests."""
    shapes = {"w": (6, 4), "v": (6, 4), "u": (3, 5)}
    return random_tree(3, 4, shapes)


ALL = NEW + [("muon", lambda lr: optim.muon(lr, ns_dtype=None))]


@pytest.mark.parametrize("name,make", ALL, ids=[n for n, _ in ALL])
def test_update_is_pure(name, make):
    params, grads = _matrix_problem()
    tx = make(1e-2)
    state = tx.init(params)
    _, state = tx.update(grads[0], state, params)
    snapshot = [x.clone() for x in optree.tree_leaves((params, grads[1], state))]
    updates, new_state = tx.update(grads[1], state, params)
    after = optree.tree_leaves((params, grads[1], state))
    assert all(torch.equal(a, b) for a, b in zip(snapshot, after))
    assert int(new_state.count) == 2
    assert all(float(u.abs().max()) > 0 for u in optree.tree_leaves(updates))


@pytest.mark.parametrize("name,make", ALL, ids=[n for n, _ in ALL])
def test_vmap_over_an_ensemble_equals_a_loop(name, make):
    """One optimizer state per member, stacked: vmap(update) == updating each alone."""
    members, grads = [], []
    for seed in range(3):
        p, g = random_tree(10 + seed, 3, {"w": (6, 4), "u": (3, 5)})
        members.append(p)
        grads.append(g)
    tx = make(1e-2)
    stack = lambda trees: optree.tree_map(lambda *x: torch.stack(x), *trees)  # noqa: E731
    states = [tx.init(p) for p in members]
    p_stack, s_stack = stack(members), stack(states)

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optim.apply_updates(p, u), s

    for t in range(3):
        p_stack, s_stack = torch.vmap(step)(p_stack, s_stack, stack([g[t] for g in grads]))
        for i in range(3):
            members[i], states[i] = step(members[i], states[i], grads[i][t])
    assert_trees_close(p_stack, stack(members), rtol=1e-6, atol=1e-6)
    assert_trees_close(s_stack, stack(states), rtol=1e-6, atol=1e-6)


def test_all_compile_fullgraph_and_equal_eager():
    params, grads = _matrix_problem()
    labels = {"w": "muon", "v": "nadam", "u": "adafactor"}
    tx = optim.chain(
        optim.clip_by_global_norm(1.0),
        optim.partition({
            "muon": optim.muon(optim.warmup_cosine(2e-2, 1, 10), ns_dtype=None),
            "nadam": optim.chain(optim.radam(1e-2), optim.scale(1.0), optim.adamax(1e-2)),
            "adafactor": optim.chain(optim.adafactor(1e-2, weight_decay=0.1),
                                     optim.lamb(1e-2), optim.adadelta(),
                                     optim.schedule_free_adamw(1e-2, warmup_steps=2),
                                     optim.prodigy()),
        }, labels),
    )

    def run(update):
        p, s = params, tx.init(params)
        for g in grads:
            u, s = update(g, s, p)
            p = optim.apply_updates(p, u)
        return p, s

    eager = run(tx.update)
    torch._dynamo.reset()
    compiled = run(torch.compile(tx.update, fullgraph=True, backend="eager"))
    assert_trees_close(compiled, eager, rtol=1e-6, atol=1e-7)
    nadam_tx = optim.nadam(1e-2, weight_decay=0.1)
    torch._dynamo.reset()
    p0, s0 = params, nadam_tx.init(params)
    u_eager, _ = nadam_tx.update(grads[0], s0, p0)
    u_comp, _ = torch.compile(nadam_tx.update, fullgraph=True, backend="eager")(grads[0], s0, p0)
    assert_trees_close(u_comp, u_eager, rtol=1e-6, atol=1e-7)


def test_train_step_with_muon_for_matrices_and_adamw_for_the_rest():
    """The usual Muon recipe through ``partition``: the loss goes down."""
    params, xs, ys = make_data(steps=40)
    labels = lambda p: {"w": "muon", "b": "adamw", "net": ["muon"]}  # noqa: E731
    tx = optim.partition({"muon": optim.muon(0.05), "adamw": optim.adamw(1e-2)}, labels)
    state = tx.init(params)
    first = float(loss_fn(params, xs[0], ys[0]))
    for t in range(40):
        updates, state = tx.update(grads_at(params, xs[t], ys[t]), state, params)
        params = optim.apply_updates(params, updates)
    assert float(loss_fn(params, xs[0], ys[0])) < first


# ------------------------------------------------------------------- bad input


@pytest.mark.parametrize("make,error,match", [
    (lambda: optim.nadam(momentum_decay=-1.0), ValueError, "momentum_decay must be >= 0"),
    (lambda: optim.radam(betas=(0.9, 1.0)), ValueError, r"betas\[1\] must be in \[0, 1\)"),
    (lambda: optim.adamax(eps=-1.0), ValueError, "eps must be >= 0"),
    (lambda: optim.adadelta(rho=1.0), ValueError, r"rho must be in \[0, 1\)"),
    (lambda: optim.adafactor(beta2_decay=0.5), ValueError, "beta2_decay must be <= 0, got 0.5"),
    (lambda: optim.adafactor(eps=1e-3), ValueError, "eps must be a pair"),
    (lambda: optim.adafactor(d=0.5), ValueError, "d .* must be a number >= 1, got 0.5"),
    (lambda: optim.muon(momentum=1.0), ValueError, r"momentum must be in \[0, 1\)"),
    (lambda: optim.muon(ns_steps=0), ValueError, "ns_steps must be >= 1, got 0"),
    (lambda: optim.muon(adjust_lr="rms"), ValueError, "adjust_lr must be 'original'"),
    (lambda: optim.lamb(eps_root=-1.0), ValueError, "eps_root must be >= 0"),
    (lambda: optim.scale_by_trust_ratio(min_norm=-1.0), ValueError, "min_norm must be >= 0"),
])
def test_bad_hyperparameters(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_muon_names_the_leaf_that_is_not_a_matrix():
    tx = optim.muon()
    with pytest.raises(ValueError, match=r"muon: leaf 'layer.bias' has shape \(4,\).*partition"):
        tx.init({"layer": {"weight": torch.ones(4, 4), "bias": torch.ones(4)}})
    state = tx.init({"w": torch.ones(4, 4)})
    with pytest.raises(ValueError, match=r"leaf 'w' has shape \(4, 4, 1\)"):
        tx.update({"w": torch.ones(4, 4, 1)}, state)
    with pytest.raises(ValueError, match="newton_schulz: x must have >= 2 dims"):
        optim.newton_schulz(torch.ones(3))


@pytest.mark.parametrize("tx", [optim.adafactor(), optim.lamb()], ids=["adafactor", "lamb"])
def test_optimizers_that_need_params_say_so(tx):
    g = {"w": torch.ones(2, 2)}
    with pytest.raises(ValueError, match="needs params"):
        tx.update(g, tx.init(g))
