"""``torchfn.associative_scan`` equals the sequential loop, forward and reversed, for
commutative and non-commutative operators, on pytrees, under every transform."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vmap

import torchfn
from torchfn import random

F64 = torch.float64


def normal(seed, *shape):
    return random.normal(random.key(seed), shape, dtype=F64)


def loop_scan(fn, xs, reverse=False):
    """The definition: out[i] = fn(...fn(x[0], x[1])..., x[i]) (JAX's order when reversed:
    the flipped sequence, fn unchanged). xs: a list of per-position pytrees."""
    seq = xs[::-1] if reverse else xs
    acc, out = seq[0], [seq[0]]
    for x in seq[1:]:
        acc = fn(acc, x)
        out.append(acc)
    return out[::-1] if reverse else out


def stack(trees, dim=0):
    return torch.utils._pytree.tree_map(lambda *xs: torch.stack(xs, dim), *trees)


def unstack(tree, n, dim=0):
    return [torch.utils._pytree.tree_map(lambda x, i=i: x.select(dim, i), tree) for i in range(n)]


def compose(first, second):  # affine maps h -> a h + b, first then second
    (a1, b1), (a2, b2) = first, second
    return a2 * a1, a2 * b1 + b2


OPS = {
    "add": (lambda a, b: a + b, lambda s, n: normal(s, n, 3)),
    "max": (torch.maximum, lambda s, n: normal(s, n, 3)),
    "matmul": (torch.matmul, lambda s, n: normal(s, n, 2, 2)),  # not commutative
    "affine": (compose, lambda s, n: (normal(s, n, 4), normal(s + 1, n, 4))),
    "dict": (lambda a, b: {"m": a["m"] @ b["m"], "s": a["s"] + b["s"]},
             lambda s, n: {"m": normal(s, n, 3, 3) / 2, "s": normal(s + 1, n)}),
}


@given(n=st.integers(1, 40), op=st.sampled_from(sorted(OPS)), reverse=st.booleans(),
       seed=st.integers(0, 2**16))
def test_equals_the_sequential_definition(n, op, reverse, seed):
    fn, make = OPS[op]
    xs = make(seed, n)
    out = torchfn.associative_scan(fn, xs, reverse=reverse)
    want = stack(loop_scan(fn, unstack(xs, n), reverse))
    for a, b in zip(torch.utils._pytree.tree_leaves(out), torch.utils._pytree.tree_leaves(want)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@given(n=st.integers(1, 17), dim=st.integers(-3, 2), reverse=st.booleans())
def test_any_dim(n, dim, reverse):
    shape = [2, 3, 4]
    shape[dim] = n
    x = normal(n, *shape)
    out = torchfn.associative_scan(lambda a, b: a + b, x, reverse=reverse, dim=dim)
    want = x.flip(dim).cumsum(dim).flip(dim) if reverse else x.cumsum(dim)
    torch.testing.assert_close(out, want)


def test_reverse_follows_jax_argument_order():
    """JAX documents (jax-ml/jax#29313): for [a, b, c] with reverse=True the result is
    [f(f(c, b), a), f(c, b), c], not [f(a, f(b, c)), ...]."""
    a, b, c = normal(1, 2, 2), normal(2, 2, 2), normal(3, 2, 2)
    out = torchfn.associative_scan(torch.matmul, torch.stack([a, b, c]), reverse=True)
    torch.testing.assert_close(out, torch.stack([(c @ b) @ a, c @ b, c]))
    assert not torch.allclose(out[0], a @ (b @ c))


def linear_recurrence_loop(a, b):  # h[t] = a[t] h[t-1] + b[t], h[-1] = 0; a, b: (T, D)
    h, hs = torch.zeros_like(b[0]), []
    for t in range(a.shape[0]):
        h = a[t] * h + b[t]
        hs.append(h)
    return torch.stack(hs)


def linear_recurrence_scan(a, b):
    return torchfn.associative_scan(compose, (a, b))[1]


def test_transforms_equal_the_loop():
    a, b = torch.sigmoid(normal(4, 13, 3)), normal(5, 13, 3)
    f = lambda a, b: linear_recurrence_scan(a, b).square().sum()  # noqa: E731
    g = lambda a, b: linear_recurrence_loop(a, b).square().sum()  # noqa: E731
    for ours, ref in zip(grad(f, argnums=(0, 1))(a, b), grad(g, argnums=(0, 1))(a, b)):
        torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(jacfwd(linear_recurrence_scan)(a, b),
                               jacrev(linear_recurrence_loop)(a, b))
    torch.testing.assert_close(jvp(linear_recurrence_scan, (a, b), (b, a))[1],
                               jvp(linear_recurrence_loop, (a, b), (b, a))[1])
    torch.testing.assert_close(hessian(f)(a[:5], b[:5]), hessian(g)(a[:5], b[:5]))
    # per-sequence gradients over a batch of sequences
    A, B = torch.sigmoid(normal(6, 4, 9, 2)), normal(7, 4, 9, 2)
    torch.testing.assert_close(vmap(grad(f))(A, B), torch.stack([grad(g)(x, y) for x, y in
                                                                  zip(A, B)]))


def test_compile_fullgraph_equals_eager():
    torch._dynamo.reset()
    a, b = torch.sigmoid(normal(8, 33, 4)), normal(9, 33, 4)
    f = torch.compile(linear_recurrence_scan, fullgraph=True)
    torch.testing.assert_close(f(a, b), linear_recurrence_loop(a, b))


def test_bad_input_gets_clear_errors():
    x = normal(10, 5, 3)
    with pytest.raises(ValueError, match=r"must share their size along dim=0, got shapes "
                                         r"\[\(5, 3\), \(4, 3\)\]"):
        torchfn.associative_scan(compose, (x, x[:4]))
    with pytest.raises(TypeError, match=r"every leaf of elems must be a tensor, got float at "
                                        r"\[1\]"):
        torchfn.associative_scan(compose, (x, 1.0))
    with pytest.raises(ValueError, match=r"dim=2 is out of range .* shape \(5, 3\)"):
        torchfn.associative_scan(lambda a, b: a + b, x, dim=2)
    with pytest.raises(ValueError, match="must act elementwise along dim=0: leaf 0 came back "
                                         r"as \(3,\)"):
        torchfn.associative_scan(lambda a, b: (a + b).sum(0), x)
    with pytest.raises(TypeError, match="must return elems' structure"):
        torchfn.associative_scan(lambda a, b: (a + b,), x)
    with pytest.raises(TypeError, match="fn must be callable"):
        torchfn.associative_scan(None, x)
