"""``kernels.gated_delta_rule``, ``kernels.gated_linear_attention`` and
``kernels.selective_scan``: the chunked forms equal the token-by-token recurrences in
float64 (any chunk size, grouped value heads, an initial state, the final state, packed
documents; a decay per token or per key channel); a sequence split in two with the state
passed on equals the whole; ``vmap(grad)``, ``jvp`` and ``gradcheck`` (reverse and forward
mode) hold; decays per channel too strong for ``exp(-cumsum)`` stay finite and exact."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.func import grad, jvp, vmap

from torchfn.kernels import gated_delta_rule, gated_linear_attention, selective_scan


def inputs(b, hk, hv, n, dk, dv, seed, dtype=torch.float64, channels=False):
    """Random inputs; ``channels``: a decay per key channel ``(B, Hv, N, Dk)``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hk, n, dk, generator=g, dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(b, hk, n, dk, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(b, hv, n, dv, generator=g, dtype=dtype)
    log_decay = -torch.rand((b, hv, n, dk) if channels else (b, hv, n), generator=g, dtype=dtype)
    beta = torch.rand(b, hv, n, generator=g, dtype=dtype)
    state = torch.randn(b, hv, dk, dv, generator=g, dtype=dtype)
    return q, k, v, log_decay, beta, state


def recurrence(q, k, v, log_decay, beta, state):
    """The rule written token by token: decay (each row of the state by its channel's
    where ``log_decay`` has one), write the error (the value itself where ``beta`` is None:
    gated linear attention), read."""
    rep = v.shape[1] // k.shape[1]
    q = q.repeat_interleave(rep, 1) * q.shape[-1] ** -0.5
    k = k.repeat_interleave(rep, 1)
    s, outs = state.clone(), []
    for t in range(q.shape[2]):
        decay = log_decay[:, :, t, :, None] if log_decay.dim() == 4 else \
            log_decay[:, :, t, None, None]
        s = s * decay.exp()
        if beta is None:
            write = v[:, :, t]
        else:
            write = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", s,
                                                                     k[:, :, t]))
        s = s + torch.einsum("bhk,bhv->bhkv", k[:, :, t], write)
        outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, :, t]))
    return torch.stack(outs, 2), s


@given(n=st.integers(1, 70), chunk=st.sampled_from([1, 3, 8, 16, 64]),
       heads=st.sampled_from([(1, 1), (2, 2), (1, 3), (2, 4)]), dk=st.integers(1, 9),
       dv=st.integers(1, 7), with_state=st.booleans(), channels=st.booleans(),
       seed=st.integers(0, 2**16))
def test_chunks_equal_the_token_recurrence(n, chunk, heads, dk, dv, with_state, channels,
                                           seed):
    """Chunks of 64 hold several 16-token sub-chunks of the per-channel products."""
    q, k, v, g, beta, state = inputs(2, *heads, n, dk, dv, seed, channels=channels)
    state = state if with_state else torch.zeros_like(state)
    o, s = gated_delta_rule(q, k, v, g, beta, state=state if with_state else None,
                            chunk=chunk, return_state=True)
    want_o, want_s = recurrence(q, k, v, g, beta, state)
    torch.testing.assert_close(o, want_o, rtol=0, atol=1e-10)
    torch.testing.assert_close(s, want_s, rtol=0, atol=1e-10)


@given(n=st.integers(1, 70), chunk=st.sampled_from([1, 3, 8, 64]),
       heads=st.sampled_from([(1, 1), (1, 3), (2, 4)]), with_state=st.booleans(),
       packed=st.booleans(), channels=st.booleans(), seed=st.integers(0, 2**16))
