"""torchfn.Model: pure init/apply equal the nn.Module, compose with torch.func, keyed dropout."""

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.func import grad, jacrev, jvp, vmap

from torchfn import Model, random

torch.set_default_dtype(torch.float32)


def data(*shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(*shape, generator=g, dtype=dtype) * 2 - 1) + 0.1  # never all zeros


def mlp(dropout=0.0):
    return nn.Sequential(
        nn.Linear(4, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 3)
    ).double()


def cnn():
    return nn.Sequential(
        nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 3 * 3, 2)
    ).double()


def encoder(dropout=0.0):
    return nn.TransformerEncoderLayer(8, 2, 16, dropout=dropout, batch_first=True).double()


CASES = {  # name -> (module factory, input shape of ONE example)
    "mlp": (mlp, (4,)),
    "cnn": (cnn, (2, 5, 5)),
    "encoder": (encoder, (3, 8)),
}


def setup(name, seed=0):
    make, shape = CASES[name]
    module = make()
    model = Model(module)
    params = model.init(random.key(seed))
    state = model.init_state()
    x = data(3, *shape, seed=seed + 1)
    return module, model, params, state, x


def loaded(module, params, state, train):
    module.load_state_dict({**params, **state})
    return module.train(train)


# ------------------------------------------------------------------ names, init


@pytest.mark.parametrize("name", list(CASES))
def test_params_flatten_to_state_dict_names(name):
    module, model, params, state, _ = setup(name)
    sd = module.state_dict()
    assert list(params) == [n for n, _ in module.named_parameters()]
    assert list(state) == [n for n, _ in module.named_buffers()]
    assert set(params) | set(state) == set(sd)
    for n, t in {**params, **state}.items():
        assert t.shape == sd[n].shape and t.dtype == sd[n].dtype and not t.requires_grad
    assert (state == {}) == (name != "cnn")


@given(st.integers(0, 2**31 - 1), st.integers(0, 2**31 - 1))
def test_init_deterministic_in_key_and_different_keys_differ(s1, s2):
    model = Model(mlp())
    a, b = model.init(random.key(s1)), model.init(random.key(s1))
    assert all(torch.equal(a[n], b[n]) for n in a)
    if s1 != s2:
        c = model.init(random.key(s2))
        assert all(not torch.equal(a[n], c[n]) for n in a)


def test_init_follows_reset_parameters_scheme():
    module = nn.Sequential(nn.Linear(400, 300), nn.BatchNorm1d(300), nn.LayerNorm(300))
    module.eval()
    p = Model(module).init(random.key(3))
    bound = 1 / math.sqrt(400)  # kaiming_uniform(a=sqrt(5)) and the bias bound of nn.Linear
    w = p["0.weight"]
    assert w.abs().max() <= bound and w.abs().max() > 0.99 * bound
    assert abs(w.std().item() - bound / math.sqrt(3)) < 0.01 * bound  # uniform std
    assert abs(w.mean().item()) < 0.01 * bound
    assert p["0.bias"].abs().max() <= bound
    for n in ("1.weight", "2.weight"):
        assert torch.equal(p[n], torch.ones(300))
    for n in ("1.bias", "2.bias"):
        assert torch.equal(p[n], torch.zeros(300))
    state = Model(module).init_state()
    assert torch.equal(state["1.running_mean"], torch.zeros(300))
    assert torch.equal(state["1.running_var"], torch.ones(300))
    assert state["1.num_batches_tracked"].item() == 0


def test_init_parent_scheme_overrides_children():
    # MultiheadAttention zeroes out_proj.bias after Linear.reset_parameters drew it
    p = Model(nn.MultiheadAttention(8, 2)).init(random.key(0))
    assert torch.equal(p["out_proj.bias"], torch.zeros(8))
    assert torch.equal(p["in_proj_bias"], torch.zeros(24))
    bound = math.sqrt(6 / (8 + 24))  # xavier_uniform on in_proj_weight (24, 8)
    assert p["in_proj_weight"].abs().max() <= bound
    assert p["in_proj_weight"].abs().max() > 0.8 * bound


