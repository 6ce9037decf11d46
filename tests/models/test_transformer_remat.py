"""``TransformerEncoder(remat=...)``: the same outputs and gradients as without remat, to
the bit, dropout masks included (per example under vmap too), for less kept memory."""

import warnings

import pytest
import torch
from torch.func import grad, vmap

import torchfn
from torchfn import checkpoint_policies as cp
from torchfn import random
from torchfn.models import TransformerEncoder
from torchfn.train import PeakMemory

REMATS = {"full": True, "dots": cp.dots_saveable,
          "dots_no_batch": cp.dots_with_no_batch_dims_saveable}


def model(remat, **kw):
    return torchfn.Model(TransformerEncoder(dim=32, heads=4, depth=3, vocab_size=50,
                                            out_dim=50, causal=True, remat=remat, **kw))


def tokens(n=2):
    return random.randint(random.key(3), (n, 16), 0, 50)


def assert_equal_trees(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), (k, (a[k] - b[k]).abs().max())


@pytest.fixture(autouse=True)
def no_divergence():
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="remat:", category=RuntimeWarning)
        yield


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("name", list(REMATS))
def test_same_loss_and_gradients_as_without_remat(name, dropout):
    plain, rem = model(False, dropout=dropout, attn_dropout=dropout), \
        model(REMATS[name], dropout=dropout, attn_dropout=dropout)
    params = plain.init(random.key(0))
    x = tokens()

    def loss(m):
        return lambda p: m.apply(p, x, train=True, key=random.key(5))[0].square().mean()

    assert torch.equal(loss(plain)(params), loss(rem)(params))
    assert_equal_trees(grad(loss(rem))(params), grad(loss(plain))(params))


@pytest.mark.parametrize("name", ["full", "dots"])
def test_per_example_gradients_with_per_example_dropout_keys(name):
    plain, rem = model(False, dropout=0.1), model(REMATS[name], dropout=0.1)
    params = plain.init(random.key(0))
    x, keys = tokens(3), random.split(random.key(7), 3)

    def per_example(m):
        def loss(p, xi, k):  # ONE example, its own dropout key
            return m.apply(p, xi, train=True, key=k)[0].square().mean()

        return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, keys)

    got, want = per_example(rem), per_example(plain)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7)


def test_kept_memory():
    """What the forward keeps for the backward: remat=True keeps each block's input
    only, dots_saveable its projections' outputs too, plain autograd everything."""
    x = random.randint(random.key(3), (8, 64), 0, 50)
    params = model(False).init(random.key(0))

    def kept(remat):
        m = model(remat)
        p = {k: v.detach().requires_grad_() for k, v in params.items()}
        with PeakMemory() as mem:
            out = m.apply(p, x)
            return mem.current - out.numel() * out.element_size()

    plain, dots, full = kept(False), kept(cp.dots_saveable), kept(True)
    assert full < dots < plain, (full, dots, plain)
    assert full < plain / 4


def test_outside_model_apply():
    net = TransformerEncoder(dim=16, heads=2, depth=2, vocab_size=20, remat=True).eval()
    x = random.randint(random.key(1), (2, 8), 0, 20)
    plain = TransformerEncoder(dim=16, heads=2, depth=2, vocab_size=20).eval()
    plain.load_state_dict(net.state_dict())
    torch.testing.assert_close(net(x), plain(x))
    net(x).sum().backward()  # nn.Parameters passed to remat as arguments get gradients
    plain(x).sum().backward()
    for (name, a), b in zip(net.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
    stochastic = TransformerEncoder(dim=16, heads=2, depth=1, vocab_size=20, dropout=0.1,
                                    remat=True)
    with pytest.raises(ValueError, match="outside torchfn.Model.apply they come from torch's "
                                         "global RNG"):
        stochastic(x)


def test_bad_input():
    with pytest.raises(TypeError, match="TransformerEncoder: remat must be a bool or a policy "
                                        "from torchfn.checkpoint_policies, got 'dots'"):
        TransformerEncoder(dim=16, heads=2, depth=1, vocab_size=20, remat="dots")
