"""Multi-head self-attention with rotary positions, grouped-query heads and KV caches,
over ``torchfn.kernels.attention``; and the pieces other attention layers share."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from torchfn.core._eager import plain
from torchfn.models._kv_cache import KVCache, StaticKVCache, check_cache
from torchfn.models._mlp import _check_dims
from torchfn.models._norm import make_norm
from torchfn.models._rotary import RotaryTable, apply_rotary, rotary_table
from torchfn.models._rotary_scaling import rotary_frequencies

__all__ = ["MultiHeadAttention", "token_positions"]

AttendFn = Callable[..., Tensor]


def _fused_attention(q: Tensor, k: Tensor, v: Tensor, *, key_padding_mask, causal,
                     **extra) -> Tensor:
    """The default attention: ``torchfn.kernels.attention`` (fused on GPU, blockwise on
    CPU; composes with grad / vmap / jvp). Imported lazily: kernels import triton only
    when it runs on CUDA. ``extra``: ``window`` / ``segment_ids`` where set."""
    from torchfn.kernels import attention

    return attention(q, k, v, key_padding_mask=key_padding_mask, causal=causal, **extra)


def _extra(window, segment_ids, softcap=None, dropout: float = 0.0, scale=None,
           sinks=None) -> dict:
    """The attention keywords beyond the basic two, only where set (so a custom ``attend``
    without them keeps working when they are not used). ``dropout`` > 0: with the next
    key of the running ``Model.apply``."""
    extra = {}
    if dropout > 0:
        from torchfn.core._dropout import next_key

        extra["dropout"], extra["key"] = dropout, next_key("attention dropout")
    if window is not None:
        extra["window"] = window
    if segment_ids is not None:
        extra["segment_ids"] = segment_ids
    if softcap is not None:
        extra["softcap"] = softcap
    if scale is not None:
        extra["scale"] = scale
    if sinks is not None:
        extra["sinks"] = sinks
    return extra


class MultiHeadAttention(nn.Module):
    """Self-attention ``(B, N, dim) -> (B, N, dim)`` with ``heads`` heads.

    ``attend(q, k, v, key_padding_mask=..., causal=...)`` on ``(B, H, N, D)`` tensors
    computes ``softmax(q k^T / sqrt(D)) v``; the default is
    ``torchfn.kernels.attention``. Pass another (e.g. a wrapper around
    ``F.scaled_dot_product_attention``) to compare. ``window`` (sliding-window attention),
    ``softcap`` (logit soft-capping) and the forward's ``segment_ids`` (packed documents)
    are passed on as keywords only when set; so is ``attn_dropout`` (attention dropout, in
    train mode only), with a key drawn from ``Model.apply``'s ``key``.

    ``kv_heads`` < ``heads`` shares each key/value head among ``heads // kv_heads`` query
    heads (grouped-query attention; 1 is multi-query): fewer projection weights and a
    smaller ``KVCache``. ``rotary=True`` applies :func:`rotary_embedding` (with
    ``rotary_base``) to queries and keys at the forward's ``positions`` (default
    ``cache.length + arange(N)``, restarting at each document with ``segment_ids``),
    its frequencies stretched by ``rotary_scaling`` (:func:`rotary_frequencies`), to the
    first ``rotary_dim`` features of each head (default all; Phi-4-mini: 3/4 of them).
    ``bias=False`` drops the projections' biases; ``qkv_bias`` (default ``bias``) sets the
    q/k/v projection's alone (Qwen2: ``bias=False, qkv_bias=True``). ``head_dim`` sets
    the heads' width apart from ``dim // heads`` (Qwen3-0.6B: 16 heads of 128 in a width
    of 1024); the output projection maps ``heads * head_dim`` back to ``dim``.
    ``qk_norm=True`` puts an RMSNorm over each head's queries and keys (one weight of
    ``head_dim`` for all heads, epsilon ``norm_eps``) before the rotary embedding, as
    Qwen3 does (``qk_norm="rms+1"``: Gemma 3's, scaling by ``1 + weight``;
    ``qk_norm_scope="all"``: one norm over all heads' queries and one over all keys, as
    OLMo 2's; ``"rotated"``: per head, after the rotary embedding, as Hunyuan's).
    ``scale`` replaces the scores' ``1 / sqrt(head_dim)`` (Gemma 2 and 3:
    ``query_pre_attn_scalar ** -0.5``). ``sinks=True`` learns one attention sink logit per
    head (``sinks`` ``(H,)``, gpt-oss: see ``torchfn.kernels.attention``), and
    ``out_bias`` sets the output projection's bias apart from ``bias``.
    ``rotary_interleaved=True`` pairs features ``(2i, 2i + 1)`` for the rotation (GPT-J,
    Cohere) instead of Hugging Face Llama's halves. ``qk_norm="rms_plain"``: an RMSNorm
    without a weight (Llama 4's; it commutes with the rotation, which keeps each head's
    norm).

    ``chunk=C``: chunked attention (Llama 4): positions are cut into chunks of ``C``
    (``0..C-1``, ``C..2C-1``, ...) and a query sees only the keys of its own chunk
    (causally with ``causal=True``). It is passed to the kernels as ``segment_ids``, so a
    query block visits only its chunk's key blocks: O(N * C), not O(N^2). It follows the
    forward's ``positions`` (with left padding, the real tokens' positions, as
    transformers does) and combines with ``segment_ids`` (a chunk never spans two
    documents) and both caches: a :class:`StaticKVCache` of capacity ``C - 1`` plus a
    call's tokens suffices (a ring buffer, as for a window).
    ``output_gate=True``: the heads' outputs are multiplied by ``sigmoid(x W_gate)`` before
    the output projection (gated attention, Qiu et al. 2025; Qwen3-Next, Qwen3.5), a gate
    per head and feature; ``output_gate="head"``: one gate per head, ``W_gate`` ``(H,
    dim)`` (the paper's headwise variant; Step 3.5).
    ``qkv_clip=c`` clamps the projected queries, keys and values to ``[-c, c]`` (after
    q/k norms over all heads; OLMo, OLMoE and DBRX's ``clip_qkv``).
    ``temperature=(floor_scale, attn_scale)``: the queries at position ``p`` are scaled by
    ``1 + attn_scale * log(1 + floor((p + 1) / floor_scale))`` (Llama 4's attention
    temperature tuning on its NoPE layers; Nakanishi 2025, "Scalable-Softmax"), so the
    scores sharpen as the context grows; ``(floor_scale, attn_scale, offset)`` puts
    ``p + offset`` in the floor (Ministral 3: ``floor(p / floor_scale)``, offset 0).

    ``v_dim`` sets the value heads' width apart from ``head_dim`` (MiMo-V2-Flash: 192 for
    queries and keys, 128 for values); the output projection then maps ``heads * v_dim``.
    ``value_scale=c`` multiplies the values by ``c`` (MiMo-V2-Flash's
    ``attention_value_scale``).

    ``forward(x, key_padding_mask, segment_ids, positions, cache)``: ``positions`` may
    also be the layer's :meth:`rotary_table` of them, made once for several layers. With a
    :class:`KVCache` (``KVCache()`` to start), the queries attend over the cached keys too
    and it returns ``(out, cache)`` with this call's keys and values appended; that needs
    ``causal=True``, and ``key_padding_mask`` then covers cached and new keys, ``(B, L + N)``.

    Example::

        >>> from torchfn import random
        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import MultiHeadAttention
        >>> model = torchfn.Model(MultiHeadAttention(dim=32, heads=4, causal=True))
        >>> params = model.init(torchfn.random.key(0))
        >>> x = random.normal(random.key(1), (2, 16, 32))  # (B, N, dim)
        >>> model.apply(params, x).shape                                 # (B, N, dim)
        torch.Size([2, 16, 32])
    """

    def __init__(self, dim: int, heads: int, *, causal: bool = False,
                 window: int | tuple[int | None, int | None] | None = None,
                 softcap: float | None = None, attn_dropout: float = 0.0,
                 kv_heads: int | None = None, rotary: bool = False,
                 rotary_base: float = 10000.0, rotary_scaling: dict | None = None,
                 rotary_dim: int | None = None,
                 bias: bool = True, qkv_bias: bool | None = None,
                 head_dim: int | None = None, qk_norm: bool | str = False,
                 qk_norm_scope: str = "head",
                 norm_eps: float | None = None, scale: float | None = None,
                 sinks: bool = False, out_bias: bool | None = None,
                 rotary_interleaved: bool = False, chunk: int | None = None,
                 temperature: tuple[float, float] | None = None,
                 output_gate: bool | str = False,
                 qkv_clip: float | None = None, v_dim: int | None = None,
                 value_scale: float | None = None, attend: AttendFn | None = None) -> None:
        super().__init__()
        _check_dims(dim=dim, heads=heads)
        self.rotary_interleaved = rotary_interleaved
        if chunk is not None:
            _check_dims(chunk=chunk)
        if temperature is not None and (
                not isinstance(temperature, (tuple, list)) or len(temperature) not in (2, 3)
                or any(isinstance(t, bool) or not isinstance(t, (int, float))
                       for t in temperature) or not min(temperature[:2]) > 0
                or not 0 <= (temperature[2:] or (1,))[0] <= 1):
            raise ValueError(f"temperature must be a pair (floor_scale, attn_scale) of numbers "
                             f"> 0 (and an offset in [0, 1]), or None; got {temperature!r}")
        self.chunk = chunk
        self.temperature = None if temperature is None else tuple(map(float, temperature))
        if qkv_clip is not None and (isinstance(qkv_clip, bool) or not isinstance(
                qkv_clip, (int, float)) or not qkv_clip > 0):
            raise ValueError(f"qkv_clip must be a number > 0 or None, got {qkv_clip!r}")
        self.qkv_clip = None if qkv_clip is None else float(qkv_clip)
        if head_dim is None and dim % heads:
            raise ValueError(f"dim must be divisible by heads, got dim={dim}, heads={heads} "
                             "(or give head_dim)")
        hd = dim // heads if head_dim is None else head_dim
        vd = hd if v_dim is None else v_dim
        _check_dims(head_dim=hd, v_dim=vd)
        if value_scale is not None and (isinstance(value_scale, bool) or not isinstance(
                value_scale, (int, float)) or not value_scale > 0):
            raise ValueError(f"value_scale must be a number > 0 or None, got {value_scale!r}")
        self.value_scale = None if value_scale is None else float(value_scale)
        kv_heads = heads if kv_heads is None else kv_heads
        _check_dims(kv_heads=kv_heads)
        if heads % kv_heads:
            raise ValueError(f"kv_heads must divide heads = {heads}, got kv_heads={kv_heads}")
        if not 0.0 <= attn_dropout < 1.0:
            raise ValueError(f"attn_dropout must be in [0, 1), got {attn_dropout}")
        rot = hd if rotary_dim is None else rotary_dim
        if rotary and (isinstance(rot, bool) or not isinstance(rot, int) or rot % 2
                       or not 2 <= rot <= hd):
            raise ValueError(f"rotary needs an even head dim, got {hd}" if rotary_dim is None
                             else f"rotary_dim must be an even int in 2..head_dim = {hd}, "
                                  f"got {rotary_dim!r}")
        if not isinstance(rotary_base, (int, float)) or not rotary_base > 0:
            raise ValueError(f"rotary_base must be a number > 0, got {rotary_base!r}")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                  or not scale > 0):
            raise ValueError(f"scale must be a number > 0 or None, got {scale!r}")
        self.heads, self.causal, self.window, self.softcap = heads, causal, window, softcap
        self.scale = None if scale is None else float(scale)
        self.kv_heads, self.rotary, self.rotary_base = kv_heads, rotary, float(rotary_base)
        self.rotary_scaling, self.rotary_dim = rotary_scaling, rot
        if rotary:  # a bad scaling dict fails here, not at the first forward
            rotary_frequencies(rot, self.rotary_base, rotary_scaling)
        self.attn_dropout = attn_dropout
        self.attend = attend or _fused_attention
        if output_gate not in (False, True, "head"):
            raise ValueError(f"output_gate must be False, True (per head and feature) or "
                             f"'head' (per head), got {output_gate!r}")
        self.head_gate = output_gate == "head"
        self.head_dim, self.v_dim = hd, vd
        qkv_bias = bias if qkv_bias is None else qkv_bias
        self._projections(dim, qkv_bias, bias if out_bias is None else out_bias, output_gate)
        if sinks:  # gpt-oss: a logit per head that every query may attend instead of a key
            self.sinks = nn.Parameter(torch.zeros(heads))
        else:
            self.sinks = None
        self.qk_norm = bool(qk_norm)
        if qk_norm_scope not in ("head", "all", "rotated"):
            raise ValueError(f"qk_norm_scope must be 'head', 'all' or 'rotated', got "
                             f"{qk_norm_scope!r}")
        self.qk_norm_scope = qk_norm_scope
        if qk_norm:
            kind = "rms" if qk_norm is True else qk_norm
            if kind not in ("rms", "rms+1", "rms_plain"):
                raise ValueError(f"qk_norm must be a bool, 'rms', 'rms+1' or 'rms_plain', got "
                                 f"{qk_norm!r}")
            every = qk_norm_scope == "all"  # OLMo 2: over all heads' features at once
            self.q_norm = make_norm(kind, heads * hd if every else hd, eps=norm_eps)
            self.k_norm = make_norm(kind, kv_heads * hd if every else hd, eps=norm_eps)

    def _projections(self, dim: int, qkv_bias: bool, out_bias: bool,
                     output_gate: bool) -> None:
        """The input and output projections (a subclass may make its own): ``qkv``,
        ``out`` and the output gate."""
        heads, kv_heads, hd, vd = self.heads, self.kv_heads, self.head_dim, self.v_dim
        self.qkv = nn.Linear(dim, (heads + kv_heads) * hd + kv_heads * vd,
                             bias=qkv_bias)  # [q | k | v]
        self.out = nn.Linear(heads * vd, dim, bias=out_bias)
        # Qwen3-Next / Qwen3.5's gated attention: o * sigmoid(x W_gate), per head and feature
        # (or per head alone)
        width = heads if output_gate == "head" else heads * vd
        self.gate = nn.Linear(dim, width, bias=qkv_bias) if output_gate else None

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, object]:
        """``x`` ``(B, N, dim)`` -> queries ``(B, N, H D)``, keys ``(B, N, Hkv D)``, values
        ``(B, N, Hkv Dv)``, and what :meth:`_output` needs besides (nothing here)."""
        hd, vd = self.head_dim, self.v_dim
        q, k, v = self.qkv(x).split([self.heads * hd, self.kv_heads * hd, self.kv_heads * vd],
                                    dim=-1)
        return q, k, v, None

    def _output(self, o: Tensor, x: Tensor, context: object) -> Tensor:
        """The heads' outputs ``o`` ``(B, N, H Dv)`` back to ``(B, N, dim)``."""
        if self.gate is not None and self.head_gate:  # (B, N, H, Dv) times (B, N, H, 1)
            o = (o.unflatten(-1, (self.heads, self.v_dim))
                 * torch.sigmoid(self.gate(x))[..., None]).flatten(-2)
        elif self.gate is not None:
            o = o * torch.sigmoid(self.gate(x))
        return self.out(o)

    @property
    def needs_positions(self) -> bool:
        """Whether the forward needs the tokens' positions themselves (``chunk``,
        ``temperature``), not just a rotary table of them."""
        return self.chunk is not None or self.temperature is not None

    def cache_shapes(self, batch_size: int, capacity: int) -> tuple[tuple, tuple]:
        """The shapes of this layer's cached keys and values, ``(B, Hkv, capacity, D)``
        and ``(B, Hkv, capacity, Dv)``, for :meth:`StaticKVCache.allocate`."""
        return ((batch_size, self.kv_heads, capacity, self.head_dim),
                (batch_size, self.kv_heads, capacity, self.v_dim))

    def reset_parameters(self) -> None:
        """The sinks start at 0 (the projections are their own modules)."""
        if self.sinks is not None:
            nn.init.zeros_(self.sinks)

    def rotary_table(self, positions: Tensor, dtype: torch.dtype) -> RotaryTable:
        """The cos / sin table of ``positions`` ``(N,)`` or ``(B, N)`` for this layer's
        rotary settings: pass it as the forward's ``positions`` to reuse it across
        layers that share them (as :class:`TransformerEncoder` does)."""
        return rotary_table(positions, self.rotary_dim, base=self.rotary_base,
                            scaling=self.rotary_scaling, dtype=dtype, device=positions.device)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None,
                segment_ids: Tensor | None = None, positions: Tensor | None = None,
                cache: KVCache | None = None) -> Tensor | tuple[Tensor, KVCache]:
        b, n, dim = x.shape
        hd = self.head_dim
        if cache is not None:
            cache = check_cache(cache, 1, "MultiHeadAttention")
            if not self.causal:
                raise ValueError("MultiHeadAttention: cache needs causal=True (decoding); "
                                 "got causal=False")
            if segment_ids is not None:
                raise ValueError("MultiHeadAttention: cache does not take segment_ids "
                                 "(decode one document per row)")
        vd = self.v_dim
        q, k, v, context = self._project(x)
        if self.qk_norm and self.qk_norm_scope == "all":
            q, k = self.q_norm(q), self.k_norm(k)  # (B, N, H D), (B, N, Hkv D)
        if self.qkv_clip is not None:  # OLMo's and DBRX's clamp
            q, k, v = (t.clamp(-self.qkv_clip, self.qkv_clip) for t in (q, k, v))
        q = q.reshape(b, n, self.heads, hd).transpose(1, 2)  # (B, H, N, D)
        k = k.reshape(b, n, self.kv_heads, hd).transpose(1, 2)  # (B, Hkv, N, D)
        v = v.reshape(b, n, self.kv_heads, vd).transpose(1, 2)  # (B, Hkv, N, Dv)
        if self.value_scale is not None:
            v = v * self.value_scale
        if self.qk_norm and self.qk_norm_scope == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if (self.rotary or self.needs_positions) and positions is None:
            start = 0 if cache is None else cache.length
            positions = token_positions(n, x.device, start, segment_ids)
        if self.needs_positions and isinstance(positions, RotaryTable):
            raise ValueError("MultiHeadAttention: chunk and temperature need the tokens' "
                             "positions, not a rotary table")
        if self.rotary:
            table = positions if isinstance(positions, RotaryTable) else \
                self.rotary_table(positions, x.dtype)  # one table for q and k
            q = apply_rotary(q, table, self.rotary_interleaved)
            k = apply_rotary(k, table, self.rotary_interleaved)
        if self.qk_norm and self.qk_norm_scope == "rotated":  # Hunyuan: after the rotation
            q, k = self.q_norm(q), self.k_norm(k)
        if self.temperature is not None:
            q = _temperature(q, positions, *self.temperature)
        drop = self.attn_dropout if self.training else 0.0
        if isinstance(cache, StaticKVCache):
            k, v, cache, mask = _write_static(cache, k, v, self.window, self.chunk, positions)
            o = self.attend(q, k, v, key_padding_mask=key_padding_mask, causal=False,
                            mask=mask, **_extra(None, None, self.softcap, drop, self.scale,
                                                self.sinks))
        else:
            past = 0
            if cache is not None:
                if cache.keys:
                    past = cache.keys[0].shape[2]
                    k = torch.cat((cache.keys[0], k), dim=2)  # (B, Hkv, L + N, D)
                    v = torch.cat((cache.values[0], v), dim=2)
                cache = KVCache((k,), (v,))
            if self.chunk is not None:
                segment_ids = _chunk_ids(positions, b, self.chunk, segment_ids,
                                         None if cache is None else past)
            o = self.attend(q, k, v, key_padding_mask=key_padding_mask, causal=self.causal,
                            **_extra(self.window, segment_ids, self.softcap, drop, self.scale,
                                     self.sinks))
        o = o.transpose(1, 2).reshape(b, n, self.heads * vd)  # (B, N, H Dv)
        out = self._output(o, x, context)  # (B, N, dim)
        return out if cache is None else (out, cache)