def test_global_rng_is_untouched():
    module, x = encoder(dropout=0.3), data(2, 3, 8)
    before = torch.get_rng_state()
    model = Model(module)
    params = model.init(random.key(0))
    model.init_state()
    model.apply(params, x)
    model.apply(params, x, key=random.key(1), train=True)
    vmap(lambda k: model.apply(params, x, key=k, train=True)[0])(random.split(random.key(2), 2))
    assert torch.equal(torch.get_rng_state(), before)


def test_module_is_never_mutated():
    module = cnn().train()
    before = {n: t.clone() for n, t in module.state_dict().items()}
    model = Model(module)
    params, state = model.init(random.key(0)), model.init_state()
    model.apply(params, data(4, 2, 5, 5), state=state, train=True)
    assert module.training and all(m.training for m in module.modules())
    assert all(torch.equal(before[n], t) for n, t in module.state_dict().items())
    assert all(t.device.type == "cpu" for t in module.state_dict().values())


# ------------------------------------------------------------ apply == forward


@pytest.mark.parametrize("name", list(CASES))
def test_apply_equals_module_forward_eval(name):
    module, model, params, state, x = setup(name)
    ref = loaded(module, params, state, train=False)(x)
    out = model.apply(params, x, state=state)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", list(CASES))
def test_apply_equals_module_forward_train_and_returns_new_state(name):
    module, model, params, state, x = setup(name)
    state_before = {n: t.clone() for n, t in state.items()}
    out, new_state = model.apply(params, x, state=state, train=True)
    ref = loaded(module, params, state, train=True)(x)  # updates module's buffers
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)
    sd = module.state_dict()
    assert set(new_state) == set(state)
    for n in new_state:
        assert torch.allclose(new_state[n], sd[n], rtol=1e-12, atol=1e-12)
        assert torch.equal(state[n], state_before[n])  # input state unchanged
    if name == "cnn":
        assert new_state["1.num_batches_tracked"].item() == 1
        assert not torch.equal(new_state["1.running_mean"], state["1.running_mean"])


# ---------------------------------------------------------------- transforms


