"""Schedule-free AdamW / SGD equal the ``schedulefree`` package (Defazio et al.'s own
code), for the trained params y and for the evaluated average x."""

import pytest
import schedulefree
import torch
from _optim_problem import assert_trees_close, grads_at, loss_fn, make_data

import torchfn
from torchfn import optim

CASES = [
    ("adamw_default", lambda: optim.schedule_free_adamw(),
     lambda ps: schedulefree.AdamWScheduleFree(ps)),
    ("adamw_all_options",
     lambda: optim.schedule_free_adamw(1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1,
                                       warmup_steps=10, r=0.5, weight_lr_power=1.0),
     lambda ps: schedulefree.AdamWScheduleFree(ps, lr=1e-2, betas=(0.8, 0.99), eps=1e-6,
                                               weight_decay=0.1, warmup_steps=10, r=0.5,
                                               weight_lr_power=1.0)),
    ("sgd_default", lambda: optim.schedule_free_sgd(0.05),
     lambda ps: schedulefree.SGDScheduleFree(ps, lr=0.05)),
    ("sgd_all_options",
     lambda: optim.schedule_free_sgd(0.05, momentum=0.8, weight_decay=0.01, warmup_steps=5,
                                     r=1.0),
     lambda ps: schedulefree.SGDScheduleFree(ps, lr=0.05, momentum=0.8, weight_decay=0.01,
                                             warmup_steps=5, r=1.0)),
]


def _theirs(make_opt, steps):
    params, xs, ys = make_data(steps=steps)
    leaves = [params["w"].clone().requires_grad_(True), params["b"].clone().requires_grad_(True),
              params["net"][0].clone().requires_grad_(True)]
    opt = make_opt(leaves)
    opt.train()
    as_tree = lambda: {"w": leaves[0], "b": leaves[1], "net": [leaves[2]]}  # noqa: E731
    for t in range(steps):
        opt.zero_grad()
        loss_fn(as_tree(), xs[t], ys[t]).backward()
        opt.step()
    y = {k: v.detach().clone() for k, v in as_tree().items() if k != "net"}
    y["net"] = [leaves[2].detach().clone()]
    opt.eval()  # the params become x
    x = {"w": leaves[0].detach(), "b": leaves[1].detach(), "net": [leaves[2].detach()]}
    return y, x


@pytest.mark.parametrize("name,make_tx,make_opt", CASES, ids=[c[0] for c in CASES])
def test_matches_schedulefree_package(name, make_tx, make_opt):
    steps = 100
    params, xs, ys = make_data(steps=steps)
    tx = make_tx()
    state = tx.init(params)
    for t in range(steps):
        updates, state = tx.update(grads_at(params, xs[t], ys[t]), state, params)
        params = optim.apply_updates(params, updates)
    y_ref, x_ref = _theirs(make_opt, steps)
    assert not torch.allclose(x_ref["w"], y_ref["w"], atol=1e-3)  # x and y differ
    assert_trees_close(params, y_ref, rtol=1e-5, atol=1e-5)
    assert_trees_close(optim.schedule_free_eval_params(state, params), x_ref,
                       rtol=1e-5, atol=1e-5)


def test_eval_params_reach_into_a_chain_and_the_state_checkpoints(tmp_path):
    params, xs, ys = make_data(steps=5)
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.schedule_free_adamw(1e-2))
    state = tx.init(params)
    for t in range(5):
        updates, state = tx.update(grads_at(params, xs[t], ys[t]), state, params)
        params = optim.apply_updates(params, updates)
    x = optim.schedule_free_eval_params(state, params)
    assert_trees_close(x, optim.schedule_free_eval_params(state[1], params), rtol=0, atol=0)
    torchfn.save(tmp_path / "sf.safetensors", {"params": params, "opt": state})
    back = torchfn.load(tmp_path / "sf.safetensors")
    assert_trees_close(optim.schedule_free_eval_params(back["opt"], back["params"]), x,
                       rtol=0, atol=0)


def test_eval_params_bad_input():
    params = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match="exactly one ScheduleFreeState .* found 0"):
        optim.schedule_free_eval_params(optim.adam().init(params), params)
    state = optim.schedule_free_sgd().init(params)
    with pytest.raises(ValueError, match="different tree structures"):
        optim.schedule_free_eval_params(state, {"v": torch.ones(2)})
    with pytest.raises(ValueError, match="momentum .beta. must be > 0"):
        optim.schedule_free_sgd(momentum=0.0)
    with pytest.raises(ValueError, match="warmup_steps must be >= 0"):
        optim.schedule_free_adamw(warmup_steps=-1)
    with pytest.raises(ValueError, match="schedule_free_sgd needs params"):
        optim.schedule_free_sgd().update(params, state)
