"""``losses.linear_cross_entropy`` (chunked, gradients made in the forward) against
``F.cross_entropy`` of the materialised logits, in float64, under every transform."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import grad, jvp, vmap

from torchfn import random
from torchfn.losses import linear_cross_entropy

IGNORE = -100


def reference(h, w, y, b=None, *, smoothing=0.0, z_loss=0.0, softcap=None, reduction="mean"):
    """The plain form: all (N, V) logits at once."""
    logits = h @ w.T if b is None else h @ w.T + b  # (..., V)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    logits, labels = logits.reshape(-1, w.shape[0]), y.reshape(-1)
    losses = F.cross_entropy(logits, labels, ignore_index=IGNORE, label_smoothing=smoothing,
                             reduction="none")
    valid = labels != IGNORE
    losses = losses + z_loss * torch.where(valid, torch.logsumexp(logits, -1).square(), 0.0)
    if reduction == "none":
        return losses.reshape(y.shape)
    return losses.sum() / valid.sum().clamp(min=1) if reduction == "mean" else losses.sum()


def problem(seed, n=13, d=6, v=17, lead=(), ignore_every=4, dtype=torch.float64):
    kh, kw, kb, ky = random.split(random.key(seed), 4)
    h = random.normal(kh, (*lead, n, d), dtype)
    w = random.normal(kw, (v, d), dtype) * 0.7
    b = random.normal(kb, (v,), dtype)
    y = random.randint(ky, (*lead, n), 0, v)
    if ignore_every:
        y = torch.where(torch.arange(n) % ignore_every == 1, IGNORE, y)
    return h, w, b, y


options = st.fixed_dictionaries({
    "smoothing": st.sampled_from([0.0, 0.1]),
    "z_loss": st.sampled_from([0.0, 1e-2]),
    "softcap": st.sampled_from([None, 2.0]),
    "reduction": st.sampled_from(["mean", "sum", "none"]),
})


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**20), n=st.integers(1, 20), chunk=st.integers(1, 25),
       use_bias=st.booleans(), opts=options)
def test_loss_and_gradients_equal_the_materialised_form(seed, n, chunk, use_bias, opts):
    h, w, b, y = problem(seed, n=n)
    b = b if use_bias else None
    weights = random.uniform(random.key(seed + 1), y.shape, torch.float64)  # a cotangent

    def ours(h, w, b):
        out = linear_cross_entropy(h, w, y, bias=b, chunk_size=chunk, label_smoothing=opts[
            "smoothing"], z_loss=opts["z_loss"], softcap=opts["softcap"],
            reduction=opts["reduction"])
        return (out * weights).sum() if opts["reduction"] == "none" else out

    def ref(h, w, b):
        out = reference(h, w, y, b, **opts)
        return (out * weights).sum() if opts["reduction"] == "none" else out

    torch.testing.assert_close(ours(h, w, b), ref(h, w, b), rtol=1e-12, atol=1e-12)
    argnums = (0, 1, 2) if use_bias else (0, 1)
    g, want = grad(ours, argnums)(h, w, b), grad(ref, argnums)(h, w, b)
    for a, r in zip(g, want):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_forward_mode_and_second_order_equal_the_materialised_form(reduction):
    """jvp, a Hessian-vector product (forward over reverse) and grad-of-grad."""
    h, w, b, y = problem(3)
    kw = dict(bias=b, chunk_size=5, z_loss=1e-2, softcap=3.0, reduction=reduction)
    ours = lambda h, w: linear_cross_entropy(h, w, y, **kw).sum()  # noqa: E731
    ref = lambda h, w: reference(h, w, y, b, z_loss=1e-2, softcap=3.0,  # noqa: E731
                                 reduction=reduction).sum()
    th, tw = random.normal(random.key(4), h.shape, h.dtype), random.normal(
        random.key(5), w.shape, w.dtype)
    torch.testing.assert_close(jvp(ours, (h, w), (th, tw))[1], jvp(ref, (h, w), (th, tw))[1])
    hvp = lambda f: jvp(grad(f, argnums=(0, 1)), (h, w), (th, tw))[1]  # noqa: E731
    for a, r in zip(hvp(ours), hvp(ref)):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)
    gg = lambda f: grad(lambda w: grad(f)(h, w).square().sum())(w)  # noqa: E731
    torch.testing.assert_close(gg(ours), gg(ref), rtol=1e-10, atol=1e-12)


def test_per_sequence_gradients_under_vmap_equal_the_loop():
    """vmap(grad) over sequences (B, N, D): each sequence's gradient of its own mean loss,
    with its own count of ignored tokens."""
    h, w, b, y = problem(6, lead=(3,))
    y = y.clone()
    y[2, :9] = IGNORE  # a different count per sequence

    def loss(w, b, h, y):
        return linear_cross_entropy(h, w, y, bias=b, chunk_size=4, label_smoothing=0.1)

    per = vmap(grad(loss, argnums=(0, 1)), in_dims=(None, None, 0, 0))(w, b, h, y)
    for i in range(3):
        want = grad(lambda w, b, i=i: reference(h[i], w, y[i], b, smoothing=0.1),
                    argnums=(0, 1))(w, b)
        for a, r in zip(per, want):
            torch.testing.assert_close(a[i], r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_low_precision_inputs_softmax_in_float32(dtype, tol):
    h, w, b, y = problem(8, n=64, d=32, v=300, dtype=dtype)
    exact = reference(h.double(), w.double(), y, b.double())
    ours = linear_cross_entropy(h, w, y, bias=b, chunk_size=16)
    plain = F.cross_entropy((h @ w.T + b).float(), y, ignore_index=IGNORE)
    assert ours.dtype == dtype
    # no worse than the plain form in that dtype (whose logits are upcast the same way)
    assert abs(ours.double() - exact) <= max(2 * abs(plain.double() - exact), tol * exact)
    gw = grad(lambda w: linear_cross_entropy(h, w, y, bias=b, chunk_size=16).float())(w)
    gw_exact = grad(lambda w: reference(h.double(), w, y, b.double()))(w.double())
    rel = (gw.double() - gw_exact).norm() / gw_exact.norm()
    assert gw.dtype == dtype and rel < 4 * tol, rel


def test_everything_ignored_gives_zero_and_autograd_backward_works():
    h, w, b, y = problem(9)
    none = torch.full_like(y, IGNORE)
    loss, g = torch.func.grad_and_value(
        lambda h: linear_cross_entropy(h, w, none), has_aux=False)(h)[::-1]
    assert loss.item() == 0.0 and (g == 0).all()
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    linear_cross_entropy(hh, ww, y, chunk_size=4).backward()
    want_h, want_w = grad(lambda h, w: reference(h, w, y), argnums=(0, 1))(h, w)
    torch.testing.assert_close(hh.grad, want_h)
    torch.testing.assert_close(ww.grad, want_w)


def test_compiles_to_the_same_loss_and_gradient(fresh_dynamo):
    """fullgraph compile with autograd's backward; ``compile(grad(...))`` runs the rule
    eagerly inside (dynamo drops Functions' rules under torch.func, see custom_vjp).
    Dynamo and AOT autograd are what could break here (``aot_eager``); inductor's C++ of
    a matmul and a logsumexp would add 25 s on a cold cache and test torch."""
    h, w, b, y = problem(10, lead=(2,))
    f = lambda h, w: linear_cross_entropy(h, w, y, bias=b, chunk_size=8)  # noqa: E731
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = torch.compile(f, fullgraph=True, backend="aot_eager")(hh, ww)
    loss.backward()
    (wh, wantw), want = torch.func.grad_and_value(f, argnums=(0, 1))(h, w)
    torch.testing.assert_close(loss.detach(), want)
    torch.testing.assert_close(hh.grad, wh)
    torch.testing.assert_close(ww.grad, wantw)
    gh = torch.compile(grad(f), backend="aot_eager")(h, w)
    torch.testing.assert_close(gh, wh)


@pytest.mark.parametrize("kw, err, match", [
    (dict(weight=torch.zeros(5, 7)), ValueError, r"weight must be \(V, D\) with D = .* = 6"),
    (dict(labels=torch.zeros(3, dtype=torch.long)), ValueError,
     r"labels must be an int tensor of shape hidden.shape\[:-1\] = \(13,\)"),
    (dict(labels=torch.zeros(13)), ValueError, "labels must be an int tensor"),
    (dict(weight=torch.zeros(5, 6, dtype=torch.float32)), TypeError,
     "weight must have hidden's dtype"),
    (dict(bias=torch.zeros(4, dtype=torch.float64)), ValueError, r"bias must be a \(17,\)"),
    (dict(chunk_size=0), ValueError, "chunk_size must be an int >= 1"),
    (dict(reduction="avg"), ValueError, "reduction must be one of"),
    (dict(label_smoothing=1.5), ValueError, r"label_smoothing must be in \[0, 1\]"),
    (dict(z_loss=-1.0), ValueError, "z_loss must be >= 0"),
    (dict(softcap=0.0), ValueError, "softcap must be > 0 or None"),
])
def test_bad_input_is_named(kw, err, match):
    h, w, _, y = problem(0)
    args = dict(hidden=h, weight=w, labels=y)
    args.update(kw)
    with pytest.raises(err, match=match):
        linear_cross_entropy(**args)
