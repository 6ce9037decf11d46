"""Self-speculative decoding with a model's own multi-token prediction depths (DeepSeek-V3,
section 5.4.3; vLLM's "MTP" speculative method): the MTP modules draft, the model checks."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from torchfn.core import random
from torchfn.models._speculative import _probs, _Stream, check_run, finish, verify

__all__ = ["mtp_speculative_generate"]


def _depths(params: Any) -> int:
    """The model's multi-token prediction depth ``D``: its ``mtp.{k}.*`` params' count."""
    found = {int(m.group(1)) for name in getattr(params, "keys", lambda: ())()
             if (m := re.match(r"mtp\.(\d+)\.", name))}
    return max(found) + 1 if found else 0


def _grow(buffer: Tensor, capacity: int) -> Tensor:
    """``buffer`` (B, C, ...) zero-padded to at least ``capacity`` positions (doubling)."""
    c = buffer.shape[1]
    if capacity <= c:
        return buffer
    pad = buffer.new_zeros(buffer.shape[0], max(capacity, 2 * c) - c, *buffer.shape[2:])
    return torch.cat((buffer, pad), 1)


class _Drafter:
    """The MTP depths ``1 .. k`` as draft streams, each with its own cache.

    Depth ``j`` at position ``t`` reads depth ``j - 1``'s state at ``t`` (the model's final
    state for ``j = 1``) and token ``t + j``, and predicts token ``t + j + 1``. With ``L``
    true tokens, each depth runs up to ``t = L - 2`` (the last position whose model state
    exists), so depth ``j`` proposes token ``L + j - 1``. Its entries up to ``t = L - 1 -
    j`` read true tokens only and are kept; the later ones read drafts, so they are masked
    out of the cache and run again the next round, against the tokens then known.
    ``hidden[j]`` (B, C, dim) holds depth ``j``'s states by position (``j = 0``: the
    model's). Past the model's ``depth`` MTP modules, the last one runs again (its own
    cache each time), chained on its own states, as vLLM drafts past DeepSeek-V3's one."""

    def __init__(self, model: Callable[..., Any], params: Any, k: int, depth: int,
                 capacity: int, like: Tensor) -> None:
        self.streams = [_Stream(model, params) for _ in range(k)]
        self.depth = depth
        b, dim = like.shape[0], like.shape[-1]
        self.hidden = [like.new_zeros(b, capacity, dim) for _ in range(k)]

    def grow(self, capacity: int) -> None:
        """Room for ``capacity`` positions (a row that finished early keeps decoding while
        the others catch up)."""
        self.hidden = [_grow(h, capacity) for h in self.hidden]

    def store(self, j: int, at: Tensor, states: Tensor, ok: Tensor) -> None:
        """Write ``states`` (B, w, dim) into ``hidden[j]`` at positions ``at`` (B, w) where
        ``ok``."""
        rows = torch.arange(at.shape[0], device=at.device)[:, None].expand_as(at)
        self.hidden[j][rows[ok], at[ok]] = states[ok]

    def propose(self, tokens: Tensor, length: Tensor, sample: Tensor | None,
                filters: dict[str, Any]) -> tuple[Tensor, list[Tensor]]:
        """Draft ``k`` tokens after the ``length`` (B,) true tokens of ``tokens`` (B, C):
        (B, k), and the draft distributions (B, V) when sampling with key ``sample``."""
        b = tokens.shape[0]
        rows = torch.arange(b, device=tokens.device)
        last = length - 2  # (B,) the last position with a model state
        ext = tokens.clone()  # true tokens, then the drafts at L, L + 1, ...
        drafted, q = [], []
        for j, stream in enumerate(self.streams, start=1):
            done = (torch.zeros_like(length) if stream.valid is None
                    else stream.valid.sum(1))  # (B,) positions kept in this depth's cache
            width = int((last - done).max()) + 1
            at = done[:, None] + torch.arange(width, device=tokens.device)  # (B, w)
            ok = at <= last[:, None]
            at_ = torch.minimum(at, last[:, None])  # in range where not ok
            states = self.hidden[j - 1].gather(
                1, at_[..., None].expand(-1, -1, self.hidden[j - 1].shape[-1]))  # (B, w, dim)
            logits, h = stream.feed(ext.gather(1, at_ + j), ok, mtp_depth=min(j, self.depth),
                                    mtp_hidden=states)  # (B, w, V), (B, w, dim)
            stream.valid[:, -width:] = ok & (at <= (length - 1 - j)[:, None])
            if j < len(self.streams):
                self.store(j, at, h, ok)
            logits = logits[rows, last - done]  # (B, V) at t = L - 2
            if sample is None:
                tok = logits.argmax(-1)
            else:
                qj = _probs(logits, filters)
                q.append(qj)
                tok = random.categorical(random.fold_in(sample, j), qj.log())
            ext[rows, length + j - 1] = tok
            drafted.append(tok)
        return torch.stack(drafted, dim=1), q  # (B, k)


