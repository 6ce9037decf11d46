"""Beam search over a causal model with a key/value cache."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from torchfn.models._generate import check_prompt
from torchfn.models._kv_cache import KVCache

__all__ = ["beam_search"]


def _reorder(cache: KVCache, rows: Tensor) -> KVCache:
    """The cache of the beams ``rows`` (B * K,): a beam's history follows it."""
    return KVCache(tuple(k.index_select(0, rows) for k in cache.keys),
                   tuple(v.index_select(0, rows) for v in cache.values))


def beam_search(
    model: Callable[..., Any],
    params: Any,
    prompt: Tensor,
    steps: int,
    *,
    beams: int = 4,
    eos: int | None = None,
    length_penalty: float = 0.0,
    return_all: bool = False,
) -> tuple[Tensor, Tensor]:
    """The ``beams`` most likely continuations of ``prompt``, ``steps`` tokens each.

    Every step extends each of the ``beams`` kept sequences by every token, and keeps
    the ``beams`` of highest total log-probability (the model's, at temperature 1). The
    prompt runs once; the beams share its :class:`KVCache` entries, and a step's
    reordering of the beams reorders the cache with them (``index_select``: the cache
    is a value, not a buffer). With ``beams=1`` this is greedy decoding; with at least
    ``V ** (steps - 1)`` beams it is exact (both tested).

    A beam that draws ``eos`` is finished: it keeps its score and is padded with
    ``eos``, and it holds its place among the beams. The final ranking divides each
    score by ``length ** length_penalty`` (tokens up to and including ``eos``; 0: the
    plain sum, > 0 favours longer sequences), as Hugging Face's does.

    Args:
        model, params: ``model(params, tokens, cache=cache) -> (logits, cache)``, e.g. a
            causal ``TransformerEncoder`` through ``torchfn.Model``.
        prompt: ``(B, P)`` or ``(P,)`` int64 tokens.
        steps: tokens to add (>= 1).
        beams: sequences kept per prompt (>= 1).
        eos: an end-of-sequence token, or None.
        length_penalty: the exponent of the length in the final ranking.
        return_all: return every beam, best first, not only the best.

    Returns:
        ``(tokens, scores)``: ``(B, P + steps)`` and ``(B,)`` (``(B, beams, P + steps)``
        and ``(B, beams)`` with ``return_all``; no batch dim for a ``(P,)`` prompt). A
        score is the sum of the new tokens' log-probabilities, over the length penalty.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import TransformerEncoder, beam_search, generate
        >>> model = torchfn.Model(TransformerEncoder(dim=16, heads=2, depth=1,
        ...                       vocab_size=10, out_dim=10, causal=True))
        >>> params = model.init(torchfn.random.key(0))
        >>> prompt = torch.tensor([[1, 2, 3]])
        >>> best, score = beam_search(model, params, prompt, 5, beams=3)
        >>> best.shape, score.shape
        (torch.Size([1, 8]), torch.Size([1]))
        >>> one, _ = beam_search(model, params, prompt, 5, beams=1)
        >>> torch.equal(one, generate(model, params, prompt, 5))           # greedy
        True
    """
    for name, n in (("steps", steps), ("beams", beams)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be an int >= 1, got {n!r}")
    if eos is not None and (isinstance(eos, bool) or not isinstance(eos, int)):
        raise TypeError(f"eos must be an int token id or None, got {eos!r}")
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)):
        raise TypeError(f"length_penalty must be a number, got {length_penalty!r}")
    tokens, one = check_prompt(prompt)  # (B, P)
    b, k, dev = tokens.shape[0], beams, tokens.device
    logits, cache = model(params, tokens, cache=KVCache())  # (B, P, V)
    rows = torch.arange(b, device=dev).repeat_interleave(k)  # (B * K,): each prompt's beams
    cache = _reorder(cache, rows)
    logp = torch.log_softmax(logits[:, -1].double(), -1).index_select(0, rows)  # (B*K, V)
    vocab = logp.shape[-1]
    # only the first beam is live at the start, so the K first picks are distinct
    scores = torch.full((b, k), float("-inf"), dtype=torch.float64, device=dev)
    scores[:, 0] = 0.0
    new = torch.zeros(b, k, 0, dtype=torch.long, device=dev)  # (B, K, t)
    done = torch.zeros(b, k, dtype=torch.bool, device=dev)
    length = torch.zeros(b, k, dtype=torch.long, device=dev)
    for step in range(steps):
        if eos is not None:  # a finished beam proposes only eos, at no cost
            stay = torch.full_like(logp, float("-inf"))
            stay[:, eos] = 0.0
            logp = torch.where(done.reshape(-1, 1), stay, logp)
        cand = (scores[..., None] + logp.reshape(b, k, vocab)).reshape(b, k * vocab)
        scores, pick = cand.topk(k, dim=-1)  # (B, K) best first
        beam, tok = pick // vocab, pick % vocab  # (B, K)
        new = torch.cat((new.gather(1, beam[..., None].expand(-1, -1, new.shape[-1])),
                         tok[..., None]), dim=-1)
        was_done = done.gather(1, beam)
        length = length.gather(1, beam) + (~was_done).long()
        done = was_done | (tok == eos) if eos is not None else was_done
        if step == steps - 1:
            break
        parents = (torch.arange(b, device=dev)[:, None] * k + beam).reshape(-1)  # (B * K,)
        cache = _reorder(cache, parents)
        logits, cache = model(params, tok.reshape(-1, 1), cache=cache)  # (B*K, 1, V)
        logp = torch.log_softmax(logits[:, -1].double(), -1)
    final = scores / length.clamp(min=1).double() ** length_penalty if length_penalty \
        else scores
    order = final.argsort(dim=-1, descending=True)  # (B, K)
    new = new.gather(1, order[..., None].expand(-1, -1, steps))
    final = final.gather(1, order)
    seqs = torch.cat((tokens[:, None].expand(-1, k, -1), new), dim=-1)  # (B, K, P + steps)
    if not return_all:
        seqs, final = seqs[:, 0], final[:, 0]
    return (seqs[0], final[0]) if one else (seqs, final)
