"""The mLSTM (xLSTM's matrix memory, Beck et al. 2024): linear attention with exponential
input gates, sigmoid forget gates and a normaliser, stabilised by a running maximum of
the log gates; chunked, in plain torch ops."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["mlstm"]

MLSTMState = tuple[Tensor, Tensor, Tensor]  # C (B, H, Dk, Dv), n (B, H, Dk), m (B, H)


def mlstm(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, *,
          state: MLSTMState | None = None, chunk: int = 64, eps: float = 1e-6,
          segment_ids: Tensor | None = None, keep: Tensor | None = None,
          return_state: bool = False) -> Tensor | tuple[Tensor, MLSTMState]:
    """The mLSTM's outputs ``(B, H, N, Dv)`` for queries and keys ``(B, H, N, Dk)``,
    values ``(B, H, N, Dv)`` and the input and forget gates' preactivations ``i``, ``f``
    ``(B, H, N)``. Token by token it is the recurrence

    ``m_t = max(log sigmoid(f_t) + m_{t-1}, i_t)``,
    ``C_t = e^(log sigmoid(f_t) + m_{t-1} - m_t) C_{t-1} + e^(i_t - m_t) k_t v_t^T``
    (``n_t`` the same with ``k_t``), and
    ``h_t = (q_t' C_t) / (max(|q_t' . n_t|, e^(-m_t)) + eps)``, ``q' = q / sqrt(Dk)``,

    from ``state = (C, n, m)`` (default zeros: ``m = 0``, as xLSTM starts). Here a chunk
    of tokens at a time: within a chunk each pair's log weight
    ``i_s + sum_{s < r <= t} log sigmoid(f_r)`` against the running maximum ``m_t`` (so
    no exponential overflows), across chunks through the state; float32 (or float64)
    inside, outputs in ``v``'s dtype. Equal to the recurrence (tested in float64), and
    composes with ``grad``, ``vmap`` and ``jvp``.

    ``segment_ids`` ``(B, N)`` packs documents (a new one wherever the id changes), each
    from the zero state as if alone; ``keep`` ``(B, N)`` bool leaves tokens out (left
    padding: the state passes them unchanged). ``return_state=True`` returns
    ``(h, (C, n, m))``, the state after the last token (of the last document).

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> from torchfn.kernels import mlstm
        >>> kq, kk, kv, ki, kf = random.split(random.key(0), 5)
        >>> q, k = random.normal(kq, (1, 2, 9, 4)), random.normal(kk, (1, 2, 9, 4))
        >>> v = random.normal(kv, (1, 2, 9, 3))                     # (B, H, N, Dv)
        >>> i, f = random.normal(ki, (1, 2, 9)), random.normal(kf, (1, 2, 9)) + 3
        >>> h, state = mlstm(q, k, v, i, f, chunk=4, return_state=True)
        >>> rest = mlstm(q[:, :, 5:], k[:, :, 5:], v[:, :, 5:], i[:, :, 5:], f[:, :, 5:],
        ...              state=mlstm(q[:, :, :5], k[:, :, :5], v[:, :, :5], i[:, :, :5],
        ...                          f[:, :, :5], return_state=True)[1])
        >>> h.shape, bool(torch.allclose(rest, h[:, :, 5:], atol=1e-5))
        (torch.Size([1, 2, 9, 3]), True)
    """
    _check(q, k, v, i, f, state, chunk, segment_ids, keep)
    b, h, n, dk = q.shape
    dtype = v.dtype
    work = torch.promote_types(dtype, torch.float32)
    q = q.to(work) * dk ** -0.5
    k, v, i = k.to(work), v.to(work), i.to(work)
    lf = nn.functional.logsigmoid(f.to(work))  # (B, H, N), <= 0
    runs = None
    if segment_ids is not None:
        new = (segment_ids[:, 1:] != segment_ids[:, :-1]).long()
        runs = torch.cat((torch.zeros_like(new[:, :1]), new.cumsum(1)), 1)  # (B, N)
    if n == 1:  # a decoding step: the recurrence itself
        if keep is not None:
            lf = lf * keep[:, None].to(work)
        zero = state is None
        c, nrm, m = (q.new_zeros(b, h, dk, v.shape[-1]), q.new_zeros(b, h, dk),
                     q.new_zeros(b, h)) if zero else (s.to(work) for s in state)
        out, state = _step(q[:, :, 0], k[:, :, 0], v[:, :, 0], i[:, :, 0], lf[:, :, 0], c,
                           nrm, m, eps, None if keep is None else keep[:, :1])
        out = out[:, :, None].to(dtype)
        return (out, state) if return_state else out
    size = min(chunk, n)
    pad = -n % size  # the tail padded with left-out tokens: they change nothing
    if pad:
        q, k, v = (nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        i, lf = (nn.functional.pad(x, (0, pad)) for x in (i, lf))
        keep = torch.cat((torch.ones(b, n, dtype=torch.bool, device=q.device) if keep is None
                          else keep, torch.zeros(b, pad, dtype=torch.bool, device=q.device)), 1)
        runs = None if runs is None else torch.cat((runs, runs[:, -1:].expand(b, pad)), 1)
    if keep is not None:  # a left-out token neither writes nor decays
        lf = lf * keep[:, None].to(work)
    if state is None:
        state = (q.new_zeros(b, h, dk, v.shape[-1]), q.new_zeros(b, h, dk), q.new_zeros(b, h))
    out, state = _chunks(q, k, v, i, lf, tuple(s.to(work) for s in state), size, eps, runs,
                         keep)
    out = out[:, :, :n].to(dtype)
    return (out, state) if return_state else out


def _step(q, k, v, i, lf, c, nrm, m, eps, keep):
    """One token ``(B, H, D)`` from the state: its output and the state after it."""
    m_new = torch.maximum(lf + m, i if keep is None else torch.where(keep, i, -torch.inf))
    carry = torch.exp(lf + m - m_new)  # (B, H)
    write = torch.exp(i - m_new) if keep is None else torch.where(
        keep, torch.exp(i - m_new), 0.0)
    c = carry[..., None, None] * c + (write[..., None] * k)[..., :, None] * v[..., None, :]
    nrm = carry[..., None] * nrm + write[..., None] * k
    num = (q[..., None, :] @ c)[..., 0, :]  # (B, H, Dv)
    den = (q * nrm).sum(-1)
    return num / (torch.maximum(den.abs(), torch.exp(-m_new)) + eps)[..., None], (c, nrm, m_new)


def _chunks(q, k, v, i, lf, state, size, eps, runs, keep):
    """The chunked mLSTM on ``N`` a multiple of ``size``: the chunks' incoming states one
    after another (a matmul a chunk), then every chunk's outputs at once."""
    b, h, n, _ = q.shape
    nc = n // size
    q, k, v = (x.unflatten(2, (nc, size)) for x in (q, k, v))  # (B, H, NC, L, D)
    i, lf = i.unflatten(2, (nc, size)), lf.unflatten(2, (nc, size))  # (B, H, NC, L)
    cum = lf.cumsum(-1)  # log forget products from each chunk's start, inclusive
    steps = torch.arange(size, device=q.device)
    valid = steps[:, None] >= steps[None, :]  # (L, L): s <= t
    cont = torch.ones(1, 1, nc, size, dtype=torch.bool, device=q.device)  # (B, 1, NC, L)
    offset = torch.zeros_like(cum)  # the zero state's log weight at t, less its m (= 0)
    if runs is not None:
        runs = runs.unflatten(1, (nc, size))  # (B, NC, L)
        valid = valid & (runs[..., :, None] == runs[..., None, :])[:, None]  # (B, 1, NC, L, L)
        prev = torch.cat((runs[:, :1, 0], runs[:, :-1, -1]), 1)  # (B, NC): the run before
        cont = (runs == prev[..., None])[:, None]  # continuing from the incoming state
        first = torch.cat((torch.ones_like(runs[..., :1], dtype=torch.bool),
                           runs[..., 1:] != runs[..., :-1]), -1)  # a document's first
        begin = torch.where(first, steps, 0).cummax(-1).values  # its index (B, NC, L)
        before = (cum - lf).gather(-1, begin[:, None].expand_as(cum))
        offset = torch.where(cont, 0.0, -before)  # forget gates since its first token
    if keep is not None:
        valid = valid & keep.unflatten(1, (nc, size))[:, None, :, None, :]  # writers
    log_w = torch.where(valid, cum[..., :, None] - cum[..., None, :] + i[..., None, :],
                        -torch.inf)  # (B, H, NC, L, L): s's log weight at t
    # the chunks' incoming states, one after another: each chunk's last row writes
    last = log_w[..., -1, :]  # (B, H, NC, L)
    top = last.amax(-1)  # (B, H, NC)
    c, nrm, m = state
    states = []
    for j in range(nc):
        states.append((c, nrm, m))
        virtual = torch.where(cont[..., j, -1], m, 0.0) + cum[..., j, -1] + offset[..., j, -1]
        m_next = torch.maximum(virtual, top[..., j])
        carry = torch.where(cont[..., j, -1], torch.exp(virtual - m_next), 0.0)  # (B, H)
        wk = k[:, :, j] * torch.exp(last[:, :, j] - m_next[..., None])[..., None]  # (B, H, L, Dk)
        c = carry[..., None, None] * c + wk.transpose(-1, -2) @ v[:, :, j]
        nrm = carry[..., None] * nrm + wk.sum(-2)
        m = m_next
    c0, n0, m0 = (torch.stack(x, 2) for x in zip(*states))  # (B, H, NC, ...)
    # every chunk's outputs at once, from its incoming state
    virtual = torch.where(cont, m0[..., None], 0.0) + cum + offset  # (B, H, NC, L)
    m_t = torch.maximum(virtual, log_w.amax(-1))  # the running maximum
    w = torch.exp(log_w - m_t[..., None])
    carry = torch.where(cont, torch.exp(virtual - m_t), 0.0)  # the state's weight at t
    scores = (q @ k.transpose(-1, -2)) * w  # (B, H, NC, L, L)
    num = carry[..., None] * (q @ c0) + scores @ v  # (B, H, NC, L, Dv)
    den = carry * (q @ n0[..., None])[..., 0] + scores.sum(-1)
    out = num / (torch.maximum(den.abs(), torch.exp(-m_t)) + eps)[..., None]
    return out.flatten(2, 3), (c, nrm, m)


