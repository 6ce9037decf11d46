"""Per-sample gradients and DP-SGD steps, side by side in one run.

Groups (compare medians within a group):

- ``psg-mlp`` / ``psg-cnn``: per-example gradients of a batch of 256 for the
  784-512-256-10 MLP and a 2-conv CNN (1->16->32 on 28x28, then Linear):
  torchfn ``per_sample_grads`` (eager ``vmap(grad)``), Opacus 1.6
  ``GradSampleModule`` (hooks), a Python loop of ``torch.autograd.grad``, and
  the plain non-private batch gradient.
- ``dp-step-mlp``: a whole train step on the MLP: non-private (batch grad +
  SGD), DP-SGD eager and ``torch.compile``-d (materialised per-example grads),
  compiled ``method="two_pass"`` (norms, then a reweighted backward), and ghost
  clipping (eager, and compiled: ghost clipping stays eager, noise + SGD compile).

    .venv/bin/pytest bench/test_bench_dp.py --benchmark-only -q -p no:randomly \
        --benchmark-columns=min,median,mean

The compiled step is compiled once before timing (cold compile: tens of seconds).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from torchfn import optim, random
from torchfn.transforms import make_dp_step, per_sample_grads

B = 256


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                         nn.Linear(256, 10))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # (16, 14, 14)
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # (32, 7, 7)
        nn.Flatten(-3), nn.Linear(32 * 7 * 7, 10),
    )


def _setup(kind: str):
    g = torch.Generator().manual_seed(0)
    module = _mlp() if kind == "mlp" else _cnn()
    params = {k: v.detach().clone() for k, v in module.named_parameters()}
    shape = (B, 784) if kind == "mlp" else (B, 1, 28, 28)
    x = torch.randn(shape, generator=g)
    y = torch.randint(0, 10, (B,), generator=g)
    return module, params, x, y


def _single_loss(module):
    def loss_fn(params, x, y):  # ONE example, unbatched: x (784,) or (1, 28, 28), y ()
        return F.cross_entropy(functional_call(module, params, (x,)), y)

    return loss_fn


def _batched_loss(module):
    def loss_fn(params, x, y):  # (B,) per-example losses
        return F.cross_entropy(functional_call(module, params, (x,)), y, reduction="none")

    return loss_fn


# ----------------------------------------------------------- per-sample grads


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_psg_torchfn_vmap(benchmark, kind):
    benchmark.group = f"psg-{kind}"
    module, params, x, y = _setup(kind)
    fn = per_sample_grads(_single_loss(module))
    out = benchmark.pedantic(fn, args=(params, x, y), rounds=5, warmup_rounds=1)
    assert out["0.weight"].shape == (B, *params["0.weight"].shape)


@pytest.mark.parametrize("kind", ["mlp"])
def test_psg_torchfn_vmap_chunk64(benchmark, kind):
    benchmark.group = f"psg-{kind}"
    module, params, x, y = _setup(kind)
    fn = per_sample_grads(_single_loss(module), chunk_size=64)
    out = benchmark.pedantic(fn, args=(params, x, y), rounds=3, warmup_rounds=1)
    assert out["0.weight"].shape[0] == B


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_psg_opacus_hooks(benchmark, kind):
    from opacus import GradSampleModule

    benchmark.group = f"psg-{kind}"
    module, _, x, y = _setup(kind)
    gsm = GradSampleModule(module, loss_reduction="sum")  # the loss below is a sum

    def run():
        for p in gsm.parameters():
            p.grad, p.grad_sample = None, None
        F.cross_entropy(gsm(x), y, reduction="sum").backward()
        return [p.grad_sample for p in gsm.parameters()]

    out = benchmark.pedantic(run, rounds=5, warmup_rounds=1)
    assert out[0].shape[0] == B


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_psg_python_loop(benchmark, kind):
    benchmark.group = f"psg-{kind}"
    module, params, x, y = _setup(kind)
    live = {k: v.requires_grad_(True) for k, v in params.items()}
    loss_fn = _single_loss(module)

    def run():
        grads = [torch.autograd.grad(loss_fn(live, x[i], y[i]), list(live.values()))
                 for i in range(B)]
        return [torch.stack(g) for g in zip(*grads)]

    out = benchmark.pedantic(run, rounds=1, warmup_rounds=0)  # slow: one round
    assert out[0].shape[0] == B


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_psg_nonprivate_batch_grad(benchmark, kind):
    benchmark.group = f"psg-{kind}"
    module, params, x, y = _setup(kind)
    live = {k: v.requires_grad_(True) for k, v in params.items()}

    def run():
        loss = F.cross_entropy(functional_call(module, live, (x,)), y)
        return torch.autograd.grad(loss, list(live.values()))

    out = benchmark.pedantic(run, rounds=20, warmup_rounds=2)
    assert out[0].shape == params["0.weight"].shape


# ------------------------------------------------------------- DP-SGD steps

DP = dict(l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=B)


def test_step_nonprivate(benchmark):
    benchmark.group = "dp-step-mlp"
    module, params, x, y = _setup("mlp")
    opt = optim.sgd(0.1)

    def step(params, opt_state, x, y):
        live = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        loss = F.cross_entropy(functional_call(module, live, (x,)), y)
        grads = dict(zip(live, torch.autograd.grad(loss, list(live.values()))))
        updates, opt_state = opt.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, loss.detach()

    state = opt.init(params)
    out = benchmark.pedantic(step, args=(params, state, x, y), rounds=20, warmup_rounds=2)
    assert torch.isfinite(out[2])


def test_step_dp_eager(benchmark):
    benchmark.group = "dp-step-mlp"
    module, params, x, y = _setup("mlp")
    dp = make_dp_step(_single_loss(module), optim.sgd(0.1), key=random.key(0), **DP)
    out = benchmark.pedantic(dp.step, args=(params, dp.init(params), x, y), rounds=3,
                             warmup_rounds=1)
    assert torch.isfinite(out[2])


def test_step_dp_compiled(benchmark):
    benchmark.group = "dp-step-mlp"
    module, params, x, y = _setup("mlp")
    dp = make_dp_step(_single_loss(module), optim.sgd(0.1), key=random.key(0), **DP)
    step = torch.compile(dp.step)
    state = dp.init(params)
    step(params, state, x, y)  # cold compile, not timed
    out = benchmark.pedantic(step, args=(params, state, x, y), rounds=10, warmup_rounds=1)
    assert torch.isfinite(out[2])


def test_step_dp_two_pass_compiled(benchmark):
    benchmark.group = "dp-step-mlp"
    module, params, x, y = _setup("mlp")
    dp = make_dp_step(_single_loss(module), optim.sgd(0.1), key=random.key(0),
                      method="two_pass", **DP)
    step = torch.compile(dp.step)
    state = dp.init(params)
    step(params, state, x, y)  # cold compile, not timed
    out = benchmark.pedantic(step, args=(params, state, x, y), rounds=10, warmup_rounds=1)
    assert torch.isfinite(out[2])


def test_step_dp_ghost(benchmark):
    benchmark.group = "dp-step-mlp"
    module, params, x, y = _setup("mlp")
    dp = make_dp_step(_batched_loss(module), optim.sgd(0.1), key=random.key(0), method="ghost",
                      **DP)
    out = benchmark.pedantic(dp.step, args=(params, dp.init(params), x, y), rounds=10,
                             warmup_rounds=1)
    assert torch.isfinite(out[2])


def test_step_dp_ghost_compiled(benchmark):
    benchmark.group = "dp-step-mlp"
    module, params, x, y = _setup("mlp")
    dp = make_dp_step(_batched_loss(module), optim.sgd(0.1), key=random.key(0), method="ghost",
                      **DP)
    step = torch.compile(dp.step)  # ghost clipping stays eager; noise + SGD compile
    state = dp.init(params)
    step(params, state, x, y)  # cold compile, not timed
    out = benchmark.pedantic(step, args=(params, state, x, y), rounds=10, warmup_rounds=1)
    assert torch.isfinite(out[2])
