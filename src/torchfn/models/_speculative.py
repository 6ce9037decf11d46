"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): a small draft model
proposes tokens, the target model checks them all in one call, and the tokens kept are
distributed exactly as the target's own samples."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from torchfn.core import random
from torchfn.core._eager import plain
from torchfn.models._generate import _check_options, check_prompt, filter_logits
from torchfn.models._kv_cache import KVCache

__all__ = ["speculative_generate"]


class _Stream:
    """One model's cache, and which of its entries are real tokens ``valid`` (B, L)."""

    def __init__(self, model, params):
        self.model, self.params = model, params
        self.cache, self.valid = KVCache(), None

    def feed(self, tokens: Tensor, ok: Tensor, **extra: Any) -> Any:
        """Run ``tokens`` (B, n) (``ok``: which are real, a prefix of each row) against
        the cache: the logits (and whatever else ``extra`` asks the model for)."""
        b = tokens.shape[0]
        before = self.valid if self.valid is not None else torch.zeros(
            b, 0, dtype=torch.bool, device=tokens.device)
        mask = torch.cat((before, ok), 1)  # (B, L + n)
        positions = (before.sum(1, keepdim=True) + ok.long().cumsum(1) - 1).clamp(min=0)
        *out, self.cache = self.model(self.params, tokens, cache=self.cache,
                                      key_padding_mask=mask, positions=positions, **extra)
        if any(k.dim() != 4 for k in self.cache.keys):
            raise ValueError("speculative_generate: the model has recurrent layers "
                             "(GatedDeltaNet, KimiDeltaAttention, Mamba2, Mamba, RGLRU, ...), "
                             "whose state cannot drop the draft's rejected tokens once it has "
                             "read them; decode it with generate")
        self.valid = mask.clone()
        return out[0] if len(out) == 1 else tuple(out)


def _probs(logits: Tensor, filters: dict[str, Any]) -> Tensor:
    """The distribution a token is drawn from: ``sample_logits``' filters, in float64."""
    return torch.softmax(filter_logits(logits.double(), **filters), dim=-1)  # (..., V)


def check_run(who: str, prompt: Tensor, steps: int, key: Tensor | None, temperature: float,
              top_k: int | None, top_p: float | None, min_p: float | None,
              eos: int | None = None) -> tuple[Tensor, bool, dict[str, Any]]:
    """A speculative decoder's arguments checked: the prompt as ``(B, P)``, whether it
    came as ``(P,)``, and the sampling filters as a dict."""
    _check_options(temperature, top_k, top_p, min_p)
    if eos is not None and (isinstance(eos, bool) or not isinstance(eos, int)):
        raise TypeError(f"eos must be an int token id or None, got {eos!r}")
    if key is not None and temperature == 0:
        raise ValueError("temperature must be > 0 when sampling (key given); use key=None "
                         "for greedy decoding")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    seq, one = check_prompt(prompt)  # (B, P)
    if not plain(prompt) or (key is not None and not plain(key)):
        raise ValueError(f"{who} runs eagerly (each round keeps a number of tokens read from "
                         f"the values): not under vmap or torch.compile; repeat the prompt "
                         f"along the batch for many samples")
    return seq, one, dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)


def finish(new: list[Tensor], steps: int, eos: int | None) -> Tensor:
    """Each row's new tokens ``new`` (a list of 1-D tensors, at least ``steps`` long unless
    the row drew ``eos``) as ``(B, steps)``: cut to ``steps``, and after a row's first
    ``eos`` every token ``eos``, as :func:`generate` gives them."""
    if eos is None:
        return torch.stack([row[:steps] for row in new])
    rows = [torch.cat((row[:steps], row.new_full((max(steps - len(row), 0),), eos)))
            for row in new]
    out = torch.stack(rows)  # (B, steps)
    hit = (out == eos).long()
    return torch.where(hit.cumsum(1) - hit > 0, eos, out)


