"""Gated DeltaNet: a linear-attention token mixer with a fixed-size state (Qwen3-Next's and
Qwen3.5's "linear_attention" layers), over ``torchfn.kernels.gated_delta_rule``."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from torchfn.models._kv_cache import KVCache, StaticKVCache
from torchfn.models._mlp import _check_dims
from torchfn.models._recurrent import causal_conv, recurrent_cache, recurrent_inputs

__all__ = ["GatedDeltaNet"]


class GatedRMSNorm(nn.Module):
    """``weight * rms_norm(x) * silu(gate)`` over the last dim ``(..., dim)``, computed in
    at least float32 as transformers' ``RMSNormGated``."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        work = torch.promote_types(x.dtype, torch.float32)
        y = nn.functional.rms_norm(x.to(work), x.shape[-1:], eps=self.eps).to(x.dtype)
        return (self.weight * y * nn.functional.silu(gate.to(work))).to(x.dtype)


def _l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim, in at least float32 (FLA's)."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet (Yang, Kautz and Hatamizadeh 2024) as Qwen3-Next and Qwen3.5 use
    it: ``(B, N, dim) -> (B, N, dim)`` with a state of fixed size per sequence, so a
    token costs the same however long the context.

    Queries, keys and values come from one projection ``qkv`` through a causal
    depthwise convolution of ``conv_kernel`` taps and SiLU; queries and keys are
    L2-normalised; each value head gets a learning rate ``beta = sigmoid(x W_b)`` and a
    decay ``g = -exp(A_log) softplus(x W_dt + dt_bias)``, and
    :func:`torchfn.kernels.gated_delta_rule` mixes the tokens. The output is normalised
    per head and gated, ``RMSNorm(o) * silu(x W_gate)``, then projected back.

    ``heads`` value heads of ``value_dim``, ``key_heads`` (dividing ``heads``) query/key
    heads of ``key_dim``. ``beta_scale=2`` widens the learning rate to ``(0, 2)``, so the
    state's transition ``I - beta k k^T`` may have a negative eigenvalue (Grazzi et al.
    2025; OLMo Hybrid's ``allow_neg_eigval``). With a cache (``KVCache()`` to start, or a
    :class:`StaticKVCache`), the forward returns ``(out, cache)``; this layer's entry holds
    the convolution's last ``conv_kernel - 1`` inputs ``(B, C, K - 1)`` as its "keys" and
    the state ``(B, heads, key_dim, value_dim)`` as its "values": fixed sizes, so a
    static cache needs no capacity for it. ``key_padding_mask`` zeroes padded tokens'
    inputs (left padding: the state stays 0 through them). Causal by construction;
    ``segment_ids`` ``(B, N)`` packs documents (a new one wherever the id changes): each
    starts from a zero state and its convolution reads nothing of the one before, as if
    it ran alone.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import GatedDeltaNet, KVCache
        >>> model = torchfn.Model(GatedDeltaNet(dim=32, heads=4, key_heads=2, key_dim=8,
        ...                                     value_dim=8))
        >>> params = model.init(torchfn.random.key(0))
        >>> x = torchfn.random.normal(torchfn.random.key(1), (2, 10, 32))  # (B, N, dim)
        >>> out = model.apply(params, x)
        >>> first, cache = model.apply(params, x[:, :6], cache=KVCache())
        >>> rest, cache = model.apply(params, x[:, 6:], cache=cache)
        >>> torch.allclose(torch.cat((first, rest), 1), out, atol=1e-5)
        True
        >>> cache.keys[0].shape, cache.values[0].shape  # conv window, state
        (torch.Size([2, 64, 3]), torch.Size([2, 4, 8, 8]))
    """

    def __init__(self, dim: int, heads: int, *, key_heads: int | None = None,
                 key_dim: int | None = None, value_dim: int | None = None,
                 conv_kernel: int = 4, norm_eps: float = 1e-6, chunk: int = 64,
                 beta_scale: float = 1.0) -> None:
        super().__init__()
        key_heads = heads if key_heads is None else key_heads
        value_dim = dim // heads if value_dim is None else value_dim
        key_dim = value_dim if key_dim is None else key_dim
        _check_dims(dim=dim, heads=heads, key_heads=key_heads, key_dim=key_dim,
                    value_dim=value_dim, conv_kernel=conv_kernel, chunk=chunk)
        if heads % key_heads:
            raise ValueError(f"key_heads must divide heads = {heads}, got key_heads={key_heads}")
        if isinstance(beta_scale, bool) or not isinstance(beta_scale, (int, float)) or not (
                0 < beta_scale <= 2):
            raise ValueError(f"beta_scale must be a number in (0, 2], got {beta_scale!r}")
        self.beta_scale = float(beta_scale)
        self.dim, self.heads, self.key_heads = dim, heads, key_heads
        self.key_dim, self.value_dim, self.conv_kernel = key_dim, value_dim, conv_kernel
        self.chunk = chunk
        self.channels = 2 * key_heads * key_dim + heads * value_dim  # [q | k | v]
        self.qkv = nn.Linear(dim, self.channels, bias=False)
        self.gate = nn.Linear(dim, heads * value_dim, bias=False)  # the output gate (z)
        self.beta = nn.Linear(dim, heads, bias=False)  # the learning rate's logits (b)
        self.dt = nn.Linear(dim, heads, bias=False)  # the step size's (a)
        self.conv = nn.Conv1d(self.channels, self.channels, conv_kernel, groups=self.channels,
                              bias=False)  # causal here: padded with the cached window
        self.dt_bias = nn.Parameter(torch.empty(heads))
        self.A_log = nn.Parameter(torch.empty(heads))
        self.norm = GatedRMSNorm(value_dim, norm_eps)
        self.out = nn.Linear(heads * value_dim, dim, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Mamba-2's: decay rates ``A`` uniform in [1, 16], step sizes log-uniform in
        [1e-3, 0.1] through softplus's inverse."""
        nn.init.uniform_(self.A_log, 1.0, 16.0)
        with torch.no_grad():
            self.A_log.log_()
        nn.init.uniform_(self.dt_bias, math.log(1e-3), math.log(0.1))
        with torch.no_grad():
            dt = self.dt_bias.exp()
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)

    def cache_shapes(self, batch_size: int, capacity: int) -> tuple[tuple, tuple]:
        """This layer's cache entry: the convolution's window ``(B, C, K - 1)`` and the
        state ``(B, heads, key_dim, value_dim)``, whatever the capacity."""
        return ((batch_size, self.channels, self.conv_kernel - 1),
                (batch_size, self.heads, self.key_dim, self.value_dim))

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None,
                segment_ids: Tensor | None = None, positions: Tensor | None = None,
                cache: KVCache | StaticKVCache | None = None) -> Tensor | tuple:
        x, _, runs, cache, window, state = recurrent_inputs(
            "GatedDeltaNet", x, key_padding_mask, segment_ids, cache)  # x: padding zeroed
        h, window = causal_conv(self.qkv(x).transpose(1, 2), self.conv.weight, None, window,
                                runs)
        h = nn.functional.silu(h)  # (B, C, N)
        hk, hv = self.key_heads * self.key_dim, self.heads * self.value_dim
        q, k, v = h.transpose(1, 2).split([hk, hk, hv], -1)  # (B, N, ...)
        q = _l2_normalize(q.unflatten(-1, (self.key_heads, self.key_dim)).transpose(1, 2))
        k = _l2_normalize(k.unflatten(-1, (self.key_heads, self.key_dim)).transpose(1, 2))
        v = v.unflatten(-1, (self.heads, self.value_dim)).transpose(1, 2)  # (B, Hv, N, Dv)
        beta = torch.sigmoid(self.beta(x)).transpose(1, 2)  # (B, Hv, N)
        if self.beta_scale != 1:  # OLMo Hybrid's 2: the update's eigenvalues in [-1, 1]
            beta = beta * self.beta_scale
        work = torch.promote_types(x.dtype, torch.float32)
        g = -self.A_log.to(work).exp() * nn.functional.softplus(
            self.dt(x).to(work) + self.dt_bias)  # (B, N, Hv): log decays <= 0
        o, state = _delta_rule(q, k, v.to(work), g.transpose(1, 2), beta, state, self.chunk,
                               runs)
        o = o.to(x.dtype).transpose(1, 2)  # (B, N, Hv, Dv)
        z = self.gate(x).unflatten(-1, (self.heads, self.value_dim))
        out = self.out(self.norm(o, z).flatten(2))  # (B, N, dim)
        return out if cache is None else (out, recurrent_cache(cache, window, state, x.shape[1]))


def _delta_rule(q, k, v, g, beta, state, chunk, segment_ids):
    """:func:`torchfn.kernels.gated_delta_rule` with the final state (imported lazily)."""
    from torchfn.kernels import gated_delta_rule

    return gated_delta_rule(q, k, v, g, beta, state=state, chunk=chunk,
                            segment_ids=segment_ids, return_state=True)