def test_gated_linear_attention_equals_its_recurrence(n, chunk, heads, with_state, packed,
                                                      channels, seed):
    """Mamba-2's SSD (or, a decay per channel, GLA) without the delta rule's correction;
    keys not normalised, the scale as Mamba's (1); packed: two documents, the second from a
    zero state."""
    q, k, v, g, _, state = inputs(2, *heads, n, 5, 3, seed, channels=channels)
    k = k * 3.0
    state = state if with_state else torch.zeros_like(state)
    cut = n // 2
    ids = (torch.arange(n) >= cut).long().expand(2, n) if packed and cut else None
    o, s = gated_linear_attention(q, k, v, g, state=state, scale=1.0, chunk=chunk,
                                  segment_ids=ids, return_state=True)
    scaled = q * q.shape[-1] ** 0.5  # the recurrence scales by Dk ** -0.5
    if ids is None:
        want_o, want_s = recurrence(scaled, k, v, g, None, state)
    else:
        first, _ = recurrence(scaled[:, :, :cut], k[:, :, :cut], v[:, :, :cut], g[:, :, :cut],
                              None, state)
        rest, want_s = recurrence(scaled[:, :, cut:], k[:, :, cut:], v[:, :, cut:],
                                  g[:, :, cut:], None, torch.zeros_like(state))
        want_o = torch.cat((first, rest), 2)
    torch.testing.assert_close(o, want_o, rtol=0, atol=1e-9)
    torch.testing.assert_close(s, want_s, rtol=0, atol=1e-9)


@pytest.mark.parametrize("cut", [1, 17, 40])
def test_a_split_sequence_continued_from_its_state_equals_the_whole(cut):
    q, k, v, g, beta, _ = inputs(2, 2, 4, 41, 8, 6, seed=1)
    whole, end = gated_delta_rule(q, k, v, g, beta, chunk=16, return_state=True)
    first, mid = gated_delta_rule(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], g[..., :cut],
                                  beta[..., :cut], chunk=16, return_state=True)
    rest, last = gated_delta_rule(q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], g[..., cut:],
                                  beta[..., cut:], state=mid, chunk=16, return_state=True)
    torch.testing.assert_close(torch.cat((first, rest), 2), whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(last, end, rtol=0, atol=1e-12)


@given(lengths=st.lists(st.integers(1, 20), min_size=1, max_size=5),
       chunk=st.sampled_from([1, 4, 8, 64]), channels=st.booleans(), seed=st.integers(0, 2**16))
def test_packed_documents_equal_each_document_alone(lengths, chunk, channels, seed):
    """``segment_ids``: each document from a zero state (the first from ``state``), the
    returned state the last document's; boundaries anywhere in a chunk."""
    n = sum(lengths)
    q, k, v, g, beta, state = inputs(1, 2, 4, n, 5, 3, seed, channels=channels)
    ids = torch.repeat_interleave(torch.arange(len(lengths)) * 3, torch.tensor(lengths))[None]
    o, s = gated_delta_rule(q, k, v, g, beta, state=state, chunk=chunk, segment_ids=ids,
                            return_state=True)
    start = 0
    for i, length in enumerate(lengths):
        part = slice(start, start + length)
        want_o, want_s = recurrence(q[:, :, part], k[:, :, part], v[:, :, part],
                                    g[:, :, part], beta[..., part],
                                    state if i == 0 else torch.zeros_like(state))
        torch.testing.assert_close(o[:, :, part], want_o, rtol=0, atol=1e-10)
        start += length
    torch.testing.assert_close(s, want_s, rtol=0, atol=1e-10)


def test_per_channel_decays_too_strong_for_exp_of_minus_cumsum_stay_exact():
    """Decays of up to -60 a token in some channels: a chunk's cumulative log decay reaches
    -3800, where ``exp(-cumsum)`` (the plain factorisation ``(q e^G)(k e^-G)^T``) is inf
    even in float64. In float32, against the float64 recurrence."""
    q, k, v, g, beta, state = inputs(1, 1, 2, 64, 8, 4, seed=7, channels=True)
    g = g * torch.where(torch.arange(8) % 2 == 0, 60.0, 0.05).double()  # strong and weak
    assert float(g.sum(2).min()) < -1000
    want, want_s = recurrence(q, k, v, g, beta, state)
    got, s = gated_delta_rule(*(x.float() for x in (q, k, v, g, beta)), state=state.float(),
                              return_state=True)
    assert torch.isfinite(got).all() and torch.isfinite(s).all()
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-4)
    torch.testing.assert_close(s.double(), want_s, rtol=0, atol=1e-4)
    plain = gated_linear_attention(*(x.float() for x in (q, k, v, g)), chunk=64)
    want, _ = recurrence(q, k, v, g, None, torch.zeros_like(state))
    torch.testing.assert_close(plain.double(), want, rtol=0, atol=1e-4)