def _autograd_grad(module, params, state, x, train):
    module = loaded(module, params, state, train)
    module.zero_grad()
    module(x).square().sum().backward()
    return {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize("name", list(CASES))
def test_grad_equals_autograd_on_module(name):
    module, model, params, state, x = setup(name)
    g = grad(lambda p: model.apply(p, x, state=state).square().sum())(params)
    ref = _autograd_grad(module, params, state, x, train=False)
    assert all(torch.allclose(g[n], ref[n], rtol=1e-10, atol=1e-12) for n in params)
    gt = grad(lambda p: model.apply(p, x, state=state, train=True)[0].square().sum())(params)
    ref = _autograd_grad(module, params, state, x, train=True)
    assert all(torch.allclose(gt[n], ref[n], rtol=1e-10, atol=1e-12) for n in params)


@pytest.mark.parametrize("name", list(CASES))
def test_vmap_over_examples_equals_loop(name):
    _, model, params, state, x = setup(name)
    batched = vmap(lambda xi: model.apply(params, xi[None], state=state)[0])(x)
    looped = torch.stack([model.apply(params, xi[None], state=state)[0] for xi in x])
    assert torch.allclose(batched, looped, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", list(CASES))
def test_per_example_grads_equal_loop(name):
    _, model, params, state, x = setup(name)

    def loss(p, xi):
        return model.apply(p, xi[None], state=state).square().sum()

    per = vmap(grad(loss), in_dims=(None, 0))(params, x)
    for i in range(x.shape[0]):
        gi = grad(loss)(params, x[i])
        assert all(torch.allclose(per[n][i], gi[n], rtol=1e-10, atol=1e-12) for n in params)


@pytest.mark.parametrize("name", list(CASES))
def test_jvp_equals_jacrev_and_autograd_jacobian(name):
    module, model, params, state, x = setup(name)
    x0 = x[:1]
    f = lambda xi: model.apply(params, xi, state=state)
    J = jacrev(f)(x0)  # (out..., in...)
    ref_module = loaded(module, params, state, train=False)
    J_ref = torch.autograd.functional.jacobian(ref_module, x0)
    assert torch.allclose(J, J_ref, rtol=1e-10, atol=1e-12)
    v = data(*x0.shape, seed=7)
    _, tangent = jvp(f, (x0,), (v,))
    expected = (J.reshape(tangent.numel(), -1) @ v.reshape(-1)).reshape(tangent.shape)
    assert torch.allclose(tangent, expected, rtol=1e-10, atol=1e-12)
    # and with respect to the parameters
    _, tp = jvp(lambda p: model.apply(p, x0, state=state), (params,), (params,))
    Jp = jacrev(lambda p: model.apply(p, x0, state=state))(params)
    exp = sum(
        (Jp[n].reshape(tp.numel(), -1) @ params[n].reshape(-1)).reshape(tp.shape) for n in params
    )
    assert torch.allclose(tp, exp, rtol=1e-9, atol=1e-11)


def test_compile_equals_eager():
    _, model, params, state, x = setup("encoder")  # eval: the MHA / SDPA path
    f = torch.compile(lambda p, xb: model.apply(p, xb, state=state))
    assert torch.allclose(f(params, x), model.apply(params, x, state=state), rtol=1e-10)
    _, model, params, state, x = setup("cnn")  # train: BatchNorm returns new state
    # aot_eager: dynamo + AOTAutograd functionalise the in-place stat updates (no C++ codegen)
    f = torch.compile(lambda p, s, xb: model.apply(p, xb, state=s, train=True), backend="aot_eager")
    out, new_state = f(params, state, x)
    ref, ref_state = model.apply(params, x, state=state, train=True)
    assert torch.allclose(out, ref, rtol=1e-10)
    assert all(torch.allclose(new_state[n], ref_state[n], rtol=1e-10) for n in ref_state)
    assert state["1.num_batches_tracked"].item() == 0


@pytest.mark.slow
def test_compile_with_keyed_dropout_equals_eager():  # the threefry compile takes ~1 min here
    module = mlp(dropout=0.5)
    model = Model(module)
    params, x = model.init(random.key(0)), data(4, 4)
    f = torch.compile(lambda p, xb, k: model.apply(p, xb, key=k, train=True)[0])
    for s in (1, 2):
        k = random.key(s)
        assert torch.equal(f(params, x, k), model.apply(params, x, key=k, train=True)[0])


def test_vmap_over_data_with_batchnorm_train_fails_eval_works():
    _, model, params, state, x = setup("cnn")
    with pytest.raises(RuntimeError):  # documented: per-example stats into one buffer
        vmap(lambda xi: model.apply(params, xi[None], state=state, train=True)[0])(x)
    out = vmap(lambda xi: model.apply(params, xi[None], state=state))(x)
    assert out.shape == (3, 1, 2)


# ------------------------------------------------------------------- dropout


def test_dropout_same_key_same_output_different_keys_differ():
    model = Model(mlp(dropout=0.5))
    params, x = model.init(random.key(0)), data(8, 4)
    run = lambda k: model.apply(params, x, key=k, train=True)[0]
    assert torch.equal(run(random.key(1)), run(random.key(1)))
    assert not torch.equal(run(random.key(1)), run(random.key(2)))
    assert torch.equal(model.apply(params, x), model.apply(params, x, key=random.key(5)))


def test_dropout_vmap_over_keys_equals_loop_and_masks_differ():
    model = Model(encoder(dropout=0.4))
    params, x = model.init(random.key(0)), data(2, 3, 8)
    keys = random.split(random.key(1), 4)
    run = lambda k: model.apply(params, x, key=k, train=True)[0]
    batched = vmap(run)(keys)
    looped = torch.stack([run(k) for k in keys])
    assert torch.allclose(batched, looped, rtol=1e-12, atol=1e-12)
    assert all(not torch.equal(batched[0], batched[i]) for i in range(1, 4))


def test_dropout_per_example_masks_under_vmap_over_data_and_keys():
    model = Model(nn.Dropout(0.5))
    x = torch.ones(4, 64)
    keys = random.split(random.key(0), 4)
    out = vmap(lambda xi, k: model.apply({}, xi, key=k, train=True)[0])(x, keys)
    masks = out != 0
    assert all(not torch.equal(masks[0], masks[i]) for i in range(1, 4))
    assert torch.equal(out[masks], torch.full_like(out[masks], 2.0))  # 1 / (1 - p)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_rate_and_scaling(p):
    out, _ = Model(nn.Dropout(p)).apply({}, torch.ones(100_000), key=random.key(0), train=True)
    kept = out != 0
    assert abs(kept.double().mean().item() - (1 - p)) < 0.01
    assert torch.allclose(out[kept], torch.full_like(out[kept], 1 / (1 - p)))


@pytest.mark.parametrize(
    "layer, shape, mask_shape",
    [
        (nn.Dropout1d(0.5), (8, 16, 5), (8, 16, 1)),
        (nn.Dropout1d(0.5), (16, 5), (16, 1)),
        (nn.Dropout2d(0.5), (8, 16, 3, 3), (8, 16, 1, 1)),
        (nn.Dropout3d(0.5), (16, 2, 2, 2), (16, 1, 1, 1)),
        (nn.FeatureAlphaDropout(0.5), (8, 16, 3), (8, 16, 1)),
    ],
)
def test_channel_dropout_drops_whole_channels(layer, shape, mask_shape):
    x = data(*shape, dtype=torch.float32).abs() + 0.5
    out, _ = Model(layer).apply({}, x, key=random.key(0), train=True)
    ratio = out / x
    reduce = tuple(i for i, s in enumerate(mask_shape) if s == 1)
    lo, hi = ratio.amin(dim=reduce, keepdim=True), ratio.amax(dim=reduce, keepdim=True)
    if isinstance(layer, nn.FeatureAlphaDropout):
        dropped = (out - out.amin(dim=reduce, keepdim=True)).abs().amax(dim=reduce) < 1e-6
        assert 0 < dropped.float().mean() < 1
    else:
        assert torch.allclose(lo, hi)  # one draw per channel
        assert lo.shape == mask_shape and {round(v, 4) for v in lo.unique().tolist()} == {0, 2}


def test_alpha_dropout_keeps_selu_moments():
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
    out, _ = Model(nn.AlphaDropout(0.3)).apply({}, x, key=random.key(0), train=True)
    assert abs(out.mean().item()) < 0.01 and abs(out.var().item() - 1) < 0.02
    assert (out != x).float().mean().item() > 0.25  # some dropped


def test_mha_need_weights_path_is_keyed():
    mha = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True).double()
    model = Model(mha)
    params, x = model.init(random.key(0)), data(2, 4, 8)
    run = lambda k: model.apply(params, x, x, x, key=k, train=True)[0]  # need_weights=True
    (o1, w1), (o2, w2) = run(random.key(1)), run(random.key(1))
    assert torch.equal(o1, o2) and torch.equal(w1, w2)
    assert not torch.equal(run(random.key(2))[0], o1)
    eval_out, _ = model.apply(params, x, x, x)
    ref, _ = loaded(mha, params, {}, train=False)(x, x, x)
    assert torch.allclose(eval_out, ref, rtol=1e-12, atol=1e-12)


@given(
    causal=st.booleans(),
    mask_kind=st.sampled_from([None, "bool", "float"]),
    seed=st.integers(0, 1000),
)
def test_keyed_sdpa_math_equals_torch_sdpa_when_nothing_is_dropped(causal, mask_kind, seed):
    from torchfn.core._dropout import KeyedRandomness

    q, k, v = (data(2, 2, 5, 4, seed=seed + i) for i in range(3))
    mask = None
    if mask_kind == "bool":
        mask = data(5, 5, seed=seed + 3) > -0.5
        mask[:, 0] = True  # no fully masked row (torch gives NaN or 0 there by backend)
    elif mask_kind == "float":
        mask = data(5, 5, seed=seed + 3)
    if causal and mask is not None:
        causal = False  # torch forbids both
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    with KeyedRandomness(random.key(seed)):  # p tiny: keep-probability rounds to 1
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=1e-12,
                                             is_causal=causal)  # fmt: skip
    assert torch.allclose(out, ref, rtol=1e-10, atol=1e-12)


