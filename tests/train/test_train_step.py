"""make_train_step: equals the nn.Module + torch.optim loop, accumulation == big batch,
loss scaling == GradScaler's skip rule, vmap over states == stacked steps."""

import copy

import optree
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import torchfn
from torchfn import optim, random, tree
from torchfn.train import NonFiniteLossError, PeakMemory, TrainState, make_train_step


def make_net(din=6, width=8, dout=3, seed=0, bn=False):
    """An nn.Module oracle whose weights come from a key (no global RNG)."""
    layers = [nn.Linear(din, width, bias=not bn)]  # a bias before BatchNorm has ~0 grad
    if bn:
        layers.append(nn.BatchNorm1d(width))
    layers += [nn.Tanh(), nn.Linear(width, dout)]
    net = nn.Sequential(*layers)
    model = torchfn.Model(net)
    net.load_state_dict(model.state_dict(model.init(random.key(seed)), model.init_state()))
    return net


def make_data(n=16, din=6, dout=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, din, generator=g), torch.randint(0, dout, (n,), generator=g)


def model_loss(model, train=False):
    def loss_fn(params, model_state, batch, key):
        x, y = batch
        if train:
            logits, model_state = model.apply(params, x, state=model_state, key=key, train=True)
        else:
            logits = model.apply(params, x, state=model_state)
        loss = F.cross_entropy(logits, y)
        acc = (logits.argmax(-1) == y).float().mean()
        return loss, (model_state, {"acc": acc})

    return loss_fn


def start(net, opt, **kw):
    model = torchfn.Model(net)
    params, ms = model.extract(net)
    return model, TrainState.create(params, opt, key=random.key(0), model_state=ms, **kw)


def assert_close_trees(a, b, **tol):
    la, lb = optree.tree_leaves(a), optree.tree_leaves(b)
    assert len(la) == len(lb)
    for u, v in zip(la, lb):
        torch.testing.assert_close(u, v, **tol)


@pytest.mark.parametrize("bn", [False, True], ids=["mlp", "batchnorm"])
def test_matches_module_and_torch_adam(bn):
    """5 steps == nn.Module + torch.optim.Adam + backward (BatchNorm stats included)."""
    net = make_net(bn=bn)
    ref = copy.deepcopy(net).train()
    torch_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    model, state = start(net, optim.adam(1e-2))
    step = make_train_step(model_loss(model, train=True), optim.adam(1e-2), has_aux=True)
    for i in range(5):
        x, y = make_data(seed=i)
        torch_opt.zero_grad()
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        torch_opt.step()
        state, metrics = step(state, (x, y))
        torch.testing.assert_close(metrics["loss"], ref_loss.detach())
    want_params, want_state = model.extract(ref)
    assert_close_trees(state.params, want_params, rtol=1e-5, atol=1e-6)
    assert_close_trees(state.model_state, want_state, rtol=1e-5, atol=1e-6)
    assert int(state.step) == 5
    assert set(metrics) == {"loss", "grad_norm", "acc"}


@settings(max_examples=8)
@given(k=st.sampled_from([2, 4]), seed=st.integers(0, 1000))
def test_accumulate_equals_full_batch(k, seed):
    net = make_net(seed=seed)
    model, state = start(net, optim.sgd(0.5, momentum=0.9))
    batch = make_data(n=8, seed=seed + 1)
    full = make_train_step(model_loss(model), optim.sgd(0.5, momentum=0.9), has_aux=True)
    acc = make_train_step(model_loss(model), optim.sgd(0.5, momentum=0.9), has_aux=True,
                          accumulate=k)
    s1, s2 = state, state
    for _ in range(2):
        s1, m1 = full(s1, batch)
        s2, m2 = acc(s2, batch)
    assert_close_trees(s1.params, s2.params, rtol=1e-5, atol=1e-6)
    assert_close_trees(s1.opt_state, s2.opt_state, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m1["loss"], m2["loss"])
    torch.testing.assert_close(m1["grad_norm"], m2["grad_norm"])


def test_clip_norm_equals_clip_grad_norm():
    net = make_net()
    ref = copy.deepcopy(net)
    torch_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model, state = start(net, optim.sgd(0.1))
    step = make_train_step(model_loss(model), optim.sgd(0.1), has_aux=True, clip_norm=0.05)
    for i in range(3):
        x, y = make_data(seed=i)
        torch_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        want_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        torch_opt.step()
        state, metrics = step(state, (x, y))
        torch.testing.assert_close(metrics["grad_norm"], want_norm)
        assert metrics["grad_norm"] > 0.05  # the clip was active
    assert_close_trees(state.params, model.extract(ref)[0], rtol=1e-5, atol=1e-7)


