"""The plain-eager path of models.LSTM / models.GRU (torch's kernels inside one Function):
taken where nothing can see it, equal to the scan it replaces (outputs, gradients,
double backward, a second backward; proj_size too), and left alone under transforms
and forward-mode AD."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.autograd import forward_ad

from torchfn import random
from torchfn.models import GRU, LSTM, _rnn_fused

KINDS = {"LSTM": LSTM, "GRU": GRU}


def _rnn(kind, seed, **kw):
    m = KINDS[kind](3, 5, **kw).double()
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.copy_(random.uniform(random.fold_in(random.key(seed), i), p.shape, p.dtype,
                                   -0.5, 0.5))
    return m


def _scan_only(monkeypatch):
    monkeypatch.setattr("torchfn.models._rnn.fusable", lambda *ts: False)


def _fused_taken(out):
    names, todo, seen = set(), [out.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return any("_TorchLayer" in n for n in names)


def _loss(kind, out, last):
    h, c = last if kind == "LSTM" else (last, last)
    return out.pow(2).sum() + h.sin().sum() + c.cos().sum()


@given(kind=st.sampled_from(sorted(KINDS)), seed=st.integers(0, 2**16), T=st.integers(1, 7),
       layers=st.integers(1, 2), bidirectional=st.booleans(), batch_first=st.booleans(),
       bias=st.booleans(), with_state=st.booleans(), proj=st.sampled_from([0, 2]))
def test_fused_equals_the_scan_with_gradients(kind, seed, T, layers, bidirectional,
                                              batch_first, bias, with_state, proj):
    proj = proj if kind == "LSTM" else 0
    m = _rnn(kind, seed, num_layers=layers, bidirectional=bidirectional,
             batch_first=batch_first, bias=bias, **({"proj_size": proj} if proj else {}))
    k1, k2, k3 = random.split(random.key(seed + 1), 3)
    x = random.normal(k1, (2, T, 3) if batch_first else (T, 2, 3), torch.float64)
    LD = layers * (2 if bidirectional else 1)
    h0 = random.normal(k2, (LD, 2, proj or 5), torch.float64)
    c0 = random.normal(k3, (LD, 2, 5), torch.float64)
    hx = None if not with_state else ((h0, c0) if kind == "LSTM" else h0)

    def run():
        xs = x.clone().requires_grad_()
        out, last = m(xs, hx)
        grads = torch.autograd.grad(_loss(kind, out, last), [xs, *m.parameters()])
        return (out, *grads), out

    fused, out = run()
    assert _fused_taken(out)
    with pytest.MonkeyPatch.context() as mp:
        _scan_only(mp)
        scanned, out = run()
        assert not _fused_taken(out)
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(fused, scanned))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_double_backward_equals_the_scans(kind, monkeypatch):
    """create_graph=True: the backward goes through the scan, so a Hessian-vector
    product by double backward is exact."""
    m = _rnn(kind, 0, num_layers=2, bidirectional=True,
             **({"proj_size": 3} if kind == "LSTM" else {}))
    x = random.normal(random.key(1), (5, 2, 3), torch.float64)
    v = [random.normal(random.fold_in(random.key(2), i), p.shape, p.dtype)
         for i, p in enumerate(m.parameters())]

    def hvp():
        out, last = m(x)
        g = torch.autograd.grad(_loss(kind, out, last), list(m.parameters()),
                                create_graph=True)
        return torch.autograd.grad(sum((a * b).sum() for a, b in zip(g, v)),
                                   list(m.parameters())), out

    fused, out = hvp()
    assert _fused_taken(out)
    _scan_only(monkeypatch)
    scanned, _ = hvp()
    assert all(torch.allclose(a, b, atol=1e-10) for a, b in zip(fused, scanned))


def test_a_second_backward_needs_retain_graph_as_torch_says():
    m = _rnn("LSTM", 2)
    x = random.normal(random.key(4), (4, 2, 3), torch.float64)
    loss = m(x)[0].pow(2).sum()
    first = torch.autograd.grad(loss, list(m.parameters()), retain_graph=True)
    again = torch.autograd.grad(loss, list(m.parameters()))  # through the scan this time
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(first, again))
    loss = m(x)[0].pow(2).sum()
    torch.autograd.grad(loss, list(m.parameters()))
    with pytest.raises(RuntimeError, match="second time"):
        torch.autograd.grad(loss, list(m.parameters()))


def test_not_taken_under_transforms_or_forward_ad(monkeypatch):
    m = _rnn("LSTM", 1)
    x = random.normal(random.key(3), (4, 2, 3), torch.float64)
    fusable = _rnn_fused.fusable
    assert fusable(x) and not torch.func.vmap(lambda t: torch.tensor(fusable(t)))(x).any()
    seen = []
    torch.func.grad(lambda t: (seen.append(fusable(t)), t.sum())[1])(x)
    assert seen == [False]
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(x, torch.ones_like(x))
        out, _ = m(dual)
        assert forward_ad.unpack_dual(out).tangent is not None  # the scan's forward mode
    with torch.no_grad():  # inference: torch's kernel, no graph, the scan's numbers
        fast = m(x)[0]
        _scan_only(monkeypatch)
        assert torch.allclose(fast, m(x)[0], atol=1e-12)