def test_dropout_in_train_mode_without_key_is_an_error():
    model = Model(mlp(dropout=0.5))
    params = model.init(random.key(0))
    with pytest.raises(ValueError, match="key: the module runs F.dropout.*key is None"):
        model.apply(params, data(2, 4), train=True)
    model = Model(encoder(dropout=0.1))
    params = model.init(random.key(0))
    with pytest.raises(ValueError, match="key is None"):
        model.apply(params, data(2, 3, 8), train=True)
    # no active dropout: train without a key is fine
    Model(mlp()).apply(Model(mlp()).init(random.key(0)), data(2, 4), train=True)


def test_global_rng_draws_in_forward_are_errors_in_train_mode():
    class Noisy(nn.Module):
        def forward(self, x):
            return x + torch.randn_like(x)

    with pytest.raises(ValueError, match="randn_like.*global RNG"):
        Model(Noisy()).apply({}, torch.ones(2), train=True)
    model = Model(nn.LSTM(3, 4, num_layers=2, dropout=0.5))
    with pytest.raises(ValueError, match="RNN modules.*global RNG"):
        model.apply(model.init(random.key(0)), torch.ones(2, 1, 3), train=True)


# ----------------------------------------------------------- ties, constants


class TinyLM(nn.Module):
    def __init__(self, vocab=11, dim=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("causal", torch.ones(4, 4).tril(), persistent=False)

    def forward(self, tokens):
        h = self.emb(tokens)  # (B, T, D)
        h = self.causal[: h.shape[1], : h.shape[1]] @ torch.tanh(self.mix(h))
        return self.head(h)  # (B, T, V)


def test_tied_weights():
    module = TinyLM().double()
    model = Model(module)
    params = model.init(random.key(0))
    assert model.tied == {"head.weight": "emb.weight"}
    assert set(params) == {"emb.weight", "mix.weight", "mix.bias"}
    assert model.init_state() == {}  # the causal mask is a constant, not state
    tokens = torch.tensor([[1, 4, 2, 9]])
    out = model.apply(params, tokens)
    module.load_state_dict(model.state_dict(params))  # strict: tied names expanded
    assert torch.allclose(out, module(tokens), rtol=1e-12)
    g = grad(lambda p: model.apply(p, tokens).square().sum())(params)
    module.zero_grad()
    module(tokens).square().sum().backward()
    assert torch.allclose(g["emb.weight"], module.emb.weight.grad, rtol=1e-10)  # both uses
    with pytest.raises(ValueError, match="tied names \\['head.weight'\\] must be left out"):
        model.apply({**params, "head.weight": params["emb.weight"]}, tokens)


@pytest.mark.parametrize("name", [*CASES, "tied"])
@pytest.mark.parametrize("train", [False, True])
def test_apply_swaps_as_functional_call_does_and_always_swaps_back(name, train):
    """Eager ``apply`` swaps the tensors in from a table made once (``core/_swap.py``);
    it must give ``functional_call``'s result (tied names, BatchNorm state, constant
    buffers), leave the skeleton's own tensors in place after a call that raises, and
    nest (an ``apply`` of the same model inside a forward)."""
    if name == "tied":
        module = TinyLM().double()
        model, x = Model(module), torch.tensor([[1, 4, 2, 9]])
        params, state = model.init(random.key(0)), {}
    else:
        module, model, params, state, x = setup(name)
    skeleton = model._train_skeleton if train else model._eval_skeleton
    own = {n: t for n, t in [*skeleton.named_parameters(), *skeleton.named_buffers()]}
    tensors = {n: t.clone() for n, t in {**params, **state, **model._consts}.items()}
    tensors.update({alias: tensors[name] for alias, name in model.tied.items()})
    want = torch.func.functional_call(skeleton, tensors, (x,))
    out = model.apply(params, x, state=state, train=train)
    torch.testing.assert_close(out[0] if train else out, want, rtol=0, atol=0)
    with pytest.raises((RuntimeError, AssertionError)):
        model.apply(params, x[..., :1] if name != "tied" else x.float(), state=state,
                    train=train)  # a shape or dtype error inside the forward
    assert all(t is own[n] for n, t in [*skeleton.named_parameters(),
                                         *skeleton.named_buffers()])

    class Twice(nn.Module):  # re-enters apply of the same model inside its forward
        def forward(self, x):
            inner = model.apply(params, x, state=state)
            return inner, model.apply(params, x, state=state)

    outer = Model(Twice())
    a, b = outer.apply({}, x)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    twin = copy.deepcopy(model)  # its swap table follows its own skeleton
    again = twin.apply(params, x, state=state, train=train)
    torch.testing.assert_close(again[0] if train else again, want, rtol=0, atol=0)


def test_parameters_without_reset_are_copied_and_warned():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.gain = nn.Parameter(torch.full((3,), 0.7))  # no reset_parameters covers it

        def forward(self, x):
            return self.lin(x) * self.gain

    module = Scaled()
    with pytest.warns(UserWarning, match=r"\['gain'\] are not set by any reset_parameters"):
        model = Model(module)
    assert model.copied == ("gain",)
    a, b = model.init(random.key(0)), model.init(random.key(1))
    assert torch.equal(a["gain"], module.gain.detach()) and torch.equal(a["gain"], b["gain"])
    assert not torch.equal(a["lin.weight"], b["lin.weight"])
    a["gain"].mul_(2)  # a returned copy: the model's snapshot is unaffected
    assert torch.equal(model.init(random.key(0))["gain"], module.gain.detach())

    class WithReset(Scaled):
        def reset_parameters(self):
            nn.init.uniform_(self.gain, 0.5, 1.5)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = Model(WithReset())
    a, b = model.init(random.key(0)), model.init(random.key(1))
    assert model.copied == () and not torch.equal(a["gain"], b["gain"])
    assert ((a["gain"] >= 0.5) & (a["gain"] <= 1.5)).all()


def test_reset_needing_real_data_and_uncovered_buffers():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(3))
            self.register_buffer("scale", torch.tensor(2.5))  # persistent, no reset covers it
            self.reset_parameters()

        def reset_parameters(self):  # .item() cannot run on the meta device
            nn.init.normal_(self.w)
            with torch.no_grad():
                self.w.mul_(1.0 / max(self.w.abs().max().item(), 1e-6))

        def forward(self, x):
            return x * self.w * self.scale

    module = Odd()
    model = Model(module)
    a, b = model.init(random.key(0)), model.init(random.key(1))
    assert torch.equal(a["w"], model.init(random.key(0))["w"]) and not torch.equal(a["w"], b["w"])
    assert torch.isclose(a["w"].abs().max(), torch.tensor(1.0))
    assert model.copied == ("scale",) and torch.equal(model.init_state()["scale"], module.scale)


