"""xLSTM's mLSTM layer (xLSTM 7B's): a matrix memory with exponential input gates, over
``torchfn.kernels.mlstm``, its heads normalised and gated."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from torchfn.models._kv_cache import KVCache, StaticKVCache
from torchfn.models._mlp import _check_dims
from torchfn.models._recurrent import recurrent_cache, recurrent_inputs

__all__ = ["MLSTM"]


class MLSTM(nn.Module):
    """xLSTM's mLSTM layer ``(B, N, dim) -> (B, N, dim)`` as xLSTM 7B (transformers'
    ``xLSTMLayer``) has it: a state of fixed size per sequence.

    Queries and keys (``qk_dim``, default ``dim / 2``) and values (``v_dim``, default
    ``dim``) come from their own projections, ``heads`` heads each; per head, an input
    gate ``i`` and a forget gate ``f`` (their preactivations soft-capped at ``gate_cap``:
    ``cap * tanh(x / cap)``) drive :func:`torchfn.kernels.mlstm`. Each head's output is
    layer-normalised (no mean over heads), scaled by ``norm`` (a weight over all heads),
    gated by ``sigmoid(x W_o)`` and projected back by ``out``.

    With a cache (``KVCache()`` to start, or a :class:`StaticKVCache`), the forward
    returns ``(out, cache)``; the entry holds no window ``(B, 0, 0)`` and the state packed
    in one tensor ``(B, heads, Dk + 1, Dv + 1)``: the memory ``C`` in ``[:Dk, :Dv]``, the
    normaliser ``n`` in ``[:Dk, Dv]`` and the maximum ``m`` in ``[Dk, 0]``.
    ``key_padding_mask`` leaves padded tokens out of the state (left padding);
    ``segment_ids`` packs documents, each from the zero state.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import KVCache, MLSTM
        >>> model = torchfn.Model(MLSTM(dim=16, heads=2))
        >>> params = model.init(torchfn.random.key(0))
        >>> x = torchfn.random.normal(torchfn.random.key(1), (2, 10, 16))  # (B, N, dim)
        >>> first, cache = model.apply(params, x[:, :6], cache=KVCache())
        >>> rest, cache = model.apply(params, x[:, 6:], cache=cache)
        >>> torch.allclose(torch.cat((first, rest), 1), model.apply(params, x), atol=1e-5)
        True
        >>> cache.values[0].shape  # (B, heads, Dk + 1, Dv + 1): C, n and m packed
        torch.Size([2, 2, 5, 9])
    """

    def __init__(self, dim: int, heads: int, *, qk_dim: int | None = None,
                 v_dim: int | None = None, bias: bool = False, gate_cap: float | None = 15.0,
                 norm_eps: float = 1e-6, eps: float = 1e-6, chunk: int = 64) -> None:
        super().__init__()
        qk_dim = dim // 2 if qk_dim is None else qk_dim
        v_dim = dim if v_dim is None else v_dim
        _check_dims(dim=dim, heads=heads, qk_dim=qk_dim, v_dim=v_dim, chunk=chunk)
        if qk_dim % heads or v_dim % heads:
            raise ValueError(f"heads must divide qk_dim = {qk_dim} and v_dim = {v_dim}, got "
                             f"heads={heads}")
        if gate_cap is not None and (isinstance(gate_cap, bool) or not isinstance(
                gate_cap, (int, float)) or not gate_cap > 0):
            raise ValueError(f"gate_cap must be a number > 0 or None, got {gate_cap!r}")
        self.dim, self.heads, self.qk_dim, self.v_dim = dim, heads, qk_dim, v_dim
        self.gate_cap, self.norm_eps, self.eps, self.chunk = gate_cap, norm_eps, eps, chunk
        self.q = nn.Linear(dim, qk_dim, bias=bias)
        self.k = nn.Linear(dim, qk_dim, bias=bias)
        self.v = nn.Linear(dim, v_dim, bias=bias)
        self.o_gate = nn.Linear(dim, v_dim, bias=bias)
        self.i_gate = nn.Linear(dim, heads)  # gates always biased
        self.f_gate = nn.Linear(dim, heads)
        self.norm = nn.Parameter(torch.ones(v_dim))
        self.norm_bias = nn.Parameter(torch.zeros(v_dim)) if bias else None
        self.out = nn.Linear(v_dim, dim, bias=bias)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """xLSTM 7B's gate init: input gates biased to -10 (closed), forget gates to
        3..6 over the heads (slow decay), gate weights zero."""
        for gate in (self.i_gate, self.f_gate):
            nn.init.zeros_(gate.weight)
        nn.init.constant_(self.i_gate.bias, -10.0)
        with torch.no_grad():
            self.f_gate.bias.copy_(torch.linspace(3.0, 6.0, self.heads))
        nn.init.ones_(self.norm)
        if self.norm_bias is not None:
            nn.init.zeros_(self.norm_bias)

    def cache_shapes(self, batch_size: int, capacity: int) -> tuple[tuple, tuple]:
        """This layer's cache entry: no window ``(B, 0, 0)`` and the packed state
        ``(B, heads, Dk + 1, Dv + 1)``, whatever the capacity."""
        dk, dv = self.qk_dim // self.heads, self.v_dim // self.heads
        return (batch_size, 0, 0), (batch_size, self.heads, dk + 1, dv + 1)

    def _cap(self, x: Tensor) -> Tensor:
        return x if self.gate_cap is None else self.gate_cap * torch.tanh(x / self.gate_cap)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None,
                segment_ids: Tensor | None = None, positions: Tensor | None = None,
                cache: KVCache | StaticKVCache | None = None) -> Tensor | tuple:
        from torchfn.kernels import mlstm

        x, keep, _, cache, _, packed = recurrent_inputs(  # (the kernel reads segment_ids)
            "MLSTM", x, key_padding_mask, segment_ids, cache)
        b, n, _ = x.shape
        dk, dv = self.qk_dim // self.heads, self.v_dim // self.heads
        q, k = (p(x).unflatten(-1, (self.heads, dk)).transpose(1, 2) for p in (self.q, self.k))
        v = self.v(x).unflatten(-1, (self.heads, dv)).transpose(1, 2)  # (B, H, N, Dv)
        i = self._cap(self.i_gate(x)).transpose(1, 2)  # (B, H, N)
        f = self._cap(self.f_gate(x)).transpose(1, 2)
        state = None
        if packed is not None:
            state = (packed[..., :dk, :dv], packed[..., :dk, dv], packed[..., dk, 0])
        h, (c, nrm, m) = mlstm(q, k, v, i, f, state=state, chunk=self.chunk, eps=self.eps,
                               segment_ids=segment_ids,
                               keep=None if keep is None else keep[..., 0] > 0,
                               return_state=True)  # (B, H, N, Dv)
        work = torch.promote_types(h.dtype, torch.float32)  # per-head layer norm
        h = nn.functional.layer_norm(h.to(work), (dv,), eps=self.norm_eps).to(x.dtype)
        h = h.transpose(1, 2).flatten(2) * self.norm  # (B, N, v_dim)
        if self.norm_bias is not None:
            h = h + self.norm_bias
        out = self.out(torch.sigmoid(self.o_gate(x)) * h)  # (B, N, dim)
        if cache is None:
            return out
        top = torch.cat((c, nrm[..., None]), -1)  # (B, H, Dk, Dv + 1)
        bottom = torch.cat((m[..., None, None], c.new_zeros(b, self.heads, 1, dv)), -1)
        packed = torch.cat((top, bottom), -2)  # (B, H, Dk + 1, Dv + 1)
        window = x.new_zeros(b, 0, 0)
        return out, recurrent_cache(cache, window, packed, n)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, heads={self.heads}, qk_dim={self.qk_dim}, "
                f"v_dim={self.v_dim}")
