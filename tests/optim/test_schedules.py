"""Schedules equal torch.optim.lr_scheduler on long sequences, for int and tensor steps."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torchfn import optim

LS = torch.optim.lr_scheduler


def torch_lrs(make_sched, steps, base_lr=1.0, opt_cls=torch.optim.SGD, **opt_kwargs):
    """``lr`` used at optimizer steps 0..steps-1 under a torch scheduler."""
    opt = opt_cls([torch.zeros(1, requires_grad=True)], lr=base_lr, **opt_kwargs)
    sched = make_sched(opt)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return torch.tensor(lrs, dtype=torch.float64)


def ours_int(schedule, steps):
    out = [schedule(t) for t in range(steps)]
    assert all(isinstance(x, float) for x in out)
    return torch.tensor(out, dtype=torch.float64)


def ours_tensor(schedule, steps):
    out = [schedule(torch.tensor(t, dtype=torch.int32)) for t in range(steps)]
    assert all(isinstance(x, torch.Tensor) and x.ndim == 0 for x in out)
    return torch.stack(out)


CASES = [
    ("step_lr", lambda: optim.step_lr(0.5, 7, 0.7), lambda o: LS.StepLR(o, 7, 0.7), 0.5, 300),
    (
        "multistep_lr",
        lambda: optim.multistep_lr(0.5, [30, 10, 80, 80], 0.3),
        lambda o: LS.MultiStepLR(o, [30, 10, 80, 80], 0.3),
        0.5,
        300,
    ),
    ("exponential_lr", lambda: optim.exponential_lr(0.5, 0.99),
     lambda o: LS.ExponentialLR(o, 0.99), 0.5, 500),
    ("constant", lambda: optim.constant(0.3), lambda o: LS.LambdaLR(o, lambda s: 1.0), 0.3, 50),
    (
        "linear_warmup",
        lambda: optim.linear_warmup(0.5, 40, start_lr=0.5 * 0.2),
        lambda o: LS.LinearLR(o, start_factor=0.2, end_factor=1.0, total_iters=40),
        0.5,
        200,
    ),
    (
        "cosine_warm_restarts",
        lambda: optim.cosine_warm_restarts(0.5, 10, 1, 0.01),
        lambda o: LS.CosineAnnealingWarmRestarts(o, 10, 1, 0.01),
        0.5,
        300,
    ),
    (
        "cosine_warm_restarts_mult",
        lambda: optim.cosine_warm_restarts(0.5, 3, 2, 0.02),
        lambda o: LS.CosineAnnealingWarmRestarts(o, 3, 2, 0.02),
        0.5,
        1000,
    ),
    (
        "one_cycle",
        lambda: optim.one_cycle(0.5, 1000),
        lambda o: LS.OneCycleLR(o, 0.5, total_steps=1000, cycle_momentum=False),
        0.5,
        1000,
    ),
    (
        "one_cycle_three_phase_linear",
        lambda: optim.one_cycle(0.5, 997, pct_start=0.25, anneal_strategy="linear",
                                div_factor=10.0, final_div_factor=100.0, three_phase=True),
        lambda o: LS.OneCycleLR(o, 0.5, total_steps=997, pct_start=0.25,
                                anneal_strategy="linear", div_factor=10.0,
                                final_div_factor=100.0, three_phase=True, cycle_momentum=False),
        0.5,
        997,
    ),
]


@pytest.mark.parametrize("name,ours,theirs,base_lr,steps", CASES, ids=[c[0] for c in CASES])
def test_schedule_equals_torch(name, ours, theirs, base_lr, steps):
    ref = torch_lrs(theirs, steps, base_lr)
    torch.testing.assert_close(ours_int(ours(), steps), ref, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(ours_tensor(ours(), steps), ref, rtol=1e-12, atol=1e-15)


def test_cosine_annealing_equals_torch_closed_form_and_recursive_form():
    """torch's step() uses a recursive update that drifts by rounding; its closed form
    ``_get_closed_form_lr`` is what we compute. Both past t_max (periodic continuation)."""
    base, t_max, eta_min, steps = 0.5, 100, 0.01, 450
    sched = optim.cosine_annealing(base, t_max, eta_min)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base)
    torch_sched = LS.CosineAnnealingLR(opt, t_max, eta_min)
    closed, recursive = [], []
    for _ in range(steps):
        closed.append(torch_sched._get_closed_form_lr()[0])
        recursive.append(opt.param_groups[0]["lr"])
        opt.step()
        torch_sched.step()
    closed = torch.tensor(closed, dtype=torch.float64)
    torch.testing.assert_close(ours_int(sched, steps), closed, rtol=1e-14, atol=1e-16)
    torch.testing.assert_close(ours_tensor(sched, steps), closed, rtol=1e-12, atol=1e-15)
    rec = torch.tensor(recursive, dtype=torch.float64)
    torch.testing.assert_close(ours_int(sched, steps), rec, rtol=0, atol=1e-9)


def test_warmup_cosine_equals_diffusers_and_torch_sequential():
    from diffusers.optimization import get_cosine_schedule_with_warmup

    base, warmup, total = 0.5, 30, 400
    ref = torch_lrs(lambda o: get_cosine_schedule_with_warmup(o, warmup, total), total + 1, base)
    sched = optim.warmup_cosine(base, warmup, total)
    torch.testing.assert_close(ours_int(sched, total + 1), ref, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(ours_tensor(sched, total + 1), ref, rtol=1e-12, atol=1e-15)
    # min_lr > 0: the cosine part equals CosineAnnealingLR's closed form
    sched = optim.warmup_cosine(base, warmup, total, min_lr=0.05)
    t = torch.arange(warmup, total + 1, dtype=torch.float64)
    closed = 0.05 + (base - 0.05) * (1 + torch.cos(math.pi * (t - warmup) / (total - warmup))) / 2
    torch.testing.assert_close(ours_tensor(sched, total + 1)[warmup:], closed)
    assert sched(total + 50) == pytest.approx(0.05)  # flat after total_steps
    assert sched(warmup // 2) == pytest.approx(base * (warmup // 2) / warmup)


def test_scale_lr():
    assert optim.scale_lr(0.1, 512, 256) == pytest.approx(0.2)


def test_schedules_under_compile():
    scheds = [optim.one_cycle(0.5, 100, three_phase=True), optim.cosine_warm_restarts(0.5, 3, 2),
              optim.warmup_cosine(0.5, 10, 100), optim.multistep_lr(1.0, [3, 5])]

    def f(step):
        return torch.stack([s(step) for s in scheds])

    compiled = torch.compile(f, fullgraph=True, backend="eager", dynamic=False)
    for t in [0, 4, 17, 50, 99]:
        step = torch.tensor(t)
        torch.testing.assert_close(compiled(step), f(step))
        expected = torch.tensor([s(t) for s in scheds], dtype=torch.float64)
        torch.testing.assert_close(f(step), expected)


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda: optim.warmup_cosine(0.1, 200, 100), ValueError,
         "warmup_steps must be <= total_steps, got warmup_steps=200 > total_steps=100"),
        (lambda: optim.cosine_annealing(0.1, 0), ValueError, "t_max must be >= 1, got 0"),
        (lambda: optim.cosine_annealing(-0.1, 10), ValueError, "base_lr must be >= 0, got -0.1"),
        (lambda: optim.step_lr(0.1, 0), ValueError, "step_size must be >= 1"),
        (lambda: optim.step_lr(0.1, 2.5), TypeError, "step_size must be an int"),
        (lambda: optim.cosine_warm_restarts(0.1, 10, t_mult=0), ValueError, "t_mult must be >= 1"),
        (lambda: optim.one_cycle(0.1, 100, pct_start=1.5), ValueError, "pct_start must be"),
        (lambda: optim.one_cycle(0.1, 100, anneal_strategy="exp"), ValueError, "anneal_strategy"),
        (lambda: optim.one_cycle(0.1, 10)(11), ValueError, "step must be <= total_steps=10"),
        (lambda: optim.exponential_lr(0.1, 0.9)(-1), ValueError, "step must be >= 0, got -1"),
        (lambda: optim.exponential_lr(0.1, 0.9)("3"), TypeError, "step must be an int"),
        (lambda: optim.scale_lr(0.1, 0, 256), ValueError, "batch_size must be >= 1"),
        (lambda: optim.linear_warmup(-1.0, 10), ValueError, "base_lr must be >= 0"),
    ],
)
def test_schedule_bad_input(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


# ------------------------------------------------------------------ plateau

PLATEAU_KW = st.fixed_dictionaries(
    {
        "mode": st.sampled_from(["min", "max"]),
        "factor": st.sampled_from([0.1, 0.5, 0.9]),
        "patience": st.integers(0, 4),
        "threshold": st.sampled_from([0.0, 1e-4, 0.05]),
        "threshold_mode": st.sampled_from(["rel", "abs"]),
        "cooldown": st.integers(0, 3),
        "min_lr": st.sampled_from([0.0, 1e-3]),
    }
)


@given(
    kw=PLATEAU_KW,
    metrics=st.lists(
        st.one_of(st.sampled_from([1.0, 0.5, 2.0]), st.floats(-10, 10, allow_nan=False)),
        min_size=30,
        max_size=120,
    ),
)
def test_reduce_on_plateau_equals_torch(kw, metrics):
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.3)
    ref = LS.ReduceLROnPlateau(opt, **kw)
    sched = optim.reduce_on_plateau(0.3, **kw)
    state = sched.init()
    assert float(state.lr) == 0.3
    for m in metrics:
        ref.step(m)
        # a float64 tensor: float32 would flush a tiny metric (1e-209) to 0 before we see it
        lr, state = sched.update(state, torch.tensor(m, dtype=torch.float64) if m > 0 else m)
        assert float(lr) == opt.param_groups[0]["lr"]
        assert int(state.num_bad_epochs) == ref.num_bad_epochs
        assert int(state.cooldown_counter) == ref.cooldown_counter


def test_reduce_on_plateau_compiles():
    sched = optim.reduce_on_plateau(1.0, patience=1, factor=0.5)
    step = torch.compile(sched.update, fullgraph=True, backend="eager")
    state, ref = sched.init(), sched.init()
    for m in [3.0, 2.0, 2.0, 2.0, 2.0, 1.0]:
        lr, state = step(state, torch.tensor(m))
        ref_lr, ref = sched.update(ref, m)
        assert float(lr) == float(ref_lr)
    assert float(lr) == 0.5


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(mode="avg"), "mode must be 'min' or 'max', got 'avg'"),
        (dict(factor=1.0), r"factor must be in \[0, 1\), got 1.0"),
        (dict(threshold_mode="pct"), "threshold_mode must be"),
        (dict(patience=-1), "patience must be >= 0"),
        (dict(base_lr=-1.0), "base_lr must be >= 0"),
    ],
)
def test_reduce_on_plateau_bad_input(kw, match):
    kw = {"base_lr": 0.1, **kw}
    with pytest.raises(ValueError, match=match):
        optim.reduce_on_plateau(**kw)