def test_ensemble_vmap_over_stacked_params_equals_loop():
    from torchfn import tree

    model = Model(mlp())
    members = [model.init(k) for k in random.split(random.key(0), 3)]
    x = data(5, 4)
    out = vmap(lambda p: model.apply(p, x))(tree.stack(members))
    assert torch.allclose(out, torch.stack([model.apply(p, x) for p in members]), rtol=1e-12)


def test_extract_from_a_pretrained_module():
    module = cnn()
    module.train()(data(4, 2, 5, 5))  # move running stats away from init
    module.eval()
    model = Model(module)
    params, state = model.extract(module)
    x = data(3, 2, 5, 5, seed=3)
    assert torch.allclose(model.apply(params, x, state=state), module(x), rtol=1e-12)
    with pytest.raises(ValueError, match="module: lacks tensors"):
        model.extract(mlp())


def test_keyword_inputs_and_device_dtype_follow_module():
    module = nn.MultiheadAttention(8, 2, batch_first=True)  # float32
    model = Model(module)
    params = model.init(random.key(0))
    assert all(t.dtype == torch.float32 for t in params.values())
    x = data(1, 3, 8, dtype=torch.float32)
    out, weights = model.apply(params, x, x, x, need_weights=True, average_attn_weights=False)
    assert weights.shape == (1, 2, 3, 3)


