"""Mamba's selective scan (Gu and Dao 2023): a state ``h`` ``(D, S)`` per sequence whose
every entry decays at its own rate, in log-depth chunks.

For each token ``t``, with ``x_t``, ``dt_t`` ``(D,)`` and ``B_t``, ``C_t`` ``(S,)``::

    h = exp(dt_t[:, None] * A) * h + (dt_t * x_t)[:, None] * B_t[None, :]
    y_t = h @ C_t

``A`` ``(D, S)`` differs per channel and state entry, so this is not linear attention
with scalar decays (Mamba-2's SSD, :func:`gated_linear_attention`): it runs as a linear
recurrence through :func:`torchfn.associative_scan`, a chunk of tokens at a time (the
chunk's ``(L, D, S)`` states are the memory bound), the state carried between chunks.
Plain torch ops: ``grad``, ``vmap`` and ``jvp`` compose with it.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["selective_scan"]


def _compose(first: tuple[Tensor, Tensor], second: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """``h -> a1 h + b1`` then ``h -> a2 h + b2``: ``h -> a2 a1 h + (a2 b1 + b2)``."""
    (a1, b1), (a2, b2) = first, second
    return a2 * a1, a2 * b1 + b2


def selective_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *,
                   state: Tensor | None = None, segment_ids: Tensor | None = None,
                   chunk: int = 64, return_state: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Mamba's selective scan over ``x`` ``(B, N, D)``, from ``state`` (default 0).

    Args:
        x: ``(B, N, D)`` inputs, one per channel.
        dt: ``(B, N, D)`` step sizes (> 0, after softplus).
        A: ``(D, S)`` decay rates (< 0: ``-exp(A_log)``).
        B, C: ``(B, N, S)`` the input and output projections of the state, per token.
        state: ``(B, D, S)`` before the first token.
        segment_ids: ``(B, N)`` packed documents: where the id changes the state restarts
            at 0 (the decay into that token is taken as 0: exact).
        chunk: tokens scanned at once (memory ``B * chunk * D * S``); the result does not
            depend on it.
        return_state: also return the state after the last token ``(B, D, S)``.

    Returns:
        ``y`` ``(B, N, D)`` in ``x``'s dtype (computed in at least float32), and with
        ``return_state`` the final state in float32 (or float64).

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> from torchfn.kernels import selective_scan
        >>> kx, kd, kb, kc = random.split(random.key(0), 4)
        >>> x = random.normal(kx, (1, 5, 3))                       # (B, N, D)
        >>> dt = random.uniform(kd, (1, 5, 3))
        >>> A = -torch.arange(1.0, 5.0).expand(3, 4)                # (D, S)
        >>> B, C = random.normal(kb, (1, 5, 4)), random.normal(kc, (1, 5, 4))  # (B, N, S)
        >>> y, h = selective_scan(x, dt, A, B, C, return_state=True)
        >>> y.shape, h.shape
        (torch.Size([1, 5, 3]), torch.Size([1, 3, 4]))
        >>> h0 = torch.zeros(1, 3, 4)                               # the recurrence, by hand
        >>> for t in range(5):
        ...     h0 = (dt[0, t, :, None] * A).exp() * h0 + (dt[0, t] * x[0, t])[:, None] * B[0, t]
        >>> torch.allclose(h, h0, atol=1e-5)
        True
    """
    for name, t, dims in (("x", x, 3), ("dt", dt, 3), ("A", A, 2), ("B", B, 3), ("C", C, 3)):
        if not isinstance(t, Tensor) or t.dim() != dims or not t.is_floating_point():
            raise ValueError(f"selective_scan: {name} must be a float tensor of {dims} dims, "
                             f"got {getattr(t, 'shape', type(t).__name__)}")
    b, n, d = x.shape
    s = A.shape[1]
    if dt.shape != x.shape or A.shape[0] != d or B.shape != (b, n, s) or C.shape != (b, n, s):
        raise ValueError(f"selective_scan: dt must be x's shape (B, N, D) = {(b, n, d)}, A "
                         f"(D, S), B and C (B, N, S); got dt {tuple(dt.shape)}, A "
                         f"{tuple(A.shape)}, B {tuple(B.shape)}, C {tuple(C.shape)}")
    if state is not None and (not isinstance(state, Tensor) or state.shape != (b, d, s)):
        raise ValueError(f"selective_scan: state must be (B, D, S) = {(b, d, s)} or None, got "
                         f"{getattr(state, 'shape', state)}")
    if segment_ids is not None and (not isinstance(segment_ids, Tensor)
                                    or segment_ids.shape != (b, n)
                                    or segment_ids.is_floating_point()):
        raise ValueError(f"selective_scan: segment_ids must be an integer tensor (B, N) = "
                         f"{(b, n)}, got {getattr(segment_ids, 'shape', segment_ids)}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"selective_scan: chunk must be an int >= 1, got {chunk!r}")
    dtype, work = x.dtype, torch.promote_types(x.dtype, torch.float32)
    x, dt, A, B, C = (t.to(work) for t in (x, dt, A, B, C))
    h = torch.zeros(b, d, s, dtype=work, device=x.device) if state is None else state.to(work)
    keep = None  # 0 where a document starts: its state does not carry in
    if segment_ids is not None:
        keep = torch.cat((torch.ones_like(segment_ids[:, :1]),
                          (segment_ids[:, 1:] == segment_ids[:, :-1]).long()), 1).to(work)
    outs = []
    for start in range(0, n, chunk):  # (B, L, D, S) states at a time
        part = slice(start, start + chunk)
        decay = (dt[:, part, :, None] * A).exp()  # (B, L, D, S)
        if keep is not None:
            decay = decay * keep[:, part, None, None]
        write = (dt[:, part] * x[:, part])[..., None] * B[:, part, None, :]  # (B, L, D, S)
        carried, states = _scan(decay, write)  # the chunk's own prefix products and sums
        states = states + carried * h[:, None]  # (B, L, D, S): with the state coming in
        outs.append(torch.einsum("blds,bls->bld", states, C[:, part]))
        h = states[:, -1]
    y = (torch.cat(outs, 1) if outs else x.new_zeros(b, 0, d)).to(dtype)
    return (y, h) if return_state else y


def _scan(decay: Tensor, write: Tensor) -> tuple[Tensor, Tensor]:
    """The linear recurrence's prefixes along dim 1: ``(prod decay, h from 0)``."""
    from torchfn.core.associative_scan import associative_scan

    return associative_scan(_compose, (decay, write), dim=1)