def mtp_speculative_generate(
    model: Callable[..., Any],
    params: Any,
    prompt: Tensor,
    steps: int,
    *,
    key: Tensor | None = None,
    lookahead: int | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    eos: int | None = None,
    return_stats: bool = False,
) -> Tensor | tuple[Tensor, dict[str, int]]:
    """Continue ``prompt`` by ``steps`` tokens of ``model``, its own multi-token prediction
    (MTP) depths drafting: self-speculative decoding, as DeepSeek-V3 serves (section 5.4.3).

    Each round, MTP depths ``1 .. lookahead`` propose one token each (depth ``j`` the
    ``j``-th next), reading the model's final states and their own key/value caches
    (``lookahead > D`` runs the last depth again for each further draft, chained on its
    own states, as vLLM drafts several tokens with DeepSeek-V3's one MTP layer); the
    model then scores the newest token and every draft in one call, and keeps the drafts
    as :func:`speculative_generate` does (greedy: while they equal its argmax; sampling:
    ``min(1, p / q)``, then the residual). So the output is the model's own: greedy,
    token for token its :func:`generate`; sampled, distributed exactly as its samples. The
    MTP depths only set how many tokens a call yields (DeepSeek-V3 reports 85-90%
    acceptance of the second token with ``D = 1``). No second model, no second
    embedding: the drafts cost one MTP block each.

    Each depth's cache keeps the positions whose inputs are all true tokens; the entries
    that read a draft are masked out and run again the next round (``lookahead - 1`` at
    most). Rows keep different numbers of tokens, as in :func:`speculative_generate`, so
    the model must take ``key_padding_mask`` and ``positions`` with a cache, and have no
    recurrent layers. Eager only (not under ``vmap``): repeat the prompt along the batch
    for many samples.

    Args:
        model, params: a causal :class:`TransformerEncoder` with ``mtp=D >= 1`` through
            ``torchfn.Model``: called as ``model(params, tokens, cache=c,
            key_padding_mask=m, positions=p, return_hidden=True)`` and ``model(params,
            tokens, cache=c, key_padding_mask=m, positions=p, mtp_depth=j,
            mtp_hidden=h)``.
        prompt: ``(B, P)`` or ``(P,)`` int64 tokens.
        steps: new tokens (>= 1).
        key: a ``torchfn.random`` key; ``None`` decodes greedily.
        lookahead: drafts per round, >= 1 (default ``D``).
        temperature, top_k, top_p, min_p: as :func:`sample_logits`, for the model's and
            the drafts' distributions; ``temperature`` > 0 when sampling.
        eos: an end-of-sequence token, as :func:`generate`'s: after a row draws it the
            rest of the row is ``eos``, and decoding stops once every row has.
        return_stats: also return ``{"rounds", "target_calls", "draft_calls", "accepted",
            "proposed"}`` (a draft call: one MTP depth on a batch).

    Returns:
        ``(B, P + steps)`` (or ``(P + steps,)``) int64, and the stats if asked.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import TransformerEncoder, generate, mtp_speculative_generate
        >>> model = torchfn.Model(TransformerEncoder(dim=16, heads=2, depth=2, vocab_size=10,
        ...                       out_dim=10, causal=True, position_embedding="rotary", mtp=2))
        >>> params = model.init(torchfn.random.key(0))
        >>> prompt = torch.tensor([[1, 2, 3]])
        >>> out = mtp_speculative_generate(model, params, prompt, 6)     # greedy
        >>> torch.equal(out, generate(model, params, prompt, 6))
        True
    """
    seq, one, filters = check_run("mtp_speculative_generate", prompt, steps, key,
                                  temperature, top_k, top_p, min_p, eos)  # (B, P)
    depth = _depths(params)
    if depth == 0:
        raise ValueError("mtp_speculative_generate: params hold no multi-token prediction "
                         "depths (mtp.0.*); build the model with TransformerEncoder(mtp=D)")
    k = depth if lookahead is None else lookahead
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"lookahead must be an int >= 1, got {lookahead!r}")
    b, p_len = seq.shape
    dev = seq.device
    rows = torch.arange(b, device=dev)
    tokens = _grow(seq, p_len + steps + 2 * k + 2)  # (B, C): the true tokens, then room
    length = torch.full((b,), p_len, dtype=torch.long, device=dev)  # true tokens per row
    target = _Stream(model, params)
    stats = {"rounds": 0, "target_calls": 0, "draft_calls": 0, "accepted": 0, "proposed": 0}
    drafter = None
    if p_len > 1:  # the model reads all but the newest token; its states seed the drafts
        _, hidden = target.feed(seq[:, :-1], torch.ones_like(seq[:, :-1], dtype=torch.bool),
                                return_hidden=True)  # (B, P - 1, dim)
        stats["target_calls"] += 1
        drafter = _Drafter(model, params, k, depth, tokens.shape[1], hidden)
        drafter.store(0, torch.arange(p_len - 1, device=dev).expand(b, -1), hidden,
                      torch.ones_like(seq[:, :-1], dtype=torch.bool))
    ended = torch.zeros(b, dtype=torch.bool, device=dev)  # the row has drawn eos
    while not bool(((length >= p_len + steps) | ended).all()):
        need = int(length.max()) + 2 * k + 2  # this round's drafts and kept tokens
        tokens = _grow(tokens, need)
        if drafter is not None:
            drafter.grow(tokens.shape[1])
        k_round = None if key is None else random.fold_in(key, stats["rounds"])
        kd, ka, kr = (None, None, None) if k_round is None else random.split(k_round, 3)
        # 1. the MTP depths propose (none before the model has read a token)
        if drafter is None:
            drafted, q = seq.new_zeros(b, 0), []
        else:
            drafted, q = drafter.propose(tokens, length, kd, filters)  # (B, k)
            stats["draft_calls"] += k
        kr_ = drafted.shape[1]
        # 2. the model scores the newest token and every draft in one call
        last = tokens[rows, length - 1][:, None]  # (B, 1)
        logits, hidden = target.feed(torch.cat((last, drafted), 1),
                                     torch.ones(b, kr_ + 1, dtype=torch.bool, device=dev),
                                     return_hidden=True)  # (B, k + 1, V), (B, k + 1, dim)
        stats["target_calls"] += 1
        # 3-4. each row keeps n drafts, then one token of the model's
        n, nxt = verify(logits, drafted, q, ka, kr, filters)
        slots = torch.arange(kr_ + 1, device=dev)
        kept = slots[None] <= n[:, None]  # (B, k + 1): `last` and the kept drafts
        if drafter is None:
            drafter = _Drafter(model, params, k, depth, tokens.shape[1], hidden)
        drafter.store(0, length[:, None] - 1 + slots, hidden, kept)
        if kr_:
            target.valid[:, -kr_:] = kept[:, 1:]
        block = torch.cat((drafted, nxt[:, None]), 1)  # (B, k + 1); slot n gets nxt
        block[rows, n] = nxt
        at = length[:, None] + slots  # (B, k + 1) their positions
        tokens[rows[:, None].expand_as(at)[kept], at[kept]] = block[kept]
        if eos is not None:
            ended |= ((block == eos) & kept).any(1)
        length = length + n + 1
        stats["rounds"] += 1
        stats["accepted"] += int(n.sum())
        stats["proposed"] += kr_ * b
    out = torch.cat((seq, finish([row[p_len:end] for row, end in zip(tokens, length.tolist())],
                                 steps, eos)), 1)  # (B, P + steps)
    out = out[0] if one else out
    return (out, stats) if return_stats else out
