"""Kimi Delta Attention (Kimi Linear's "linear_attention" layers): the gated delta rule with
a decay per key channel, over ``torchfn.kernels.gated_delta_rule``."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from torchfn.models._delta_net import _delta_rule, _l2_normalize
from torchfn.models._kv_cache import KVCache, StaticKVCache
from torchfn.models._mlp import _check_dims
from torchfn.models._recurrent import causal_conv, recurrent_cache, recurrent_inputs

__all__ = ["KimiDeltaAttention"]


class KimiDeltaAttention(nn.Module):
    """Kimi Delta Attention (Kimi Team 2025, "Kimi Linear"): ``(B, N, dim) -> (B, N, dim)``
    with a state of fixed size per sequence; Gated DeltaNet with its scalar decay made one
    per key channel.

    Queries, keys and values (``heads`` of ``head_dim`` each) come from one projection
    ``qkv`` through a causal depthwise convolution of ``conv_kernel`` taps and SiLU;
    queries and keys are L2-normalised. Each head and channel decays by
    ``g = -exp(A_log) softplus(f_b(f_a(x)) + dt_bias)`` (a low-rank projection through
    ``head_dim`` features), each head learns at ``beta = sigmoid(x W_beta)``, and
    :func:`torchfn.kernels.gated_delta_rule` with ``log_decay`` ``(B, H, N, head_dim)``
    mixes the tokens. The output is normalised per head and gated by a sigmoid of
    another low-rank projection, ``RMSNorm(o) * sigmoid(g_b(g_a(x)))``, then projected
    back.

    ``low_rank_gates=False``: the decay's and the output gate's projections full rank,
    ``f`` and ``g`` ``(heads head_dim, dim)`` each (Ling 3's ``bailing_hybrid``);
    ``lower_bound=b`` (< 0): the decay ``g = b sigmoid(exp(A_log) (f(x) + dt_bias))`` in
    ``(b, 0)`` instead (its "safe gate").

    Caches as :class:`GatedDeltaNet`'s: an entry holds the convolution's window
    ``(B, 3 heads head_dim, K - 1)`` and the state ``(B, heads, head_dim, head_dim)``.
    ``key_padding_mask`` keeps padded tokens out of both; ``segment_ids`` packs documents.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import KVCache, KimiDeltaAttention
        >>> model = torchfn.Model(KimiDeltaAttention(dim=32, heads=4, head_dim=8))
        >>> params = model.init(torchfn.random.key(0))
        >>> x = torchfn.random.normal(torchfn.random.key(1), (2, 10, 32))  # (B, N, dim)
        >>> first, cache = model.apply(params, x[:, :6], cache=KVCache())
        >>> rest, cache = model.apply(params, x[:, 6:], cache=cache)
        >>> torch.allclose(torch.cat((first, rest), 1), model.apply(params, x), atol=1e-5)
        True
        >>> cache.values[0].shape                           # (B, heads, head_dim, head_dim)
        torch.Size([2, 4, 8, 8])
    """

    def __init__(self, dim: int, heads: int, *, head_dim: int = 128, conv_kernel: int = 4,
                 norm_eps: float = 1e-5, chunk: int = 64, low_rank_gates: bool = True,
                 lower_bound: float | None = None) -> None:
        super().__init__()
        _check_dims(dim=dim, heads=heads, head_dim=head_dim, conv_kernel=conv_kernel,
                    chunk=chunk)
        self.dim, self.heads, self.head_dim = dim, heads, head_dim
        self.conv_kernel, self.chunk = conv_kernel, chunk
        inner = heads * head_dim
        self.channels = 3 * inner  # [q | k | v]
        self.qkv = nn.Linear(dim, self.channels, bias=False)
        self.conv = nn.Conv1d(self.channels, self.channels, conv_kernel, groups=self.channels,
                              bias=False)  # causal here: padded with the cached window
        if not isinstance(low_rank_gates, bool):
            raise ValueError(f"low_rank_gates must be a bool, got {low_rank_gates!r}")
        if lower_bound is not None and (isinstance(lower_bound, bool) or not isinstance(
                lower_bound, (int, float)) or not lower_bound < 0):
            raise ValueError(f"lower_bound must be a number < 0 or None, got {lower_bound!r}")
        self.low_rank_gates = low_rank_gates
        self.lower_bound = None if lower_bound is None else float(lower_bound)
        if low_rank_gates:  # through head_dim features (Kimi Linear)
            self.f_a = nn.Linear(dim, head_dim, bias=False)  # the decays' projection
            self.f_b = nn.Linear(head_dim, inner, bias=False)
        else:
            self.f = nn.Linear(dim, inner, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(inner))
        self.A_log = nn.Parameter(torch.empty(heads))
        self.beta = nn.Linear(dim, heads, bias=False)
        if low_rank_gates:
            self.g_a = nn.Linear(dim, head_dim, bias=False)  # the output gate's
            self.g_b = nn.Linear(head_dim, inner, bias=False)
        else:
            self.g = nn.Linear(dim, inner, bias=False)
        self.norm = nn.Parameter(torch.empty(head_dim))
        self.norm_eps = norm_eps
        self.out = nn.Linear(inner, dim, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Decay rates ``A`` uniform in [1, 16], step sizes log-uniform in [1e-3, 0.1]
        through softplus's inverse (FLA's), the norm's weight 1."""
        nn.init.uniform_(self.A_log, 1.0, 16.0)
        nn.init.uniform_(self.dt_bias, math.log(1e-3), math.log(0.1))
        nn.init.ones_(self.norm)
        with torch.no_grad():
            self.A_log.log_()
            dt = self.dt_bias.exp()
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)

    def cache_shapes(self, batch_size: int, capacity: int) -> tuple[tuple, tuple]:
        """This layer's cache entry: the convolution's window ``(B, C, K - 1)`` and the
        state ``(B, heads, head_dim, head_dim)``, whatever the capacity."""
        return ((batch_size, self.channels, self.conv_kernel - 1),
                (batch_size, self.heads, self.head_dim, self.head_dim))

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None,
                segment_ids: Tensor | None = None, positions: Tensor | None = None,
                cache: KVCache | StaticKVCache | None = None) -> Tensor | tuple:
        x, _, runs, cache, window, state = recurrent_inputs(
            "KimiDeltaAttention", x, key_padding_mask, segment_ids, cache)  # padding zeroed
        conv = self.conv.weight.to(x.dtype)  # (a checkpoint may keep it in float32)
        h, window = causal_conv(self.qkv(x).transpose(1, 2), conv, None, window, runs)
        h = nn.functional.silu(h).transpose(1, 2)  # (B, N, C)
        q, k, v = (t.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)
                   for t in h.chunk(3, -1))  # (B, H, N, D) each
        q, k = _l2_normalize(q), _l2_normalize(k)
        work = torch.promote_types(x.dtype, torch.float32)
        f = self.f_b(self.f_a(x)) if self.low_rank_gates else self.f(x)  # (B, N, H D)
        f = (f.to(work) + self.dt_bias).unflatten(-1, (self.heads, -1))  # (B, N, H, D)
        a = self.A_log.to(work).exp()[:, None]  # (H, 1)
        g = -a * nn.functional.softplus(f) if self.lower_bound is None else \
            self.lower_bound * torch.sigmoid(a * f)  # log decays in (lower_bound, 0)
        beta = torch.sigmoid(self.beta(x)).transpose(1, 2)  # (B, H, N)
        o, state = _delta_rule(q, k, v.to(work), g.transpose(1, 2), beta, state, self.chunk,
                               runs)  # o (B, H, N, D); g (B, H, N, D): log decays <= 0
        gate = self.g_b(self.g_a(x)) if self.low_rank_gates else self.g(x)
        gate = gate.unflatten(-1, (self.heads, self.head_dim))  # (B, N, H, D)
        o = nn.functional.rms_norm(o.transpose(1, 2).to(work), (self.head_dim,),
                                   eps=self.norm_eps) * self.norm.to(work)
        o = o * torch.sigmoid(gate.to(work))
        out = self.out(o.flatten(2).to(x.dtype))  # (B, N, dim)
        return out if cache is None else (out, recurrent_cache(cache, window, state, x.shape[1]))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, heads={self.heads}, head_dim={self.head_dim}"