def test_keys_are_fold_in_of_step_and_root_key_stays():
    seen = []

    def loss_fn(params, model_state, batch, key):
        seen.append(key)
        return (params["w"] * batch).sum()

    opt = optim.sgd(0.1)
    state = TrainState.create({"w": torch.ones(2)}, opt, key=random.key(3))
    step = make_train_step(loss_fn, opt)
    for _ in range(3):
        state, _ = step(state, torch.ones(2))
    assert torch.equal(state.key, random.key(3))
    for i, k in enumerate(seen):
        assert torch.equal(k, random.fold_in(random.key(3), i))
    seen.clear()
    step2 = make_train_step(loss_fn, opt, accumulate=2)
    step2(state, torch.ones(2, 2))
    base = random.fold_in(random.key(3), 3)
    assert [k.tolist() for k in seen] == [random.fold_in(base, i).tolist() for i in range(2)]


def test_lr_metric_from_injected_hyperparams():
    sched = optim.warmup_cosine(0.1, 2, 10)
    opt = optim.inject_hyperparams(optim.adam)(lr=sched)
    state = TrainState.create({"w": torch.ones(2)}, opt, key=random.key(0))
    step = make_train_step(lambda p, s, b, k: (p["w"] * b).sum(), opt)
    lrs = []
    for _ in range(3):
        state, m = step(state, torch.ones(2))
        lrs.append(float(m["lr"]))
    assert lrs[0] != lrs[1] and all(lr > 0 for lr in lrs[1:])


def test_loss_scale_matches_unscaled_and_skips_nonfinite():
    net = make_net()
    model, plain = start(net, optim.adam(1e-2))
    _, scaled = start(net, optim.adam(1e-2), loss_scale=optim.DynamicLossScale(2.0**10))
    loss_fn = model_loss(model)
    step = make_train_step(loss_fn, optim.adam(1e-2), has_aux=True)
    x, y = make_data()
    s_plain, _ = step(plain, (x, y))
    s_scaled, m = step(scaled, (x, y))
    # scaling by a power of two is exact: same params bit for bit
    for u, v in zip(optree.tree_leaves(s_plain.params), optree.tree_leaves(s_scaled.params)):
        assert torch.equal(u, v)
    assert float(m["skipped"]) == 0.0 and float(m["loss_scale"]) == 2.0**10

    def overflow(params, model_state, batch, key):  # inf gradient on one step
        loss, aux = loss_fn(params, model_state, batch[:2], key)
        return loss * batch[2], aux

    step_inf = make_train_step(overflow, optim.adam(1e-2), has_aux=True)
    s2, m2 = step_inf(s_scaled, (x, y, torch.tensor(float("inf"))))
    assert float(m2["skipped"]) == 1.0
    assert float(s2.loss_scale.loss_scale) == 2.0**9  # backed off, as GradScaler
    assert int(s2.step) == 2
    for u, v in zip(optree.tree_leaves((s2.params, s2.opt_state)),
                    optree.tree_leaves((s_scaled.params, s_scaled.opt_state))):
        assert torch.equal(u, v)  # update skipped


def test_nonfinite_loss_without_scale_names_the_step():
    def loss_fn(params, model_state, batch, key):
        return (params["w"] * batch).sum()

    opt = optim.adam(0.1)
    state = TrainState.create({"w": torch.ones(2)}, opt, key=random.key(0))
    step = make_train_step(loss_fn, opt)
    state, _ = step(state, torch.ones(2))
    state, _ = step(state, torch.ones(2))
    with pytest.raises(NonFiniteLossError, match="step 2"):
        step(state, torch.tensor([1.0, float("nan")]))
    # inside vmap the step cannot raise: it skips the update and reports it
    states = tree.stack([state, state])
    batch = torch.tensor([[1.0, 1.0], [1.0, float("nan")]])
    new, m = torch.func.vmap(step)(states, batch)
    assert m["nonfinite"].tolist() == [False, True]
    assert torch.equal(new.params["w"][1], state.params["w"])
    assert not torch.equal(new.params["w"][0], state.params["w"])


