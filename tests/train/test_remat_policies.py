"""remat(fn, policy=...): the same gradients as plain autograd under every transform,
and the saved ops really are not run again (counted below every transform)."""

import warnings
from collections import Counter

import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.func import grad, hessian, jacrev, jvp, vmap
from torch.utils._python_dispatch import TorchDispatchMode

import torchfn
from torchfn import checkpoint_policies as cp
from torchfn import random
from torchfn.train import PeakMemory

aten = torch.ops.aten


class CountKernels(TorchDispatchMode):
    """Counts the aten ops that really run (a saved op replayed by remat never gets here)."""

    def __init__(self):
        super().__init__()
        self.ran = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ran[func] += 1
        return func(*args, **(kwargs or {}))


def block(p, x):  # x: (B, D); w1: (D, 2D); w2: (2D, D)
    h = cp.checkpoint_name(x @ p["w1"], "up")  # (B, 2D)
    h = torch.tanh(h) * torch.sigmoid(h)
    return x + cp.checkpoint_name(h @ p["w2"], "down")  # (B, D)


POLICIES = {
    "nothing": cp.nothing_saveable,
    "dots": cp.dots_saveable,
    "dots_no_batch": cp.dots_with_no_batch_dims_saveable,
    "everything": cp.everything_saveable,
    "names_up": cp.save_only_these_names("up"),
    "names_but_up": cp.save_any_names_but_these("up"),
    "all_but_up": cp.save_anything_except_these_names("up"),
    "ops_tanh": cp.save_these_ops(aten.tanh, aten.sigmoid.default),
    "both": cp.save_from_both_policies(cp.save_only_these_names("down"),
                                       cp.save_these_ops(aten.tanh)),
    "custom": lambda op, *args, **kw: op is aten.mm.default and args[1].shape[-1] > 3,
}


def params(key, depth, width, dtype=torch.float64):
    keys = random.split(key, 2 * depth)
    return [{"w1": random.normal(keys[2 * i], (width, 2 * width), dtype=dtype) / width**0.5,
             "w2": random.normal(keys[2 * i + 1], (2 * width, width), dtype=dtype) / width**0.5}
            for i in range(depth)]


def deep(blk):
    def loss(ps, x):
        for p in ps:
            x = blk(p, x)
        return (x * x.roll(1, -1)).sum()

    return loss


def assert_trees_equal(a, b):
    la, lb = optree.tree_leaves(a), optree.tree_leaves(b)
    assert len(la) == len(lb)
    for u, v in zip(la, lb):
        torch.testing.assert_close(u, v, rtol=1e-12, atol=1e-12)


