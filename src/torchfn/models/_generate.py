"""Autoregressive decoding with a key/value cache: ``sample_logits`` and ``generate``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from torchfn.core import random
from torchfn.core._eager import plain
from torchfn.models._kv_cache import KVCache, StaticKVCache

__all__ = ["generate", "sample_logits"]


def _check_options(temperature: float, top_k: int | None, top_p: float | None,
                   min_p: float | None = None) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not temperature >= 0:
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an int >= 1 or None, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be a number in (0, 1] or None, got {top_p!r}")
    if min_p is not None and (isinstance(min_p, bool) or not isinstance(min_p, (int, float))
                              or not 0 <= min_p <= 1):
        raise ValueError(f"min_p must be a number in [0, 1] or None, got {min_p!r}")


def check_prompt(prompt: Tensor) -> tuple[Tensor, bool]:
    """``prompt`` as int64 ``(B, P)``, and whether it came as one ``(P,)`` sequence."""
    if not isinstance(prompt, Tensor) or prompt.dtype not in (torch.int64, torch.int32) \
            or prompt.dim() not in (1, 2) or prompt.shape[-1] == 0:
        got = f"{prompt.dtype} {tuple(prompt.shape)}" if isinstance(prompt, Tensor) else \
            type(prompt).__name__
        raise ValueError(f"prompt must be a non-empty int tensor (B, P) or (P,), got {got}")
    one = prompt.dim() == 1
    return (prompt.long()[None] if one else prompt.long()), one


def sample_logits(
    key: Tensor | None,
    logits: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> Tensor:
    """Draw a token from each row of ``logits`` ``(..., V)``, keyed: ``(...)`` int64.

    The logits are divided by ``temperature``, cut to the ``top_k`` largest (ties with the
    k-th kept), then to the smallest set of most likely tokens whose probability reaches
    ``top_p`` (nucleus sampling), in that order, as Hugging Face's samplers do; then
    ``min_p`` drops the tokens less likely than ``min_p`` times the most likely one
    (Nguyen et al. 2024, "min-p sampling").
    ``temperature=0`` or ``key=None`` is greedy (``argmax``; the key is not used).

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> from torchfn.models import sample_logits
        >>> logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))   # (B, V)
        >>> sample_logits(None, logits)                                  # greedy
        tensor([0])
        >>> keys = random.split(random.key(0), 4000)
        >>> draws = torch.vmap(lambda k: sample_logits(k, logits, top_p=0.7))(keys)
        >>> sorted(draws.unique().tolist())                              # {0.5, 0.3} reach 0.7
        [0, 1]
    """
    _check_options(temperature, top_k, top_p, min_p)
    if not isinstance(logits, Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        got = f"{logits.dtype} {tuple(logits.shape)}" if isinstance(logits, Tensor) else \
            type(logits).__name__
        raise ValueError(f"logits must be a float tensor (..., V), got {got}")
    if key is None or temperature == 0:
        return logits.argmax(dim=-1)
    return random.categorical(key, filter_logits(logits, temperature, top_k, top_p, min_p))


def filter_logits(logits: Tensor, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None, min_p: float | None = None) -> Tensor:
    """The logits :func:`sample_logits` draws from: over ``temperature``, with the tokens
    that ``top_k``, ``top_p`` and ``min_p`` drop set to ``-inf``. ``(..., V)``."""
    logits = logits / temperature
    neg = float("-inf")
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, neg)
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (..., V)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
        drop_sorted = before >= top_p  # the most likely token is always kept
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, neg)
    if min_p:  # p_i < min_p * p_max  <=>  l_i < l_max + log(min_p)
        floor = logits.amax(dim=-1, keepdim=True) + math.log(min_p)
        logits = logits.masked_fill(logits < floor, neg)
    return logits


def generate(
    model: Callable[..., Any],
    params: Any,
    prompt: Tensor,
    steps: int,
    *,
    key: Tensor | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    prompt_mask: Tensor | None = None,
    eos: int | None = None,
    cache: KVCache | StaticKVCache | None = None,
) -> Tensor:
    """Continue ``prompt`` by ``steps`` tokens, one model call per token after the prompt's.

    ``model(params, tokens, cache=cache)`` must return ``(logits (B, n, V), cache)``: a
    ``torchfn.Model`` of a causal :class:`TransformerEncoder` does. The prompt runs once,
    filling a :class:`KVCache`; each new token then runs alone against the cache. The
    result equals re-running the whole sequence for every token (tested), for O(N) instead
    of O(N^2) work per token. Every token's draw uses ``fold_in(key, step)``, so
    ``vmap(lambda k: generate(..., key=k))(random.split(key, n))`` draws ``n`` samples.

    Args:
        model, params: the model and its parameters.
        prompt: ``(B, P)`` (or ``(P,)``) int64 tokens.
        steps: tokens to add (>= 1).
        key: a ``torchfn.random`` key; ``None`` decodes greedily.
        temperature, top_k, top_p, min_p: as :func:`sample_logits`.
        prompt_mask: ``(B, P)`` bool, False at padding. Pad prompts of different lengths
            on the left; each token's position then counts only the real tokens before
            it, and no token attends to a pad, so each row decodes as it would alone.
            The model must take ``key_padding_mask`` and ``positions`` keywords.
        eos: an end-of-sequence token. Once a row draws it, the rest of the row is
            ``eos``; in plain eager mode decoding stops early when every row has.
        cache: the cache to start from: ``KVCache()`` (the default) or an empty
            :class:`StaticKVCache` of capacity >= ``P + steps - 1`` (or, for sliding-window
            layers, >= window + P: a ring buffer), whose fixed shapes let a compiled
            ``model`` (``torch.compile(model)``) compile its step once. With
            ``prompt_mask`` a ring buffer must not wrap.

    Returns:
        ``(B, P + steps)`` (or ``(P + steps,)``) int64: the prompt and the new tokens.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import TransformerEncoder, generate
        >>> net = TransformerEncoder(dim=16, heads=2, depth=1, vocab_size=10, out_dim=10,
        ...                          causal=True, position_embedding="rotary")
        >>> model = torchfn.Model(net)
        >>> params = model.init(torchfn.random.key(0))
        >>> prompt = torch.tensor([[1, 2, 3]])                            # (B, P)
        >>> out = generate(model, params, prompt, 5, key=torchfn.random.key(1), top_k=3)
        >>> out.shape                                                    # (B, P + steps)
        torch.Size([1, 8])
        >>> bool((out[:, :3] == prompt).all())
        True
    """
    _check_options(temperature, top_k, top_p, min_p)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if eos is not None and (isinstance(eos, bool) or not isinstance(eos, int)):
        raise TypeError(f"eos must be an int token id or None, got {eos!r}")
    tokens, one = check_prompt(prompt)
    extra: dict[str, Tensor] = {}
    if prompt_mask is not None:
        if not isinstance(prompt_mask, Tensor) or prompt_mask.dtype != torch.bool \
                or prompt_mask.shape != prompt.shape:
            raise ValueError(f"prompt_mask must be a bool tensor of the prompt's shape "
                             f"{tuple(prompt.shape)}, got "
                             f"{getattr(prompt_mask, 'dtype', type(prompt_mask).__name__)} "
                             f"{tuple(getattr(prompt_mask, 'shape', ()))}")
        mask = prompt_mask[None] if one else prompt_mask  # (B, P)
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, P): real tokens before
        extra = {"key_padding_mask": mask, "positions": positions}
    cache = KVCache() if cache is None else cache
    static = isinstance(cache, StaticKVCache)
    if static:  # its capacity is checked by the layers (a windowed one may wrap around)
        needed = tokens.shape[1] + steps - 1
        capacity = needed if cache.capacity is None else cache.capacity  # (recurrent alone)
        if extra and capacity < needed:
            raise ValueError(f"cache: with prompt_mask a StaticKVCache must not wrap around "
                             f"(its mask covers slots, not positions): capacity >= P + "
                             f"steps - 1 = {needed}, got {capacity}")
        if extra:  # the mask covers every slot: the prompt's, then real tokens
            slots = torch.ones(mask.shape[0], capacity, dtype=torch.bool, device=mask.device)
            extra["key_padding_mask"] = torch.cat((mask, slots[:, mask.shape[1]:]), 1)
    elif not isinstance(cache, KVCache) or cache.keys:
        raise ValueError(f"cache must be an empty KVCache or StaticKVCache, got "
                         f"{type(cache).__name__} of length {getattr(cache, 'length', '?')}")

    logits, cache = model(params, tokens, cache=cache, **extra)  # (B, P, V)
    out = [tokens]
    done = None  # (B, 1) bool: the row has drawn eos
    for step in range(steps):
        k = None if key is None else random.fold_in(key, step)
        nxt = sample_logits(k, logits[:, -1], temperature=temperature, top_k=top_k,
                            top_p=top_p, min_p=min_p)[:, None]  # (B, 1)
        if eos is not None:
            nxt = nxt if done is None else torch.where(done, eos, nxt)
            done = nxt == eos if done is None else done | (nxt == eos)
        out.append(nxt)
        if step == steps - 1:
            break
        if done is not None and plain(done) and bool(done.all()):  # every row has ended
            out.append(torch.full((nxt.shape[0], steps - 1 - step), eos, dtype=nxt.dtype,
                                  device=nxt.device))
            break
        if extra:  # the new token is real; its position is one past the last
            mask = extra["key_padding_mask"]
            if not static:
                mask = torch.cat((mask, torch.ones_like(nxt, dtype=torch.bool)), -1)  # (B, L+1)
            extra = {"key_padding_mask": mask, "positions": extra["positions"][:, -1:] + 1}
        logits, cache = model(params, nxt, cache=cache, **extra)  # (B, 1, V)
    result = torch.cat(out, dim=-1)  # (B, P + steps)
    return result[0] if one else result
