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

    With ``eos``, as Hugging Face's: each step looks at the ``2 * beams`` best
    extensions. Those among the first ``beams`` that end in ``eos`` are finished: scored
    over ``length ** length_penalty`` (tokens up to and including ``eos``; 0: the plain
    sum, > 0 favours longer sequences), padded with ``eos``, and the ``beams`` best of them
    kept aside. The best ``beams`` that do not end go on, so ``beams`` sequences are
    always live. At the end the live beams (scored over ``steps ** length_penalty``) and
    the finished ones are ranked together. With at least ``V ** steps`` beams this is
    exact too (tested), and every beam and score equals transformers' ``generate(...,
    num_beams=beams)`` on the same Llama weights, with and without ``eos``, for length
    penalties 0, 1 and 2 (tested).

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
    new = torch.zeros(b, k, 0, dtype=torch.long, device=dev)  # (B, K, t) live beams' tokens
    pool = _Finished.empty(b, k, steps, eos, dev)
    n = min(2 * k, k * vocab) if eos is not None else k  # candidates looked at per step
    for step in range(steps):
        cand = (scores[..., None] + logp.reshape(b, k, vocab)).reshape(b, k * vocab)
        top, pick = cand.topk(n, dim=-1)  # (B, n) best first
        beam, tok = pick // vocab, pick % vocab  # (B, n)
        if eos is not None:
            rank = torch.arange(n, device=dev).expand(b, n)
            ends = (tok == eos) & (rank < k) & top.isfinite()  # Hugging Face's rule
            seqs = torch.cat((new.gather(1, beam[..., None].expand(-1, -1, step)),
                              torch.full((b, n, steps - step), eos, device=dev)), -1)
            pool = pool.add(seqs, top, ends, step + 1, length_penalty)
            # the live beams: the best K candidates that do not end
            keep = torch.where(tok == eos, rank + n, rank).topk(k, largest=False).values % n
            top, beam, tok = top.gather(1, keep), beam.gather(1, keep), tok.gather(1, keep)
        scores = top
        new = torch.cat((new.gather(1, beam[..., None].expand(-1, -1, step)),
                         tok[..., None]), dim=-1)
        if step == steps - 1:
            break
        parents = (torch.arange(b, device=dev)[:, None] * k + beam).reshape(-1)  # (B * K,)
        cache = _reorder(cache, parents)
        logits, cache = model(params, tok.reshape(-1, 1), cache=cache)  # (B*K, 1, V)
        logp = torch.log_softmax(logits[:, -1].double(), -1)
    live = scores / float(steps) ** length_penalty if length_penalty else scores
    pool = pool.add(new, live, live.isfinite(), None, 0.0)  # the live beams, ranked in
    seqs = torch.cat((tokens[:, None].expand(-1, k, -1), pool.tokens), dim=-1)  # (B, K, P+T)
    final = pool.scores
    if not return_all:
        seqs, final = seqs[:, 0], final[:, 0]
    return (seqs[0], final[0]) if one else (seqs, final)


class _Finished:
    """The ``K`` best finished sequences per prompt: tokens ``(B, K, steps)`` (padded with
    ``eos``) and their scores over the length penalty ``(B, K)``, best first."""

    def __init__(self, tokens: Tensor, scores: Tensor) -> None:
        self.tokens, self.scores = tokens, scores

    @classmethod
    def empty(cls, b: int, k: int, steps: int, eos: int | None, dev) -> _Finished:
        fill = 0 if eos is None else eos
        return cls(torch.full((b, k, steps), fill, dtype=torch.long, device=dev),
                   torch.full((b, k), float("-inf"), dtype=torch.float64, device=dev))

    def add(self, tokens: Tensor, scores: Tensor, ok: Tensor, length: int | None,
            length_penalty: float) -> _Finished:
        """With the candidates ``ok`` of ``tokens`` ``(B, n, steps)``, raw ``scores``
        ``(B, n)`` over ``length ** length_penalty`` (None: already divided)."""
        if length is not None and length_penalty:
            scores = scores / float(length) ** length_penalty
        scores = torch.where(ok, scores, float("-inf"))
        every = torch.cat((self.scores, scores), 1)  # (B, K + n)
        best, at = every.topk(self.scores.shape[1], dim=-1)
        seqs = torch.cat((self.tokens, tokens), 1).gather(
            1, at[..., None].expand(-1, -1, tokens.shape[-1]))
        return _Finished(seqs, best)
