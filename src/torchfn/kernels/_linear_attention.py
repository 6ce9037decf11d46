"""Linear attention with a decaying state, chunked: the gated delta rule (Gated DeltaNet;
Yang, Kautz and Hatamizadeh 2024), whose state is corrected toward each new value, and
gated linear attention (Mamba-2's SSD, with scalar decays), whose state is only added to.

Per value head, with a state ``S`` ``(Dk, Dv)`` and for each token ``t``::

    S = exp(g_t) S                                  # decay (g_t <= 0; or per key channel,
                                                    #   diag(exp(g_t)) S: GLA, Kimi's KDA)
    S = S + beta_t k_t (v_t - S^T k_t)^T             # the delta rule: write the error
    S = S + k_t v_t^T                                # (or, without it: write the value)
    o_t = S^T (scale q_t)

A chunk of ``L`` tokens is computed at once (for the delta rule through a unit lower
triangular system, the WY representation) and the state passes from chunk to chunk, so
most of the work is matmuls. Written in plain torch ops, so ``grad``, ``vmap``, ``jvp``
and ``torch.compile`` compose with it as they do with any torch code.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["gated_delta_rule", "gated_linear_attention"]


def _check(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, beta: Tensor | None,
           state: Tensor | None, chunk: int, segment_ids: Tensor | None,
           who: str = "gated_delta_rule") -> None:
    channels = isinstance(log_decay, Tensor) and log_decay.dim() == 4  # a decay per channel
    checked = (("q", q, 4), ("k", k, 4), ("v", v, 4), ("log_decay", log_decay, 3 + channels)) + (
        (("beta", beta, 3),) if who == "gated_delta_rule" else ())
    for name, t, dims in checked:
        if not isinstance(t, Tensor) or t.dim() != dims or not t.is_floating_point():
            raise ValueError(f"{who}: {name} must be a float tensor of {dims} dims, "
                             f"got {getattr(t, 'shape', type(t).__name__)}")
    b, hk, n, dk = k.shape
    hv = v.shape[1]
    if q.shape != k.shape:
        raise ValueError(f"{who}: q must have k's shape (B, Hk, N, Dk) = "
                         f"{tuple(k.shape)}, got {tuple(q.shape)}")
    if v.shape[0] != b or v.shape[2] != n or hv % hk:
        raise ValueError(f"{who}: v must be (B, Hv, N, Dv) with B = {b}, N = {n} "
                         f"and Hk = {hk} dividing Hv, got {tuple(v.shape)}")
    if log_decay.shape not in ((b, hv, n), (b, hv, n, dk)):
        raise ValueError(f"{who}: log_decay must be (B, Hv, N) = {(b, hv, n)} or, a decay per "
                         f"key channel, (B, Hv, N, Dk) = {(b, hv, n, dk)}; got "
                         f"{tuple(log_decay.shape)}")
    if beta is not None and beta.shape != (b, hv, n):
        raise ValueError(f"{who}: beta must be (B, Hv, N) = {(b, hv, n)}, "
                         f"got {tuple(beta.shape)}")
    if state is not None and (not isinstance(state, Tensor)
                              or state.shape != (b, hv, dk, v.shape[-1])):
        raise ValueError(f"{who}: state must be (B, Hv, Dk, Dv) = "
                         f"{(b, hv, dk, v.shape[-1])} or None, got "
                         f"{getattr(state, 'shape', state)}")
    devices = {t.device for t in (q, k, v, log_decay, beta) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"{who}: every input must be on one device, got {devices}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"{who}: chunk must be an int >= 1, got {chunk!r}")
    if segment_ids is not None and (not isinstance(segment_ids, Tensor)
                                    or segment_ids.shape != (b, n)
                                    or segment_ids.is_floating_point()):
        raise ValueError(f"{who}: segment_ids must be an integer tensor (B, N) = "
                         f"{(b, n)}, got {getattr(segment_ids, 'shape', segment_ids)}")


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, beta: Tensor, *,
                     state: Tensor | None = None, scale: float | None = None, chunk: int = 64,
                     segment_ids: Tensor | None = None,
                     return_state: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Causal linear attention by the gated delta rule, a chunk of tokens at a time.

    Within a chunk of ``L`` tokens the updates are solved together: a unit lower
    triangular system (``I + tril(beta k k^T * decays, -1)``, the WY form) gives each
    token's correction at once, and the state passes from chunk to chunk. The work is
    O(N L (Dk + Dv)) in matmuls plus N / L sequential steps, where the token recurrence
    is N steps of outer products. Computed in float32 (float64 inputs: float64), returned
    in ``v``'s dtype.

    Args:
        q, k: ``(B, Hk, N, Dk)`` queries and keys (Gated DeltaNet L2-normalises both).
        v: ``(B, Hv, N, Dv)`` values; ``Hk`` divides ``Hv``: value head ``h`` reads query
            and key head ``h // (Hv // Hk)``.
        log_decay: ``(B, Hv, N)``, each token's ``g_t <= 0``: the state is multiplied by
            ``exp(g_t)`` before its update (Mamba-2's gate; 0 is DeltaNet without decay);
            or ``(B, Hv, N, Dk)``, a decay per key channel: the state's row ``d`` is
            multiplied by ``exp(g_t[d])`` (Kimi Delta Attention). Per channel, the pairs
            of tokens within a chunk are decayed channel by channel in sub-chunks of 16
            and through the sub-chunks' ends across them, so no exponential overflows
            however strong the decay.
        beta: ``(B, Hv, N)``, the update's strength in [0, 1] (a learning rate: 1 writes
            ``v_t`` for ``k_t`` exactly).
        state: ``(B, Hv, Dk, Dv)``, the state before the first token (default 0): pass the
            state a previous call returned to continue a sequence.
        scale: the queries' scale, default ``Dk ** -0.5``.
        chunk: tokens per chunk (64, as FlashLinearAttention); a sequence shorter than it
            is one chunk. The result does not depend on it, up to rounding.
        segment_ids: ``(B, N)`` integers, packed documents: where the id changes a new
            document starts from a zero state, as if each ran alone (the chunks keep
            their size; the masks are multiplicative, so exact and differentiable).
            ``state`` is then the first document's, the returned state the last one's.
        return_state: also return the state after the last token.

    Returns:
        ``o`` ``(B, Hv, N, Dv)``, and with ``return_state`` the final state
        ``(B, Hv, Dk, Dv)`` in float32 (float64 for float64 inputs).

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> from torchfn.kernels import gated_delta_rule
        >>> kq, kk, kv, kg, kb = random.split(random.key(0), 5)
        >>> q = random.normal(kq, (1, 2, 5, 8))                     # (B, Hk, N, Dk)
        >>> k = torch.nn.functional.normalize(random.normal(kk, (1, 2, 5, 8)), dim=-1)
        >>> v = random.normal(kv, (1, 2, 5, 4))                     # (B, Hv, N, Dv)
        >>> g, beta = -random.uniform(kg, (1, 2, 5)), random.uniform(kb, (1, 2, 5))  # (B, Hv, N)
        >>> o, s = gated_delta_rule(q, k, v, g, beta, return_state=True)
        >>> o.shape, s.shape                              # (B, Hv, N, Dv), (B, Hv, Dk, Dv)
        (torch.Size([1, 2, 5, 4]), torch.Size([1, 2, 8, 4]))
        >>> o2, _ = gated_delta_rule(q[:, :, 3:], k[:, :, 3:], v[:, :, 3:], g[..., 3:],
        ...                          beta[..., 3:], state=gated_delta_rule(
        ...                              q[:, :, :3], k[:, :, :3], v[:, :, :3], g[..., :3],
        ...                              beta[..., :3], return_state=True)[1],
        ...                          return_state=True)
        >>> torch.allclose(o2, o[:, :, 3:], atol=1e-5)  # continued from the state
        True
    """
    _check(q, k, v, log_decay, beta, state, chunk, segment_ids)
    return _chunked(q, k, v, log_decay, beta, state, scale, chunk, segment_ids, return_state)


