"""Second-order attention derivatives a block of query rows at a time (``_second_order``):
the same derivatives as the whole materialised formula, in a fraction of its memory."""

import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.func import grad, jacrev, jvp, vmap

from torchfn import random
from torchfn.kernels import _second_order, attention, reference_attention
from torchfn.train import PeakMemory


@given(b=st.integers(1, 3), h=st.integers(1, 3), nq=st.integers(1, 40), nk=st.integers(1, 40),
       budget=st.integers(1, 500))
def test_row_blocks_cover_every_row_once_within_the_budget(b, h, nq, nk, budget):
    blocks = _second_order.row_blocks(b, h, nq, nk, budget)
    assert [r for i0, i1 in blocks for r in range(i0, i1)] == list(range(nq))
    assert all(i1 - i0 == 1 or b * h * (i1 - i0) * nk <= budget for i0, i1 in blocks)


def test_accelerators_take_blocks_16x_larger():
    q, k = torch.empty(1, 8, 4096, 64, device="meta"), torch.empty(1, 8, 4096, 64, device="meta")
    on_gpu = _second_order._blocks((q, k), None)  # meta: not the CPU, so the GPU budget
    on_cpu = _second_order._blocks((torch.empty(q.shape), k), None)
    assert len(on_cpu) == 32 and len(on_gpu) == 2  # 128 and 2048 rows of 4096 keys x 8 heads


@st.composite
def problems(draw):
    """float64 primals (q, k, v, do[, dlse]), matching tangents / cotangents, and options."""
    b, hkv, groups = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    h, nq, nk, d = hkv * groups, draw(st.integers(1, 9)), draw(st.integers(1, 9)), 3
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))

    def normal(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    primals = [normal(b, h, nq, d), normal(b, hkv, nk, d), normal(b, hkv, nk, d),
               normal(b, h, nq, d)]
    if draw(st.booleans()):  # a cotangent for lse
        primals.append(normal(b, h, nq))
    mask = draw(st.sampled_from([None, "rows", "keys", "additive"]))
    if mask == "rows":  # varies with the query row: each block takes its rows
        mask = torch.rand(b, 1, nq, nk, generator=g) < 0.7
    elif mask == "keys":  # (b, 1, 1, nk): shared by every row
        mask = torch.rand(b, 1, 1, nk, generator=g) < 0.7
    elif mask == "additive":
        mask = normal(1, h, nq, nk)
    segments = None
    if draw(st.booleans()):
        ids = torch.randint(0, 2, (b, max(nq, nk)), generator=g).sort(-1).values
        segments = (ids[:, -nq:], ids[:, -nk:])
    left = draw(st.sampled_from([-1, 0, 2]))
    dropout = draw(st.sampled_from([0.0, 0.3]))
    seeds = (torch.randint(-2**31, 2**31 - 1, (b, h, 2), generator=g, dtype=torch.int32)
             if dropout else None)
    args = dict(mask=mask, causal=draw(st.booleans()), scale=0.7, window=(left, -1),
                segments=segments, softcap=draw(st.sampled_from([0.0, 2.0])),
                dropout=dropout, seeds=seeds,
                slopes=normal(b, h).abs() if draw(st.booleans()) else None)
    tangents = tuple(normal(*p.shape) for p in primals)
    cotangents = (normal(b, h, nq, d), normal(b, hkv, nk, d), normal(b, hkv, nk, d))
    return tuple(primals), tangents, cotangents, args, draw(st.integers(1, 3 * b * h * nk))


@given(problems())
def test_blocked_derivatives_equal_the_whole_formulas(problem):
    """vjp and jvp of the backward, in row blocks of any size, == in one block: with a
    mask per row or per key, segments, a window, ALiBi, softcap, dropout, a cotangent
    for lse and GQA."""
    primals, tangents, cotangents, args, budget = problem
    for fn, extra in ((_second_order.vjp, cotangents), (_second_order.jvp, tangents)):
        whole = fn(primals, extra, **args)
        blocked = fn(primals, extra, budget=budget, **args)
        assert len(whole) == len(blocked) == (3 if fn is _second_order.jvp else len(primals))
        for a, b in zip(whole, blocked):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["hvp", "grad-of-grad"])