def verify(logits: Tensor, drafted: Tensor, q: list[Tensor], key_accept: Tensor | None,
           key_residual: Tensor | None, filters: dict[str, Any]) -> tuple[Tensor, Tensor]:
    """The target's verdict on ``drafted`` (B, k): how many leading drafts each row keeps
    ``n`` (B,), and the token after them ``nxt`` (B,).

    ``logits`` (B, k + 1, V): the target's, at the token before the drafts and at each
    draft. Greedy (``key_accept=None``): drafts are kept while they equal the target's
    argmax, and ``nxt`` is the target's argmax after them. Sampling: ``q`` holds the
    draft's distributions (B, V) for each draft; draft ``j`` is kept with probability
    ``min(1, p_j / q_j)``, and ``nxt`` is drawn from ``max(0, p - q)`` renormalised at the
    first rejection, or from ``p`` when all ``k`` were kept. ``k`` may be 0."""
    b, k = drafted.shape
    rows = torch.arange(b, device=drafted.device)
    if key_accept is None:
        best = logits.argmax(-1)  # (B, k + 1)
        n = (best[:, :-1] == drafted).long().cumprod(1).sum(1)  # (B,)
        return n, best[rows, n]
    p = _probs(logits, filters)  # (B, k + 1, V)
    qs = torch.stack(q, dim=1) if q else p[:, :0]  # (B, k, V)
    p_tok = p[:, :-1].gather(-1, drafted[..., None])[..., 0]  # (B, k)
    q_tok = qs.gather(-1, drafted[..., None])[..., 0]
    accept = random.uniform(key_accept, (b, k), dtype=torch.float64) * q_tok < p_tok
    n = accept.long().cumprod(1).sum(1)  # (B,)
    p_n = p[rows, n]  # (B, V)
    q_n = torch.cat((qs, torch.zeros_like(p[:, :1])), 1)[rows, n]  # 0 past k
    resid = (p_n - q_n).clamp(min=0)
    resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, p_n)
    return n, random.categorical(key_residual, resid.log())


