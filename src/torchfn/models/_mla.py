"""Multi-head latent attention (DeepSeek-V2 / V3): keys and values from a small latent
per token, which is all the cache holds."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from torchfn.models._attention import _extra, _fused_attention, _write_static, token_positions
from torchfn.models._dsa import LightningIndexer
from torchfn.models._kv_cache import KVCache, StaticKVCache, check_cache
from torchfn.models._mlp import _check_dims
from torchfn.models._rotary import RotaryTable, apply_rotary, rotary_table
from torchfn.models._rotary_scaling import rotary_frequencies

__all__ = ["LatentAttention"]


class LatentAttention(nn.Module):
    """DeepSeek's multi-head latent attention (MLA): ``(B, N, dim) -> (B, N, dim)``.

    Each token's keys and values come from one latent ``c = norm(W_a x)`` of
    ``kv_rank`` features (DeepSeek-V3: 512) shared by all ``heads``: head ``h``'s key is
    ``[W_k^h c | rope(k_r)]`` and its value ``W_v^h c``, where ``k_r`` (``rope_dim``
    features, DeepSeek-V3: 64) is one rotary key part shared by the heads. Queries are
    ``[q_nope | rope(q_rope)]`` per head, from ``x`` directly or through a low-rank
    ``q_rank`` bottleneck with its own RMSNorm. Head dims: ``nope_dim + rope_dim`` for
    queries and keys, ``v_dim`` for values (DeepSeek-V3: 128 + 64 and 128), so the
    attention runs with ``Dv != D`` (``torchfn.kernels.attention`` takes that).

    A :class:`KVCache` or :class:`StaticKVCache` holds the latent ``c`` ``(B, 1, L,
    kv_rank)`` as its keys and the rotated ``k_r`` ``(B, 1, L, rope_dim)`` as its values:
    ``kv_rank + rope_dim`` numbers a token and layer (576 for DeepSeek-V3, where its 128
    heads' keys and values would be 40960). Where a call has few queries against many
    cached tokens (decoding), the up-projections are *absorbed*: the queries move into
    the latent space (``q_nope W_k^h``), attention runs there over ``[c | k_r]`` as one
    key head, and the output leaves it through ``W_v^h``, never expanding the cache. The
    path is chosen by a multiply-add count of the two (``absorb=True`` / ``False``
    forces one); both give the same values up to rounding (tested in float64), and both
    compose with ``grad``, ``vmap`` and ``jvp``. The absorbed path materialises its
    ``(B, H, N, L)`` scores and takes no attention dropout or ``segment_ids``.

    Params: ``q`` (or ``q_a``, ``q_norm``, ``q_b``), ``kv_a`` ``(kv_rank + rope_dim,
    dim)``, ``kv_norm``, ``kv_b`` ``(heads * (nope_dim + v_dim), kv_rank)``, ``out``;
    no biases. The rotary part follows Hugging Face's half-split pairing (a checkpoint
    stored interleaved, as DeepSeek's, is permuted on load by
    :func:`deepseek_from_hf`). ``scale`` replaces ``1 / sqrt(nope_dim + rope_dim)``
    (DeepSeek with YaRN multiplies it by ``mscale ** 2``). ``rotary=False``: no position
    embedding, the shared ``k_r`` and the queries' ``rope_dim`` parts left as they are
    (Kimi Linear's NoPE latent attention). ``window``, ``softcap`` and ``attend`` as
    :class:`MultiHeadAttention`'s.

    ``head_gate=True``: each head's output is scaled by ``sigmoid(x W_gate)``, one gate
    per head and token (param ``gate`` ``(heads, dim)``; Ling 3's ``bailing_hybrid``).

    ``indexer=dict(heads=, head_dim=, topk=)`` makes it DeepSeek Sparse Attention
    (DeepSeek-V3.2, GLM-5): a :class:`LightningIndexer` (param ``indexer``, which needs
    ``q_rank``) scores the keys from the query latent, and each query attends to its
    ``topk`` best only (with no more keys than ``topk``, to all: the plain attention, and
    the indexer is not run). The cache then also holds each token's indexer key, after
    its rotary key part: values ``(B, 1, L, rope_dim + head_dim)``. Without a cache,
    ``forward(..., return_indexer_loss=True)`` returns ``(out, loss)``: the indexer's
    training loss (:meth:`LightningIndexer.loss`, DeepSeek-V3.2's KL of the heads' mean
    attention against the indexer's softmax, over the chosen keys), whose gradient
    reaches the indexer alone.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn import random
        >>> from torchfn.models import KVCache, LatentAttention
        >>> mla = LatentAttention(dim=32, heads=4, kv_rank=16, rope_dim=8, nope_dim=8,
        ...                       v_dim=8, q_rank=24)
        >>> model = torchfn.Model(mla)
        >>> params = model.init(random.key(0))
        >>> x = random.normal(random.key(1), (2, 5, 32))                  # (B, N, dim)
        >>> out, cache = model.apply(params, x, cache=KVCache())
        >>> out.shape, cache.keys[0].shape, cache.values[0].shape      # latent, rope key
        (torch.Size([2, 5, 32]), torch.Size([2, 1, 5, 16]), torch.Size([2, 1, 5, 8]))
    """

    def __init__(self, dim: int, heads: int, *, kv_rank: int, rope_dim: int = 64,
                 nope_dim: int = 128, v_dim: int = 128, q_rank: int | None = None,
                 causal: bool = True,
                 window: int | tuple[int | None, int | None] | None = None,
                 softcap: float | None = None, attn_dropout: float = 0.0,
                 rotary_base: float = 10000.0, rotary_scaling: dict | None = None,
                 latent_eps: float = 1e-6, scale: float | None = None,
                 absorb: bool | None = None, rotary: bool = True,
                 indexer: dict | None = None, head_gate: bool = False,
                 attend: Callable[..., Tensor] | None = None) -> None:
        super().__init__()
        _check_dims(dim=dim, heads=heads, kv_rank=kv_rank, rope_dim=rope_dim,
                    nope_dim=nope_dim, v_dim=v_dim)
        if q_rank is not None:
            _check_dims(q_rank=q_rank)
        if rope_dim % 2:
            raise ValueError(f"rope_dim must be even, got {rope_dim}")
        if not isinstance(rotary_base, (int, float)) or not rotary_base > 0:
            raise ValueError(f"rotary_base must be a number > 0, got {rotary_base!r}")
        rotary_frequencies(rope_dim, float(rotary_base), rotary_scaling)  # fails here if bad
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                  or not scale > 0):
            raise ValueError(f"scale must be a number > 0 or None, got {scale!r}")
        if not 0.0 <= attn_dropout < 1.0:
            raise ValueError(f"attn_dropout must be in [0, 1), got {attn_dropout}")
        if absorb not in (None, True, False):
            raise ValueError(f"absorb must be None, True or False, got {absorb!r}")
        self.absorb = absorb
        self.heads, self.causal, self.window, self.softcap = heads, causal, window, softcap
        self.kv_rank, self.rope_dim, self.nope_dim, self.v_dim = kv_rank, rope_dim, nope_dim, v_dim
        self.q_rank, self.attn_dropout = q_rank, attn_dropout
        self.rotary_base, self.rotary_scaling = float(rotary_base), rotary_scaling
        if not isinstance(rotary, bool):
            raise ValueError(f"rotary must be a bool, got {rotary!r}")
        self.rotary, self.rotary_dim = rotary, rope_dim  # as TransformerEncoder reads them
        qk = nope_dim + rope_dim
        self.scale = qk ** -0.5 if scale is None else float(scale)
        self.attend = attend or _fused_attention
        if q_rank is None:
            self.q = nn.Linear(dim, heads * qk, bias=False)
        else:
            self.q_a = nn.Linear(dim, q_rank, bias=False)
            self.q_norm = nn.RMSNorm(q_rank, eps=latent_eps)
            self.q_b = nn.Linear(q_rank, heads * qk, bias=False)
        self.kv_a = nn.Linear(dim, kv_rank + rope_dim, bias=False)  # [latent | rope key]
        self.kv_norm = nn.RMSNorm(kv_rank, eps=latent_eps)
        self.kv_b = nn.Linear(kv_rank, heads * (nope_dim + v_dim), bias=False)  # per head
        self.out = nn.Linear(heads * v_dim, dim, bias=False)  # [k_nope | v]
        if not isinstance(head_gate, bool):
            raise ValueError(f"head_gate must be a bool, got {head_gate!r}")
        self.gate = nn.Linear(dim, heads, bias=False) if head_gate else None
        self.indexer = None
        if indexer is not None:
            if not isinstance(indexer, dict) or set(indexer) != {"heads", "head_dim", "topk"}:
                raise ValueError(f"indexer must be a dict of heads, head_dim and topk, got "
                                 f"{indexer!r}")
            if q_rank is None:
                raise ValueError("indexer needs q_rank: it reads the query latent")
            self.indexer = LightningIndexer(dim, q_rank, rope_dim=rope_dim, **indexer)

    def rotary_table(self, positions: Tensor, dtype: torch.dtype) -> RotaryTable:
        """The cos / sin table of ``positions`` for the ``rope_dim`` rotary features."""
        return rotary_table(positions, self.rope_dim, base=self.rotary_base,
                            scaling=self.rotary_scaling, dtype=dtype, device=positions.device)

    def cache_shapes(self, batch_size: int, capacity: int) -> tuple[tuple, tuple]:
        """The shapes of this layer's cached keys (the latents) and values (the rotary
        key parts), for :meth:`StaticKVCache.allocate`."""
        return ((batch_size, 1, capacity, self.kv_rank),
                (batch_size, 1, capacity, self._value_dim()))

    def _value_dim(self) -> int:
        """The cached values' features: the rotary key part, then any indexer key."""
        return self.rope_dim + (0 if self.indexer is None else self.indexer.head_dim)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None,
                segment_ids: Tensor | None = None, positions: Tensor | None = None,
                cache: KVCache | None = None, return_indexer_loss: bool = False
                ) -> Tensor | tuple[Tensor, KVCache] | tuple[Tensor, Tensor]:
        b, n, _ = x.shape
        h, dn, dr = self.heads, self.nope_dim, self.rope_dim
        if return_indexer_loss and (self.indexer is None or cache is not None):
            raise ValueError(f"LatentAttention: return_indexer_loss needs an indexer and no "
                             f"cache; got indexer={self.indexer is not None}, cache="
                             f"{type(cache).__name__ if cache is not None else None}")
        if cache is not None:
            cache = check_cache(cache, 1, "LatentAttention")
            if not self.causal:
                raise ValueError("LatentAttention: cache needs causal=True (decoding); got "
                                 "causal=False")
            if segment_ids is not None:
                raise ValueError("LatentAttention: cache does not take segment_ids (decode "
                                 "one document per row)")
            if cache.keys and (cache.keys[0].shape[-1], cache.values[0].shape[-1]) != (
                    self.kv_rank, self._value_dim()):
                raise ValueError(f"LatentAttention: cache must hold latents (B, 1, L, "
                                 f"{self.kv_rank}) and rotary keys (B, 1, L, "
                                 f"{self._value_dim()}), got "
                                 f"{tuple(cache.keys[0].shape)} and "
                                 f"{tuple(cache.values[0].shape)}")
        q_latent = None if self.q_rank is None else self.q_norm(self.q_a(x))  # (B, N, q_rank)
        q = self.q(x) if q_latent is None else self.q_b(q_latent)
        q = q.unflatten(-1, (h, dn + dr)).transpose(1, 2)  # (B, H, N, dn + dr)
        latent, k_rope = self.kv_a(x).split([self.kv_rank, dr], dim=-1)
        latent = self.kv_norm(latent)[:, None]  # (B, 1, N, r)
        k_rope = k_rope[:, None]  # (B, 1, N, dr)
        q_nope, q_rope = q[..., :dn], q[..., dn:]
        table = None
        if self.rotary:  # (without: NoPE, the "rope" parts shared but not rotated: Kimi Linear)
            if positions is None:
                start = 0 if cache is None else cache.length
                positions = token_positions(n, x.device, start, segment_ids)
            table = positions if isinstance(positions, RotaryTable) else \
                self.rotary_table(positions, x.dtype)
            q_rope, k_rope = apply_rotary(q_rope, table), apply_rotary(k_rope, table)
        if self.indexer is not None:  # cached with the rotary key parts: (B, 1, N, dr + Di)
            k_rope = torch.cat((k_rope, self.indexer.keys(x, table).to(k_rope.dtype)), -1)
        mask = None
        if isinstance(cache, StaticKVCache):
            latent, k_rope, cache, mask = _write_static(cache, latent, k_rope, self.window)
        elif cache is not None:
            if cache.keys:
                latent = torch.cat((cache.keys[0], latent), dim=2)  # (B, 1, L + N, r)
                k_rope = torch.cat((cache.values[0], k_rope), dim=2)  # (B, 1, L + N, dr [+ Di])
            cache = KVCache((latent,), (k_rope,))
        select = None
        if self.indexer is not None:
            k_rope, k_index = k_rope[..., :dr], k_rope[..., dr:]
            select = self._select(x, q_latent, k_index, table, mask, key_padding_mask,
                                  segment_ids)
        drop = self.attn_dropout if self.training else 0.0
        absorb = self._absorb_cheaper(n, latent.shape[2]) if self.absorb is None else self.absorb
        if absorb and (drop > 0 or segment_ids is not None):
            if self.absorb:
                raise ValueError("LatentAttention: absorb=True takes neither attention "
                                 "dropout nor segment_ids")
            absorb = False
        if absorb:
            o = self._absorbed(q_nope, q_rope, latent, k_rope, key_padding_mask, mask, select)
        else:
            kv = self.kv_b(latent[:, 0]).unflatten(-1, (h, dn + self.v_dim)).transpose(1, 2)
            k_nope, v = kv.split([dn, self.v_dim], dim=-1)  # (B, H, L, dn), (B, H, L, dv)
            k = torch.cat((k_nope, k_rope.expand(-1, h, -1, -1)), dim=-1)  # (B, H, L, dn+dr)
            q = torch.cat((q_nope, q_rope), dim=-1)  # (B, H, N, dn + dr)
            if mask is not None:
                o = self.attend(q, k, v, key_padding_mask=key_padding_mask, causal=False,
                                mask=mask if select is None else mask & select,
                                **_extra(None, None, self.softcap, drop, self.scale))
            else:
                o = self.attend(q, k, v, key_padding_mask=key_padding_mask,
                                causal=self.causal,
                                **({} if select is None else {"mask": select}),
                                **_extra(self.window, segment_ids, self.softcap, drop,
                                         self.scale))
        o = o.transpose(1, 2)  # (B, N, H, dv)
        if self.gate is not None:
            o = o * torch.sigmoid(self.gate(x).to(torch.promote_types(x.dtype, torch.float32))
                                  ).to(o.dtype)[..., None]
        out = self.out(o.reshape(b, n, h * self.v_dim))  # (B, N, dim)
        if return_indexer_loss:
            keep = self._allowed(n, latent.shape[2], None, key_padding_mask, segment_ids,
                                 x.device)
            keep = select if keep is None else keep if select is None else keep & select
            if keep is None:
                keep = torch.ones(1, 1, n, latent.shape[2], dtype=torch.bool, device=x.device)
            target = self._head_probabilities(q_nope, q_rope, latent, k_rope, keep)
            return out, self.indexer.loss(x, q_latent, table, keep, target)
        return out if cache is None else (out, cache)

    def _select(self, x: Tensor, q_latent: Tensor, k_index: Tensor,
                table: RotaryTable | None, mask: Tensor | None,
                key_padding_mask: Tensor | None, segment_ids: Tensor | None) -> Tensor | None:
        """The indexer's choice of keys ``(B, 1, N, L)`` among those each query may see
        (a static cache's ``mask``, else causal and the window; padding; documents), or
        None where there are no more than ``topk`` keys (all kept)."""
        n, length = x.shape[1], k_index.shape[2]
        if length <= self.indexer.topk:
            return None
        allowed = self._allowed(n, length, mask, key_padding_mask, segment_ids, x.device)
        return self.indexer.select(x, q_latent, k_index, table, allowed)

    def _allowed(self, n: int, length: int, mask: Tensor | None,
                 key_padding_mask: Tensor | None, segment_ids: Tensor | None,
                 device: torch.device) -> Tensor | None:
        """The keys each of ``n`` queries may see among ``length``, ``(B | 1, 1, N, L)``
        bool (or ``(N, L)``), None for all: a static cache's ``mask``, else causal
        (aligned bottom-right) and the window; ``key_padding_mask`` ``(B, L)``;
        ``segment_ids`` ``(B, N)`` (no cache: the keys are the queries)."""
        from torchfn.kernels._dispatch import _normalize_window
        from torchfn.kernels._reference import band

        allowed = mask if mask is not None else band(
            n, length, self.causal, _normalize_window(self.window, self.causal, n, length),
            device)  # (N, L), (B | 1, 1, N, L) or None: all
        limits = [] if key_padding_mask is None else [key_padding_mask[:, None, None, :]]
        if segment_ids is not None:
            limits.append(segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
        for limit in limits:
            allowed = limit.to(torch.bool) if allowed is None else allowed & limit.to(torch.bool)
        return allowed

    def _head_probabilities(self, q_nope: Tensor, q_rope: Tensor, latent: Tensor,
                            k_rope: Tensor, keep: Tensor) -> Callable[[slice], Tensor]:
        """For the indexer's loss: ``rows -> (B, 1, r, L)``, the attention's probabilities
        of those query rows over the keys in ``keep`` (softcapped, no dropout), averaged
        over the heads (so each row sums to 1; a row with no key is 0); from the queries
        ``(B, H, N, dn | dr)``, latents ``(B, 1, L, r)`` and rotary keys ``(B, 1, L, dr)``
        as in :meth:`_absorbed`, without gradients."""
        w_k = self.kv_b.weight.detach().unflatten(0, (self.heads, -1))[:, :self.nope_dim]
        work = torch.promote_types(q_nope.dtype, torch.float32)
        q_lat = q_nope.detach().to(work) @ w_k.to(work)  # (B, H, N, r)
        q_rope, latent, k_rope = (t.detach().to(work) for t in (q_rope, latent, k_rope))

        def target(rows: slice) -> Tensor:
            scores = q_lat[:, :, rows] @ latent.transpose(-1, -2) \
                + q_rope[:, :, rows] @ k_rope.transpose(-1, -2)
            scores = scores * self.scale  # (B, H, r, L)
            if self.softcap is not None:
                scores = self.softcap * torch.tanh(scores / self.softcap)
            kept = keep[..., rows, :]
            scores = scores.masked_fill(~kept, torch.finfo(work).min)
            p = scores.softmax(-1) * kept  # a row with no key: 0
            return p.mean(1, keepdim=True)  # (B, 1, r, L)
        return target

    def _absorb_cheaper(self, n: int, keys: int) -> bool:
        """Multiply-adds per head of the two ways: expanding ``keys`` latents into keys
        and values, then attention at ``dn + dr`` / ``dv``; or moving ``n`` queries into
        the latent space and attending there at ``r + dr`` / ``r``."""
        r, dn, dr, dv = self.kv_rank, self.nope_dim, self.rope_dim, self.v_dim
        expand = keys * r * (dn + dv) + n * keys * (dn + dr + dv)
        absorb = n * r * (dn + dv) + n * keys * (2 * r + dr)
        return absorb < expand

    def _absorbed(self, q_nope: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor,
                  key_padding_mask: Tensor | None, mask: Tensor | None,
                  select: Tensor | None = None) -> Tensor:
        """Attention in the latent space: ``q_nope`` ``(B, H, N, dn)`` through ``W_k^h``
        to ``(B, H, N, r)``, scores against the latents ``(B, 1, L, r)`` plus the rotary
        parts', the weighted latents out through ``W_v^h``: ``(B, H, N, dv)``. The
        scores are materialised, ``(B, H, N, L)``: this runs for few queries (decoding).
        Masks as :func:`torchfn.kernels.attention`'s: causal aligned bottom-right,
        ``key_padding_mask`` ``(B, L)``, a static cache's ``mask`` (else the band), the
        indexer's ``select``; a row with no key gives 0."""
        h, dn, dv = self.heads, self.nope_dim, self.v_dim
        n, length = q_nope.shape[2], latent.shape[2]
        w = self.kv_b.weight.unflatten(0, (h, dn + dv))  # (H, dn + dv, r)
        w_k, w_v = w[:, :dn], w[:, dn:]  # (H, dn, r), (H, dv, r)
        work = torch.promote_types(q_nope.dtype, torch.float32)
        q_lat = q_nope @ w_k.to(q_nope.dtype)  # (B, H, N, r)
        scores = (q_lat @ latent.transpose(-1, -2) + q_rope @ k_rope.transpose(-1, -2))
        scores = scores.to(work) * self.scale  # (B, H, N, L)
        if self.softcap is not None:
            scores = self.softcap * torch.tanh(scores / self.softcap)
        keep = torch.ones(1, 1, n, length, dtype=torch.bool, device=scores.device)
        allowed = self._allowed(n, length, mask, key_padding_mask, None, scores.device)
        keep = keep if allowed is None else keep & allowed
        if select is not None:
            keep = keep & select
        scores = scores.masked_fill(~keep, float("-inf"))
        top = scores.amax(-1, keepdim=True).clamp_min(torch.finfo(work).min)
        p = torch.exp(scores - top)  # rows with no key: all 0
        p = p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(work).tiny)
        o_lat = p.to(latent.dtype) @ latent  # (B, H, N, r)
        return o_lat @ w_v.transpose(-1, -2).to(o_lat.dtype)  # (B, H, N, dv)