def _temperature(q: Tensor, positions: Tensor, floor_scale: float, attn_scale: float,
                 offset: float = 1.0) -> Tensor:
    """Queries ``(B, H, N, D)`` at ``positions`` ``(N,)`` or ``(B, N)`` times
    ``1 + attn_scale * log1p(floor((p + offset) / floor_scale))``, computed in float32 as
    transformers' Llama 4 (offset 1) and Ministral 3 (offset 0) do."""
    p = positions.to(torch.float32)
    t = torch.log1p(torch.floor((p + offset) / floor_scale)) * attn_scale + 1.0
    t = t[:, None, :, None] if t.dim() == 2 else t[:, None]  # (B, 1, N, 1) or (N, 1)
    return (q * t).to(q.dtype)


def _chunk_ids(positions: Tensor, b: int, chunk: int, segment_ids: Tensor | None,
               past: int | None) -> Tensor | tuple[Tensor, Tensor]:
    """``segment_ids`` for chunked attention. Without a cache (``past`` None): one id per
    run of tokens in one chunk (and one document), ``(B, N)``, ascending. With a
    :class:`KVCache` of ``past`` keys: ``(q_ids (B, N), kv_ids (B, past + N))``, each
    key's position counted back from the first query's."""
    pos = positions.expand(b, -1) if positions.dim() == 1 else positions  # (B, N)
    ids = torch.div(pos, chunk, rounding_mode="floor")
    if past is not None:  # key j's position: its slot minus the row's padding
        slots = torch.arange(past + pos.shape[1], device=pos.device)  # (L + N,)
        return ids, torch.div(slots - _padding(slots[past:], pos), chunk,
                              rounding_mode="floor")  # (B, N), (B, L + N)
    new = ids[:, 1:] != ids[:, :-1]  # (B, N - 1): a chunk (or a document) starts
    if segment_ids is not None:
        new = new | (segment_ids[:, 1:] != segment_ids[:, :-1])
    return torch.cat((torch.zeros_like(ids[:, :1]), new.long().cumsum(1)), 1)