def _check(q, k, v, i, f, state, chunk, segment_ids, keep):
    """Shapes, dtypes and devices of :func:`mlstm`'s arguments, or a ValueError naming
    the one that does not fit."""
    for name, t in (("q", q), ("k", k), ("v", v), ("i", i), ("f", f)):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise ValueError(f"mlstm: {name} must be a floating-point tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)}")
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"mlstm: q and k must be (B, H, N, Dk) and v (B, H, N, Dv), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)} and {tuple(v.shape)}")
    for name, t in (("i", i), ("f", f)):
        if t.shape != q.shape[:3]:
            raise ValueError(f"mlstm: {name} must be (B, H, N) = {tuple(q.shape[:3])}, got "
                             f"{tuple(t.shape)}")
    devices = {t.device for t in (q, k, v, i, f)}
    if len(devices) > 1:
        raise ValueError(f"mlstm: q, k, v, i and f must be on one device, got {devices}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"mlstm: chunk must be an int >= 1, got {chunk!r}")
    b, h, _, dk = q.shape
    if state is not None:
        want = [(b, h, dk, v.shape[-1]), (b, h, dk), (b, h)]
        if not isinstance(state, (tuple, list)) or len(state) != 3 or any(
                not isinstance(s, Tensor) or tuple(s.shape) != w for s, w in zip(state, want)):
            got = [tuple(getattr(s, "shape", ())) for s in state] \
                if isinstance(state, (tuple, list)) else type(state).__name__
            raise ValueError(f"mlstm: state must be (C, n, m) of shapes {want}, got {got}")
    for name, t in (("segment_ids", segment_ids), ("keep", keep)):
        if t is not None and tuple(t.shape) != (b, q.shape[2]):
            raise ValueError(f"mlstm: {name} must be (B, N) = {(b, q.shape[2])}, got "
                             f"{tuple(getattr(t, 'shape', ()))}")
    if segment_ids is not None and state is not None:
        raise ValueError("mlstm: segment_ids take no state (each document starts from zero)")
