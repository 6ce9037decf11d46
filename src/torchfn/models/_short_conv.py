"""LFM2's gated short convolution: a token mixer that reads only the last few tokens."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from torchfn.models._kv_cache import KVCache, StaticKVCache
from torchfn.models._mlp import _check_dims
from torchfn.models._recurrent import causal_conv, recurrent_cache, recurrent_inputs

__all__ = ["ShortConv"]


class ShortConv(nn.Module):
    """A gated short convolution ``(B, N, dim) -> (B, N, dim)``, as Liquid AI's LFM2
    (``Lfm2ShortConv``): ``in_proj`` gives ``b``, ``c`` and ``x`` (``dim`` each),
    ``y = c * conv(b * x)`` with a causal depthwise convolution of ``kernel`` taps, through
    ``out``. Each output reads its token and the ``kernel - 1`` before it, no more.

    Caches as the recurrent layers do: an entry holds the convolution's last
    ``kernel - 1`` inputs ``(B, dim, K - 1)`` as its "keys" and an empty state
    ``(B, 0, 0, 0)`` as its "values". ``key_padding_mask`` keeps padded tokens out of the
    window; ``segment_ids`` packs documents.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import KVCache, ShortConv
        >>> model = torchfn.Model(ShortConv(dim=16))
        >>> params = model.init(torchfn.random.key(0))
        >>> x = torchfn.random.normal(torchfn.random.key(1), (2, 10, 16))  # (B, N, dim)
        >>> first, cache = model.apply(params, x[:, :6], cache=KVCache())
        >>> rest, cache = model.apply(params, x[:, 6:], cache=cache)
        >>> torch.allclose(torch.cat((first, rest), 1), model.apply(params, x), atol=1e-6)
        True
        >>> cache.keys[0].shape                                      # (B, dim, kernel - 1)
        torch.Size([2, 16, 2])
    """

    def __init__(self, dim: int, *, kernel: int = 3, bias: bool = False) -> None:
        super().__init__()
        _check_dims(dim=dim, kernel=kernel)
        self.dim, self.kernel = dim, kernel
        self.in_proj = nn.Linear(dim, 3 * dim, bias=bias)  # [b | c | x]
        self.conv = nn.Conv1d(dim, dim, kernel, groups=dim, bias=bias)  # causal here
        self.out = nn.Linear(dim, dim, bias=bias)

    def cache_shapes(self, batch_size: int, capacity: int) -> tuple[tuple, tuple]:
        """This layer's cache entry: the convolution's window ``(B, dim, K - 1)`` and no
        state ``(B, 0, 0, 0)``, whatever the capacity."""
        return (batch_size, self.dim, self.kernel - 1), (batch_size, 0, 0, 0)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None,
                segment_ids: Tensor | None = None, positions: Tensor | None = None,
                cache: KVCache | StaticKVCache | None = None) -> Tensor | tuple:
        x, keep, runs, cache, window, _ = recurrent_inputs(
            "ShortConv", x, key_padding_mask, segment_ids, cache)  # x: padding zeroed
        b, c, h = self.in_proj(x).chunk(3, -1)  # (B, N, dim) each
        h = b * h
        if keep is not None:  # a biased projection of 0 is not 0: keep padding out
            h = h * keep
        h, window = causal_conv(h.transpose(1, 2), self.conv.weight, self.conv.bias, window,
                                runs)
        out = self.out(c * h.transpose(1, 2))  # (B, N, dim)
        if cache is None:
            return out
        none = torch.zeros(x.shape[0], 0, 0, 0, dtype=x.dtype, device=x.device)
        return out, recurrent_cache(cache, window, none, x.shape[1])

    def extra_repr(self) -> str:
        return f"dim={self.dim}, kernel={self.kernel}"
