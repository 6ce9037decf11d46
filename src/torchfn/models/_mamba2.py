"""Mamba-2 (Dao and Gu 2024): a selective state-space token mixer, over
``torchfn.kernels.gated_linear_attention`` (its SSD is linear attention with decays)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from torchfn.models._kv_cache import KVCache, StaticKVCache
from torchfn.models._mlp import _check_dims
from torchfn.models._recurrent import causal_conv, recurrent_cache, recurrent_inputs

__all__ = ["Mamba2"]


class GroupRMSNorm(nn.Module):
    """Mamba-2's gated norm: ``weight * rms_norm(x * silu(gate))`` over each of ``groups``
    slices of the last dim ``(..., dim)``, in at least float32; ``before_gate=True``:
    ``weight * rms_norm(x) * silu(gate)`` (Falcon-H1's ``mamba_norm_before_gate``)."""

    def __init__(self, dim: int, groups: int = 1, eps: float = 1e-6,
                 before_gate: bool = False) -> None:
        super().__init__()
        self.groups, self.eps, self.before_gate = groups, eps, before_gate
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        work = torch.promote_types(x.dtype, torch.float32)
        gate = nn.functional.silu(gate.to(work))
        y = x.to(work) if self.before_gate else x.to(work) * gate
        y = y.unflatten(-1, (self.groups, -1))
        y = nn.functional.rms_norm(y, y.shape[-1:], eps=self.eps).flatten(-2)
        if self.before_gate:
            return (self.weight * y * gate).to(x.dtype)
        return self.weight * y.to(x.dtype)


class Mamba2(nn.Module):
    """A Mamba-2 mixer ``(B, N, dim) -> (B, N, dim)`` with a state of fixed size per
    sequence, as transformers' ``Mamba2Mixer`` (and the Mamba layers of Bamba, Granite
    4.0-H, Falcon-H1).

    One projection gives the gate ``z`` (``inner = expand * dim``), the inputs ``x``, ``B``
    and ``C`` (through a causal depthwise convolution of ``conv_kernel`` taps and SiLU)
    and a step size per head, ``dt = clamp(softplus(. + dt_bias), *dt_limit)``. Each of
    ``heads`` heads of ``head_dim`` (``heads * head_dim = inner``) runs the selective scan
    ``h = exp(dt A) h + dt B x^T``, ``y = C h + D x``, with ``A = -exp(A_log)`` and ``B``,
    ``C`` ``(state_dim,)`` shared by the heads of each of ``groups`` groups: that is
    :func:`torchfn.kernels.gated_linear_attention` with ``q = C``, ``k = B``,
    ``v = dt x``, decays ``dt A``. The output is ``norm(y * silu(z))`` (per group) through
    ``out``; ``norm="before_gate"``: ``norm(y) * silu(z)``; ``norm="none"``: ``y * silu(z)``
    (both Falcon-H1's options). ``in_scales``: five numbers multiplying the projection's
    ``z``, ``x``, ``B``, ``C`` and step-size parts (Falcon-H1's ``ssm_multipliers``).
    ``out_bias``: the output projection's bias alone (default ``bias``).

    Caches as :class:`GatedDeltaNet`'s: a :class:`KVCache` or :class:`StaticKVCache`
    entry holds the convolution's window ``(B, C, K - 1)`` and the state
    ``(B, heads, state_dim, head_dim)``. ``key_padding_mask`` keeps padded tokens out of
    the convolution and the state, so a left-padded row is computed as it is alone (with
    ``bias=True`` transformers lets the projection's bias of the padding into the
    convolution); ``segment_ids`` packs documents.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import KVCache, Mamba2
        >>> model = torchfn.Model(Mamba2(dim=32, heads=4, head_dim=16, state_dim=8))
        >>> params = model.init(torchfn.random.key(0))
        >>> x = torchfn.random.normal(torchfn.random.key(1), (2, 10, 32))  # (B, N, dim)
        >>> out = model.apply(params, x)
        >>> first, cache = model.apply(params, x[:, :6], cache=KVCache())
        >>> rest, cache = model.apply(params, x[:, 6:], cache=cache)
        >>> torch.allclose(torch.cat((first, rest), 1), out, atol=1e-5)
        True
        >>> cache.values[0].shape                          # (B, heads, state_dim, head_dim)
        torch.Size([2, 4, 8, 16])
    """

    def __init__(self, dim: int, heads: int, *, head_dim: int | None = None,
                 state_dim: int = 128, groups: int = 1, conv_kernel: int = 4,
                 bias: bool = False, conv_bias: bool = True, norm_eps: float = 1e-5,
                 dt_limit: tuple[float, float] = (0.0, float("inf")), chunk: int = 64,
                 norm: str = "gated", in_scales: tuple[float, ...] | None = None,
                 out_bias: bool | None = None) -> None:
        super().__init__()
        head_dim = 2 * dim // heads if head_dim is None else head_dim  # expand 2
        _check_dims(dim=dim, heads=heads, head_dim=head_dim, state_dim=state_dim,
                    groups=groups, conv_kernel=conv_kernel, chunk=chunk)
        if heads % groups:
            raise ValueError(f"groups must divide heads = {heads}, got groups={groups}")
        self.dim, self.heads, self.head_dim, self.state_dim = dim, heads, head_dim, state_dim
        self.groups, self.conv_kernel, self.chunk = groups, conv_kernel, chunk
        if norm not in ("gated", "before_gate", "none"):
            raise ValueError(f"norm must be 'gated', 'before_gate' or 'none', got {norm!r}")
        if in_scales is not None and (not isinstance(in_scales, (tuple, list)) or len(
                in_scales) != 5 or not all(isinstance(v, (int, float)) and not isinstance(
                v, bool) for v in in_scales)):
            raise ValueError(f"in_scales must be 5 numbers (z, x, B, C, dt) or None, got "
                             f"{in_scales!r}")
        self.in_scales = None if in_scales is None else tuple(float(v) for v in in_scales)
        self.dt_limit = (float(dt_limit[0]), float(dt_limit[1]))
        self.inner = heads * head_dim
        self.channels = self.inner + 2 * groups * state_dim  # [x | B | C]
        self.in_proj = nn.Linear(dim, self.inner + self.channels + heads, bias=bias)  # z, xBC, dt
        self.conv = nn.Conv1d(self.channels, self.channels, conv_kernel, groups=self.channels,
                              bias=conv_bias)  # causal here: padded with the cached window
        self.dt_bias = nn.Parameter(torch.empty(heads))
        self.A_log = nn.Parameter(torch.empty(heads))
        self.D = nn.Parameter(torch.empty(heads))
        self.norm = None if norm == "none" else GroupRMSNorm(
            self.inner, groups, norm_eps, before_gate=norm == "before_gate")
        self.out = nn.Linear(self.inner, dim, bias=bias if out_bias is None else out_bias)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Mamba-2's: ``A`` = 1..heads, ``D`` = 1, step sizes log-uniform in [1e-3, 0.1]
        through softplus's inverse."""
        with torch.no_grad():
            self.A_log.copy_(torch.arange(1, self.heads + 1, dtype=torch.float32).log())
            nn.init.ones_(self.D)
            nn.init.uniform_(self.dt_bias, math.log(1e-3), math.log(0.1))
            dt = self.dt_bias.exp().clamp(min=1e-4)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)

    def cache_shapes(self, batch_size: int, capacity: int) -> tuple[tuple, tuple]:
        """This layer's cache entry: the convolution's window ``(B, C, K - 1)`` and the
        state ``(B, heads, state_dim, head_dim)``, whatever the capacity."""
        return ((batch_size, self.channels, self.conv_kernel - 1),
                (batch_size, self.heads, self.state_dim, self.head_dim))

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None,
                segment_ids: Tensor | None = None, positions: Tensor | None = None,
                cache: KVCache | StaticKVCache | None = None) -> Tensor | tuple:
        x, keep, runs, cache, window, state = recurrent_inputs(
            "Mamba2", x, key_padding_mask, segment_ids, cache)  # x: padding zeroed
        z, xbc, dt = self.in_proj(x).split([self.inner, self.channels, self.heads], -1)
        if self.in_scales is not None:  # Falcon-H1's multipliers, one a part
            z, xbc, dt = z * self.in_scales[0], xbc * self._xbc_scale(xbc), dt * self.in_scales[4]
        if keep is not None:  # a biased projection of 0 is not 0: padding must stay out of
            xbc = xbc * keep  # the convolution's window (transformers lets it in)
        xbc, window = causal_conv(xbc.transpose(1, 2), self.conv.weight, self.conv.bias,
                                  window, runs)
        xbc = nn.functional.silu(xbc).transpose(1, 2)  # (B, N, C)
        if keep is not None:  # and out of the state
            xbc = xbc * keep
        gs = self.groups * self.state_dim
        xs, bs, cs = xbc.split([self.inner, gs, gs], -1)
        work = torch.promote_types(x.dtype, torch.float32)
        dt = nn.functional.softplus(dt.to(work) + self.dt_bias).clamp(*self.dt_limit)  # (B, N, H)
        xs = xs.to(work).unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)  # (B, H, N, P)
        q = cs.to(work).unflatten(-1, (self.groups, self.state_dim)).transpose(1, 2)  # (B, G, N, S)
        k = bs.to(work).unflatten(-1, (self.groups, self.state_dim)).transpose(1, 2)
        dt = dt.transpose(1, 2)  # (B, H, N)
        a = -self.A_log.to(work).exp()  # (H,)
        y, state = _scan(q, k, xs * dt[..., None], dt * a[:, None], state, self.chunk, runs)
        y = y + self.D.to(work)[:, None, None] * xs  # (B, H, N, P)
        y = y.transpose(1, 2).flatten(2)  # (B, N, inner)
        if self.norm is None:
            y = y * nn.functional.silu(z.to(work))
        else:
            y = self.norm(y, z)
        out = self.out(y.to(x.dtype))  # (B, N, dim)
        return out if cache is None else (out, recurrent_cache(cache, window, state, x.shape[1]))

    def _xbc_scale(self, xbc: Tensor) -> Tensor:
        """``in_scales``' x, B and C parts as one vector over the channels ``(C,)``."""
        gs = self.groups * self.state_dim
        return torch.repeat_interleave(
            torch.tensor(self.in_scales[1:4], dtype=xbc.dtype, device=xbc.device),
            torch.tensor([self.inner, gs, gs], device=xbc.device), output_size=self.channels)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, heads={self.heads}, head_dim={self.head_dim}, "
                f"state_dim={self.state_dim}, groups={self.groups}")


def _scan(q, k, v, g, state, chunk, segment_ids):
    """:func:`torchfn.kernels.gated_linear_attention` (imported lazily), scale 1, with the
    final state."""
    from torchfn.kernels import gated_linear_attention

    return gated_linear_attention(q, k, v, g, state=state, scale=1.0, chunk=chunk,
                                  segment_ids=segment_ids, return_state=True)
