"""Ensembles: stacked inits equal per-key inits; vmap-applied stacked params equal a loop
over members; a vmapped train step over stacked TrainStates equals a loop of steps."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import torchfn
from torchfn import random, tree
from torchfn.models import MLP
from torchfn.transforms import ensemble_apply, ensemble_init, ensemble_size, ensemble_step

MODEL = torchfn.Model(MLP(3, (8,), 2, activation="tanh"))


def assert_trees_close(a, b, **kw):
    la, sa = torch.utils._pytree.tree_flatten(a)
    lb, sb = torch.utils._pytree.tree_flatten(b)
    assert sa == sb
    for x, y in zip(la, lb):
        torch.testing.assert_close(x, y, **kw)


def test_init_members_equal_single_inits_with_split_keys():
    key = random.key(3)
    stacked = ensemble_init(MODEL, key, 4)
    assert ensemble_size(stacked) == 4
    for i, k in enumerate(random.split(key, 4)):
        assert_trees_close(tree.unstack(stacked)[i], MODEL.init(k), rtol=0, atol=0)
    fn = lambda k: {"w": random.normal(k, (2, 3))}  # noqa: E731 -- a pure init function
    stacked = ensemble_init(fn, key, 3)
    assert stacked["w"].shape == (3, 2, 3)
    assert not torch.equal(stacked["w"][0], stacked["w"][1])


@given(seed=st.integers(0, 2**16), n=st.integers(1, 4), b=st.integers(1, 4),
       split=st.booleans())
def test_apply_equals_loop_over_members(seed, n, b, split):
    params = ensemble_init(MODEL, random.key(seed), n)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*((n,) if split else ()), b, 3, generator=g)
    out = ensemble_apply(MODEL.apply, params, x, split_inputs=split)
    members = tree.unstack(params)
    loop = torch.stack([MODEL.apply(p, x[i] if split else x) for i, p in enumerate(members)])
    torch.testing.assert_close(out, loop, rtol=1e-6, atol=1e-6)


class BNNet(nn.Module):
    """Linear -> BatchNorm -> ReLU -> Dropout -> Linear: has state and randomness. (No bias
    before BatchNorm: its true gradient is 0, and Adam would blow rounding noise up to +-lr.)"""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 8, bias=False), nn.BatchNorm1d(8), nn.ReLU(),
                                 nn.Dropout(0.2), nn.Linear(8, 2))

    def forward(self, x):
        return self.net(x)


def test_vmapped_train_step_equals_loop_over_members():
    model = torchfn.Model(BNNet())

    def loss_fn(params, model_state, batch, key):
        x, y = batch
        logits, model_state = model.apply(params, x, state=model_state, key=key, train=True)
        acc = (logits.argmax(-1) == y).float().mean()
        return F.cross_entropy(logits, y), (model_state, {"acc": acc})

    opt = torchfn.optim.adam(0.01)
    step = torchfn.make_train_step(loss_fn, opt, has_aux=True)
    n = 3
    keys = random.split(random.key(0), n)
    members = [
        torchfn.TrainState.create(model.init(k), opt, key=random.fold_in(k, 1),
                                  model_state=model.init_state())
        for k in keys
    ]
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(6, 3, generator=g), torch.randint(0, 2, (6,), generator=g))
               for _ in range(2)]

    stacked, vstep = tree.stack(members), ensemble_step(step)
    for batch in batches:
        stacked, metrics = vstep(stacked, batch)
    looped = []
    for s in members:
        for batch in batches:
            s, m = step(s, batch)
        looped.append((s, m))
    assert_trees_close(stacked.params, tree.stack([s.params for s, _ in looped]),
                       rtol=1e-5, atol=1e-6)
    assert_trees_close(stacked.model_state, tree.stack([s.model_state for s, _ in looped]),
                       rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics["loss"], torch.stack([m["loss"] for _, m in looped]),
                               rtol=1e-5, atol=1e-6)
    assert stacked.step.tolist() == [2] * n
    assert not torch.equal(stacked.params["net.0.weight"][0], stacked.params["net.0.weight"][1])


def test_train_step_with_a_batch_per_member_equals_loop():
    def loss_fn(params, model_state, batch, key):
        x, y = batch
        return F.mse_loss(MODEL.apply(params, x), y)

    opt = torchfn.optim.sgd(0.1)
    step = torchfn.make_train_step(loss_fn, opt)
    members = [torchfn.TrainState.create(p, opt, key=random.key(i))
               for i, p in enumerate(tree.unstack(ensemble_init(MODEL, random.key(1), 2)))]
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(2, 5, 3, generator=g), torch.randn(2, 5, 2, generator=g))
    new, _ = ensemble_step(step, split_batch=True)(tree.stack(members), batch)
    for i, s in enumerate(members):
        s, _ = step(s, (batch[0][i], batch[1][i]))
        assert_trees_close(tree.unstack(new.params)[i], s.params, rtol=1e-5, atol=1e-6)


def test_bad_input():
    with pytest.raises(ValueError, match="n must be an int >= 1, got 0"):
        ensemble_init(MODEL, random.key(0), 0)
    with pytest.raises(TypeError, match="init must be a torchfn.Model or a function"):
        ensemble_init(3, random.key(0), 2)
    with pytest.raises(ValueError, match=r"params must be stacked: .* leading sizes"):
        ensemble_size({"a": torch.ones(2, 3), "b": torch.ones(3)})
    params = ensemble_init(MODEL, random.key(0), 2)
    with pytest.raises(ValueError, match="leading member dim of size 2, got leaf 0 with shape"):
        ensemble_apply(MODEL.apply, params, torch.ones(3, 4, 3), split_inputs=True)
    step = ensemble_step(lambda s, b: (s, {}), split_batch=True)
    with pytest.raises(ValueError, match="batch: with split_batch=True"):
        step({"w": torch.ones(2, 3)}, torch.ones(3, 1))