def test_float32_is_as_close_as_rounding_and_keeps_the_dtype():
    q, k, v, g, beta, state = inputs(1, 2, 2, 50, 16, 16, seed=2)
    want, _ = recurrence(q, k, v, g, beta, torch.zeros_like(state))
    low = gated_delta_rule(*(x.float() for x in (q, k, v, g, beta)))
    assert low.dtype == torch.float32
    torch.testing.assert_close(low.double(), want, rtol=0, atol=1e-5)
    half = gated_delta_rule(*(x.bfloat16() for x in (q, k, v, g, beta)))
    assert half.dtype == torch.bfloat16


@pytest.mark.parametrize("channels", [False, True])
def test_per_sample_gradients_and_forward_mode_equal_their_references(channels):
    args = inputs(3, 1, 2, 20, 4, 3, seed=3, channels=channels)[:5]

    def loss(*a):
        return gated_delta_rule(*(x.unsqueeze(0) for x in a), chunk=8).square().sum()

    batched = vmap(grad(loss, argnums=(0, 1, 2, 3, 4)))(*args)
    for i in range(3):
        one = grad(loss, argnums=(0, 1, 2, 3, 4))(*(x[i] for x in args))
        for a, b in zip(batched, one):
            torch.testing.assert_close(a[i], b, rtol=0, atol=1e-12)
    tangents = inputs(3, 1, 2, 20, 4, 3, seed=4, channels=channels)[:5]
    _, tangent = jvp(lambda *a: gated_delta_rule(*a, chunk=8), args, tangents)
    eps = 1e-6
    plus = gated_delta_rule(*(x + eps * t for x, t in zip(args, tangents)), chunk=8)
    minus = gated_delta_rule(*(x - eps * t for x, t in zip(args, tangents)), chunk=8)
    torch.testing.assert_close(tangent, (plus - minus) / (2 * eps), rtol=0, atol=1e-7)


def test_gradcheck_in_both_modes():
    args = [x.requires_grad_() for x in inputs(1, 1, 2, 7, 3, 2, seed=5)]
    assert torch.autograd.gradcheck(
        lambda *a: gated_delta_rule(*a[:5], state=a[5], chunk=3, return_state=True), args,
        check_forward_ad=True)
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1]])
    assert torch.autograd.gradcheck(
        lambda *a: gated_linear_attention(*a[:4], state=a[5], chunk=3, segment_ids=ids,
                                          return_state=True), args, check_forward_ad=True)
    # per channel, over two 16-token sub-chunks and the pairs across them
    args = [x.requires_grad_() for x in inputs(1, 1, 1, 20, 2, 2, seed=5, channels=True)]
    assert torch.autograd.gradcheck(
        lambda *a: gated_delta_rule(*a[:5], state=a[5], return_state=True), args,
        check_forward_ad=True)


def test_bad_input_is_named():
    q, k, v, g, beta, state = inputs(1, 2, 4, 5, 3, 2, seed=6)
    with pytest.raises(ValueError, match=r"q must have k's shape \(B, Hk, N, Dk\) = "
                                         r"\(1, 2, 5, 3\), got \(1, 2, 4, 3\)"):
        gated_delta_rule(q[:, :, :4], k, v, g, beta)
    with pytest.raises(ValueError, match="Hk = 2 dividing Hv, got \\(1, 3, 5, 2\\)"):
        gated_delta_rule(q, k, v[:, :3], g[:, :3], beta[:, :3])
    with pytest.raises(ValueError, match=r"beta must be \(B, Hv, N\) = \(1, 4, 5\)"):
        gated_delta_rule(q, k, v, g, beta[..., :4])
    with pytest.raises(ValueError, match=r"state must be \(B, Hv, Dk, Dv\) = \(1, 4, 3, 2\)"):
        gated_delta_rule(q, k, v, g, beta, state=state[:, :2])
    with pytest.raises(ValueError, match="log_decay must be a float tensor of 3 dims"):
        gated_delta_rule(q, k, v, g[0], beta)
    with pytest.raises(ValueError, match="chunk must be an int >= 1, got 0"):
        gated_delta_rule(q, k, v, g, beta, chunk=0)
    with pytest.raises(ValueError, match=r"gated_linear_attention: log_decay must be \(B, Hv, "
                                         r"N\) = \(1, 4, 5\) or, a decay per key channel, "
                                         r"\(B, Hv, N, Dk\) = \(1, 4, 5, 3\); got "
                                         r"\(1, 4, 5, 2\)"):
        gated_linear_attention(q, k, v, g[..., None].expand(1, 4, 5, 2))
    with pytest.raises(ValueError, match=r"segment_ids must be an integer tensor \(B, N\) = "
                                         r"\(1, 5\), got torch.Size\(\[1, 4\]\)"):
        gated_delta_rule(q, k, v, g, beta, segment_ids=torch.zeros(1, 4, dtype=torch.long))


