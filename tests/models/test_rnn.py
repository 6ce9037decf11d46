"""LSTM / GRU: nn.LSTM / nn.GRU's function, under every torch.func transform."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vmap

import torchfn
from torchfn import random
from torchfn.models import GRU, LSTM

PAIRS = {"LSTM": (LSTM, nn.LSTM), "GRU": (GRU, nn.GRU)}


def _pair(kind, seed, **kw):
    ours_cls, torch_cls = PAIRS[kind]
    ours = ours_cls(**kw).double()
    theirs = torch_cls(**kw).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.rand(p.shape, generator=g, dtype=p.dtype) * 0.8 - 0.4)
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


def _close(a, b, tol=1e-12):
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b))
    return a.shape == b.shape and torch.allclose(a, b, rtol=tol, atol=tol)


@given(
    kind=st.sampled_from(sorted(PAIRS)),
    seed=st.integers(0, 2**16),
    layers=st.integers(1, 2),
    bidirectional=st.booleans(),
    batch_first=st.booleans(),
    bias=st.booleans(),
    batch=st.sampled_from([None, 1, 3]),  # None: unbatched (T, F)
    T=st.integers(1, 6),
    with_state=st.booleans(),
    proj=st.sampled_from([0, 2]),  # LSTM only: h projected to 2 (LSTMP)
)
def test_equals_torch_module_with_its_state_dict(kind, seed, layers, bidirectional,
                                                 batch_first, bias, batch, T, with_state,
                                                 proj):
    kw = dict(input_size=3, hidden_size=5, num_layers=layers, bias=bias,
              batch_first=batch_first, bidirectional=bidirectional)
    proj = proj if kind == "LSTM" else 0
    if proj:
        kw["proj_size"] = proj
    ours, theirs = _pair(kind, seed, **kw)
    g = torch.Generator().manual_seed(seed + 1)
    shape = (T, 3) if batch is None else ((batch, T, 3) if batch_first else (T, batch, 3))
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    hx = None
    if with_state:
        LD = layers * (2 if bidirectional else 1)
        s = (LD, 5) if batch is None else (LD, batch, 5)
        s_h = (*s[:-1], proj or 5)
        h0 = torch.randn(s_h, generator=g, dtype=torch.float64)
        hx = (h0, torch.randn(s, generator=g, dtype=torch.float64)) if kind == "LSTM" else h0
    assert _close(ours(x, hx), theirs(x, hx))
    # and gradients, through output and final state
    gx = [torch.autograd.grad(m(x.requires_grad_(), hx)[0].pow(2).sum() +
                              (m(x, hx)[1][0] if kind == "LSTM" else m(x, hx)[1]).sum(),
                              [x, *m.parameters()]) for m in (ours, theirs)]
    assert _close(tuple(gx[0]), tuple(gx[1]), 1e-10)


@pytest.mark.parametrize("kind", sorted(PAIRS))
def test_names_shapes_and_state_dict_load_both_ways(kind):
    ours_cls, torch_cls = PAIRS[kind]
    kw = dict(input_size=4, hidden_size=6, num_layers=2, bidirectional=True)
    ours, theirs = ours_cls(**kw), torch_cls(**kw)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {
        k: v.shape for k, v in theirs.state_dict().items()
    }
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(7, 2, 4)
    assert _close(ours(x), theirs(x), 1e-5)


@pytest.mark.parametrize("kind", sorted(PAIRS))
def test_keyed_init_is_reproducible_and_within_torch_bounds(kind):
    model = torchfn.Model(PAIRS[kind][0](3, 16, num_layers=2))
    a, b = model.init(random.key(0)), model.init(random.key(0))
    c = model.init(random.key(1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["weight_hh_l1"], c["weight_hh_l1"])
    assert all(v.abs().max() <= 16**-0.5 for v in a.values())
    assert all(v.std() > 0.5 * 16**-0.5 / 3**0.5 for v in a.values())  # uniform, not zeros


@pytest.mark.parametrize("kind", sorted(PAIRS))
def test_jvp_jacfwd_and_hessian_equal_reverse_mode(kind):
    """Forward mode, which nn.LSTM / nn.GRU's fused CPU kernels lack."""
    model = torchfn.Model(PAIRS[kind][0](2, 4, num_layers=2, bidirectional=True).double())
    params = model.init(random.key(0))
    x = random.normal(random.key(1), (5, 2), torch.float64)
    f = lambda x: model.apply(params, x)[0]  # noqa: E731  (5, 8)
    dx = random.normal(random.key(2), (5, 2), torch.float64)
    _, dout = jvp(f, (x,), (dx,))
    J = jacrev(f)(x)  # (5, 8, 5, 2)
    assert torch.allclose(dout, (J * dx).sum((-2, -1)), atol=1e-12)
    assert torch.allclose(jacfwd(f)(x), J, atol=1e-12)
    energy = lambda x: f(x).pow(2).sum()  # noqa: E731
    Hs = hessian(energy)(x)  # (5, 2, 5, 2) = jacfwd(jacrev)
    assert torch.allclose(Hs, jacrev(jacrev(energy))(x), atol=1e-10)
    assert torch.allclose(Hs, Hs.permute(2, 3, 0, 1), atol=1e-10)


