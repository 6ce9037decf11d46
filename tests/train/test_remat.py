"""remat: same values and gradients as the plain function under every transform, less memory."""

import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.func import grad, jacrev, vmap

import torchfn
from torchfn import random
from torchfn.train import PeakMemory


def block(p, x):  # x: (B, D), p["w"]: (D, D), p["b"]: (D,)
    return torch.tanh(x @ p["w"] + p["b"])


remat_block = torchfn.remat(block)


def make_params(depth, width, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        {"w": torch.randn(width, width, generator=g) / width**0.5,
         "b": torch.randn(width, generator=g) * 0.1}
        for _ in range(depth)
    ]


def deep(blk):
    def loss(ps, x):
        for p in ps:
            x = blk(p, x)
        return x.square().mean()

    return loss


def assert_trees_equal(a, b):
    la, lb = optree.tree_leaves(a), optree.tree_leaves(b)
    assert len(la) == len(lb)
    for u, v in zip(la, lb):
        assert torch.equal(u, v), (u - v).abs().max()


@given(depth=st.integers(1, 4), width=st.integers(1, 6), batch=st.integers(1, 5),
       seed=st.integers(0, 2**16))
def test_grad_identical(depth, width, batch, seed):
    ps = make_params(depth, width, seed)
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(seed + 1))
    plain, rem = deep(block), deep(remat_block)
    assert torch.equal(plain(ps, x), rem(ps, x))
    assert_trees_equal(grad(plain, argnums=(0, 1))(ps, x), grad(rem, argnums=(0, 1))(ps, x))


@pytest.fixture
def problem():
    ps = make_params(3, 4)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(7)) + 0.5
    return ps, x


def test_vmap_grad(problem):
    ps, x = problem
    per_example = lambda f: vmap(grad(lambda p, xi: f(p, xi[None])), in_dims=(None, 0))(ps, x)
    assert_trees_equal(per_example(deep(block)), per_example(deep(remat_block)))


def test_grad_of_grad(problem):
    ps, x = problem

    def gg(f):
        return grad(lambda x: grad(f)(ps, x)[0]["w"].square().sum())(x)

    a, b = gg(deep(block)), gg(deep(remat_block))
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert a.abs().sum() > 0


def test_jacrev(problem):
    ps, x = problem
    jac = lambda f: jacrev(lambda x: torch.stack([f(ps, xi[None]) for xi in x]))(x)
    assert_trees_equal(jac(deep(block)), jac(deep(remat_block)))


def test_autograd_grad(problem):
    ps, x = problem

    def ag(f):
        leaves = [{k: v.clone().requires_grad_() for k, v in p.items()} for p in ps]
        return torch.autograd.grad(f(leaves, x), optree.tree_leaves(leaves))

    assert_trees_equal(ag(deep(block)), ag(deep(remat_block)))


def test_compile(problem):
    ps, x = problem
    want = grad(deep(block))(ps, x)
    got = torch.compile(grad(deep(remat_block)), fullgraph=True, backend="aot_eager")(ps, x)
    for u, v in zip(optree.tree_leaves(want), optree.tree_leaves(got)):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)


def test_pytree_args_keys_and_kwargs(key):
    """Integer keys pass through undifferentiated; dropout recomputes identically."""

    def noisy(p, x, *, key, scale):
        keep = random.bernoulli(key, 0.7, x.shape)  # (B, D)
        return {"h": torch.tanh(x @ p["w"]) * keep * scale, "aux": x.sum()}

    r = torchfn.remat(noisy)
    ps = make_params(1, 4)[0]
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(3))

    def loss(f, p, x):
        out = f(p, x, key=key, scale=2.0)
        return out["h"].square().sum() + out["aux"]

    assert_trees_equal(grad(lambda p, x: loss(noisy, p, x), argnums=(0, 1))(ps, x),
                       grad(lambda p, x: loss(r, p, x), argnums=(0, 1))(ps, x))
    # vmap over keys (an ensemble of dropout masks)
    keys = random.split(key, 3)
    per_key = lambda f: vmap(grad(lambda p, k: f(p, x, key=k, scale=1.0)["h"].sum()),
                             in_dims=(None, 0))(ps, keys)
    assert_trees_equal(per_key(noisy), per_key(r))


def mlp_block(p, x):  # x: (B, D), w1: (D, 4D), w2: (4D, D)
    return x + torch.tanh(x @ p["w1"]) @ p["w2"]


