"""CTC: equal to ``F.ctc_loss`` (values and gradients, float64) over drawn shapes, lengths
and blanks, impossible targets included; equal to the brute-force sum over every
alignment; and, where ``F.ctc_loss`` has no rule, right under ``vmap(grad)`` (== a loop),
``jvp`` (== the gradient's directional derivative), ``hessian`` (== finite differences of
the gradient) and grad-of-grad; ``torch.compile(grad)`` equals eager."""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import grad, hessian, jvp, vmap

from torchfn import losses, random


def _torch_ctc(logits, targets, in_len, tgt_len, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its deterministic-algorithms notice
        return F.ctc_loss(logits.log_softmax(-1).transpose(0, 1), targets, in_len, tgt_len,
                          **kw)


def _case(seed, B, T, C, S):
    k = random.split(random.key(seed), 5)
    logits = 2 * random.normal(k[0], (B, T, C), dtype=torch.float64)
    blank = int(random.randint(k[1], (), 0, C))
    targets = random.randint(k[2], (B, S), 0, C - 1)
    targets = targets + (targets >= blank).long()  # never the blank
    in_len = random.randint(k[3], (B,), 0, T + 1)
    tgt_len = random.randint(k[4], (B,), 0, S + 1)
    return logits, targets, in_len, tgt_len, blank


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), B=st.integers(1, 3), T=st.integers(1, 9),
       C=st.integers(2, 5), S=st.integers(0, 4), zero_infinity=st.booleans(),
       reduction=st.sampled_from(["none", "sum", "mean"]))
def test_equals_torch_ctc_loss(seed, B, T, C, S, zero_infinity, reduction):
    logits, targets, in_len, tgt_len, blank = _case(seed, B, T, C, S)
    kw = dict(blank=blank, reduction=reduction, zero_infinity=zero_infinity)
    x = logits.clone().requires_grad_(True)
    got = losses.ctc_loss(x, targets, in_len, tgt_len, **kw)
    want = _torch_ctc(logits.clone().requires_grad_(True), targets, in_len, tgt_len, **kw)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    if zero_infinity:  # torch's gradient of an infinite loss is not meaningful
        y = logits.clone().requires_grad_(True)
        g, = torch.autograd.grad(got.sum(), x)
        want_g, = torch.autograd.grad(_torch_ctc(y, targets, in_len, tgt_len, **kw).sum(), y)
        torch.testing.assert_close(g, want_g, rtol=1e-9, atol=1e-10)


def test_equals_the_sum_over_every_alignment():
    """``p(y | x) = sum over the C^T paths that collapse (merge repeats, drop blanks) to
    y of prod_t p_t(path_t)``, for every target up to length 3 over 3 classes."""
    T, C, blank = 4, 3, 1
    logp = random.normal(random.key(3), (T, C), dtype=torch.float64).log_softmax(-1)
    by_target: dict[tuple, float] = {}
    for path in itertools.product(range(C), repeat=T):
        merged = [c for i, c in enumerate(path) if i == 0 or c != path[i - 1]]
        label = tuple(c for c in merged if c != blank)
        prob = math.exp(sum(logp[t, c].item() for t, c in enumerate(path)))
        by_target[label] = by_target.get(label, 0.0) + prob
    labels = [c for c in range(C) if c != blank]
    for length in range(4):
        for target in itertools.product(labels, repeat=length):
            got = losses.ctc_loss(logp, torch.tensor(target, dtype=torch.long), blank=blank,
                                  reduction="none")
            want = by_target.get(target, 0.0)
            if want == 0.0:  # e.g. (0, 0, 0) needs 5 frames
                assert got.item() == math.inf
            else:
                assert got.item() == pytest.approx(-math.log(want), rel=1e-12)


def test_one_sequence_equals_its_row_of_a_batch():
    logits, targets, in_len, tgt_len, blank = _case(5, 3, 8, 4, 3)
    batch = losses.ctc_loss(logits, targets, in_len, tgt_len, blank=blank, reduction="none")
    for b in range(3):
        one = losses.ctc_loss(logits[b], targets[b], in_len[b], tgt_len[b], blank=blank,
                              reduction="none")
        assert one.shape == ()
        torch.testing.assert_close(one, batch[b])


def _finite_case():
    """Lengths long enough for every target: finite losses."""
    logits, targets, _, _, blank = _case(7, 3, 9, 4, 3)
    return logits, targets, torch.tensor([9, 7, 8]), torch.tensor([3, 1, 2]), blank


def test_per_sample_gradients_under_vmap_equal_a_loop():
    logits, targets, in_len, tgt_len, blank = _finite_case()

    def one(x, t, i, n):
        return losses.ctc_loss(x, t, i, n, blank=blank)

    got = vmap(grad(one))(logits, targets, in_len, tgt_len)
    for b in range(3):
        x = logits[b].clone().requires_grad_(True)
        want, = torch.autograd.grad(_torch_ctc(x[None], targets[b:b + 1], in_len[b:b + 1],
                                               tgt_len[b:b + 1], blank=blank), x)
        torch.testing.assert_close(got[b], want, rtol=1e-9, atol=1e-11)


