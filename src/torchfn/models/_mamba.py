"""Mamba (Gu and Dao 2023): the selective state-space token mixer of Mamba-1 language
models, over ``torchfn.kernels.selective_scan``."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from torchfn.models._kv_cache import KVCache, StaticKVCache
from torchfn.models._mlp import _check_dims
from torchfn.models._recurrent import causal_conv, recurrent_cache, recurrent_inputs

__all__ = ["Mamba"]


class Mamba(nn.Module):
    """A Mamba(-1) mixer ``(B, N, dim) -> (B, N, dim)``, as transformers' ``MambaMixer``.

    ``in_proj`` gives the inputs ``x`` and the gate ``z`` (``inner`` channels each); ``x``
    goes through a causal depthwise convolution of ``conv_kernel`` taps and SiLU; ``x_proj``
    gives each token's step-size features (``dt_rank``) and its ``B``, ``C``
    (``state_dim``); ``dt = softplus(dt_proj(.))`` per channel; then
    :func:`torchfn.kernels.selective_scan` with ``A = -exp(A_log)`` ``(inner, state_dim)``,
    plus ``D x``, times ``silu(z)``, through ``out``. ``bcdt_norm_eps``: the step-size
    features, ``B`` and ``C`` are each RMS-normalised first, with no weight as
    Falcon-Mamba's, or with a learned one each (``bcdt_norm_weight=True``: params
    ``dt_norm`` ``(dt_rank,)``, ``b_norm`` and ``c_norm`` ``(state_dim,)``) as Jamba's.

    Caches as :class:`Mamba2`'s: an entry holds the convolution's window
    ``(B, inner, K - 1)`` and the state ``(B, 1, inner, state_dim)``. ``key_padding_mask``
    keeps padded tokens out of the window and the state; ``segment_ids`` packs documents.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import KVCache, Mamba
        >>> model = torchfn.Model(Mamba(dim=16, inner=32, state_dim=4))
        >>> params = model.init(torchfn.random.key(0))
        >>> x = torchfn.random.normal(torchfn.random.key(1), (2, 10, 16))  # (B, N, dim)
        >>> first, cache = model.apply(params, x[:, :6], cache=KVCache())
        >>> rest, cache = model.apply(params, x[:, 6:], cache=cache)
        >>> torch.allclose(torch.cat((first, rest), 1), model.apply(params, x), atol=1e-5)
        True
    """

    def __init__(self, dim: int, inner: int | None = None, *, state_dim: int = 16,
                 dt_rank: int | None = None, conv_kernel: int = 4, bias: bool = False,
                 conv_bias: bool = True, bcdt_norm_eps: float | None = None,
                 bcdt_norm_weight: bool = False, chunk: int = 64) -> None:
        super().__init__()
        inner = 2 * dim if inner is None else inner
        dt_rank = math.ceil(dim / 16) if dt_rank is None else dt_rank
        _check_dims(dim=dim, inner=inner, state_dim=state_dim, dt_rank=dt_rank,
                    conv_kernel=conv_kernel, chunk=chunk)
        self.dim, self.inner, self.state_dim, self.dt_rank = dim, inner, state_dim, dt_rank
        self.conv_kernel, self.chunk = conv_kernel, chunk
        if bcdt_norm_eps is not None and (isinstance(bcdt_norm_eps, bool) or not isinstance(
                bcdt_norm_eps, (int, float)) or not bcdt_norm_eps > 0):
            raise ValueError(f"bcdt_norm_eps must be a number > 0 or None, got "
                             f"{bcdt_norm_eps!r}")
        if not isinstance(bcdt_norm_weight, bool) or bcdt_norm_weight and bcdt_norm_eps is None:
            raise ValueError(f"bcdt_norm_weight must be a bool, and True only with a "
                             f"bcdt_norm_eps; got bcdt_norm_weight={bcdt_norm_weight!r}, "
                             f"bcdt_norm_eps={bcdt_norm_eps!r}")
        self.bcdt_norm_eps = bcdt_norm_eps
        self.in_proj = nn.Linear(dim, 2 * inner, bias=bias)  # [x | z]
        self.conv = nn.Conv1d(inner, inner, conv_kernel, groups=inner, bias=conv_bias)
        self.x_proj = nn.Linear(inner, dt_rank + 2 * state_dim, bias=False)  # [dt | B | C]
        self.dt_proj = nn.Linear(dt_rank, inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(inner, state_dim))
        self.D = nn.Parameter(torch.empty(inner))
        self.out = nn.Linear(inner, dim, bias=bias)
        if bcdt_norm_weight:  # Jamba's: one weight for each of the three norms
            self.dt_norm = nn.Parameter(torch.empty(dt_rank))
            self.b_norm = nn.Parameter(torch.empty(state_dim))
            self.c_norm = nn.Parameter(torch.empty(state_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Mamba's: ``A`` = 1..state_dim in every channel, ``D`` = 1, step sizes
        log-uniform in [1e-3, 0.1] through softplus's inverse (``dt_proj``'s bias); the
        norms' weights 1."""
        with torch.no_grad():
            for weight in self._norm_weights():
                nn.init.ones_(weight)
            self.A_log.copy_(torch.arange(1, self.state_dim + 1, dtype=torch.float32)
                             .log().expand(self.inner, -1))
            nn.init.ones_(self.D)
            nn.init.uniform_(self.dt_proj.bias, math.log(1e-3), math.log(0.1))
            dt = self.dt_proj.bias.exp().clamp(min=1e-4)
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)

    def cache_shapes(self, batch_size: int, capacity: int) -> tuple[tuple, tuple]:
        """This layer's cache entry: the convolution's window ``(B, inner, K - 1)`` and the
        state ``(B, 1, inner, state_dim)``, whatever the capacity."""
        return ((batch_size, self.inner, self.conv_kernel - 1),
                (batch_size, 1, self.inner, self.state_dim))

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None,
                segment_ids: Tensor | None = None, positions: Tensor | None = None,
                cache: KVCache | StaticKVCache | None = None) -> Tensor | tuple:
        x, keep, runs, cache, window, state = recurrent_inputs(
            "Mamba", x, key_padding_mask, segment_ids, cache)  # x: padding zeroed
        xs, z = self.in_proj(x).chunk(2, -1)  # (B, N, inner) each
        if keep is not None:  # a biased projection of 0 is not 0: keep padding out
            xs = xs * keep
        xs, window = causal_conv(xs.transpose(1, 2), self.conv.weight, self.conv.bias, window,
                                 runs)
        xs = nn.functional.silu(xs).transpose(1, 2)  # (B, N, inner)
        if keep is not None:
            xs = xs * keep
        dt, b, c = self.x_proj(xs).split([self.dt_rank, self.state_dim, self.state_dim], -1)
        work = torch.promote_types(x.dtype, torch.float32)
        if self.bcdt_norm_eps is not None:  # Falcon-Mamba (no weight), Jamba (a weight each)
            weights = self._norm_weights() or (None,) * 3
            dt, b, c = (_rms(t, w, self.bcdt_norm_eps, work) for t, w in zip((dt, b, c), weights))
        dt = nn.functional.softplus(self.dt_proj(dt).to(work))  # (B, N, inner)
        a = -self.A_log.to(work).exp()  # (inner, S)
        y, state = _scan(xs, dt, a, b, c, None if state is None else state[:, 0], runs,
                         self.chunk)
        y = (y.to(work) + self.D.to(work) * xs.to(work)) * nn.functional.silu(z.to(work))
        out = self.out(y.to(x.dtype))  # (B, N, dim)
        if cache is None:
            return out
        return out, recurrent_cache(cache, window, state[:, None], x.shape[1])

    def _norm_weights(self) -> tuple[Tensor, ...]:
        """The three norms' weights (dt, B, C), or () without them."""
        return (self.dt_norm, self.b_norm, self.c_norm) if hasattr(self, "dt_norm") else ()

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, inner={self.inner}, state_dim={self.state_dim}, "
                f"dt_rank={self.dt_rank}")


def _rms(t: Tensor, weight: Tensor | None, eps: float, work: torch.dtype) -> Tensor:
    """``t`` RMS-normalised over its last dim in ``work`` precision, back in its dtype,
    times ``weight`` (as Jamba's norms: the weight after the cast back)."""
    out = nn.functional.rms_norm(t.to(work), t.shape[-1:], eps=eps).to(t.dtype)
    return out if weight is None else weight.to(t.dtype) * out


def _scan(x, dt, a, b, c, state, runs, chunk):
    """:func:`torchfn.kernels.selective_scan` (imported lazily), with the final state."""
    from torchfn.kernels import selective_scan

    return selective_scan(x, dt, a, b, c, state=state, segment_ids=runs, chunk=chunk,
                          return_state=True)