# ------------------------------------------------------------------ bad input


def test_bad_input_errors():
    with pytest.raises(TypeError, match="module must be a torch.nn.Module, got function"):
        Model(lambda x: x)
    with pytest.raises(ValueError, match="uninitialized lazy tensor"):
        Model(nn.LazyLinear(3))
    _, model, params, state, x = setup("cnn")
    with pytest.raises(TypeError, match="params must be a dict"):
        model.apply(list(params.values()), x, state=state)
    with pytest.raises(ValueError, match=r"missing \['0.bias'\]"):
        model.apply({n: t for n, t in params.items() if n != "0.bias"}, x, state=state)
    with pytest.raises(ValueError, match=r"unexpected \['extra'\]"):
        model.apply({**params, "extra": torch.ones(1)}, x, state=state)
    with pytest.raises(ValueError, match=r"params\['0.weight'\] has shape \(4, 2\), expected"):
        model.apply({**params, "0.weight": torch.ones(4, 2)}, x, state=state)
    with pytest.raises(TypeError, match=r"params\['0.bias'\] must be a tensor, got float"):
        model.apply({**params, "0.bias": 1.0}, x, state=state)
    with pytest.raises(ValueError, match="state: the Sequential has buffers.*init_state"):
        model.apply(params, x)
    with pytest.raises(ValueError, match=r"state: names do not match.*missing \['1.running_var'\]"):
        model.apply(params, x, state={n: t for n, t in state.items() if "var" not in n})
    with pytest.raises(ValueError, match=r"state\['1.running_mean'\] has shape \(3,\)"):
        model.apply(params, x, state={**state, "1.running_mean": torch.zeros(3)})
    with pytest.raises(TypeError, match="state must be a dict"):
        model.apply(params, x, state=[1])
    with pytest.raises(TypeError, match="train must be a bool, got 'yes'"):
        model.apply(params, x, state=state, train="yes")
    with pytest.raises(TypeError, match="key must be a torchfn.random key.*got a torch.float32"):
        model.apply(params, x, state=state, key=torch.zeros(2))
    with pytest.raises(TypeError, match="key must be a torchfn.random key.*got int"):
        model.init(0)
    with pytest.raises(ValueError, match=r"key must have shape \(2,\), got \(3, 2\).*tree.stack"):
        model.init(random.split(random.key(0), 3))
    with pytest.raises(ValueError, match=r"cannot run under vmap.*ensemble_init"):
        torch.func.vmap(model.init)(random.split(random.key(0), 3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_module_params_and_dropout_match_cpu():
    cpu_model = Model(encoder(dropout=0.3))
    gpu_model = Model(encoder(dropout=0.3).cuda())
    params = gpu_model.init(random.key(0))
    assert all(t.is_cuda for t in params.values())
    cpu_params = cpu_model.init(random.key(0))  # init runs on the CPU: same values
    assert all(torch.equal(params[n].cpu(), cpu_params[n]) for n in params)
    x = data(2, 3, 8)
    k = random.key(1)
    out, _ = gpu_model.apply(params, x.cuda(), key=k.cuda(), train=True)
    ref, _ = cpu_model.apply(cpu_params, x, key=k, train=True)
    assert torch.allclose(out.cpu(), ref, rtol=1e-6, atol=1e-8)  # same masks on both devices