def test_jvp_is_the_gradients_directional_derivative():
    logits, targets, in_len, tgt_len, blank = _finite_case()
    tangent = random.normal(random.key(9), logits.shape, dtype=torch.float64)

    def f(x):
        return losses.ctc_loss(x, targets, in_len, tgt_len, blank=blank)

    _, got = jvp(f, (logits,), (tangent,))
    want = (grad(f)(logits) * tangent).sum()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    with pytest.raises(NotImplementedError):  # what torchfn's version is for
        jvp(lambda x: _torch_ctc(x, targets, in_len, tgt_len, blank=blank), (logits,),
            (tangent,))


def test_hessian_equals_finite_differences_of_the_gradient():
    logits, targets, in_len, tgt_len, blank = _finite_case()
    x0, t, n = logits[0], targets[:1], tgt_len[:1]

    def f(x):  # (T, C) -> ()
        return losses.ctc_loss(x[None], t, None, n, blank=blank)

    h = hessian(f)(x0)  # (T, C, T, C)
    g = grad(f)
    v = random.normal(random.key(11), x0.shape, dtype=torch.float64)
    eps = 1e-5
    fd = (g(x0 + eps * v) - g(x0 - eps * v)) / (2 * eps)
    torch.testing.assert_close(torch.einsum("ijkl,kl->ij", h, v), fd, rtol=1e-6, atol=1e-8)
    # grad of grad: the Hessian-vector product by reverse-over-reverse
    hvp = grad(lambda x: (g(x) * v).sum())(x0)
    torch.testing.assert_close(hvp, torch.einsum("ijkl,kl->ij", h, v), rtol=1e-9, atol=1e-11)
    assert h.abs().max() > 1e-3


def test_compiled_gradient_equals_eager():
    """``torch.compile(grad(...), fullgraph=True)``: the loop unrolls into one graph (the
    value checks stand aside while compiling). aot_eager: the graph, not inductor's code."""
    logits, targets, in_len, tgt_len, blank = _finite_case()

    def f(x):
        return losses.ctc_loss(x, targets, in_len, tgt_len, blank=blank)

    compiled = torch.compile(grad(f), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(logits), grad(f)(logits))


def test_impossible_targets_are_inf_or_zero_and_add_no_gradient():
    logits = random.normal(random.key(4), (2, 3, 4), dtype=torch.float64)
    targets = torch.tensor([[2, 2, 3], [1, 2, 3]])  # row 0 needs 4 frames (a blank between)
    x = logits.clone().requires_grad_(True)
    loss = losses.ctc_loss(x, targets, reduction="none")
    assert loss[0].item() == math.inf and math.isfinite(loss[1].item())
    zero = losses.ctc_loss(x, targets, reduction="none", zero_infinity=True)
    assert zero[0].item() == 0.0
    g, = torch.autograd.grad(zero.sum(), x)
    assert torch.all(g[0] == 0) and g[1].abs().max() > 0


def test_half_logits_are_taken_in_float32():
    logits, targets, in_len, tgt_len, blank = _finite_case()
    got = losses.ctc_loss(logits.bfloat16(), targets, in_len, tgt_len, blank=blank)
    assert got.dtype == torch.float32
    want = losses.ctc_loss(logits.bfloat16().double(), targets, in_len, tgt_len, blank=blank)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("call, match", [
    (lambda x, t: losses.ctc_loss(x[0, 0], t[0]), r"logits must have shape \(B, T, C\)"),
    (lambda x, t: losses.ctc_loss(x, t[0]), r"targets must have shape \(2, S\)"),
    (lambda x, t: losses.ctc_loss(x, t.float()), "targets must be an integer Tensor"),
    (lambda x, t: losses.ctc_loss(x.long(), t), "logits must be a floating-point"),
    (lambda x, t: losses.ctc_loss(x, t, blank=4), r"blank must be a class index in \[0, 4\)"),
    (lambda x, t: losses.ctc_loss(x, t, blank=1), "must not contain the blank class 1"),
    (lambda x, t: losses.ctc_loss(x, t + 3), r"targets must be class indices in \[0, 4\)"),
    (lambda x, t: losses.ctc_loss(x, t, torch.tensor([5, 7])),
     r"input_lengths must be in \[0, 5\], got values in \[5, 7\]"),
    (lambda x, t: losses.ctc_loss(x, t, None, torch.tensor([1, 2, 3])),
     r"target_lengths must have shape \(2,\)"),
    (lambda x, t: losses.ctc_loss(x, t, None, torch.tensor([1.0, 2.0])),
     "target_lengths must be an integer Tensor"),
    (lambda x, t: losses.ctc_loss(x, t, reduction="avg"), "reduction must be one of"),
])
def test_bad_input_is_named(call, match):
    x = random.normal(random.key(0), (2, 5, 4))
    t = torch.tensor([[1, 2], [3, 1]])
    with pytest.raises((ValueError, TypeError), match=match):
        call(x, t)
