"""The key/value cache of a causal Transformer's attention layers, for decoding."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

__all__ = ["KVCache"]


class KVCache(NamedTuple):
    """Keys and values of the tokens seen so far, one entry per attention layer.

    A plain pytree (a NamedTuple of tuples of tensors): the models take one and return the
    next, never changing it. ``KVCache()`` is the empty cache; passing it makes a model
    return ``(out, cache)`` with the keys and values of its input tokens. Each later call
    with that cache attends over the cached tokens too, with positions continuing from
    ``cache.length``.

    Attributes:
        keys: per layer ``(B, Hkv, L, D)``: the keys after rotary embedding, if any.
        values: per layer ``(B, Hkv, L, D)``.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import KVCache, TransformerEncoder
        >>> model = torchfn.Model(TransformerEncoder(dim=16, heads=2, depth=2, vocab_size=10,
        ...                                          out_dim=10, causal=True))
        >>> params = model.init(torchfn.random.key(0))
        >>> tokens = torch.tensor([[1, 2, 3, 4]])                        # (B, N)
        >>> logits, cache = model.apply(params, tokens[:, :3], cache=KVCache())
        >>> cache.length, cache.keys[0].shape                            # (B, Hkv, L, D)
        (3, torch.Size([1, 2, 3, 8]))
        >>> last, cache = model.apply(params, tokens[:, 3:], cache=cache)
        >>> torch.allclose(last[:, -1], model.apply(params, tokens)[:, -1], atol=1e-5)
        True
    """

    keys: tuple[Tensor, ...] = ()
    values: tuple[Tensor, ...] = ()

    @property
    def length(self) -> int:
        """The number of cached tokens ``L`` (0 for the empty cache)."""
        return int(self.keys[0].shape[-2]) if self.keys else 0

    def layer(self, i: int) -> KVCache:
        """Layer ``i``'s entry as a one-layer cache (empty if this cache is empty)."""
        if not self.keys:
            return KVCache()
        return KVCache((self.keys[i],), (self.values[i],))


def check_cache(cache: object, layers: int, who: str) -> KVCache:
    """``cache`` is a KVCache with 0 or ``layers`` entries, keys and values alike."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"{who}: cache must be a torchfn.models.KVCache (KVCache() to start), "
                        f"got {type(cache).__name__}")
    n = len(cache.keys)
    if n not in (0, layers) or len(cache.values) != n:
        raise ValueError(f"{who}: cache must hold 0 or {layers} layers of keys and values, "
                         f"got {n} keys and {len(cache.values)} values")
    for i, (k, v) in enumerate(zip(cache.keys, cache.values)):
        if not isinstance(k, Tensor) or not isinstance(v, Tensor) or k.dim() != 4 \
                or v.shape[:3] != k.shape[:3] or k.shape[2] != cache.keys[0].shape[2]:
            raise ValueError(f"{who}: cache layer {i} must hold keys and values (B, Hkv, L, D) "
                             f"with one L for all layers, got "
                             f"{getattr(k, 'shape', k)} and {getattr(v, 'shape', v)}")
    return cache