@pytest.mark.parametrize("kind", sorted(PAIRS))
def test_per_sample_grads_equal_a_loop(kind):
    model = torchfn.Model(PAIRS[kind][0](3, 4, batch_first=True))
    params = model.init(random.key(0))
    xs = random.normal(random.key(1), (6, 5, 3))  # (B, T, F)

    def loss(p, x):  # ONE sequence (T, F)
        return model.apply(p, x)[0][-1].pow(2).sum()

    per = vmap(grad(loss), in_dims=(None, 0))(params, xs)
    for b in range(6):
        g = grad(loss)(params, xs[b])
        assert all(torch.allclose(per[k][b], g[k], atol=1e-6) for k in g)


@pytest.mark.parametrize("kind", sorted(PAIRS))
def test_compiled_equals_eager(kind):
    model = torchfn.Model(PAIRS[kind][0](3, 4))
    params = model.init(random.key(0))
    x = random.normal(random.key(1), (3, 2, 3))  # the compiler unrolls the T steps
    f = lambda p, x: model.apply(p, x)[0]  # noqa: E731
    # aot_eager: one graph of the unrolled steps (dynamo, AOT autograd); inductor's C++
    # for it would be torch's to test, and 10 s on a cold cache
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.allclose(compiled(params, x), f(params, x), atol=1e-6)


def test_dropout_between_layers_is_keyed():
    model = torchfn.Model(LSTM(3, 8, num_layers=3, dropout=0.5))
    params = model.init(random.key(0))
    x = random.normal(random.key(1), (6, 2, 3))
    run = lambda k: model.apply(params, x, key=k, train=True)[0][0]  # noqa: E731  (out, state)
    assert torch.equal(run(random.key(5)), run(random.key(5)))
    assert not torch.equal(run(random.key(5)), run(random.key(6)))
    assert not torch.equal(run(random.key(5)), model.apply(params, x)[0])  # eval: no dropout


@pytest.mark.parametrize(
    "make, args, err, match",
    [
        (lambda: LSTM(0, 4), (), ValueError, "LSTM: input_size must be an int >= 1, got 0"),
        (lambda: GRU(3, 4, dropout=1.0), (), ValueError, r"GRU: dropout must be in \[0, 1\)"),
        (lambda: LSTM(3, 4, bidirectional=1), (), TypeError, "bidirectional must be a bool"),
        (lambda: LSTM(3, 4, proj_size=4), (), ValueError,
         r"proj_size must be an int in \[0, hidden_size=4\), got 4"),
        (lambda: LSTM(3, 4, proj_size=2), (torch.randn(5, 2, 3), (torch.zeros(1, 2, 4),
                                                                  torch.zeros(1, 2, 4))),
         ValueError, r"h_0 must have shape \(1, 2, 2\) \(num_layers \* num_directions, B, "
         r"proj_size\)"),
        (lambda: LSTM(3, 4), (torch.randn(5, 2, 4),), ValueError,
         r"input must be \(T, B, input_size\) or \(T, input_size\) with input_size=3, "
         r"got shape \(5, 2, 4\)"),
        (lambda: GRU(3, 4, batch_first=True), (torch.randn(5, 2, 2, 3),), ValueError,
         r"\(B, T, input_size\)"),
        (lambda: GRU(3, 4), (torch.ones(5, 3, dtype=torch.long),), TypeError,
         "input must be a float tensor, got torch.int64"),
        (lambda: GRU(3, 4, num_layers=2), (torch.randn(5, 2, 3), torch.zeros(1, 2, 4)),
         ValueError, r"hx must have shape \(2, 2, 4\) .* got \(1, 2, 4\)"),
        (lambda: LSTM(3, 4), (torch.randn(5, 2, 3), torch.zeros(1, 2, 4)), TypeError,
         r"hx must be a pair \(h_0, c_0\)"),
        (lambda: LSTM(3, 4), (torch.randn(5, 2, 3),
                              (torch.zeros(1, 2, 4), torch.zeros(1, 2, 4).double())),
         ValueError, "c_0 must have the input's dtype and device"),
    ],
)
def test_bad_input_gets_a_clear_error(make, args, err, match):
    with pytest.raises(err, match=match):
        make()(*args)


