"""``kernels.mlstm`` against the mLSTM's token-by-token recurrence (xLSTM's stabilised
step, written out here in float64): outputs and final states over chunk sizes (dividing
the length or not) from a given state, with gates that overflow ``exp`` unstabilised;
packed documents and left padding as each alone; ``grad``, ``vmap(grad)`` and ``jvp``
equal the recurrence's; bad input is named."""

from __future__ import annotations

import pytest
import torch

from torchfn import random
from torchfn.kernels import mlstm


def recurrence(q, k, v, i, f, state=None, eps=1e-6):
    """xLSTM's step (transformers' ``mlstm_recurrent_step_native``) token by token."""
    b, h, n, dk = q.shape
    if state is None:
        c, nrm, m = q.new_zeros(b, h, dk, v.shape[-1]), q.new_zeros(b, h, dk), q.new_zeros(b, h)
    else:
        c, nrm, m = state
    outs = []
    for t in range(n):
        lf = torch.nn.functional.logsigmoid(f[:, :, t])
        m_new = torch.maximum(lf + m, i[:, :, t])
        a, w = torch.exp(lf + m - m_new), torch.exp(i[:, :, t] - m_new)
        kt, vt, qt = k[:, :, t], v[:, :, t], q[:, :, t] * dk ** -0.5
        c = a[..., None, None] * c + w[..., None, None] * kt[..., :, None] * vt[..., None, :]
        nrm = a[..., None] * nrm + w[..., None] * kt
        num = (qt[..., None, :] @ c)[..., 0, :]
        den = (qt * nrm).sum(-1)
        outs.append(num / (torch.maximum(den.abs(), torch.exp(-m_new)) + eps)[..., None])
        m = m_new
    return torch.stack(outs, 2), (c, nrm, m)


def inputs(seed, b=2, h=2, n=23, dk=4, dv=3, strong=False):
    keys = random.split(random.key(seed), 5)
    q, k = (random.normal(key, (b, h, n, dk), torch.float64) for key in keys[:2])
    v = random.normal(keys[2], (b, h, n, dv), torch.float64)
    scale = 15.0 if strong else 2.0  # i up to 15: e^i alone would not fit float16
    i = scale * torch.tanh(random.normal(keys[3], (b, h, n), torch.float64))
    f = 3 + 3 * random.normal(keys[4], (b, h, n), torch.float64)
    return q, k, v, i, f


def _state(seed, b=2, h=2, dk=4, dv=3):
    keys = random.split(random.key(seed), 3)
    return (random.normal(keys[0], (b, h, dk, dv), torch.float64),
            random.normal(keys[1], (b, h, dk), torch.float64),
            random.normal(keys[2], (b, h), torch.float64))


@pytest.mark.parametrize("chunk", [1, 5, 8, 64])
@pytest.mark.parametrize("strong", [False, True])
def test_chunks_equal_the_recurrence_from_a_state(chunk, strong):
    args = inputs(0, strong=strong)
    for state in (None, _state(1)):
        got, got_state = mlstm(*args, state=state, chunk=chunk, return_state=True)
        want, want_state = recurrence(*args, state)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        for g, w in zip(got_state, want_state):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_token_by_token_calls_equal_the_whole():
    """The decoding step (one token a call, a left-out one among them) and the chunks."""
    q, k, v, i, f = inputs(6, n=9)
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[:, 4] = False
    want, want_state = mlstm(q, k, v, i, f, chunk=4, keep=keep, return_state=True)
    state, outs = None, []
    for t in range(9):
        out, state = mlstm(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                           i[:, :, t:t + 1], f[:, :, t:t + 1], state=state,
                           keep=keep[:, t:t + 1], return_state=True)
        outs.append(out)
    kept = keep[0]
    torch.testing.assert_close(torch.cat(outs, 2)[:, :, kept], want[:, :, kept], rtol=1e-10,
                               atol=1e-12)
    for g, w in zip(state, want_state):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_packed_documents_and_left_padding_equal_each_alone():
    q, k, v, i, f = inputs(2, b=2, n=20)
    lengths = [3, 1, 9, 7]  # a run of one id each, 0 1 0 1
    runs = torch.repeat_interleave(torch.arange(4) % 2, torch.tensor(lengths))[None]
    got, state = mlstm(q, k, v, i, f, chunk=4, segment_ids=runs.expand(2, -1),
                       return_state=True)
    start = 0
    for length in lengths:
        part = slice(start, start + length)
        want, last = recurrence(q[:, :, part], k[:, :, part], v[:, :, part], i[:, :, part],
                                f[:, :, part])
        torch.testing.assert_close(got[:, :, part], want, rtol=1e-10, atol=1e-12)
        start += length
    for g, w in zip(state, last):  # the last document's
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    keep = torch.ones(2, 20, dtype=torch.bool)
    keep[1, :6] = False
    got, state = mlstm(q, k, v, i, f, chunk=8, keep=keep, return_state=True)
    want, last = recurrence(*(t[1:, :, 6:] for t in (q, k, v, i, f)))
    torch.testing.assert_close(got[1:, :, 6:], want, rtol=1e-10, atol=1e-12)
    for g, w in zip(state, last):
        torch.testing.assert_close(g[1:], w, rtol=1e-10, atol=1e-12)


def test_grad_vmap_and_jvp_equal_the_recurrence():
    args = inputs(3, b=3, n=13)

    def loss(fn, q, k, v, i, f):
        return fn(q[None], k[None], v[None], i[None], f[None]).square().sum()

    chunked = lambda *a: mlstm(*a, chunk=4)  # noqa: E731
    reference = lambda *a: recurrence(*a)[0]  # noqa: E731
    argnums = tuple(range(1, 6))
    got = torch.func.vmap(torch.func.grad(loss, argnums), in_dims=(None, 0, 0, 0, 0, 0))(
        chunked, *args)
    for row in range(3):
        want = torch.func.grad(loss, argnums)(reference, *(a[row] for a in args))
        for g, w in zip(got, want):
            torch.testing.assert_close(g[row], w, rtol=1e-9, atol=1e-11)
    tangents = inputs(4, b=3, n=13)
    _, got = torch.func.jvp(chunked, args, tangents)
    _, want = torch.func.jvp(reference, args, tangents)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


def test_bad_input_is_named():
    q, k, v, i, f = inputs(5, n=6)
    with pytest.raises(ValueError, match=r"mlstm: i must be \(B, H, N\) = \(2, 2, 6\), got "
                                         r"\(2, 2, 5\)"):
        mlstm(q, k, v, i[..., :5], f)
    with pytest.raises(ValueError, match=r"q and k must be \(B, H, N, Dk\) and v"):
        mlstm(q, k[..., :3], v, i, f)
    with pytest.raises(ValueError, match="chunk must be an int >= 1, got 0"):
        mlstm(q, k, v, i, f, chunk=0)
    with pytest.raises(ValueError, match=r"state must be \(C, n, m\) of shapes"):
        mlstm(q, k, v, i, f, state=_state(0)[:2])
    with pytest.raises(ValueError, match=r"keep must be \(B, N\) = \(2, 6\)"):
        mlstm(q, k, v, i, f, keep=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="segment_ids take no state"):
        mlstm(q, k, v, i, f, state=_state(0), segment_ids=torch.zeros(2, 6, dtype=torch.long))
