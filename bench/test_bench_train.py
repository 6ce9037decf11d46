"""Train step: torchfn.make_train_step vs the same nn.Module + torch.optim loop.

MLP 784-512-256-10, batch 256, Adam, cross-entropy, CPU.

* group ``train_step_eager``: the eager torchfn step (``Model.apply`` + pure
  ``optim.adam``) vs ``nn.Module`` + ``loss.backward()`` +
  ``torch.optim.Adam(foreach=True)``. The torchfn case also records the peak
  tensor memory of one step, both ways, in ``extra_info`` (``PeakMemory``: all
  live tensor bytes, params and optimizer state included).
* group ``train_step_compiled``: ``torch.compile(step)`` (forward, backward and
  Adam in one graph) vs the eager module + ``torch.optim.Adam(fused=True)``,
  and vs ``torch.compile(module)`` + ``Adam(fused=True)``.

Run: ``pytest bench/test_bench_train.py --benchmark-only -p no:randomly
--benchmark-columns=min,median,mean``; ratios are median torchfn / median peer.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchfn
from torchfn import optim, random
from torchfn.train import PeakMemory, TrainState, make_train_step

BATCH = 256


def make_mlp() -> nn.Module:
    net = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                        nn.Linear(256, 10))
    model = torchfn.Model(net)  # weights from a key, not the global RNG
    net.load_state_dict(model.state_dict(model.init(random.key(0))))
    return net


def make_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 784, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def torchfn_setup(net, donate=False):
    model = torchfn.Model(net)
    params, _ = model.extract(net)

    def loss_fn(params, model_state, batch, key):
        x, y = batch
        return F.cross_entropy(model.apply(params, x), y)

    opt = optim.adam(1e-3)
    state = TrainState.create(params, opt, key=random.key(0))
    return make_train_step(loss_fn, opt, donate=donate), state


def module_setup(net, **adam_kw):
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, **adam_kw)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def run_torchfn(step, state, batch, n):
    holder = [state]

    def one():
        holder[0], metrics = step(holder[0], batch)
        return metrics["loss"]

    for _ in range(n):  # warm-up (and compilation)
        one()
    return one


def peak_memory(run, warmup=2):
    """Peak live tensor bytes of one step, counting everything the run allocated."""
    with PeakMemory() as mem:
        one = run()
        for _ in range(warmup):
            one()
        mem.reset_peak()
        one()
    return mem.peak


@pytest.mark.benchmark(group="train_step_eager")
@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donate"])
def test_torchfn_eager(benchmark, donate):
    """donate=True: params and Adam moments updated in the given state's buffers."""
    batch = make_batch()
    step, state = torchfn_setup(make_mlp(), donate=donate)
    benchmark(run_torchfn(step, state, batch, 3))

    def fn_run():
        s, st = torchfn_setup(make_mlp(), donate=donate)
        return run_torchfn(s, st, batch, 0)

    def module_run():
        f = module_setup(make_mlp(), foreach=True)
        return lambda: f(*batch)

    ours, peer = peak_memory(fn_run), peak_memory(module_run)
    benchmark.extra_info.update(peak_bytes=ours, peer_peak_bytes=peer,
                                peak_memory_ratio=round(ours / peer, 3))


@pytest.mark.benchmark(group="train_step_eager")
def test_module_adam_foreach(benchmark):
    x, y = make_batch()
    step = module_setup(make_mlp(), foreach=True)
    for _ in range(3):
        step(x, y)
    benchmark(step, x, y)


@pytest.mark.benchmark(group="train_step_compiled")
def test_torchfn_compiled(benchmark):
    batch = make_batch()
    step, state = torchfn_setup(make_mlp())
    benchmark(run_torchfn(torch.compile(step), state, batch, 3))


@pytest.mark.benchmark(group="train_step_compiled")
def test_module_adam_fused(benchmark):
    x, y = make_batch()
    step = module_setup(make_mlp(), fused=True)
    for _ in range(3):
        step(x, y)
    benchmark(step, x, y)


@pytest.mark.benchmark(group="train_step_compiled")
def test_compiled_module_adam_fused(benchmark):
    x, y = make_batch()
    net = make_mlp()
    compiled = torch.compile(net)
    opt = torch.optim.Adam(compiled.parameters(), lr=1e-3, fused=True)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(compiled(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    for _ in range(3):
        step(x, y)
    benchmark(step, x, y)
