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
    if keep is not None:  # a left-out token neither writes nor decays
        lf = lf * keep[:, None].to(work)
    if state is None:
        c = q.new_zeros(b, h, dk, v.shape[-1])
        nrm, m = q.new_zeros(b, h, dk), q.new_zeros(b, h)
    else:
        c, nrm, m = (s.to(work) for s in state)
    runs = None
    if segment_ids is not None:
        new = (segment_ids[:, 1:] != segment_ids[:, :-1]).long()
        runs = torch.cat((torch.zeros_like(new[:, :1]), new.cumsum(1)), 1)  # (B, N)
    outs = []
    for start in range(0, n, chunk):
        part = slice(start, min(start + chunk, n))
        prev = None if runs is None or start == 0 else runs[:, start - 1]
        out, (c, nrm, m) = _chunk(q[:, :, part], k[:, :, part], v[:, :, part], i[:, :, part],
                                  lf[:, :, part], c, nrm, m, eps,
                                  None if runs is None else runs[:, part], prev,
                                  None if keep is None else keep[:, part])
        outs.append(out)
    out = torch.cat(outs, 2).to(dtype)
    return (out, (c, nrm, m)) if return_state else out


def _chunk(q, k, v, i, lf, c, nrm, m, eps, runs, prev, keep):
    """One chunk of L tokens from the state ``(c, nrm, m)``: outputs ``(B, H, L, Dv)`` and
    the state after it (its last token's)."""
    length = q.shape[2]
    b = lf.cumsum(-1)  # (B, H, L): log forget products from the chunk's start, inclusive
    steps = torch.arange(length, device=q.device)
    valid = steps[:, None] >= steps[None, :]  # (L, L): s <= t
    if runs is not None:
        valid = valid & (runs[:, :, None] == runs[:, None, :])[:, None]  # (B, 1, L, L)
    if keep is not None:
        valid = valid & keep[:, None, None, :]  # left-out tokens write nothing
    log_w = torch.where(valid, b[..., :, None] - b[..., None, :] + i[..., None, :],
                        -torch.inf)  # (B, H, L, L): s's weight at t
    # the incoming state's (or, for a document starting here, the zero state's m = 0)
    # log weight at t: its m plus the forget gates since its document began
    if runs is None:
        cont = torch.ones(1, 1, length, dtype=torch.bool, device=q.device)
        virtual = m[..., None] + b  # (B, H, L)
    else:
        first = torch.cat((torch.ones_like(runs[:, :1], dtype=torch.bool),
                           runs[:, 1:] != runs[:, :-1]), 1)  # (B, L): a document's first
        begin = torch.where(first, steps, 0).cummax(1).values  # its first token's index
        cont = (runs == (runs[:, :1] if prev is None else prev[:, None]))[:, None]  # (B, 1, L)
        before = (b - lf).gather(-1, begin[:, None].expand_as(b))  # b before its first
        virtual = torch.where(cont, m[..., None], 0.0) + b - torch.where(cont, 0.0, before)
    m_t = torch.maximum(virtual, log_w.amax(-1))  # (B, H, L): the running maximum
    w = torch.exp(log_w - m_t[..., None])  # (B, H, L, L)
    carry = torch.where(cont, torch.exp(virtual - m_t), 0.0)  # the state's weight at t
    scores = (q @ k.transpose(-1, -2)) * w  # (B, H, L, L)
    num = carry[..., None] * (q @ c) + scores @ v  # (B, H, L, Dv)
    den = carry * (q @ nrm[..., None])[..., 0] + scores.sum(-1)  # (B, H, L)
    out = num / (torch.maximum(den.abs(), torch.exp(-m_t)) + eps)[..., None]
    last = w[..., -1, :]  # (B, H, L): the last token's weights, for the state after it
    c = carry[..., -1, None, None] * c + (k * last[..., None]).transpose(-1, -2) @ v
    nrm = carry[..., -1, None] * nrm + (k * last[..., None]).sum(-2)
    return out, (c, nrm, m_t[..., -1])


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