def test_lowers_peak_memory():
    """16 residual MLP blocks: remat keeps each block's input, not its (B, 4D) hiddens."""
    width, batch, depth = 32, 256, 16
    g = torch.Generator().manual_seed(0)
    ps = [{"w1": torch.randn(width, 4 * width, generator=g) / width**0.5,
           "w2": torch.randn(4 * width, width, generator=g) / (4 * width) ** 0.5}
          for _ in range(depth)]
    x = torch.randn(batch, width, generator=g)

    def peak_and_grads(blk):
        leaves = [{k: v.clone().requires_grad_() for k, v in p.items()} for p in ps]
        with PeakMemory() as mem:
            g = torch.autograd.grad(deep(blk)(leaves, x), optree.tree_leaves(leaves))
        return mem.peak, g

    plain_peak, plain_g = peak_and_grads(mlp_block)
    remat_peak, remat_g = peak_and_grads(torchfn.remat(mlp_block))
    assert_trees_equal(plain_g, remat_g)
    hidden = batch * 4 * width * 4  # bytes of one (B, 4D) float32 activation
    assert plain_peak >= depth * hidden  # every block's hiddens were alive
    assert remat_peak < plain_peak / 2, (remat_peak, plain_peak)


def test_closure_over_differentiated_tensor_raises():
    """A closed-over parameter would silently get a zero gradient: remat refuses it."""
    w = torch.randn(3, 3, generator=torch.Generator().manual_seed(0))
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(1))

    def loss(w, x):
        return torchfn.remat(lambda x: torch.tanh(x @ w))(x).sum()

    with pytest.raises(ValueError, match="not one of its arguments"):
        grad(loss)(w, x)
    with pytest.raises(ValueError, match="not one of its arguments"):
        loss(w.clone().requires_grad_(), x)
    # a closure over a constant is fine
    assert torch.equal(grad(lambda x: loss(w, x))(x), grad(lambda x: torch.tanh(x @ w).sum())(x))


def test_bad_input():
    with pytest.raises(TypeError, match="fn must be callable"):
        torchfn.remat(3)
    with pytest.raises(TypeError, match="floating-point tensors"):
        torchfn.remat(lambda x: x.long())(torch.ones(2))


def test_an_input_returned_unchanged_gets_its_gradient():
    """fn may return an argument as-is (a scan carry passing its parameters on)."""
    w = torch.randn(3, 3, generator=torch.Generator().manual_seed(0))
    x = torch.ones(3)

    def f(w, x):
        return w, torch.tanh(w @ x)

    def loss(w, f):
        w_out, y = f(w, x)
        return (w_out * 2).sum() + y.pow(2).sum()

    got = torch.func.grad(loss)(w, torchfn.remat(f))
    assert torch.allclose(got, torch.func.grad(loss)(w, f), atol=1e-6)
    w_req = w.clone().requires_grad_()
    loss(w_req, torchfn.remat(f)).backward()
    assert torch.allclose(w_req.grad, got, atol=1e-6)


@pytest.mark.parametrize("transform", ["grad", "vmap_grad", "autograd"])
def test_nested_remat(problem, transform):
    """A remat inside a remat'd function: its backward runs inside the outer backward
    (torch.func's vjp_fn would run it after the level it saved tensors at was gone)."""
    ps, x = problem
    inner = torchfn.remat(block)
    outer = torchfn.remat(lambda p, q, x: inner(q, block(p, x)))
    nested = lambda ps, x: outer(ps[0], ps[1], x).square().mean()
    plain = lambda ps, x: block(ps[1], block(ps[0], x)).square().mean()
    if transform == "grad":
        assert_trees_equal(grad(nested)(ps, x), grad(plain)(ps, x))
    elif transform == "vmap_grad":
        per_example = lambda f: vmap(grad(lambda p, xi: f(p, xi[None])), (None, 0))(ps, x)
        assert_trees_equal(per_example(nested), per_example(plain))
    else:
        leaves = [{k: v.clone().requires_grad_() for k, v in p.items()} for p in ps]
        got = torch.autograd.grad(nested(leaves, x), optree.tree_leaves(leaves[:2]))
        assert_trees_equal(got, grad(plain)(ps, x)[:2])


def test_complex_outputs(key):
    """The backward pulls back <out, cotangent> as real pairs, as autograd's vjp does."""
    w = torch.randn(3, 3, dtype=torch.complex128, generator=torch.Generator().manual_seed(0))
    x = torch.randn(2, 3, dtype=torch.complex128, generator=torch.Generator().manual_seed(1))
    f = lambda w, x: torch.exp(x @ w) * 1j
    loss = lambda f: lambda w: f(w, x).abs().square().sum()
    torch.testing.assert_close(grad(loss(torchfn.remat(f)))(w), grad(loss(f))(w))