def test_second_order_holds_one_block_of_scores(mode, monkeypatch):
    """An HVP (forward over reverse) and grad-of-grad (reverse over reverse) through
    attention in blocks of 64 rows of N = 512: the same result, and a peak memory a
    fraction of the whole formula's (about ten N x N score tensors)."""
    B, H, N, D = 1, 2, 512, 8
    g = torch.Generator().manual_seed(0)
    q, k, v, w, t = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
                     for _ in range(5))

    def loss(q):
        return (attention(q, k, v, causal=True, backend="torch") * w).sum()

    def second_order(budget):
        monkeypatch.setattr(_second_order, "_BUDGET", budget)
        with PeakMemory() as mem:
            if mode == "hvp":
                out = jvp(grad(loss), (q,), (t,))[1]
            else:
                out = grad(lambda q: (grad(loss)(q) * t).sum())(q)
        return out, mem.peak / (B * H * N * N * 8)  # in N x N float64 score tensors

    whole, whole_peak = second_order(1 << 40)
    blocked, blocked_peak = second_order(B * H * 64 * N)
    torch.testing.assert_close(blocked, whole, rtol=1e-10, atol=1e-10)
    assert whole_peak > 4  # the test can fail: the whole formula holds several (N, N)
    assert blocked_peak < whole_peak / 4


@pytest.mark.parametrize("options", ["mask", "segments-alibi", "dropout-window"])
def test_third_order_through_the_block_pullbacks(options, monkeypatch):
    """Third derivatives, reverse and forward over grad-of-grad, one query row a block:
    the block pullbacks' own backward and jvp (they recompute the block, its option
    tensors passed in, not captured) == reference."""
    monkeypatch.setattr(_second_order, "_BUDGET", 1)
    g = torch.Generator().manual_seed(3)

    def normal(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q, k, v = normal(1, 2, 4, 3), normal(1, 1, 5, 3), normal(1, 1, 5, 3)  # GQA, Nq < Nk
    w, u, u2, t = normal(1, 2, 4, 3), normal(1, 2, 4, 3), normal(1, 2, 4, 3), normal(1, 2, 4, 3)
    kw = dict(mask=torch.rand(1, 1, 4, 5, generator=g) < 0.8)
    if options == "segments-alibi":
        kw = dict(segment_ids=(torch.tensor([[0, 1, 1, 1]]), torch.tensor([[0, 0, 1, 1, 1]])),
                  alibi_slopes=torch.tensor([0.5, 0.25]))
    elif options == "dropout-window":
        kw = dict(dropout=0.3, key=random.key(5), window=(2, None))

    def grad_of_grad(attn):
        def loss(q):
            return (attn(q, k, v, causal=True, **kw) * w).sum()

        return grad(lambda q: (grad(loss)(q) * u).sum())

    def third(attn):  # (reverse over grad-of-grad, forward over it)
        gg = grad_of_grad(attn)
        return grad(lambda q: (gg(q) * u2).sum())(q), jvp(gg, (q,), (t,))[1]

    results = [third(functools.partial(attention, backend="torch")), third(reference_attention)]
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    assert results[1][0].abs().amax() > 0 and results[1][1].abs().amax() > 0


def test_reverse_over_reverse_hessian_and_per_sample_grad_of_grad(monkeypatch):
    """``jacrev(jacrev)`` and ``vmap`` over grad-of-grad vmap the block pullbacks (their
    generated vmap rule), one query row a block: == the reference's."""
    monkeypatch.setattr(_second_order, "_BUDGET", 1)
    g = torch.Generator().manual_seed(4)

    def normal(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q, k, v, w, qs = normal(1, 2, 4, 3), normal(1, 1, 5, 3), normal(1, 1, 5, 3), \
        normal(1, 2, 4, 3), normal(3, 1, 2, 4, 3)
    mask = torch.rand(1, 1, 4, 5, generator=g) < 0.8

    def both(attn):
        def loss(q):
            return (attn(q, k, v, mask=mask, causal=True) * w).sum()

        grad_of_grad = grad(lambda q: (grad(loss)(q) * w).sum())
        return jacrev(jacrev(loss))(q), vmap(grad_of_grad)(qs)

    ours, ref = both(functools.partial(attention, backend="torch")), both(reference_attention)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert ref[0].shape == (1, 2, 4, 3) * 2 and ref[1].abs().amax() > 0
