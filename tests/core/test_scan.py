"""torchfn.scan: equals the Python loop it stands for, under every transform."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.func import grad, jacrev, jvp, vmap

import torchfn
from torchfn import random


def _weights(key, H=4, D=3):
    k1, k2 = random.split(key)
    return {"w_h": random.normal(k1, (H, H)) * 0.5, "w_x": random.normal(k2, (H, D))}


def _step(w):
    """An RNN cell with a two-leaf carry and a two-leaf output."""

    def step(carry, x):
        h = torch.tanh(w["w_h"] @ carry["h"] + w["w_x"] @ x["u"]) * x["gate"]
        return {"h": h, "n": carry["n"] + 1}, (h.sum(), h * 2)

    return step


def _loop(step, init, xs, reverse=False):
    T = xs["u"].shape[0]
    carry, ys = init, [None] * T
    for t in reversed(range(T)) if reverse else range(T):
        carry, ys[t] = step(carry, {"u": xs["u"][t], "gate": xs["gate"][t]})
    return carry, (torch.stack([y[0] for y in ys]), torch.stack([y[1] for y in ys]))


def _inputs(key, T, D=3, H=4):
    k1, k2, k3 = random.split(key, 3)
    xs = {"u": random.normal(k1, (T, D)), "gate": random.uniform(k2, (T, 1))}
    init = {"h": random.normal(k3, (H,)), "n": torch.tensor(0)}
    return init, xs


def _equal(a, b):
    la, lb = torchfn.tree.leaves(a), torchfn.tree.leaves(b)
    return len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb))


@given(seed=st.integers(0, 2**31 - 1), T=st.integers(1, 9), reverse=st.booleans())
def test_scan_equals_the_loop(seed, T, reverse):
    key = random.key(seed)
    w = _weights(key)
    init, xs = _inputs(random.fold_in(key, 1), T)
    got = torchfn.scan(_step(w), init, xs, reverse=reverse)
    want = _loop(_step(w), init, xs, reverse=reverse)
    assert _equal(got, want)
    assert int(got[0]["n"]) == T


def test_reverse_is_the_flipped_scan(key):
    w = _weights(key)
    init, xs = _inputs(key, 6)
    carry, (s, h) = torchfn.scan(_step(w), init, xs, reverse=True)
    flipped = torchfn.tree.map(lambda t: t.flip(0), xs)
    carry_f, (s_f, h_f) = torchfn.scan(_step(w), init, flipped)
    assert _equal(carry, carry_f) and torch.equal(s, s_f.flip(0)) and torch.equal(h, h_f.flip(0))


def test_no_xs_runs_length_steps_and_none_outputs_stay_none():
    carry, ys = torchfn.scan(lambda c, x: (c * 2, None), torch.tensor(1.0), length=5)
    assert float(carry) == 32.0 and ys is None
    carry, ys = torchfn.scan(lambda c, x: (c + 1, c), torch.tensor(0), length=4)
    assert ys.tolist() == [0, 1, 2, 3]


def test_zero_steps_give_the_init_and_empty_outputs(key):
    w = _weights(key)
    init, xs = _inputs(key, 0)
    carry, (s, h) = torchfn.scan(_step(w), init, xs)
    assert carry is init
    assert s.shape == (0,) and h.shape == (0, 4) and h.dtype == torch.float32


def test_grad_equals_the_loop_grad(key):
    w = _weights(key)
    init, xs = _inputs(key, 7)

    def loss(w, run):
        carry, (s, h) = run(_step(w), init, xs)
        return carry["h"].pow(2).sum() + s.sum() + h.pow(3).sum()

    g = grad(loss)(w, torchfn.scan)
    want = grad(loss)(w, _loop)
    assert all(torch.allclose(g[k], want[k], rtol=1e-6, atol=1e-6) for k in w)


def test_vmap_over_sequences_equals_the_loop(key):
    w = _weights(key)
    inits, xss = zip(*(_inputs(k, 5) for k in random.split(key, 4)))
    init_b, xs_b = torchfn.tree.stack(inits), torchfn.tree.stack(xss)
    carry, (s, h) = vmap(lambda i, x: torchfn.scan(_step(w), i, x))(init_b, xs_b)
    for b in range(4):
        c_b, (s_b, h_b) = _loop(_step(w), inits[b], xss[b])
        assert torch.allclose(carry["h"][b], c_b["h"], atol=1e-6)
        assert torch.allclose(s[b], s_b, atol=1e-6) and torch.allclose(h[b], h_b, atol=1e-6)


def test_jvp_equals_the_jacobian_product(key):
    w = _weights(key)
    init, xs = _inputs(key, 5)

    def final(u):
        carry, _ = torchfn.scan(_step(w), init, {"u": u, "gate": xs["gate"]})
        return carry["h"]

    tangent = random.normal(random.fold_in(key, 9), xs["u"].shape)
    _, out_t = jvp(final, (xs["u"],), (tangent,))
    J = jacrev(final)(xs["u"])  # (H, T, D)
    assert torch.allclose(out_t, (J * tangent).sum((1, 2)), atol=1e-5)


def test_compiled_scan_equals_eager(key):
    w = _weights(key)
    init, xs = _inputs(key, 4)
    run = lambda init, xs: torchfn.scan(_step(w), init, xs)  # noqa: E731
    got = torch.compile(run, fullgraph=True)(init, xs)
    want = run(init, xs)
    assert torchfn.tree.structure(got) == torchfn.tree.structure(want)
    assert all(torch.allclose(a, b, atol=1e-6)
               for a, b in zip(torchfn.tree.leaves(got), torchfn.tree.leaves(want)))


def test_remat_step_gives_the_same_gradients(key):
    """Parameters passed through the carry, so remat sees what it differentiates."""
    w = _weights(key)
    init, xs = _inputs(key, 6)

    def cell(carry, x):
        w, h = carry
        h = torch.tanh(w["w_h"] @ h + w["w_x"] @ x)
        return (w, h), h.sum()

    def loss(w, cell):
        (_, h), s = torchfn.scan(cell, (w, init["h"]), xs["u"])
        return h.sum() + s.pow(2).sum()

    g = grad(loss)(w, torchfn.remat(cell))
    want = grad(loss)(w, cell)
    assert all(torch.allclose(g[k], want[k], atol=1e-6) for k in w)


@pytest.mark.parametrize(
    "f, init, xs, length, match",
    [
        (lambda c, x: (c[:1], x), torch.zeros(2), torch.ones(3, 2), None,
         r"step 0 changed leaf 0 from \(\(2,\), torch.float32\) to \(\(1,\)"),
        (lambda c, x: (c.double(), x), torch.zeros(2), torch.ones(3, 2), None,
         "changed leaf 0 .* torch.float64"),
        (lambda c, x: ((c, c), x), torch.zeros(2), torch.ones(3, 2), None,
         "structure of init; step 0 returned"),
        (lambda c, x: c, torch.zeros(2), torch.ones(3, 2), None, r"\(carry, y\) pair"),
        (lambda c, x: (c, x), torch.zeros(2), (torch.ones(3, 2), torch.ones(4)), None,
         r"share their leading dim, got shapes \[\(3, 2\), \(4,\)\]"),
        (lambda c, x: (c, x), torch.zeros(2), torch.ones(3, 2), 4,
         "length=4 but the leaves of xs have leading dim 3"),
        (lambda c, x: (c, x), torch.zeros(2), None, None, "length must give the number"),
        (lambda c, x: (c, x), torch.zeros(2), torch.tensor(1.0), None, "leaf 0 is a 0-d"),
        (lambda c, x: (c, x), torch.zeros(2), None, -1, "length must be an int >= 0"),
        (lambda c, x: (c + 1, torch.zeros(int(c) + 1)), torch.tensor(0), None, 3,
         "outputs y of one structure and shape"),
        (lambda c, x: (c + 1, (c,) if int(c) else c), torch.tensor(0), None, 3,
         r"outputs y of one structure and shape at every step .* tree 1 is PyTreeSpec\(\(\*,\)\)"),
    ],
)
def test_bad_input_gets_a_clear_error(f, init, xs, length, match):
    with pytest.raises((ValueError, TypeError), match=match):
        torchfn.scan(f, init, xs, length)
