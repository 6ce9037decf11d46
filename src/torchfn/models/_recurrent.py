"""What the recurrent token mixers (Gated DeltaNet, Mamba-2) share: their inputs' checks,
padding and document runs, the causal depthwise convolution in front of them (continued
from a cached window of past inputs), and their cache entry (that window and the
state)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from torchfn.models._kv_cache import KVCache, StaticKVCache, check_cache

__all__ = ["RecurrentInputs", "causal_conv", "recurrent_cache", "recurrent_inputs"]


class RecurrentInputs(NamedTuple):
    """A recurrent layer's call, checked: ``x`` with padded tokens zeroed, ``keep``
    ``(B, N, 1)`` (None without padding), ``runs`` ``(B, N)`` ascending document numbers
    (None without ``segment_ids``), the cache, and its ``window`` and ``state`` (None for
    an empty one)."""

    x: Tensor
    keep: Tensor | None
    runs: Tensor | None
    cache: KVCache | StaticKVCache | None
    window: Tensor | None
    state: Tensor | None


def recurrent_inputs(who: str, x: Tensor, key_padding_mask: Tensor | None,
                     segment_ids: Tensor | None, cache: KVCache | StaticKVCache | None
                     ) -> RecurrentInputs:
    """The checks and preparations of a recurrent layer ``who``'s forward on ``x``
    ``(B, N, dim)``. ``key_padding_mask`` is ``(B, N)``, or covers the cache too: the
    cached and new tokens ``(B, L + N)``, or a ``StaticKVCache``'s slots. A document is a
    run of equal ``segment_ids`` (packing takes no cache)."""
    b, n, _ = x.shape
    if cache is not None:
        cache = check_cache(cache, 1, who)
        if segment_ids is not None:
            raise ValueError(f"{who}: cache does not take segment_ids (decode one document "
                             f"per row)")
    runs = None
    if segment_ids is not None:
        if tuple(segment_ids.shape) != (b, n):
            raise ValueError(f"{who}: segment_ids must be (B, N) = {(b, n)}, got "
                             f"{tuple(segment_ids.shape)}")
        new = (segment_ids[:, 1:] != segment_ids[:, :-1]).long()  # a document per run
        runs = torch.cat((torch.zeros_like(new[:, :1]), new.cumsum(1)), 1)
    keep = None
    if key_padding_mask is not None:  # this call's columns of it
        if isinstance(cache, StaticKVCache):  # the mask covers the slots (its width)
            at = (cache.length + torch.arange(n, device=x.device)) % key_padding_mask.shape[1]
            key_padding_mask = key_padding_mask.index_select(1, at)
        keep = key_padding_mask[:, -n:, None].to(x.dtype)  # (B, N, 1)
        x = x * keep
    window = state = None
    if cache is not None and cache.keys:
        window, state = cache.keys[0], cache.values[0]
    return RecurrentInputs(x, keep, runs, cache, window, state)


def recurrent_cache(cache: KVCache | StaticKVCache, window: Tensor, state: Tensor,
                    n: int) -> KVCache | StaticKVCache:
    """The layer's cache entry after ``n`` more tokens: its convolution's ``window`` and
    its ``state`` (a ``StaticKVCache``'s in its buffers' dtypes, its length moved on)."""
    if isinstance(cache, StaticKVCache):
        return StaticKVCache((window.to(cache.keys[0].dtype),),
                             (state.to(cache.values[0].dtype),), cache.length + n)
    return KVCache((window,), (state,))


def causal_conv(x: Tensor, weight: Tensor, bias: Tensor | None = None,
                window: Tensor | None = None, runs: Tensor | None = None
                ) -> tuple[Tensor, Tensor]:
    """``x`` ``(B, C, N)`` convolved per channel by ``weight`` ``(C, 1, K)`` (an
    ``nn.Conv1d(C, C, K, groups=C)``'s), each output reading its own and the ``K - 1``
    inputs before it: those of ``window`` ``(B, C, K - 1)`` (a cache's; default zeros) for
    the first. With ``runs`` ``(B, N)`` (ascending document numbers) an input of an earlier
    document counts as 0. Returns ``(y (B, C, N), window)``, the new window being the last
    ``K - 1`` inputs.

    A few tokens (decoding) or documents take the taps as multiply-adds, which is cheaper
    than a ``conv1d`` call there and maskable; longer inputs ``conv1d``.

    Example::

        >>> import torch
        >>> x = torch.arange(1.0, 6.0).reshape(1, 1, 5)             # (B, C, N)
        >>> y, window = causal_conv(x, torch.ones(1, 1, 3))           # sums of 3
        >>> y, window
        (tensor([[[ 1.,  3.,  6.,  9., 12.]]]), tensor([[[4., 5.]]]))
    """
    b, c, n = x.shape
    k = weight.shape[-1]
    if window is None:
        window = x.new_zeros(b, c, k - 1)
    full = torch.cat((window.to(x.dtype), x), 2)  # (B, C, K - 1 + N)
    if n > 8 and runs is None:
        y = nn.functional.conv1d(full, weight, bias, groups=c)
    else:
        y = 0
        for j in range(k):
            tap = weight[:, 0, j, None] * full[:, :, j:j + n]  # reads d = K - 1 - j back
            d = k - 1 - j
            if runs is not None and d:
                same = runs[:, d:] == runs[:, :-d]  # (B, N - d)
                same = torch.cat((same.new_ones(b, min(d, n)), same), 1)[:, :n]
                tap = tap * same[:, None].to(tap.dtype)  # (the first d read the window)
            y = y + tap
        if bias is not None:
            y = y + bias[:, None]
    return y, full[:, :, full.shape[2] - (k - 1):]