def _padding(slots: Tensor, positions: Tensor) -> Tensor:
    """Each row's left padding ``(B, 1)``: its queries' largest ``slot - position`` (a real
    token's; generate's pads sit at position 0, before their slot)."""
    return (slots - positions).amax(-1, keepdim=True)


def _write_static(cache: StaticKVCache, k: Tensor, v: Tensor, window, chunk: int | None = None,
                  positions: Tensor | None = None) -> tuple:
    """Write this call's keys and values ``(B, Hkv, N, D)`` at positions ``cache.length``
    on (into copies), and the mask ``(1, 1, N, capacity)`` of the slots each query sees:
    written, at or before its own position, and inside the window; with ``chunk``,
    ``(B, 1, N, capacity)``, and only the slots of the query's chunk, counted in
    ``positions`` ``(N,)`` or ``(B, N)`` (each row's real tokens under left padding).

    Position ``p`` goes to slot ``p % capacity``: a sliding-window (or chunked) layer
    whose capacity holds its window (``chunk - 1``) and this call's tokens wraps around (a
    ring buffer, O(window) memory however long the generation); any other layer must
    not wrap."""
    n, cap = k.shape[2], cache.capacity
    left = window if isinstance(window, int) else (None if window is None else window[0])
    if chunk is not None:  # a query's chunk lies within the chunk - 1 keys before it
        left = chunk - 1 if left is None else min(left, chunk - 1)
    if plain(cache.length) and int(cache.length) + n > cap and (left is None
                                                               or cap < left + n):
        raise ValueError(
            f"StaticKVCache: {int(cache.length)} tokens cached and {n} more exceed its "
            f"capacity {cap}" + ("" if left is None else
                                 f" (a window of {left} keys wraps around from capacity "
                                 f"{left + n} for {n} tokens a call)"))
    at = cache.length + torch.arange(n, device=k.device)  # (N,) positions written
    slots = at % cap
    keys = cache.keys[0].index_copy(2, slots, k.to(cache.keys[0].dtype))  # (B, Hkv, cap, D)
    values = cache.values[0].index_copy(2, slots, v.to(cache.values[0].dtype))
    end = cache.length + n
    slot = torch.arange(cap, device=k.device)  # (cap,)
    held = end - 1 - (end - 1 - slot) % cap  # the position in each slot; < 0: never written
    mask = (held[None, :] >= 0) & (held[None, :] <= at[:, None])  # (N, cap): causal
    if left is not None:
        mask = mask & (held[None, :] >= at[:, None] - left)
    mask = mask[None, None]  # (1, 1, N, cap)
    if chunk is not None:
        pos = at if positions is None else positions  # (N,) or (B, N)
        pos = pos.expand(k.shape[0], -1) if pos.dim() == 1 else pos  # (B, N)
        q_ids = torch.div(pos, chunk, rounding_mode="floor")  # (B, N)
        kv_ids = torch.div(held[None, :] - _padding(at, pos), chunk,
                           rounding_mode="floor")  # (B, cap)
        mask = mask & (q_ids[:, None, :, None] == kv_ids[:, None, None, :])  # (B, 1, N, cap)
    new = StaticKVCache((keys,), (values,), end)
    return keys, values, new, mask


def token_positions(n: int, device: torch.device, start: int = 0,
                    segment_ids: Tensor | None = None) -> Tensor:
    """``start + arange(n)`` ``(N,)``; with ``segment_ids`` ``(B, N)``, restarting at 0 at
    each document's first token ``(B, N)``."""
    positions = start + torch.arange(n, device=device)  # (N,); start may be a tensor
    if segment_ids is not None:  # minus the index of the document's first token
        from torchfn.kernels._reference import segment_ranges

        positions = positions - segment_ranges(segment_ids, segment_ids)[0]  # (B, N)
    return positions
