"""Lightning attention (MiniMax-01's "linear_attention" layers): linear attention whose state
decays at a fixed rate per head, over ``torchfn.kernels.gated_linear_attention``."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from torchfn.models._kv_cache import KVCache, StaticKVCache
from torchfn.models._mlp import _check_dims
from torchfn.models._recurrent import recurrent_cache, recurrent_inputs

__all__ = ["LightningAttention", "lightning_slopes"]


def lightning_slopes(heads: int, layer: int = 0, depth: int = 1) -> tuple[float, ...]:
    """MiniMax-01's decay rates: ALiBi's slopes ``2^(-8 (h + 1) / heads)``, scaled by
    ``1 - layer / (depth - 1) + 1e-5`` (a model's first layer forgets fastest, its last
    barely), computed as transformers' ``MiniMaxLightningAttention`` does in float64.

    Example::

        >>> from torchfn.models import lightning_slopes
        >>> [round(s, 4) for s in lightning_slopes(4)]
        [0.25, 0.0625, 0.0156, 0.0039]
    """
    _check_dims(heads=heads, depth=depth)
    base = 1 / (2 ** (8 / heads))
    factor = 1 - layer / (depth - 1 + 1e-5) + 1e-5
    rates = torch.tensor(base, dtype=torch.float64) ** (torch.arange(heads) + 1) * factor
    return tuple(rates.tolist())


class LightningAttention(nn.Module):
    """MiniMax-01's lightning attention: ``(B, N, dim) -> (B, N, dim)`` with a state of
    fixed size per sequence.

    One projection ``qkv`` gives each head's ``[q | k | v]`` (``head_dim`` each), through
    SiLU; each head's state decays by ``exp(-slope)`` a token (``slopes``, one a head:
    :func:`lightning_slopes`), and
    :func:`torchfn.kernels.gated_linear_attention` (scale 1) mixes the tokens:
    ``o_i = sum_{j <= i} exp(-slope (i - j)) (q_i . k_j) v_j``. The heads' outputs are
    RMS-normalised together (``norm``, over ``heads * head_dim``), gated by
    ``sigmoid(x W_gate)`` and projected back.

    Caches as the recurrent layers do: an entry holds an empty window ``(B, 0, 0)`` (no
    convolution) and the state ``(B, heads, head_dim, head_dim)``. ``key_padding_mask``
    keeps padded tokens out of the state; ``segment_ids`` packs documents.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import KVCache, LightningAttention
        >>> model = torchfn.Model(LightningAttention(dim=32, heads=4))
        >>> params = model.init(torchfn.random.key(0))
        >>> x = torchfn.random.normal(torchfn.random.key(1), (2, 10, 32))  # (B, N, dim)
        >>> first, cache = model.apply(params, x[:, :6], cache=KVCache())
        >>> rest, cache = model.apply(params, x[:, 6:], cache=cache)
        >>> torch.allclose(torch.cat((first, rest), 1), model.apply(params, x), atol=1e-5)
        True
    """

    def __init__(self, dim: int, heads: int, *, head_dim: int | None = None,
                 slopes: Sequence[float] | None = None, norm_eps: float = 1e-6,
                 chunk: int = 64) -> None:
        super().__init__()
        head_dim = dim // heads if head_dim is None else head_dim
        _check_dims(dim=dim, heads=heads, head_dim=head_dim, chunk=chunk)
        slopes = lightning_slopes(heads) if slopes is None else slopes
        if not isinstance(slopes, Sequence) or len(slopes) != heads or not all(
                isinstance(s, (int, float)) and not isinstance(s, bool) and s >= 0
                for s in slopes):
            raise ValueError(f"slopes must be {heads} numbers >= 0 (one a head), got {slopes!r}")
        self.dim, self.heads, self.head_dim, self.chunk = dim, heads, head_dim, chunk
        self.slopes = tuple(float(s) for s in slopes)
        self.norm_eps = norm_eps
        inner = heads * head_dim
        self.qkv = nn.Linear(dim, 3 * inner, bias=False)  # per head [q | k | v]
        self.gate = nn.Linear(dim, inner, bias=False)
        self.norm = nn.Parameter(torch.ones(inner))
        self.out = nn.Linear(inner, dim, bias=False)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.norm)

    def cache_shapes(self, batch_size: int, capacity: int) -> tuple[tuple, tuple]:
        """This layer's cache entry: no window ``(B, 0, 0)`` and the state
        ``(B, heads, head_dim, head_dim)``, whatever the capacity."""
        return (batch_size, 0, 0), (batch_size, self.heads, self.head_dim, self.head_dim)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None,
                segment_ids: Tensor | None = None, positions: Tensor | None = None,
                cache: KVCache | StaticKVCache | None = None) -> Tensor | tuple:
        x, keep, runs, cache, _, state = recurrent_inputs(
            "LightningAttention", x, key_padding_mask, segment_ids, cache)  # padding zeroed
        b, n, _ = x.shape
        h = nn.functional.silu(self.qkv(x))
        if keep is not None:  # SiLU of 0 is 0, but keep the padding out however
            h = h * keep
        q, k, v = h.unflatten(-1, (self.heads, 3 * self.head_dim)).transpose(1, 2).chunk(3, -1)
        work = torch.promote_types(x.dtype, torch.float32)
        slopes = torch.tensor(self.slopes, dtype=work, device=x.device)
        g = (-slopes)[:, None].expand(self.heads, n).expand(b, -1, -1)  # (B, H, N)
        o, state = _linear(q, k, v.to(work), g, state, self.chunk, runs)  # (B, H, N, D)
        o = o.transpose(1, 2).flatten(2).to(work)  # (B, N, H D)
        o = nn.functional.rms_norm(o, o.shape[-1:], eps=self.norm_eps) * self.norm.to(work)
        o = torch.sigmoid(self.gate(x).to(work)) * o
        out = self.out(o.to(x.dtype))  # (B, N, dim)
        if cache is None:
            return out
        return out, recurrent_cache(cache, x.new_zeros(b, 0, 0), state, n)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, heads={self.heads}, head_dim={self.head_dim}"


def _linear(q, k, v, g, state, chunk, segment_ids):
    """:func:`torchfn.kernels.gated_linear_attention` (imported lazily), scale 1, with the
    final state."""
    from torchfn.kernels import gated_linear_attention

    return gated_linear_attention(q, k, v, g, state=state, scale=1.0, chunk=chunk,
                                  segment_ids=segment_ids, return_state=True)