@pytest.fixture(autouse=True)
def no_divergence():
    """A recomputation that left the forward's path would warn (and recompute all):
    none of these tests may take that fallback unnoticed."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="remat:", category=RuntimeWarning)
        yield


@pytest.mark.parametrize("name", POLICIES)
@given(seed=st.integers(0, 2**16), depth=st.integers(1, 3), width=st.integers(1, 5),
       batch=st.integers(1, 4))
def test_grad_and_per_example_grads_equal_plain_autograd(name, seed, depth, width, batch):
    key = random.key(seed)
    ps = params(key, depth, width)
    x = random.normal(random.fold_in(key, 1), (batch, width), dtype=torch.float64)
    plain, rem = deep(block), deep(torchfn.remat(block, policy=POLICIES[name]))
    assert torch.equal(plain(ps, x), rem(ps, x))
    assert_trees_equal(grad(rem, argnums=(0, 1))(ps, x), grad(plain, argnums=(0, 1))(ps, x))
    per_example = lambda f: vmap(grad(lambda p, xi: f(p, xi[None])), (None, 0))(ps, x)
    assert_trees_equal(per_example(rem), per_example(plain))


@pytest.mark.parametrize("name", ["dots", "names_up", "all_but_up"])
def test_higher_order_and_forward_mode(name, key):
    ps = params(key, 2, 3)
    x = random.normal(random.fold_in(key, 1), (2, 3), dtype=torch.float64)
    plain, rem = deep(block), deep(torchfn.remat(block, policy=POLICIES[name]))
    assert_trees_equal(hessian(rem, argnums=1)(ps, x), hessian(plain, argnums=1)(ps, x))
    assert_trees_equal(jacrev(grad(rem, argnums=1), argnums=1)(ps, x),
                       jacrev(grad(plain, argnums=1), argnums=1)(ps, x))
    gg = lambda f: grad(lambda x: grad(f)(ps, x)[0]["w1"].square().sum())(x)
    assert_trees_equal(gg(rem), gg(plain))
    t = torch.ones_like(x)
    assert_trees_equal(jvp(lambda x: rem(ps, x), (x,), (t,)),
                       jvp(lambda x: plain(ps, x), (x,), (t,)))
    # torch.autograd with create_graph (a gradient penalty)
    def penalty(f):
        xr = x.clone().requires_grad_()
        (gx,) = torch.autograd.grad(f(ps, xr), xr, create_graph=True)
        return torch.autograd.grad(gx.square().sum(), xr)[0]

    assert_trees_equal(penalty(rem), penalty(plain))


def kernels_run(policy, ps, x, *, per_example=False):
    loss = deep(torchfn.remat(block, policy=policy) if policy is not None else block)
    with CountKernels() as count:
        # x differentiated too: remat differentiates every float input of a block
        if per_example:
            vmap(grad(lambda p, xi: loss(p, xi[None]), argnums=(0, 1)), (None, 0))(ps, x)
        else:
            grad(loss, argnums=(0, 1))(ps, x)
    return count.ran


@pytest.mark.parametrize("per_example", [False, True])
def test_saved_ops_are_not_run_again(key, per_example):
    """Counted below autograd and vmap: what a policy keeps runs as often as in plain
    autograd; what it does not keep runs once more (the recomputation)."""
    depth = 3
    ps = params(key, depth, 4, dtype=torch.float32)
    x = random.normal(key, (5, 4))
    plain = kernels_run(None, ps, x, per_example=per_example)
    dot = aten.mm.default  # under vmap too: (B, 1, D) @ (D, 2D) folds into one mm
    ran = {name: kernels_run(POLICIES[name], ps, x, per_example=per_example)
           for name in ("nothing", "dots", "names_up", "ops_tanh", "all_but_up")}
    # nothing kept: each block's two products and its tanh run again
    assert ran["nothing"][dot] == plain[dot] + 2 * depth
    assert ran["nothing"][aten.tanh.default] == plain[aten.tanh.default] + depth
    # products kept: only the elementwise ops run again
    assert ran["dots"][dot] == plain[dot]
    assert ran["dots"][aten.tanh.default] == plain[aten.tanh.default] + depth
    # one named product kept, the other recomputed
    assert ran["names_up"][dot] == plain[dot] + depth
    # the tanh kept, the products recomputed
    assert ran["ops_tanh"][aten.tanh.default] == plain[aten.tanh.default]
    assert ran["ops_tanh"][dot] == plain[dot] + 2 * depth
    # everything kept except the value named "up"
    assert ran["all_but_up"][dot] == plain[dot] + depth
    assert ran["all_but_up"][aten.tanh.default] == plain[aten.tanh.default]


def test_memory_between_nothing_and_everything():
    """16 residual blocks: keeping the products keeps (B, 2D) + (B, D) per block, where
    plain autograd also keeps tanh's and sigmoid's (B, 2D) outputs."""
    width, batch, depth = 32, 256, 16
    ps = params(random.key(0), depth, width, dtype=torch.float32)
    x = random.normal(random.key(1), (batch, width))

    def peak(policy):
        leaves = [{k: v.clone().requires_grad_() for k, v in p.items()} for p in ps]
        loss = deep(torchfn.remat(block, policy=policy))
        with PeakMemory() as mem:
            g = torch.autograd.grad(loss(leaves, x), optree.tree_leaves(leaves))
        return mem.peak, g

    (p_all, g_all), (p_dots, g_dots), (p_none, g_none) = (
        peak(cp.everything_saveable), peak(cp.dots_saveable), peak(cp.nothing_saveable))
    assert_trees_equal(g_dots, g_all)
    assert_trees_equal(g_none, g_all)
    hidden = batch * 2 * width * 4  # bytes of one (B, 2D) float32 activation
    assert p_none < p_dots < p_all, (p_none, p_dots, p_all)
    assert p_dots >= depth * hidden  # each block's first product was kept
    assert p_all - p_dots >= depth * hidden  # and at least one (B, 2D) value per block not


def test_transformer_block_keeps_its_products(key):
    """A real model (LayerNorm, attention, GELU MLP through torchfn.Model): the forward
    is recorded under vjp, as its recomputation runs, so no code path that branches on
    grad makes the two differ."""
    from torchfn.models import TransformerBlock

    model = torchfn.Model(TransformerBlock(dim=16, heads=2, mlp_ratio=2))
    ps = model.init(key)
    x = random.normal(random.fold_in(key, 1), (2, 8, 16))
    f = lambda p, x: model.apply(p, x)
    r = torchfn.remat(f, policy=cp.dots_with_no_batch_dims_saveable)
    loss = lambda f: lambda p, x: f(p, x).square().sum()
    for transform in (grad, lambda h: vmap(grad(lambda p, xi: h(p, xi[None])), (None, 0))):
        got, want = transform(loss(r))(ps, x), transform(loss(f))(ps, x)
        for u, v in zip(optree.tree_leaves(got), optree.tree_leaves(want)):
            torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)
    with CountKernels() as count:
        grad(loss(r))(ps, x)
    with CountKernels() as base:
        grad(loss(f))(ps, x)
    assert count.ran[aten.addmm.default] == base.ran[aten.addmm.default]  # projections kept
    assert count.ran[aten.native_layer_norm.default] > base.ran[aten.native_layer_norm.default]


def test_value_written_in_place_after_its_op_is_recomputed(key):
    """``h = x @ w; h.mul_(2)``: the kept product would hold the doubled value, so it is
    dropped and recomputed, and the gradient stays exact."""

    def inplace(p, x):
        h = x @ p["w1"]
        h.mul_(2)
        return torch.tanh(h) @ p["w2"]

    ps = params(key, 1, 3)
    x = random.normal(key, (4, 3), dtype=torch.float64)
    plain, rem = deep(inplace), deep(torchfn.remat(inplace, policy=cp.dots_saveable))
    assert_trees_equal(grad(rem)(ps, x), grad(plain)(ps, x))
    per_example = lambda f: vmap(grad(lambda p, xi: f(p, xi[None])), (None, 0))(ps, x)
    assert_trees_equal(per_example(rem), per_example(plain))


def test_a_recomputation_that_leaves_the_forward_path_warns_and_stays_exact(key):
    calls = []

    def moody(p, x):  # impure on purpose: the second call takes another path
        calls.append(1)
        if len(calls) % 2 == 0:
            x = x * 1.0
        return torch.tanh(x @ p["w1"]) @ p["w2"]

    ps = params(key, 1, 3)
    x = random.normal(key, (4, 3), dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="did not follow the forward"):
        got = grad(deep(torchfn.remat(moody, policy=cp.dots_saveable)))(ps, x)
    calls.clear()
    assert_trees_equal(got, grad(deep(moody))(ps, x))


def test_nested_remat_and_decorator_form(key):
    inner = torchfn.remat(block, policy=cp.dots_saveable)

    @torchfn.remat(policy=cp.save_only_these_names("down"))
    def two(p, x):
        return inner(p[1], block(p[0], x))

    ps = params(key, 2, 3)
    x = random.normal(key, (4, 3), dtype=torch.float64)
    head = lambda y: (y * y.roll(1, -1)).sum()
    assert_trees_equal(grad(lambda p: head(two(p, x)))(ps), grad(deep(block))(ps, x))


def test_keys_and_dropout_recompute_identically(key):
    def noisy(p, x, key):
        keep = random.bernoulli(key, 0.7, (x.shape[0], p["w1"].shape[1]))
        return (torch.tanh(x @ p["w1"]) * keep) @ p["w2"]

    ps = params(key, 1, 4)[0]
    x = random.normal(key, (3, 4), dtype=torch.float64)
    keys = random.split(key, 5)
    per_key = lambda f: vmap(grad(lambda p, k: f(p, x, k).square().sum()), (None, 0))(ps, keys)
    assert_trees_equal(per_key(torchfn.remat(noisy, policy=cp.dots_saveable)), per_key(noisy))


def test_checkpoint_name_is_the_identity_outside_remat_and_under_compile():
    x = torch.randn(3)
    assert cp.checkpoint_name(x, "a") is x
    tree = {"a": x, "b": [x * 2]}
    assert cp.checkpoint_name(tree, "t") is tree
    f = torch.compile(lambda x: torch.tanh(cp.checkpoint_name(x * 2, "a")), fullgraph=True,
                      backend="eager")
    assert torch.equal(f(x), torch.tanh(x * 2))
    assert torchfn.checkpoint_name is cp.checkpoint_name


def test_compile_ignores_the_policy(key):
    ps = params(key, 2, 3, dtype=torch.float32)
    x = random.normal(key, (4, 3))
    rem = deep(torchfn.remat(block, policy=cp.dots_saveable))
    got = torch.compile(grad(rem), fullgraph=True, backend="aot_eager")(ps, x)
    want = grad(deep(block))(ps, x)
    for u, v in zip(optree.tree_leaves(got), optree.tree_leaves(want)):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)


def test_bad_input():
    with pytest.raises(TypeError, match=r"remat: policy must be a function .* got str"):
        torchfn.remat(block, policy="dots")
    with pytest.raises(TypeError, match="name must be a str, got int"):
        cp.checkpoint_name(torch.ones(1), 3)
    with pytest.raises(TypeError, match="save_only_these_names: names must be str, got int 1"):
        cp.save_only_these_names("a", 1)
    with pytest.raises(TypeError, match=r"save_these_ops: each op must be an aten op .* got str"):
        cp.save_these_ops("mm")
    with pytest.raises(TypeError, match="policy_2 must be a policy"):
        cp.save_from_both_policies(cp.dots_saveable, None)
