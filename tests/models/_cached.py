"""Logits through the KV cache: the prompt in one call, then a token at a time."""

import torch

from torchfn.models import KVCache


def logits_through_cache(model, params, tokens, prefill, cache=None):
    """``(B, N, ...)`` from ``model(params, ...)`` (a ``torchfn.Model`` or its ``apply``
    with state bound): ``tokens[:, :prefill]`` (tokens, or a layer's inputs) in one call,
    then each later one alone against the cache (default ``KVCache()``; or a fresh
    ``StaticKVCache``); to compare with the uncached forward."""
    out, cache = model(params, tokens[:, :prefill], cache=KVCache() if cache is None else cache)
    outs = [out]
    for i in range(prefill, tokens.shape[1]):
        out, cache = model(params, tokens[:, i:i + 1], cache=cache)
        outs.append(out)
    return torch.cat(outs, 1)