def gated_linear_attention(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, *,
                           state: Tensor | None = None, scale: float | None = None,
                           chunk: int = 64, segment_ids: Tensor | None = None,
                           return_state: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Causal linear attention whose state decays by a scalar per token and head, a chunk
    of tokens at a time: ``o_i = sum_{j <= i} exp(g_{j+1} + ... + g_i) (q_i . k_j) v_j``
    (plus the decayed initial state). This is Mamba-2's SSD (``q = C``, ``k = B``,
    ``v = dt x``, ``g = dt A``, ``scale=1``), RetNet with a constant decay, and linear
    attention with ``g = 0``; with ``log_decay`` ``(B, Hv, N, Dk)``, a decay per key
    channel, it is Gated Linear Attention (Yang et al. 2023):
    ``o_i = sum_{j <= i} (q_i * exp(g_{j+1} + ... + g_i)) . k_j v_j``. Arguments, shapes
    and dtypes as :func:`gated_delta_rule`'s, without ``beta``.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> from torchfn.kernels import gated_linear_attention
        >>> kq, kk, kv, kg = random.split(random.key(0), 4)
        >>> q = random.normal(kq, (1, 1, 6, 4))                     # (B, G, N, S)
        >>> k = random.normal(kk, (1, 1, 6, 4))
        >>> v = random.normal(kv, (1, 2, 6, 3))                     # (B, H, N, P)
        >>> g = -random.uniform(kg, (1, 2, 6))                      # (B, H, N)
        >>> o = gated_linear_attention(q, k, v, g, scale=1.0)       # (B, H, N, P)
        >>> want = sum((q[0, 0, 2] @ k[0, 0, t]) * g[0, 0, t + 1:3].sum().exp() * v[0, 0, t]
        ...            for t in range(3))                           # token 2, head 0
        >>> o.shape, bool(torch.allclose(o[0, 0, 2], want, atol=1e-5))
        (torch.Size([1, 2, 6, 3]), True)
    """
    _check(q, k, v, log_decay, None, state, chunk, segment_ids, "gated_linear_attention")
    return _chunked(q, k, v, log_decay, None, state, scale, chunk, segment_ids, return_state)


def _chunked(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, beta: Tensor | None,
             state: Tensor | None, scale: float | None, chunk: int,
             segment_ids: Tensor | None, return_state: bool) -> Tensor | tuple[Tensor, Tensor]:
    """Both rules, chunked: the delta rule with ``beta``, plain writes without. The value
    heads are grouped by the query/key head they read, ``(B, Hk, r, ...)``, so what
    depends on queries and keys alone (``q k^T``, ``k k^T``) is computed once a group."""
    delta = beta is not None
    channels = log_decay.dim() == 4  # a decay per key channel (GLA, KDA)
    b, hk, n, dk = k.shape
    hv, dv = v.shape[1], v.shape[-1]
    r = hv // hk  # value heads per query/key head
    dtype = v.dtype
    work = torch.promote_types(dtype, torch.float32)
    scale = dk ** -0.5 if scale is None else float(scale)
    q = q.to(work)[:, :, None]  # (B, Hk, 1, N, Dk)
    q = q if scale == 1.0 else q * scale
    k = k.to(work)[:, :, None]
    v = v.to(work).unflatten(1, (hk, r))  # (B, Hk, r, N, Dv)
    g = log_decay.to(work).unflatten(1, (hk, r))  # (B, Hk, r, N), or (B, Hk, r, N, Dk)
    beta = beta.to(work).unflatten(1, (hk, r)) if delta else None
    s = torch.zeros(b, hk, r, dk, dv, dtype=work, device=v.device) if state is None else \
        state.to(work).unflatten(1, (hk, r))  # (B, Hk, r, Dk, Dv)
    if n == 1:  # a decoding step: the rule itself, no triangular system to solve
        # (one token is one document: the state is its own)
        s = s * (g.transpose(-1, -2) if channels else g[..., None]).exp()  # rows, or all
        write = beta[..., None] * (v - k @ s) if delta else v  # (B, Hk, r, 1, Dv)
        s = s + k.transpose(-1, -2) @ write
        o = (q @ s).flatten(1, 2).to(dtype)  # (B, Hv, 1, Dv)
        return (o, s.flatten(1, 2)) if return_state else o
    size = min(chunk, n) if n else 1
    pad = -n % size  # padded tokens: no decay (g = 0), no update (beta = 0), zero output
    if pad:
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g = torch.nn.functional.pad(g, (0, 0, 0, pad) if channels else (0, pad))
        beta = torch.nn.functional.pad(beta, (0, pad)) if delta else None
    c = (n + pad) // size
    runs = None
    if segment_ids is not None:  # each run of equal ids a document; padding joins the last
        new = (segment_ids[:, 1:] != segment_ids[:, :-1]).long()
        runs = torch.cat((torch.zeros_like(segment_ids[:, :1]), new.cumsum(1)), 1)  # (B, N)
        if pad:
            runs = torch.cat((runs, runs[:, -1:].expand(-1, pad)), 1)
        runs = runs.unflatten(1, (c, size))[:, None, None]  # (B, 1, 1, C, L)
    q, k, v = (x.unflatten(3, (c, size)) for x in (q, k, v))  # (B, Hk, 1 or r, C, L, D)
    g = g.unflatten(3, (c, size))  # (B, Hk, r, C, L), or (B, Hk, r, C, L, Dk)
    cum = g.cumsum(3 + 1)  # log decay from the chunk's start through token i
    kt = k.transpose(-1, -2)  # (B, Hk, 1, C, Dk, L)
    if channels:  # pairs decayed channel by channel: (B, Hk, r, C, L, L)
        scores, keys = _decayed_products((q, k), k, cum)
    else:  # one decay for all channels: a factor on q k^T and k k^T
        later = torch.ones(size, size, dtype=torch.bool, device=q.device).triu(1)  # j > i
        between = (cum[..., :, None] - cum[..., None, :]).masked_fill(later, float("-inf")).exp()
        scores, keys = (q @ kt) * between, (k @ kt) * between
    reads = writes = None
    if runs is not None:  # no pair across documents; only the documents the state
        # comes from reads it, and only the chunk's last document writes it
        same = runs[..., :, None] == runs[..., None, :]  # (B, 1, 1, C, L, L)
        scores, keys = scores * same, keys * same
        before = torch.cat((runs[..., :1, 0], runs[..., :-1, -1]), -1)  # (B, 1, 1, C)
        reads = (runs == before[..., None]).to(work)  # (B, 1, 1, C, L)
        writes = (runs == runs[..., -1:]).to(work)
        if channels:
            reads, writes = reads[..., None], writes[..., None]
    last = cum[..., -1:, :] if channels else cum[..., -1:]
    decay_in = cum.exp() if reads is None else cum.exp() * reads  # (B, Hk, r, C, L[, Dk])
    decay_out = (last - cum).exp()
    carry = last.exp()  # (B, Hk, r, C, 1[, Dk])
    if runs is not None:
        decay_out = decay_out * writes
        new_doc = before == runs[..., -1]  # (B, 1, 1, C): a new document drops the state
        carry = carry * (new_doc[..., None, None] if channels else new_doc[..., None])
    if not channels:
        decay_in, decay_out = decay_in[..., None], decay_out[..., None]  # (..., L, 1)
    u, w = v, None  # what each token writes, less what the old state predicts (w s)
    if delta:  # the WY system: token i's correction depends on those of tokens j < i
        beta = beta.unflatten(3, (c, size))[..., None]  # (B, Hk, r, C, L, 1)
        system = keys * beta  # row i: beta_i k_i . k_j, decayed; diagonal unused
        u, w = torch.linalg.solve_triangular(
            system, torch.cat((v * beta, k * (beta * decay_in)), -1),
            upper=False, unitriangular=True).split([dv, dk], -1)
    q_in = q * decay_in  # reading the state at the chunk's start
    k_out = k * decay_out  # decayed to the chunk's end
    # the state's decay over the chunk: (B, Hk, r, C, Dk, 1) per row, or (..., 1, 1)
    carry = carry.transpose(-1, -2) if channels else carry[..., None]
    # one view per chunk, taken at once: indexing chunk i in the loop would make the
    # backward write each chunk's gradient into a zeroed copy of the whole tensor
    u, q_in, scores, k_out, carry = (x.unbind(3) for x in (u, q_in, scores, k_out, carry))
    w = (None,) * c if w is None else w.unbind(3)
    outs = []
    for i in range(c):  # the chunks in order: (B, Hk, r, Dk, Dv) state between them
        new = u[i] if w[i] is None else u[i] - w[i] @ s  # (B, Hk, r, L, Dv)
        outs.append(q_in[i] @ s + scores[i] @ new)
        s = s * carry[i] + k_out[i].transpose(-1, -2) @ new
    o = torch.cat(outs, 3)[:, :, :, :n] if outs else v.new_zeros(b, hk, r, 0, dv)
    o = o.flatten(1, 2).to(dtype)  # (B, Hv, N, Dv)
    return (o, s.flatten(1, 2)) if return_state else o


def _decayed_products(rows: tuple[Tensor, ...], b: Tensor, cum: Tensor,
                      sub: int = 16) -> list[Tensor]:
    """For each ``a`` of ``rows``: ``P[..., i, j] = sum_d a_i[d] b_j[d] exp(cum_i[d] -
    cum_j[d])`` for ``j <= i`` (0 above), the products of tokens ``i`` and ``j`` through
    the decay between them, channel by channel. ``a``, ``b`` ``(..., L, D)`` and ``cum``
    ``(..., L, D)`` (cumulative log decays, non-increasing along ``L``) broadcast; each
    ``P`` is ``(..., L, L)``. The decays are computed once for all of ``rows``.

    No exponential of a positive number is taken: within a sub-chunk of ``sub`` tokens
    each pair's decay is formed channel by channel (``(..., L, sub, D)``); across
    sub-chunks ``I > J`` the decay passes through ``J``'s last token ``e``:
    ``(a_i exp(cum_i - cum_e)) . (b_j exp(cum_e - cum_j))``, both factors at most 1, one
    matmul a pair of sub-chunks.
    """
    n = cum.shape[-2]
    s = min(sub, n)
    pad = -n % s
    if pad:  # more tokens of no decay and zero inputs, cut off at the end
        rows, b = tuple(torch.nn.functional.pad(a, (0, 0, 0, pad)) for a in rows), \
            torch.nn.functional.pad(b, (0, 0, 0, pad))
        cum = torch.cat((cum, cum[..., -1:, :].expand(*cum.shape[:-2], pad, cum.shape[-1])), -2)
    m = (n + pad) // s
    rows = tuple(a.unflatten(-2, (m, s)) for a in rows)  # (..., M, s, D)
    b, cum = b.unflatten(-2, (m, s)), cum.unflatten(-2, (m, s))
    ones = torch.ones(s, s, dtype=torch.bool, device=cum.device)
    pair = cum[..., :, None, :] - cum[..., None, :, :]  # (..., M, s, s, D): i, j
    pair = pair.masked_fill(ones.triu(1)[..., None], float("-inf")).exp()  # 0 for j > i
    pair = pair * b[..., None, :, :]  # the decayed b_j of each pair
    insides = [(a[..., :, None, :] * pair).sum(-1) for a in rows]  # (..., M, s, s)
    if m == 1:
        return [inside[..., 0, :n, :n] for inside in insides]
    end = cum[..., -1, :]  # (..., M, D): through each sub-chunk's last token
    b_end = b * (end[..., None, :] - cum).exp()  # (..., J, s, D): decayed to J's end
    gap = cum[..., :, None, :, :] - end[..., None, :, None, :]  # (..., I, J, s, D)
    not_before = torch.ones(m, m, dtype=torch.bool, device=cum.device).triu()  # J >= I
    gap = gap.masked_fill(not_before[:, :, None, None], float("-inf")).exp()
    b_end = b_end[..., None, :, :, :].transpose(-1, -2)  # (..., 1, J, D, s)
    diagonal = torch.eye(m, dtype=torch.bool, device=cum.device)[:, :, None, None]
    out = []
    for a, inside in zip(rows, insides):
        across = (a[..., :, None, :, :] * gap) @ b_end  # (..., I, J, s, s)
        full = torch.where(diagonal, inside[..., :, None, :, :], across)
        out.append(full.transpose(-3, -2).flatten(-4, -3).flatten(-2)[..., :n, :n])
    return out  # each (..., L, L)
