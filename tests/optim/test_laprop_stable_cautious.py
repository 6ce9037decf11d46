"""LaProp, StableAdamW and the cautious mask (C-Lion, C-LaProp, C-AdamW) equal
pytorch_optimizer's over 100 steps (LaProp with a schedule too: its momentum holds
lr-scaled steps); each composes with tensor lrs, vmap over an ensemble and
torch.compile, and keeps its arguments untouched. StableAdamW is AdamW until a
gradient spike, which it steps over 5x more cautiously; a cautious step never goes uphill."""

import pytest
import torch
from _optim_problem import (
    assert_trees_close,
    check_ensemble_and_compile,
    check_pure_update,
    make_data,
    random_tree,
    run_ours,
    run_torch,
)

from torchfn import optim

po = pytest.importorskip("pytorch_optimizer", reason="pytorch_optimizer is the reference")

ORACLES = [
    ("laprop", optim.laprop(1e-2), po.LaProp, dict(lr=1e-2)),
    ("laprop_wd", optim.laprop(1e-2, betas=(0.95, 0.9), eps=1e-8, weight_decay=0.1),
     po.LaProp, dict(lr=1e-2, betas=(0.95, 0.9), eps=1e-8, weight_decay=0.1)),
    ("stable_adamw", optim.stable_adamw(1e-2), po.StableAdamW, dict(lr=1e-2)),
    ("stable_adamw_l2", optim.stable_adamw(1e-2, betas=(0.8, 0.95), weight_decay=0.1,
                                           decoupled_weight_decay=False),
     po.StableAdamW, dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1,
                          weight_decouple=False)),
    ("c_lion", optim.chain(optim.cautious(optim.lion(1e-2)), optim.decay_weights(1e-2, 0.1)),
     po.Lion, dict(lr=1e-2, weight_decay=0.1, cautious=True)),
    ("c_laprop", optim.cautious(optim.laprop(1e-2)), po.LaProp, dict(lr=1e-2, cautious=True)),
    ("c_adopt", optim.cautious(optim.adopt(1e-2)), po.ADOPT, dict(lr=1e-2, cautious=True)),
]


@pytest.mark.parametrize("name,tx,opt_cls,kwargs", ORACLES, ids=[o[0] for o in ORACLES])
def test_matches_pytorch_optimizer_after_100_steps(name, tx, opt_cls, kwargs):
    ours = run_ours(tx)
    ref = run_torch(opt_cls, foreach=False, **kwargs)
    start, _, _ = make_data()
    assert not torch.allclose(ref["w"], start["w"], atol=1e-2)  # the run moved the params
    assert_trees_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_laprop_with_a_schedule_matches_pytorch_optimizer():
    """The momentum holds lr-scaled steps and the debias is EMA(lr) / lr: a decaying
    lr changes LaProp differently from scaling Adam's step, and equals the reference."""
    sched = lambda count: 1e-2 / (1 + 0.1 * count)  # noqa: E731
    ours = run_ours(optim.laprop(sched, weight_decay=0.1))
    ref = run_torch(po.LaProp, foreach=False, lr=1e-2, weight_decay=0.1,
                    scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
                        opt, lambda s: 1 / (1 + 0.1 * s)))
    assert_trees_close(ours, ref, rtol=1e-5, atol=1e-5)


MAKERS = [
    ("laprop", lambda lr: optim.laprop(lr, weight_decay=0.01)),
    ("stable_adamw", lambda lr: optim.stable_adamw(lr, weight_decay=0.01)),
    ("c_adamw", lambda lr: optim.chain(optim.cautious(optim.adam(lr)),
                                       optim.decay_weights(lr, 0.01))),
]


@pytest.mark.parametrize("name,make", MAKERS, ids=[n for n, _ in MAKERS])
def test_tensor_lr_and_schedule_equal_float_lr(name, make):
    a = run_ours(make(torch.tensor(1e-2)), steps=10)
    b = run_ours(make(1e-2), steps=10)
    c = run_ours(make(optim.constant(1e-2)), steps=10)
    assert_trees_close(a, b, rtol=1e-6, atol=1e-7)
    assert_trees_close(c, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name,make", MAKERS, ids=[n for n, _ in MAKERS])
def test_update_is_pure(name, make):
    check_pure_update(make(1e-2))


@pytest.mark.parametrize("name,make", MAKERS, ids=[n for n, _ in MAKERS])
def test_vmap_over_an_ensemble_and_compile_equal_eager(name, make):
    check_ensemble_and_compile(make(1e-2))


def test_stable_adamw_is_adamw_until_a_gradient_spike():
    """Debiased EMAs equal Adam's bias-corrected ones, so while g^2 <= v (RMS clipped to
    1) StableAdamW steps exactly as AdamW. On a gradient 1000x the usual, AdamW still
    takes 0.6-0.7 lr; StableAdamW divides by RMS(g^2 / v) ~ 10."""
    lr, small, big = 1e-2, {"w": torch.full((64,), 1e-3)}, {"w": torch.full((64,), 1.0)}
    adam = optim.adamw(lr, betas=(0.9, 0.99), weight_decay=0.0)
    stable = optim.stable_adamw(lr, betas=(0.9, 0.99), weight_decay=0.0)
    s_a, s_s = adam.init(small), stable.init(small)
    for _ in range(50):
        u_a, s_a = adam.update(small, s_a, small)
        u_s, s_s = stable.update(small, s_s, small)
        torch.testing.assert_close(u_s["w"], u_a["w"], rtol=1e-5, atol=1e-9)
    spike_a = adam.update(big, s_a, small)[0]["w"].abs().max().item()
    spike_s = stable.update(big, s_s, small)[0]["w"].abs().max().item()
    assert spike_a > 0.5 * lr and spike_s < spike_a / 5


def test_a_cautious_step_never_goes_uphill():
    """Every kept coordinate of the update opposes its gradient (u g < 0), the rest are
    0, and the kept ones are scaled by numel / (kept + 1), over a run of SGD momentum."""
    params, grads = random_tree(3, 20)
    inner, tx = optim.sgd(0.1, momentum=0.9), optim.cautious(optim.sgd(0.1, momentum=0.9))
    s_in, s_c = inner.init(params), tx.init(params)
    dropped = 0
    for g in grads:
        u_in, s_in = inner.update(g, s_in, params)
        u, s_c = tx.update(g, s_c, params)
        for k in g:
            keep = u_in[k] * g[k] < 0
            scale = keep.numel() / (keep.sum() + 1)
            torch.testing.assert_close(u[k], torch.where(keep, u_in[k] * scale, 0.0))
            assert bool((u[k] * g[k] <= 0).all())
            dropped += int((~keep).sum())
    assert dropped > 0  # momentum did point uphill somewhere, and was dropped


def test_bad_arguments():
    with pytest.raises(TypeError, match="inner must be a GradientTransformation"):
        optim.cautious(optim.adam)
    with pytest.raises(ValueError, match="weight_decay must be >= 0"):
        optim.decay_weights(1e-2, -0.1)
    with pytest.raises(ValueError, match="with weight_decay"):
        tx = optim.laprop(weight_decay=0.1)
        tx.update({"w": torch.ones(2)}, tx.init({"w": torch.ones(2)}))
    with pytest.raises(ValueError, match=r"betas\[1\] must be in \[0, 1\)"):
        optim.stable_adamw(betas=(0.9, 1.0))
