"""donate=True: the same numbers as the pure step, with torch.optim's peak memory."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchfn
from torchfn import optim, random
from torchfn.train import PeakMemory, TrainState, make_train_step


def _net():
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                        nn.Linear(256, 10))
    model = torchfn.Model(net)
    net.load_state_dict(model.state_dict(model.init(random.key(0))))
    return net, model


def _batch():
    g = torch.Generator().manual_seed(3)
    return torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)


def _setup(opt, donate):
    net, model = _net()
    params, _ = model.extract(net)

    def loss_fn(params, model_state, batch, key):
        x, y = batch
        return F.cross_entropy(model.apply(params, x), y)

    state = TrainState.create(params, opt, key=random.key(0))
    return make_train_step(loss_fn, opt, donate=donate), state


@pytest.mark.parametrize("opt", [optim.adam(1e-2), optim.adamw(1e-2), optim.sgd(0.1, momentum=0.9)],
                         ids=["adam", "adamw", "sgd"])
def test_donated_step_equals_pure_step(opt):
    batch = _batch()
    (pure, s1), (donating, s2) = _setup(opt, False), _setup(opt, True)
    for _ in range(4):
        s1, m1 = pure(s1, batch)
        s2, m2 = donating(s2, batch)
        assert torch.equal(m1["loss"], m2["loss"])
    for a, b in zip(torchfn.tree.leaves(s1), torchfn.tree.leaves(s2)):
        assert torch.equal(a, b)


def test_donated_step_peak_memory_matches_torch_optim():
    batch = _batch()

    def peak(make_one):
        with PeakMemory() as mem:
            one = make_one()
            for _ in range(2):
                one()
            mem.reset_peak()
            one()
        return mem.peak

    def ours():
        step, state = _setup(optim.adam(1e-3), True)
        holder = [state]

        def one():
            holder[0], _ = step(holder[0], batch)
        return one

    def module():
        net, _ = _net()
        opt = torch.optim.Adam(net.parameters(), lr=1e-3, foreach=True)

        def one():
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(batch[0]), batch[1]).backward()
            opt.step()
        return one

    assert peak(ours) <= 1.05 * peak(module)


def test_donate_must_be_bool():
    with pytest.raises(TypeError, match="donate must be a bool"):
        make_train_step(lambda p, s, b, k: p["w"].sum(), optim.adam(1e-3), donate="yes")


@pytest.mark.parametrize(
    "opt",
    [optim.sgd(0.1), optim.sgd(0.1, momentum=0.9), optim.rmsprop(1e-2),
     optim.rmsprop(1e-2, centered=True, momentum=0.5), optim.adam(1e-2)],
    ids=["sgd", "sgd-momentum", "rmsprop", "rmsprop-centered-momentum", "adam"],
)
def test_vmapped_step_over_stacked_states_equals_loop(opt):
    """Ensembles: every optimizer state vmaps with in_dims=0 (no None leaves)."""
    def loss_fn(params, model_state, batch, key):
        x, y = batch
        return ((x @ params["w"] - y) ** 2).mean()

    step = make_train_step(loss_fn, opt)
    g = torch.Generator().manual_seed(0)
    members = [TrainState.create({"w": torch.randn(3, generator=g)}, opt, key=random.key(i))
               for i in range(4)]
    batch = (torch.randn(8, 3, generator=g), torch.randn(8, generator=g))
    stacked = torchfn.tree.stack(members)
    for _ in range(2):
        stacked, _ = torch.func.vmap(step, in_dims=(0, None))(stacked, batch)
        members = [step(m, batch)[0] for m in members]
    torch.testing.assert_close(stacked.params["w"], torch.stack([m.params["w"] for m in members]))
