"""The key/value cache of a causal Transformer's attention layers, for decoding."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

__all__ = ["KVCache", "StaticKVCache"]


class KVCache(NamedTuple):
    """Keys and values of the tokens seen so far, one entry per attention layer.

    A plain pytree (a NamedTuple of tuples of tensors): the models take one and return the
    next, never changing it. ``KVCache()`` is the empty cache; passing it makes a model
    return ``(out, cache)`` with the keys and values of its input tokens. Each later call
    with that cache attends over the cached tokens too, with positions continuing from
    ``cache.length``.

    Attributes:
        keys: per layer ``(B, Hkv, L, D)``: the keys after rotary embedding, if any; for
            a recurrent layer (:class:`GatedDeltaNet`) its convolution's window
            ``(B, C, K - 1)`` instead.
        values: per layer ``(B, Hkv, L, D)``; a recurrent layer's state ``(B, H, Dk, Dv)``.

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
        """The number of cached tokens ``L``: an attention layer's keys' (0 for the empty
        cache, or one of recurrent layers only, whose state does not count tokens)."""
        return next((int(k.shape[-2]) for k in self.keys if k.dim() == 4), 0)

    def layer(self, i: int) -> KVCache:
        """Layer ``i``'s entry as a one-layer cache (empty if this cache is empty)."""
        return self.layers(i, i + 1)

    def layers(self, start: int, stop: int) -> KVCache:
        """Entries ``start`` to ``stop - 1`` as a cache (empty if this cache is empty)."""
        if not self.keys:
            return KVCache()
        return KVCache(self.keys[start:stop], self.values[start:stop])