def speculative_generate(
    target: Callable[..., Any],
    target_params: Any,
    draft: Callable[..., Any],
    draft_params: Any,
    prompt: Tensor,
    steps: int,
    *,
    key: Tensor | None = None,
    lookahead: int = 4,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    eos: int | None = None,
    return_stats: bool = False,
) -> Tensor | tuple[Tensor, dict[str, int]]:
    """Continue ``prompt`` by ``steps`` tokens of ``target``, with ``draft`` proposing.

    Each round the draft proposes ``lookahead`` tokens, one cached call each; the target
    scores them all in one call. Draft token ``j`` is kept with probability ``min(1,
    p_j / q_j)`` (target over draft probability); at the first rejection the token is
    drawn from ``max(0, p - q)``, renormalised, and if all are kept the target's next
    token comes free. So every token is distributed exactly as the target's own sample
    (tested against the target's enumerated distribution), and with ``key=None``
    (greedy) the output equals ``generate(target, ...)`` token for token.

    Each row of a batch keeps as many tokens as it accepted. The caches stay
    rectangular: every token fed gets an entry, and the rejected ones are masked out of
    every later call (``key_padding_mask``), positions counting only kept tokens. So the
    models must take ``key_padding_mask`` and ``positions`` (``TransformerEncoder``
    does), and a learned position table must be long enough for the caches (up to
    ``lookahead + 1`` entries a round). How many tokens a round keeps depends on the
    values, so this runs eagerly, not under ``vmap``: for many samples, repeat the
    prompt along the batch.

    Args:
        target, target_params, draft, draft_params: models called as
            ``model(params, tokens, cache=cache, key_padding_mask=m, positions=p) ->
            (logits, cache)`` (a causal ``TransformerEncoder`` through
            ``torchfn.Model``); one vocabulary.
        prompt: ``(B, P)`` or ``(P,)`` int64 tokens.
        steps: new tokens (>= 1).
        key: a ``torchfn.random`` key; ``None`` decodes greedily.
        lookahead: draft tokens per round (>= 1).
        temperature, top_k, top_p, min_p: as :func:`sample_logits`, applied to both
            models' distributions: the samples follow the target's filtered one exactly.
            ``temperature`` > 0 when sampling.
        eos: an end-of-sequence token, as :func:`generate`'s: after a row draws it the
            rest of the row is ``eos``, and decoding stops once every row has.
        return_stats: also return ``{"rounds", "target_calls", "draft_calls",
            "accepted", "proposed"}``.

    Returns:
        ``(B, P + steps)`` (or ``(P + steps,)``) int64, and the stats if asked.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import TransformerEncoder, generate, speculative_generate
        >>> def lm(depth, seed):
        ...     model = torchfn.Model(TransformerEncoder(dim=16, heads=2, depth=depth,
        ...                           vocab_size=10, out_dim=10, causal=True))
        ...     return model, model.init(torchfn.random.key(seed))
        >>> (big, pb), (small, ps) = lm(2, 0), lm(1, 1)
        >>> prompt = torch.tensor([[1, 2, 3]])
        >>> out = speculative_generate(big, pb, small, ps, prompt, 6)      # greedy
        >>> torch.equal(out, generate(big, pb, prompt, 6))
        True
    """
    if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 1:
        raise ValueError(f"lookahead must be an int >= 1, got {lookahead!r}")
    seq, one, filters = check_run("speculative_generate", prompt, steps, key, temperature,
                                  top_k, top_p, min_p, eos)  # (B, P)
    b, p_len = seq.shape
    k, dev = lookahead, seq.device
    # Rows keep different numbers of tokens each round. The caches stay rectangular:
    # every fed token gets a cache entry, and `valid` masks the rejected ones out of
    # every later call (key_padding_mask), with positions counting only valid tokens.
    target_state = _Stream(target, target_params)
    draft_state = _Stream(draft, draft_params)
    if p_len > 1:
        target_state.feed(seq[:, :-1], torch.ones_like(seq[:, :-1], dtype=torch.bool))
    blocks, block_valid = [], []  # per round: (B, k + 1) new tokens and which are real
    made = torch.zeros(b, dtype=torch.long, device=dev)  # new tokens per row so far
    ended = torch.zeros(b, dtype=torch.bool, device=dev)  # the row has drawn eos
    last = seq[:, -1:]  # (B, 1) the newest token, not yet in the target's cache
    carry, carry_ok = seq[:, :-1], torch.ones_like(seq[:, :-1], dtype=torch.bool)
    stats = {"rounds": 0, "target_calls": int(p_len > 1), "draft_calls": 0, "accepted": 0,
             "proposed": 0}
    while not bool(((made >= steps) | ended).all()):
        k_round = None if key is None else random.fold_in(key, stats["rounds"])
        kd, ka, kr = (None, None, None) if k_round is None else random.split(k_round, 3)
        # 1. the draft proposes k tokens (first catching up: the carried tokens, `last`)
        feed = torch.cat((carry, last), 1)
        ok = torch.cat((carry_ok, torch.ones_like(last, dtype=torch.bool)), 1)
        proposal, q = [], []
        for j in range(k):
            logits = draft_state.feed(feed, ok)[:, -1]  # (B, V)
            stats["draft_calls"] += 1
            if key is None:
                tok = logits.argmax(-1)
            else:
                qj = _probs(logits, filters)
                q.append(qj)
                tok = random.categorical(random.fold_in(kd, j), qj.log())
            proposal.append(tok)
            feed, ok = tok[:, None], torch.ones(b, 1, dtype=torch.bool, device=dev)
        drafted = torch.stack(proposal, dim=1)  # (B, k)
        # 2. the target scores `last` and every draft token in one call
        logits = target_state.feed(torch.cat((last, drafted), 1),
                                   torch.ones(b, k + 1, dtype=torch.bool, device=dev))
        stats["target_calls"] += 1
        # 3-4. each row keeps its leading accepted drafts, n of them, and one more token
        n, nxt = verify(logits, drafted, q, ka, kr, filters)
        rows = torch.arange(b, device=dev)
        slots = torch.arange(k + 1, device=dev)
        block = torch.cat((drafted, drafted[:, :1]), 1).clone()
        block[rows, n] = nxt
        blocks.append(block)
        block_valid.append(slots[None] <= n[:, None])  # (B, k + 1)
        if eos is not None:
            ended |= ((block == eos) & block_valid[-1]).any(1)
        made = made + n + 1
        # 5. mark the rejected entries: the target's (last, d_0..d_k-1), the draft's
        # (.., d_0..d_k-2); a row that kept all k carries d_k-1 into the draft next round
        target_state.valid[:, -k:] = slots[None, :k] < n[:, None]
        if k > 1:
            draft_state.valid[:, -(k - 1):] = slots[None, :k - 1] < n[:, None]
        carry, carry_ok = drafted[:, -1:], (n == k)[:, None]
        last = nxt[:, None]
        stats["rounds"] += 1
        stats["accepted"] += int(n.sum())
        stats["proposed"] += k * b
    new = torch.cat(blocks, 1)  # (B, rounds * (k + 1))
    new_ok = torch.cat(block_valid, 1)
    kept = finish([row[ok] for row, ok in zip(new, new_ok)], steps, eos)  # (B, steps)
    seq = torch.cat((seq, kept), 1)
    out = seq[0] if one else seq
    return (out, stats) if return_stats else out
