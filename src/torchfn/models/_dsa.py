"""DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, GLM-5): a few cheap
ReLU heads score every (query, key) pair, and each query attends to its ``topk`` best
keys only."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from torchfn.models._mlp import _check_dims
from torchfn.models._rotary import RotaryTable, apply_rotary

__all__ = ["LightningIndexer"]


class LightningIndexer(nn.Module):
    """The lightning indexer of DeepSeek Sparse Attention (DSA): which keys each query
    attends to.

    Query ``t`` scores key ``s`` as ``I(t, s) = sum_j w_j(t) relu(q_j(t) . k(s) /
    sqrt(head_dim))`` over ``heads`` small heads, where the queries ``q_j`` come from the
    attention's query latent (``q_rank`` features, ``q_norm(q_a(x))``), the one key ``k``
    per token from ``x`` through a LayerNorm, and the head weights ``w_j`` from ``x``
    (scaled by ``1 / sqrt(heads)``). The first ``rope_dim`` features of queries and keys
    are rotated with the attention's rotary table. Each query keeps its ``topk`` keys of
    highest score among those it may see at all (causal, window, padding, documents);
    with no more keys than ``topk`` every key is kept and nothing is scored.

    The scores are taken a block of queries at a time (``query_block`` rows, by default
    as many as keep the block's ``(B, heads, rows, L)`` scores under 2^26 numbers), so
    their memory stays O(L) per query however long the sequence; each row's choice is
    its own, so the blocks give the unblocked result exactly.

    The choice is discrete: no gradient reaches the indexer through it (the model's loss
    leaves its params at zero gradient). DeepSeek trains them with a separate KL loss
    against the attention's own distribution, :meth:`loss` (``LatentAttention``'s
    ``return_indexer_loss=True``): first a dense warm-up over every key (the same
    params with ``topk`` at least the sequence length), then over the chosen keys.
    Scores run in float32 or wider.

    Params: ``q`` ``(heads * head_dim, q_rank)``, ``k`` ``(head_dim, dim)``, ``k_norm``
    (LayerNorm with bias, eps 1e-6), ``weights`` ``(heads, dim)``; no biases.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> from torchfn.models import LightningIndexer
        >>> from torchfn.models._rotary import rotary_table
        >>> ix = LightningIndexer(dim=32, q_rank=16, heads=2, head_dim=8, topk=3, rope_dim=4)
        >>> x = random.normal(random.key(0), (1, 6, 32))                 # (B, N, dim)
        >>> q_latent = random.normal(random.key(1), (1, 6, 16))          # (B, N, q_rank)
        >>> table = rotary_table(torch.arange(6), 4)
        >>> causal = torch.ones(6, 6, dtype=torch.bool).tril()
        >>> keep = ix.select(x, q_latent, ix.keys(x, table), table, causal)  # (B, 1, N, L)
        >>> (keep & causal).sum(-1).flatten().tolist()             # at most topk each
        [1, 2, 3, 3, 3, 3]
    """

    def __init__(self, dim: int, q_rank: int, *, heads: int, head_dim: int, topk: int,
                 rope_dim: int) -> None:
        super().__init__()
        _check_dims(heads=heads, head_dim=head_dim, topk=topk)
        if rope_dim > head_dim:
            raise ValueError(f"indexer head_dim must be >= the rotary rope_dim {rope_dim}, "
                             f"got {head_dim}")
        self.heads, self.head_dim, self.topk, self.rope_dim = heads, head_dim, topk, rope_dim
        self.query_block: int | None = None  # None: from the sizes (see above)
        self.q = nn.Linear(q_rank, heads * head_dim, bias=False)
        self.k = nn.Linear(dim, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights = nn.Linear(dim, heads, bias=False)

    def keys(self, x: Tensor, table: RotaryTable | None) -> Tensor:
        """Each token's indexer key: ``(B, N, dim) -> (B, 1, N, head_dim)``, its first
        ``rope_dim`` features rotated by ``table`` (None: not rotated)."""
        k = self.k_norm(self.k(x))[:, None]  # (B, 1, N, Di)
        return k if table is None else apply_rotary(k, table)

    def select(self, x: Tensor, q_latent: Tensor, keys: Tensor, table: RotaryTable | None,
               allowed: Tensor | None) -> Tensor:
        """The keys each query keeps, ``(B, 1, N, L)`` bool: its ``topk`` best by the
        indexer's score among the ``allowed`` ones (a bool mask broadcastable to ``(B, 1,
        N, L)``, None: all). ``x`` ``(B, N, dim)`` and ``q_latent`` ``(B, N, q_rank)`` are
        the queries' tokens, ``keys`` ``(B, 1, L, head_dim)`` from :meth:`keys`. A query
        with fewer than ``topk`` allowed keys keeps some others too: the attention's own
        mask removes them."""
        q, w, keys = self._prepare(x, q_latent, keys, table)
        n, length = x.shape[1], keys.shape[-1]
        if allowed is not None:
            allowed = allowed.expand(*allowed.shape[:-2], n, length)  # (.., N, L)
        keep = []
        for part in self._blocks(x.shape[0], n, length):
            index = self._score(q, w, keys, part)  # (B, 1, r, L)
            if allowed is not None:
                index = index.masked_fill(~allowed[..., part, :], float("-inf"))
            top = index.topk(self.topk, dim=-1).indices  # (B, 1, r, topk)
            keep.append(torch.zeros_like(index, dtype=torch.bool).scatter(-1, top, True))
        return torch.cat(keep, dim=-2)  # (B, 1, N, L)

    def loss(self, x: Tensor, q_latent: Tensor, table: RotaryTable | None, keep: Tensor,
             target: Callable[[slice], Tensor]) -> Tensor:
        """DeepSeek-V3.2's indexer training loss: the mean over query rows of ``KL(p_t ||
        softmax(I_t))``, both over the keys row ``t`` ``keep`` s (``(B | 1, 1, N, L)``
        bool: the attention's own mask and the indexer's choice, for the sparse stage; or
        every key the query may see, for the dense warm-up). ``target(rows)`` gives the
        attention's probabilities of those query rows, ``(B, 1, r, L)``, summed over its
        heads and normalised (each row sums to 1 over ``keep``); it is taken as a
        constant. ``x`` and ``q_latent`` (the queries' and, without a cache, the keys'
        tokens) are detached: the loss trains the indexer alone, as the model's loss
        trains the rest. Rows with no key in ``keep`` (padding) do not count. Blocked
        over query rows as :meth:`select`, so memory stays O(L) a row."""
        x, q_latent = x.detach(), q_latent.detach()
        q, w, keys = self._prepare(x, q_latent, self.keys(x, table), table)
        n, length = x.shape[1], keys.shape[-1]
        keep = keep.expand(*keep.shape[:-2], n, length)  # (.., N, L)
        total, rows = q.new_zeros(()), q.new_zeros(())
        for part in self._blocks(x.shape[0], n, length):
            kept = keep[..., part, :]
            index = self._score(q, w, keys, part)  # (B, 1, r, L)
            # the lowest finite score, not -inf: a row with no key stays finite (and drops)
            log_q = index.masked_fill(~kept, torch.finfo(index.dtype).min).log_softmax(-1)
            p = target(part).detach().to(log_q.dtype)  # (B, 1, r, L)
            kl = torch.where(kept, torch.xlogy(p, p) - p * log_q, 0.0).sum(-1)  # (B, 1, r)
            some = kept.any(-1).expand_as(kl)
            total = total + torch.where(some, kl, 0.0).sum()
            rows = rows + some.sum()
        return total / rows.clamp_min(1)

    def _prepare(self, x: Tensor, q_latent: Tensor, keys: Tensor, table: RotaryTable | None
                 ) -> tuple[Tensor, Tensor, Tensor]:
        """The queries ``(B, Hi, N, Di)``, head weights ``(B, N, Hi)`` and keys ``(B, 1,
        Di, L)``, in float32 or wider."""
        q = self.q(q_latent).unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)
        if table is not None:
            q = apply_rotary(q, table)  # (B, Hi, N, Di)
        work = torch.promote_types(x.dtype, torch.float32)
        w = self.weights(x).to(work) * self.heads ** -0.5  # (B, N, Hi)
        return q.to(work), w, keys.to(work).transpose(-1, -2)  # keys (B, 1, Di, L)

    def _blocks(self, b: int, n: int, length: int) -> list[slice]:
        """The query rows scored at once (``query_block``, or under 2^26 scores)."""
        rows = self.query_block or max(1, (1 << 26) // (b * self.heads * length))
        return [slice(start, start + rows) for start in range(0, n, rows)]

    def _score(self, q: Tensor, w: Tensor, keys: Tensor, part: slice) -> Tensor:
        """``I(t, s)`` of the query rows ``part``: ``(B, 1, r, L)``."""
        scores = (q[:, :, part] @ keys) * self.head_dim ** -0.5  # (B, Hi, r, L)
        return torch.einsum("bhnl,bnh->bnl", scores.relu(), w[:, part])[:, None]