def selective_recurrence(x, dt, A, B, C, state):
    """Mamba's scan token by token: ``h = exp(dt A) h + (dt x) B``, ``y = h C``."""
    h, ys = state.clone(), []
    for t in range(x.shape[1]):
        h = (dt[:, t, :, None] * A).exp() * h + (dt[:, t] * x[:, t])[..., None] * B[:, t, None]
        ys.append(torch.einsum("bds,bs->bd", h, C[:, t]))
    return torch.stack(ys, 1), h


def scan_inputs(b, n, d, s, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, d, generator=g, dtype=torch.float64)
    dt = torch.rand(b, n, d, generator=g, dtype=torch.float64)
    A = -3 * torch.rand(d, s, generator=g, dtype=torch.float64)
    B, C = (torch.randn(b, n, s, generator=g, dtype=torch.float64) for _ in range(2))
    return x, dt, A, B, C, torch.randn(b, d, s, generator=g, dtype=torch.float64)


@given(n=st.integers(1, 50), chunk=st.sampled_from([1, 4, 16, 64]), d=st.integers(1, 5),
       s=st.integers(1, 5), packed=st.booleans(), seed=st.integers(0, 2**16))
def test_selective_scan_equals_its_recurrence(n, chunk, d, s, packed, seed):
    """From a state; packed: two documents, the second from a zero state."""
    x, dt, A, B, C, state = scan_inputs(2, n, d, s, seed)
    cut = n // 2
    ids = (torch.arange(n) >= cut).long().expand(2, n) if packed and cut else None
    y, h = selective_scan(x, dt, A, B, C, state=state, segment_ids=ids, chunk=chunk,
                          return_state=True)
    if ids is None:
        want_y, want_h = selective_recurrence(x, dt, A, B, C, state)
    else:
        first, _ = selective_recurrence(x[:, :cut], dt[:, :cut], A, B[:, :cut], C[:, :cut],
                                        state)
        rest, want_h = selective_recurrence(x[:, cut:], dt[:, cut:], A, B[:, cut:],
                                            C[:, cut:], torch.zeros_like(state))
        want_y = torch.cat((first, rest), 1)
    torch.testing.assert_close(y, want_y, rtol=0, atol=1e-10)
    torch.testing.assert_close(h, want_h, rtol=0, atol=1e-10)


def test_selective_scan_gradcheck_in_both_modes_and_named_errors():
    args = [t.requires_grad_() for t in scan_inputs(1, 6, 2, 3, seed=7)]
    ids = torch.tensor([[0, 0, 1, 1, 1, 1]])
    assert torch.autograd.gradcheck(
        lambda *a: selective_scan(*a[:5], state=a[5], chunk=4, segment_ids=ids,
                                  return_state=True), args, check_forward_ad=True)
    x, dt, A, B, C, _ = scan_inputs(1, 4, 2, 3, seed=8)
    with pytest.raises(ValueError, match=r"selective_scan: dt must be x's shape \(B, N, D\)"):
        selective_scan(x, dt[:, :3], A, B, C)
    with pytest.raises(ValueError, match=r"state must be \(B, D, S\) = \(1, 2, 3\)"):
        selective_scan(x, dt, A, B, C, state=torch.zeros(1, 3, 2))
    with pytest.raises(ValueError, match="chunk must be an int >= 1, got 0"):
        selective_scan(x, dt, A, B, C, chunk=0)