class StaticKVCache(NamedTuple):
    """A key/value cache of fixed capacity, for decoding under ``torch.compile``.

    :class:`KVCache` grows by one entry a token, so every decoding step has new shapes.
    Here the buffers are allocated once, ``(B, Hkv, capacity, D)`` per layer, and
    ``length`` is a tensor: each step writes its keys and values at ``length`` (into a
    copy: the cache passed in is not changed) and attends through a mask of the written
    slots. The shapes never change, so a compiled step compiles once (tested), and
    CUDA graphs can replay it. ``key_padding_mask`` then covers the ``capacity`` slots.
    Position ``p`` lives in slot ``p % capacity``: for sliding-window layers a capacity
    of the window plus the tokens of one call is enough, however long the sequence (a
    ring buffer; other layers refuse to wrap).

    Attributes:
        keys, values: per layer ``(B, Hkv, capacity, D)``.
        length: ``()`` int64, the tokens written so far.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import StaticKVCache, TransformerEncoder
        >>> net = TransformerEncoder(dim=16, heads=2, depth=2, vocab_size=10, out_dim=10,
        ...                          causal=True, position_embedding="rotary")
        >>> model = torchfn.Model(net)
        >>> params = model.init(torchfn.random.key(0))
        >>> cache = StaticKVCache.allocate(net, batch_size=1, capacity=32)
        >>> tokens = torch.tensor([[1, 2, 3, 4]])
        >>> _, cache = model.apply(params, tokens[:, :3], cache=cache)
        >>> last, cache = model.apply(params, tokens[:, 3:], cache=cache)
        >>> int(cache.length), cache.keys[0].shape                        # (B, Hkv, cap, D)
        (4, torch.Size([1, 2, 32, 8]))
        >>> torch.allclose(last[:, -1], model.apply(params, tokens)[:, -1], atol=1e-5)
        True
    """

    keys: tuple[Tensor, ...]
    values: tuple[Tensor, ...]
    length: Tensor

    @property
    def capacity(self) -> int | None:
        """The number of slots ``L`` of the attention layers' buffers; None for a cache of
        recurrent layers alone (their windows and states hold no slots)."""
        return next((int(k.shape[-2]) for k in self.keys if k.dim() == 4), None)

    def layer(self, i: int) -> StaticKVCache:
        """Layer ``i``'s buffers as a one-layer cache."""
        return self.layers(i, i + 1)

    def layers(self, start: int, stop: int) -> StaticKVCache:
        """Entries ``start`` to ``stop - 1`` as a cache."""
        return StaticKVCache(self.keys[start:stop], self.values[start:stop], self.length)

    @staticmethod
    def allocate(module: Any, batch_size: int, capacity: int, *,
                 dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> StaticKVCache:
        """An empty cache for every attention layer of ``module`` (an ``nn.Module``
        holding ``MultiHeadAttention``, ``LatentAttention`` or recurrent layers, or the
        ``torchfn.Model`` of one); a ``LatentAttention``'s holds its latents and rotary
        keys, a recurrent layer's (``GatedDeltaNet``, ``KimiDeltaAttention``, ``Mamba``,
        ``Mamba2``, ``ShortConv``, ``LightningAttention``, ``RGLRU``, ``MLSTM``) its
        convolution window and state
        (zeros: the start), whatever the capacity. The blocks of a
        :class:`MultiTokenPrediction` run without a cache and get none."""
        from torchfn.models._attention import MultiHeadAttention
        from torchfn.models._delta_net import GatedDeltaNet
        from torchfn.models._kda import KimiDeltaAttention
        from torchfn.models._lightning import LightningAttention
        from torchfn.models._mamba import Mamba
        from torchfn.models._mamba2 import Mamba2
        from torchfn.models._mla import LatentAttention
        from torchfn.models._mlstm import MLSTM
        from torchfn.models._mtp import MultiTokenPrediction
        from torchfn.models._rg_lru import RGLRU
        from torchfn.models._short_conv import ShortConv

        module = getattr(module, "_eval_skeleton", module)  # a torchfn.Model's module
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module or a torchfn.Model, got "
                            f"{type(module).__name__}")
        for name, n in (("batch_size", batch_size), ("capacity", capacity)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be an int >= 1, got {n!r}")
        uncached = {id(m) for mtp in module.modules() if isinstance(mtp, MultiTokenPrediction)
                    for m in mtp.modules()}
        kinds = (MultiHeadAttention, LatentAttention, GatedDeltaNet, Mamba, Mamba2,
                 KimiDeltaAttention, ShortConv, LightningAttention, RGLRU, MLSTM)
        layers = [m for m in module.modules() if id(m) not in uncached and isinstance(m, kinds)]
        if not layers:
            raise ValueError(f"module has no MultiHeadAttention, LatentAttention or recurrent "
                             f"layer to cache: {type(module).__name__}")
        shapes = [m.cache_shapes(batch_size, capacity) for m in layers]  # (keys, values)
        return StaticKVCache(
            tuple(torch.zeros(k, dtype=dtype, device=device) for k, _ in shapes),
            tuple(torch.zeros(v, dtype=dtype, device=device) for _, v in shapes),
            torch.zeros((), dtype=torch.long, device=device))


def join_caches(first: KVCache | StaticKVCache, second: KVCache | StaticKVCache
                ) -> KVCache | StaticKVCache:
    """The entries of ``first`` then ``second`` as one cache (a StaticKVCache's length:
    ``first``'s)."""
    if isinstance(first, StaticKVCache):
        return StaticKVCache(first.keys + second.keys, first.values + second.values,
                             first.length)
    return KVCache(first.keys + second.keys, first.values + second.values)


def check_cache(cache: object, layers: int, who: str) -> KVCache | StaticKVCache:
    """``cache`` is a KVCache with 0 or ``layers`` entries (keys and values alike), or a
    StaticKVCache with ``layers``."""
    if isinstance(cache, StaticKVCache):
        if len(cache.keys) != layers or len(cache.values) != layers:
            raise ValueError(f"{who}: cache must hold {layers} layers of keys and values, "
                             f"got {len(cache.keys)} keys and {len(cache.values)} values")
        return cache
    if not isinstance(cache, KVCache):
        raise TypeError(f"{who}: cache must be a torchfn.models.KVCache (KVCache() to start) "
                        f"or a StaticKVCache, got {type(cache).__name__}")
    n = len(cache.keys)
    if n not in (0, layers) or len(cache.values) != n:
        raise ValueError(f"{who}: cache must hold 0 or {layers} layers of keys and values, "
                         f"got {n} keys and {len(cache.values)} values")
    length = cache.length
    for i, (k, v) in enumerate(zip(cache.keys, cache.values)):
        recurrent = isinstance(k, Tensor) and isinstance(v, Tensor) and k.dim() == 3 \
            and v.dim() == 4 and k.shape[0] == v.shape[0]  # a GatedDeltaNet's window, state
        if not recurrent and (not isinstance(k, Tensor) or not isinstance(v, Tensor)
                              or k.dim() != 4 or v.shape[:3] != k.shape[:3]
                              or k.shape[2] != length):
            raise ValueError(f"{who}: cache layer {i} must hold keys and values (B, Hkv, L, D) "
                             f"with one L for all layers (or a recurrent layer's window "
                             f"(B, C, K - 1) and state (B, H, Dk, Dv)), got "
                             f"{getattr(k, 'shape', k)} and {getattr(v, 'shape', v)}")
    return cache