def test_vmap_ensemble_equals_stacked_steps():
    nets = [make_net(seed=s) for s in range(3)]
    opt = optim.adam(1e-2)
    model = torchfn.Model(nets[0])
    states = [TrainState.create(model.extract(n)[0], opt, key=random.key(s))
              for s, n in enumerate(nets)]
    step = make_train_step(model_loss(model), opt, has_aux=True)
    batch = make_data()
    want = []
    for s in states:
        for _ in range(2):
            s, m = step(s, batch)
        want.append((s, m))
    stacked = tree.stack(states)
    vstep = torch.func.vmap(step, in_dims=(0, None))
    for _ in range(2):
        stacked, metrics = vstep(stacked, batch)
    for i, (s, m) in enumerate(want):
        assert_close_trees(tree.unstack(stacked)[i], s, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(metrics["loss"][i], m["loss"])


def test_compiled_step_equals_eager():
    net = make_net()
    model, state = start(net, optim.adam(1e-2))
    step = make_train_step(model_loss(model), optim.adam(1e-2), has_aux=True, clip_norm=1.0)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    s1, s2 = state, state
    for i in range(2):
        batch = make_data(seed=i)
        s1, m1 = step(s1, batch)
        s2, m2 = compiled(s2, batch)
    assert_close_trees(s1.params, s2.params, rtol=1e-5, atol=1e-6)
    assert not bool(m2["nonfinite"])


def test_policy_bfloat16_compute():
    net = make_net()
    policy = optim.Policy.from_string("mixed_bfloat16")
    model, state = start(net, optim.sgd(0.1))
    dtypes = []

    def loss_fn(params, model_state, batch, key):
        dtypes.append((params["0.weight"].dtype, batch[0].dtype, batch[1].dtype))
        return model_loss(model)(params, model_state, batch, key)

    full = make_train_step(model_loss(model), optim.sgd(0.1), has_aux=True)
    mixed = make_train_step(loss_fn, optim.sgd(0.1), has_aux=True, policy=policy)
    batch = make_data()
    s_full, m_full = full(state, batch)
    s_mixed, m_mixed = mixed(state, batch)
    assert dtypes == [(torch.bfloat16, torch.bfloat16, torch.int64)]
    assert m_mixed["loss"].dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in s_mixed.params.values())
    assert_close_trees(s_full.params, s_mixed.params, rtol=2e-2, atol=2e-3)


def test_peak_memory_close_to_backward_when_activations_dominate():
    """The eager step takes grads with autograd.grad (no create_graph): peak memory
    within 1.2x of nn.Module + backward() + torch.optim.Adam."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 64, generator=g)
    y = torch.randint(0, 10, (1024,), generator=g)
    layers = []
    for _ in range(6):
        layers += [nn.Linear(64, 64), nn.Tanh()]
    net = nn.Sequential(*layers, nn.Linear(64, 10))

    with PeakMemory() as mem:
        ref = copy.deepcopy(net)
        torch_opt = torch.optim.Adam(ref.parameters(), foreach=True)

        def module_step():
            torch_opt.zero_grad()
            F.cross_entropy(ref(x), y).backward()
            torch_opt.step()

        module_step()
        mem.reset_peak()
        module_step()
    module_peak = mem.peak

    model = torchfn.Model(net)
    opt = optim.adam(1e-3)
    with PeakMemory() as mem:
        state = TrainState.create(copy.deepcopy(model.extract(net)[0]), opt, key=random.key(0))
        step = make_train_step(lambda p, s, b, k: F.cross_entropy(model.apply(p, b[0]), b[1]),
                               opt)
        state, _ = step(state, (x, y))
        mem.reset_peak()
        state, _ = step(state, (x, y))
    assert mem.peak <= 1.2 * module_peak, (mem.peak, module_peak)


def test_bad_input():
    opt = optim.sgd(0.1)
    state = TrainState.create({"w": torch.ones(2)}, opt, key=random.key(0))
    loss_fn = lambda p, s, b, k: (p["w"] * b).sum()
    with pytest.raises(ValueError, match="accumulate must be an int >= 1, got 0"):
        make_train_step(loss_fn, opt, accumulate=0)
    with pytest.raises(ValueError, match="clip_norm must be a number > 0"):
        make_train_step(loss_fn, opt, clip_norm=-1.0)
    with pytest.raises(TypeError, match="optimizer must be a gradient transformation"):
        make_train_step(loss_fn, object())
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        make_train_step(3, opt)
    with pytest.raises(ValueError, match="batch size 3 is not divisible by accumulate=2"):
        make_train_step(loss_fn, opt, accumulate=2)(state, torch.ones(3, 2))
    with pytest.raises(TypeError, match="0-d floating-point loss"):
        make_train_step(lambda p, s, b, k: p["w"] * b, opt)(state, torch.ones(2))
    with pytest.raises(TypeError, match=r"must return \(loss, \(model_state, aux\)\)"):
        make_train_step(loss_fn, opt, has_aux=True)(state, torch.ones(2))
    with pytest.raises(TypeError, match="state must be a TrainState"):
        make_train_step(loss_fn, opt)(tuple(state), torch.ones(2))

    class BadOpt:  # returns updates whose tree does not match the params
        init = staticmethod(lambda params: ())

        @staticmethod
        def update(grads, state, params=None):
            return {"w": grads["w"], "extra": grads["w"]}, state

    bad_state = TrainState.create({"w": torch.ones(2)}, BadOpt(), key=random.key(0))
    with pytest.raises(ValueError, match="tree structures"):
        make_train_step(loss_fn, BadOpt())(bad_state, torch.ones(2))
    with pytest.raises(TypeError, match="floating-point tensors"):
        TrainState.create({"w": torch.ones(2, dtype=torch.int64)}, opt, key=random.key(0))
    with pytest.raises(TypeError, match="loss_scale must be"):
        TrainState.create({"w": torch.ones(2)}, opt, key=random.key(0), loss_scale=2.0)