@pytest.mark.parametrize("kind", sorted(PAIRS))
def test_forward_over_reverse_hvp_equals_torch_double_backward(kind):
    """transforms.hvp (jvp of grad) through ours; nn.LSTM / nn.GRU only allow reverse
    over reverse (torch.autograd.functional.hvp), which must give the same H v."""
    from torch.func import functional_call

    from torchfn.transforms import hvp

    ours, theirs = _pair(kind, 0, input_size=3, hidden_size=4, num_layers=2)
    x = random.normal(random.key(1), (5, 2, 3), torch.float64)
    params = {k: v.detach() for k, v in theirs.named_parameters()}
    names = sorted(params)  # v in another key order than params: hvp aligns it
    v = {k: random.normal(random.fold_in(random.key(2), i), params[k].shape, torch.float64)
         for i, k in enumerate(names)}

    def loss(module):
        def f(p):
            out, state = functional_call(module, p, (x,))
            h = state[0] if kind == "LSTM" else state
            return out.pow(2).mean() + h.sin().sum()
        return f

    got = hvp(loss(ours), params, v)
    flat = lambda *ts: loss(theirs)(dict(zip(names, ts)))  # noqa: E731
    _, want = torch.autograd.functional.hvp(flat, tuple(params[k] for k in names),
                                            tuple(v[k] for k in names))
    assert all(torch.allclose(got[k], w, atol=1e-10) for k, w in zip(names, want))


# Opacus's hooks warn that inputs need no gradient here (they are data): expected
@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")
def test_per_sample_grads_equal_opacus_dplstm():
    """Opacus needs its own DPLSTM (hooks cannot see inside nn.LSTM); ours gets
    per-sample gradients from vmap(grad), equal to Opacus's grad_sample."""
    from opacus import GradSampleModule
    from opacus.layers import DPLSTM
    from torch.func import functional_call

    from torchfn.transforms import per_sample_grads

    class Classifier(nn.Module):  # last hidden state -> 3 classes
        def __init__(self, rnn):
            super().__init__()
            self.rnn, self.head = rnn, nn.Linear(5, 3)

        def forward(self, x):  # (B, T, 4)
            return self.head(self.rnn(x)[0][:, -1])

    ours = Classifier(LSTM(4, 5, num_layers=2, batch_first=True)).double()
    theirs = Classifier(DPLSTM(4, 5, num_layers=2, batch_first=True)).double()
    theirs_params = dict(theirs.named_parameters())  # nn.LSTM's names, as ours
    with torch.no_grad():  # (DPLSTM's load_state_dict wants its inner names too)
        for name, value in ours.named_parameters():
            theirs_params[name].copy_(value)
    x = random.normal(random.key(0), (6, 7, 4), torch.float64)  # (B, T, F)
    y = random.randint(random.key(1), (6,), 0, 3)

    params = {k: v.detach() for k, v in ours.named_parameters()}
    loss = lambda p, x, y: nn.functional.cross_entropy(  # noqa: E731  ONE sequence
        functional_call(ours, p, (x[None],)), y[None])
    per = per_sample_grads(loss)(params, x, y)

    gsm = GradSampleModule(theirs, loss_reduction="sum")
    nn.functional.cross_entropy(gsm(x), y, reduction="sum").backward()
    for name in params:
        assert torch.allclose(per[name], theirs_params[name].grad_sample,
                              atol=1e-10), name
