"""A small pre-LayerNorm Transformer encoder whose attention is ``torchfn.kernels.attention``."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from itertools import accumulate

import torch
from torch import Tensor, nn

from torchfn.models._attention import AttendFn, MultiHeadAttention, token_positions
from torchfn.models._delta_net import GatedDeltaNet
from torchfn.models._kda import KimiDeltaAttention
from torchfn.models._kv_cache import KVCache, StaticKVCache, check_cache, join_caches
from torchfn.models._lightning import LightningAttention
from torchfn.models._mamba import Mamba
from torchfn.models._mamba2 import Mamba2
from torchfn.models._mla import LatentAttention
from torchfn.models._mlp import XIELU, SquaredReLU, SwiGLU, _check_dims
from torchfn.models._mlstm import MLSTM
from torchfn.models._moa import MixtureOfAttention
from torchfn.models._moe import MoE
from torchfn.models._mtp import MultiTokenPrediction
from torchfn.models._norm import make_norm
from torchfn.models._remat_block import call_remat, remat_policy
from torchfn.models._rg_lru import RGLRU
from torchfn.models._rotary import RotaryTable
from torchfn.models._short_conv import ShortConv

__all__ = ["TransformerEncoder", "TransformerBlock", "MultiHeadAttention"]

_ATTN_OPTIONS = {"chunk", "temperature", "qk_norm", "softcap", "scale", "qkv_clip",
                 "kv_heads", "sinks", "rotary_dim", "v_dim", "value_scale"}  # per block
_MIXER_SCALES = ("attn_in", "attn_out", "linear_in", "linear_out")  # parallel_linear's
_LINEAR = {"gated_deltanet": GatedDeltaNet, "mamba2": Mamba2, "mamba": Mamba,
           "kda": KimiDeltaAttention, "short_conv": ShortConv,
           "lightning": LightningAttention, "rg_lru": RGLRU,
           "mlstm": MLSTM}  # linear_attention's kinds


def _pair(value: object) -> bool:
    """Whether ``value`` is two numbers (a normed residual's ``(alpha, beta)``)."""
    return isinstance(value, (tuple, list)) and len(value) == 2 and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)


def _block_linear(linear_attention: dict | None, linear: bool | dict) -> dict | None:
    """A block's ``linear_attention`` keywords: none (``linear`` False), the encoder's, or
    those with ``linear``'s (a dict) overriding them."""
    if linear is False or linear_attention is None:
        return None
    return dict(linear_attention) | (linear if isinstance(linear, dict) else {})


def _by_kind(name: str, value: bool | dict, default: bool) -> dict[str, bool]:
    """A bool, or a dict of bools by the blocks' mixer (``"attention"``, ``"linear"``), as
    one bool for each kind."""
    if isinstance(value, bool):
        return {"attention": value, "linear": value}
    if not isinstance(value, dict) or not set(value) <= {"attention", "linear"} or not all(
            isinstance(v, bool) for v in value.values()):
        raise ValueError(f"{name} must be a bool or a dict of bools for 'attention' and "
                         f"'linear' blocks, got {value!r}")
    return {"attention": default, "linear": default} | value


def _mixer_scales(parallel_linear: bool | dict) -> dict[str, float] | None:
    """``parallel_linear`` as the four scales of a parallel block (None: not parallel)."""
    if parallel_linear is False or parallel_linear is None:
        return None
    scales = dict.fromkeys(_MIXER_SCALES, 1.0)
    if parallel_linear is True:
        return scales
    if not isinstance(parallel_linear, dict) or not set(parallel_linear) <= set(scales) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool)
            for v in parallel_linear.values()):
        raise ValueError(f"parallel_linear must be a bool or a dict of numbers for "
                         f"{list(_MIXER_SCALES)}, got {parallel_linear!r}")
    return scales | {k: float(v) for k, v in parallel_linear.items()}


def _latent(dim: int, heads: int, options: dict, *, rotary: bool, kv_heads, head_dim,
            qk_norm, rotary_dim, qkv_bias, sinks, out_bias, rotary_interleaved,
            **kwargs) -> LatentAttention:
    """A block's :class:`LatentAttention` from ``latent_attention`` (its ``kv_rank``,
    ``rope_dim``, ``nope_dim``, ``v_dim``, ``q_rank``, ``latent_eps``, ``absorb``); the options of
    :class:`MultiHeadAttention`'s heads that it has no use for must be unset."""
    if not isinstance(options, dict) or "kv_rank" not in options:
        raise ValueError(f"latent_attention must be a dict with kv_rank (and rope_dim, "
                         f"nope_dim, v_dim, q_rank, latent_eps), got {options!r}")
    unset = {"kv_heads": kv_heads, "head_dim": head_dim, "qk_norm": qk_norm or None,
             "rotary_dim": rotary_dim, "qkv_bias": qkv_bias or None,
             "attn_sinks": sinks or None, "out_bias": out_bias or None,
             "rotary_interleaved": rotary_interleaved or None}
    clash = {k: v for k, v in unset.items() if v is not None}
    if clash:
        raise ValueError(f"latent_attention sets the heads' shapes itself; got {clash} too")
    return LatentAttention(dim, heads, rotary=rotary, **kwargs, **options)


class TransformerBlock(nn.Module):
    """``x + Drop(Attn(LN(x)))`` then ``x + Drop(MLP(LN(x)))`` (pre-norm; LayerNorm and a
    GELU MLP, or with ``norm="rms"``, ``mlp="swiglu"``, ``bias=False`` Llama's RMSNorm,
    :class:`SwiGLU` and bias-free projections). ``post_norms=True`` also normalises each
    sublayer's output before the residual add (Gemma 2 and 3): ``x + Drop(LN(Attn(LN(x))))``;
    with ``pre_norms=False`` as well, only the output is normalised (OLMo 2).
    ``parallel=True``: ``x + Attn(LN1(x)) + MLP(LN2(x))``, both sublayers reading the
    block's input (GPT-NeoX / Pythia); ``parallel="shared"``: one norm for both,
    ``x + Attn(LN(x)) + MLP(LN(x))`` (GPT-J, Phi-2).

    ``parallel_linear``: attention and the ``linear_attention`` layer (``linear``) side by
    side on the same normalised input, ``x + a_o Attn(a_i LN(x)) + l_o Lin(l_i LN(x))``
    (Falcon-H1), the four scales from the dict (``attn_in``, ``attn_out``, ``linear_in``,
    ``linear_out``; default 1); the block then has two cache entries, attention's first.

    ``normed_residual=((a1, b1), (a2, b2))``: each sublayer adds to its *normalised*
    input, ``h = a1 LN1(x) + b1 Attn(LN1(x))`` then ``a2 LN2(h) + b2 MLP(LN2(h))``
    (MiniMax-01's block).

    ``(B, N, dim) -> (B, N, dim)``; arguments as in :class:`TransformerEncoder`.
    ``mixer=False``: no token mixer, the MLP alone (``x + MLP(LN(x))``); ``mlp="none"``:
    the mixer alone. The token mixer is attention, :class:`LatentAttention`
    (``latent_attention``), or :class:`GatedDeltaNet` / :class:`KimiDeltaAttention` /
    :class:`Mamba` / :class:`Mamba2` / :class:`ShortConv` / :class:`LightningAttention` /
    :class:`RGLRU` / :class:`MLSTM` (``linear_attention``); ``attn`` is None without one.
    ``key_padding_mask`` ``(B, N)`` bool marks real tokens (True). ``positions`` and
    ``cache`` go to :class:`MultiHeadAttention`; with a cache it returns ``(out, cache)``.
    With ``experts`` the MLP is a :class:`MoE`, and ``return_router_logits=True`` returns
    ``(out, logits)`` with its router's logits ``(B, N, E)`` (with ``attn_experts``, the
    attention's router's first: ``(out, attn_logits[, mlp_logits])``). With a
    :class:`LatentAttention` that has an indexer, ``return_indexer_loss=True`` returns
    ``(out, loss)`` (after the logits, with both): the indexer's training loss
    (:meth:`LightningIndexer.loss`).

    Example::

        >>> from torchfn import random
        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import TransformerBlock
        >>> model = torchfn.Model(TransformerBlock(dim=32, heads=4, mlp_ratio=2))
        >>> params = model.init(torchfn.random.key(0))
        >>> x = random.normal(random.key(2), (2, 16, 32))  # (B, N, dim)
        >>> mask = torch.ones(2, 16, dtype=torch.bool)                   # (B, N)
        >>> model.apply(params, x, mask).shape                           # (B, N, dim)
        torch.Size([2, 16, 32])
    """

    def __init__(self, dim: int, heads: int, *, mlp_ratio: int = 4,
                 mlp_hidden: int | None = None, norm_eps: float | None = None,
                 dropout: float = 0.0,
                 causal: bool = False,
                 window: int | tuple[int | None, int | None] | None = None,
                 softcap: float | None = None, attn_dropout: float = 0.0,
                 kv_heads: int | None = None, rotary: bool = False,
                 rotary_base: float = 10000.0, rotary_scaling: dict | None = None,
                 rotary_dim: int | None = None,
                 norm: str = "layer", mlp: str = "gelu",
                 bias: bool = True, qkv_bias: bool | None = None,
                 head_dim: int | None = None, qk_norm: bool | str = False,
                 attn_scale: float | None = None, post_norms: bool = False,
                 pre_norms: bool = True, qk_norm_scope: str = "head",
                 experts: int | None = None, top_k: int = 2,
                 moe_options: dict | None = None, expert_hidden: int | None = None,
                 latent_attention: dict | None = None, attn_sinks: bool = False,
                 out_bias: bool | None = None, parallel: bool | str = False,
                 rotary_interleaved: bool = False, residual_scale: float | None = None,
                 attn_options: dict | None = None, linear_attention: dict | None = None,
                 attn_gate: bool | str = False, mixer: bool = True,
                 attn_experts: dict | None = None,
                 parallel_linear: bool | dict = False,
                 mlp_scales: tuple[float, float] | None = None,
                 normed_residual: tuple | None = None,
                 attend: AttendFn | None = None) -> None:
        super().__init__()
        if normed_residual is not None and (
                not isinstance(normed_residual, (tuple, list)) or len(normed_residual) != 2
                or not all(_pair(p) for p in normed_residual)):
            raise ValueError(f"normed_residual must be ((alpha, beta) of the mixer, (alpha, "
                             f"beta) of the MLP), numbers; got {normed_residual!r}")
        if normed_residual is not None and (parallel or post_norms or not pre_norms
                                            or not mixer or mlp == "none"):
            raise ValueError("TransformerBlock: normed_residual takes the sequential pre-norm "
                             "block with a mixer and an MLP")
        self.normed_residual = None if normed_residual is None else tuple(
            (float(a), float(b)) for a, b in normed_residual)
        self.mixer_scales = _mixer_scales(parallel_linear)
        if self.mixer_scales is not None and (linear_attention is None or not mixer
                                              or latent_attention is not None):
            raise ValueError("TransformerBlock: parallel_linear needs linear_attention (and a "
                             "mixer, not latent_attention)")
        if mlp_scales is not None and (experts is not None or mlp not in ("swiglu", "geglu")):
            raise ValueError(f"mlp_scales are a dense SwiGLU / GeGLU's (gate, out); got "
                             f"mlp={mlp!r}, experts={experts!r}")
        if residual_scale is not None and (isinstance(residual_scale, bool) or not isinstance(
                residual_scale, (int, float))):
            raise ValueError(f"residual_scale must be a number or None, got {residual_scale!r}")
        self.residual_scale = residual_scale
        if parallel not in (False, True, "shared"):
            raise ValueError(f"parallel must be False, True or 'shared', got {parallel!r}")
        if parallel and (post_norms or not pre_norms):
            raise ValueError("TransformerBlock: parallel=True takes the pre-norm block only "
                             "(post_norms=False, pre_norms=True)")
        self.parallel, self.shared_norm = bool(parallel), parallel == "shared"
        if mlp not in ("gelu", "gelu_tanh", "relu2", "xielu", "swiglu", "geglu", "none"):
            raise ValueError(f"mlp must be 'gelu', 'gelu_tanh', 'relu2', 'xielu', 'swiglu', "
                             f"'geglu' or 'none', got {mlp!r}")
        if mlp == "none" and (parallel or experts is not None or not mixer):
            raise ValueError("TransformerBlock: mlp='none' (a mixer alone) takes neither "
                             "parallel, experts nor mixer=False")
        if not mixer and parallel:
            raise ValueError("TransformerBlock: mixer=False (an MLP alone) is not parallel")
        if not (pre_norms or post_norms):
            raise ValueError("TransformerBlock: pre_norms=False needs post_norms=True (a "
                             "block without norms)")
        self.ln1 = make_norm(norm, dim, bias, norm_eps) if pre_norms and mixer else nn.Identity()
        if attn_options is not None and (not isinstance(attn_options, dict) or not set(
                attn_options) <= _ATTN_OPTIONS):
            raise ValueError(f"attn_options must be a dict of {sorted(_ATTN_OPTIONS)}, got "
                             f"{attn_options!r}")
        if not mixer:  # an MLP alone (Nemotron-H's MLP and mixture blocks)
            self.attn = None
        elif linear_attention is not None:
            options = dict(linear_attention) if isinstance(linear_attention, dict) else {}
            kind = options.pop("kind", "gated_deltanet")
            if kind not in _LINEAR or ("heads" not in options and kind not in (
                    "mamba", "short_conv")):
                raise ValueError(f"linear_attention must be a dict of GatedDeltaNet's keywords "
                                 f"(heads, key_heads, key_dim, value_dim, conv_kernel) or, with "
                                 f"kind='mamba2', 'mamba', 'kda', 'short_conv', 'lightning', "
                                 f"'rg_lru' or 'mlstm', Mamba2's, Mamba's, "
                                 f"KimiDeltaAttention's, ShortConv's, LightningAttention's, "
                                 f"RGLRU's or MLSTM's; got "
                                 f"{linear_attention!r}")
            if latent_attention is not None:
                raise ValueError("TransformerBlock: give linear_attention or latent_attention, "
                                 "not both")
            if norm_eps is not None and kind not in ("mamba", "short_conv", "rg_lru"):  # no norm
                options.setdefault("norm_eps", norm_eps)
            linear = _LINEAR[kind](dim, **options)
            if self.mixer_scales is None:
                self.attn = linear
        if not mixer or linear_attention is not None and self.mixer_scales is None:
            pass  # the mixer (or none) is set
        elif latent_attention is not None:
            if attn_options:
                raise ValueError(f"attn_options are MultiHeadAttention's, not latent "
                                 f"attention's; got {attn_options!r}")
            self.attn: nn.Module = _latent(
                dim, heads, latent_attention, causal=causal, window=window, softcap=softcap,
                attn_dropout=attn_dropout, rotary=rotary, rotary_base=rotary_base,
                rotary_scaling=rotary_scaling, scale=attn_scale, attend=attend,
                kv_heads=kv_heads, head_dim=head_dim, qk_norm=qk_norm, rotary_dim=rotary_dim,
                qkv_bias=qkv_bias, sinks=attn_sinks, out_bias=out_bias,
                rotary_interleaved=rotary_interleaved)
        else:
            options = dict(
                causal=causal, window=window, softcap=softcap,
                attn_dropout=attn_dropout, kv_heads=kv_heads, rotary=rotary,
                rotary_base=rotary_base, rotary_scaling=rotary_scaling, rotary_dim=rotary_dim,
                bias=bias, qkv_bias=qkv_bias, head_dim=head_dim, qk_norm=qk_norm,
                qk_norm_scope=qk_norm_scope, norm_eps=norm_eps, scale=attn_scale,
                sinks=attn_sinks, out_bias=out_bias, rotary_interleaved=rotary_interleaved,
                output_gate=attn_gate, attend=attend) | (attn_options or {})
            if options["qk_norm"] is True:  # of the blocks' kind
                options["qk_norm"] = norm if norm != "layer" else "rms"
            if attn_experts is None:
                self.attn = MultiHeadAttention(dim, heads, **options)
            else:  # JetMoE: query and output projections as experts; heads per expert
                if not isinstance(attn_experts, dict) or set(attn_experts) - {
                        "experts", "top_k", "out_bias"} or "experts" not in attn_experts:
                    raise ValueError(f"attn_experts must be a dict of experts (and top_k, "
                                     f"out_bias), got {attn_experts!r}")
                if options.pop("kv_heads") not in (None, heads):
                    raise ValueError("attn_experts: the experts share heads keys and values "
                                     f"(kv_heads None or {heads}), got kv_heads={kv_heads}")
                options.pop("qkv_bias")
                options.pop("out_bias")
                self.attn = MixtureOfAttention(dim, heads, **attn_experts, **options)
        # a parallel block's linear mixer, registered after its attention (cache order)
        self.linear = linear if self.mixer_scales is not None else None
        self.ln2 = nn.Identity() if self.shared_norm or not pre_norms or mlp == "none" else \
            make_norm(norm, dim, bias, norm_eps)  # "shared": the MLP reads ln1's output
        hidden = mlp_ratio * dim if mlp_hidden is None else mlp_hidden
        _check_dims(mlp_hidden=hidden)
        self.moe = experts is not None
        if self.moe:
            options = dict(moe_options or {})
            self.mlp: nn.Module = MoE(dim, expert_hidden or hidden, experts, top_k,
                                      mlp=options.pop("mlp", mlp), **options)
        elif moe_options:
            raise ValueError(f"moe_options need experts, got moe_options={moe_options}")
        elif mlp == "none":  # the mixer alone (Mamba's blocks)
            self.mlp = None
        elif mlp in ("swiglu", "geglu"):
            self.mlp = SwiGLU(dim, hidden, bias=bias, scales=mlp_scales,
                              activation="silu" if mlp == "swiglu" else "gelu_tanh")
        else:  # GELU, exact or tanh-approximated (GPT-2's and Phi's "gelu_new"), ReLU^2, xIELU
            act = SquaredReLU() if mlp == "relu2" else XIELU() if mlp == "xielu" else nn.GELU(
                "tanh" if mlp == "gelu_tanh" else "none")
            self.mlp = nn.Sequential(nn.Linear(dim, hidden, bias=bias), act,
                                     nn.Linear(hidden, dim, bias=bias))
        self.post_norms = post_norms
        if post_norms:  # Gemma 2's sandwich: a norm on each sublayer's output too
            self.post_ln1 = make_norm(norm, dim, bias, norm_eps) if mixer else nn.Identity()
            if mlp != "none":
                self.post_ln2 = make_norm(norm, dim, bias, norm_eps)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None,
                segment_ids: Tensor | None = None, positions: Tensor | None = None,
                cache: KVCache | None = None, return_router_logits: bool = False,
                return_indexer_loss: bool = False) -> Tensor | tuple:
        a, h, index_loss, routers = 0, x, None, []  # without a mixer: the MLP alone
        if return_router_logits and not (self.moe or isinstance(self.attn, MixtureOfAttention)):
            raise ValueError("TransformerBlock: return_router_logits needs experts")
        if return_indexer_loss and getattr(self.attn, "indexer", None) is None:
            raise ValueError("TransformerBlock: return_indexer_loss needs a LatentAttention "
                             "with an indexer")
        if self.attn is not None:
            n1 = self.ln1(x)
            if self.linear is not None:  # Falcon-H1: attention and the linear mixer, side by side
                a, cache = self._parallel(n1, key_padding_mask, segment_ids, positions, cache)
            elif return_indexer_loss:  # DeepSeek Sparse Attention's indexer loss (no cache)
                a, index_loss = self.attn(n1, key_padding_mask, segment_ids, positions, cache,
                                          return_indexer_loss=True)
            else:
                a = self.attn(n1, key_padding_mask, segment_ids, positions, cache)
                if cache is not None:
                    a, cache = a
            if return_router_logits and isinstance(self.attn, MixtureOfAttention):
                routers.append(self.attn.route(n1)[0])  # (B, N, E): JetMoE balances these too
            a = self.drop(self.post_ln1(a) if self.post_norms else a)
            if self.residual_scale is not None:  # Granite: each sublayer's output scaled
                a = a * self.residual_scale
            if self.normed_residual is not None:  # MiniMax: the residual is LN1(x)
                alpha, beta = self.normed_residual[0]
                h = alpha * n1 + beta * a
            else:  # parallel (GPT-J, GPT-NeoX): the MLP reads x too
                h = x if self.parallel else x + a
            if self.shared_norm:  # Phi, GPT-J: one norm for both sublayers
                h = n1
        if self.mlp is None:  # a mixer alone
            aux = (*routers, *(() if index_loss is None else (index_loss,)))
            if aux:
                return (h, *aux)
            return h if cache is None else (h, cache)
        n2 = self.ln2(h)
        if return_router_logits and self.moe:
            m, logits = self.mlp(n2, True)  # logits (B, N, E)
            routers.append(logits)
        else:
            m = self.mlp(n2)
        m = self.drop(self.post_ln2(m) if self.post_norms else m)
        if self.residual_scale is not None:
            m = m * self.residual_scale
        if self.normed_residual is not None:  # the residual is LN2(h)
            alpha, beta = self.normed_residual[1]
            x = alpha * n2 + beta * m
        else:
            x = x + a + m if self.parallel else h + m  # (B, N, dim)
        aux = (*routers, *(() if index_loss is None else (index_loss,)))
        if aux:
            return (x, *aux)
        return x if cache is None else (x, cache)

    @property
    def cache_entries(self) -> int:
        """How many cache entries the block holds: one a token mixer."""
        return 0 if self.attn is None else 1 if self.linear is None else 2

    def _parallel(self, n1: Tensor, key_padding_mask: Tensor | None,
                  segment_ids: Tensor | None, positions: Tensor | None,
                  cache: KVCache | StaticKVCache | None) -> tuple[Tensor, object]:
        """``a_o Attn(a_i n1) + l_o Lin(l_i n1)``, and the two layers' cache entries."""
        s = self.mixer_scales

        def scaled(t: Tensor, scale: float) -> Tensor:
            return t if scale == 1.0 else t * scale

        outs, entries = [], []
        for j, (layer, name) in enumerate(((self.attn, "attn"), (self.linear, "linear"))):
            out = layer(scaled(n1, s[f"{name}_in"]), key_padding_mask, segment_ids, positions,
                        None if cache is None else cache.layers(j, j + 1))
            if cache is not None:
                out, entry = out
                entries.append(entry)
            outs.append(scaled(out, s[f"{name}_out"]))
        return outs[0] + outs[1], None if cache is None else join_caches(*entries)


class TransformerEncoder(nn.Module):
    """Token (or feature) embedding + positions, ``depth`` pre-LN blocks, final
    LayerNorm and an optional linear head.

    Inputs: integer tokens ``(B, N)`` when ``vocab_size`` is given, else features
    ``(B, N, in_dim)`` (``in_dim`` defaults to ``dim``). One example (``(N,)`` tokens or
    ``(N, in_dim)`` features) also works, for per-example ``vmap``. Output
    ``(B, N, out_dim)`` (``out_dim=None``: ``dim``, no head). ``key_padding_mask``
    ``(B, N)`` bool marks real tokens (True) as in ``torchfn.kernels.attention``.
    ``segment_ids`` ``(B, N)`` packs several documents into one sequence: tokens attend
    only within their document, and positions restart at 0 at each document's first
    token, so a packed batch gives each document the output it would get alone.
    ``positions`` ``(N,)`` or ``(B, N)`` overrides the tokens' positions (e.g. counting
    only real tokens of a left-padded row).

    Decoding: with ``cache=KVCache()`` (``causal=True`` only) the forward returns
    ``(out, cache)``; passing that cache with the next tokens continues the sequence
    without recomputing the earlier ones, positions counting on from ``cache.length``.
    ``key_padding_mask`` then covers cached and new tokens, ``(B, L + N)``. See
    :func:`generate`. ``return_hidden=True`` also returns the final states ``(B, N, dim)``
    (after the final norm, before the head), with or without a cache: ``(out, ...,
    hidden)`` or ``(out, ..., hidden, cache)``.

    Args:
        dim: model width; heads: attention heads (``dim % heads == 0``); depth: blocks.
        vocab_size / in_dim: token or feature input (give at most one).
        max_len: the longest sequence (size of the learned position table).
        position_embedding: ``"learned"`` (a table added to the input embedding),
            ``"rotary"`` (:func:`rotary_embedding` on queries and keys in every block, base
            ``rotary_base``, stretched by ``rotary_scaling``, a Hugging Face
            ``rope_scaling`` dict: :func:`rotary_frequencies`; no table, no length limit)
            or ``"none"``.
        kv_heads: key/value heads per block (grouped-query attention); default ``heads``.
        experts, top_k: a mixture of ``experts`` feed-forward networks in every block
            (:class:`MoE`, ``mlp``-type experts of ``mlp_hidden`` units without biases),
            each token sent to ``top_k`` of them (Mixtral: 8 and 2). The forward's
            ``return_router_logits=True`` then returns ``(out, logits)``, the routers'
            logits ``(B, N, E)`` per block, for :func:`torchfn.losses.moe_load_balance`.
        moe_options: :class:`MoE`'s other keywords: ``normalize``, ``shared_hidden``,
            ``shared_gate``, ``capacity_factor``, DeepSeek-V3's routing, gpt-oss's
            experts (``mlp="swiglu_clamp"`` here sets the experts' MLP alone).
        expert_hidden: the experts' width (default ``mlp_hidden``).
        layer_attention: per block, a dict of :class:`MultiHeadAttention` keywords that
            override the encoder's in that block (None: none): ``chunk``, ``temperature``,
            ``qk_norm``, ``softcap``, ``scale``, ``qkv_clip``, ``kv_heads``, ``sinks``,
            ``rotary_dim``, ``v_dim``, ``value_scale``. Llama 4 chunks three layers of four and
            tunes the temperature of the fourth: ``[{"chunk": 8192, "qk_norm":
            "rms_plain"}] * 3 + [{"temperature": (8192, 0.1)}]``, repeated.
        layer_parts: per block, ``"both"`` (default: a token mixer, then an MLP),
            ``"mixer"`` (the mixer alone) or ``"mlp"`` (the MLP, or the mixture, alone),
            as Nemotron-H's blocks; the caches hold an entry per block with a mixer.
        linear_attention, layer_linear: :class:`GatedDeltaNet` (linear attention with a
            fixed-size state) as the token mixer, a dict of its keywords (``heads``,
            ``key_heads``, ``key_dim``, ``value_dim``, ``conv_kernel``), or with
            ``"kind"`` ``"mamba2"``, ``"mamba"``, ``"kda"``, ``"short_conv"``,
            ``"lightning"``, ``"rg_lru"`` or ``"mlstm"`` a :class:`Mamba2`, :class:`Mamba`,
            :class:`KimiDeltaAttention`, :class:`ShortConv` (LFM2's),
            :class:`LightningAttention`, :class:`RGLRU` (Griffin's) or :class:`MLSTM`
            (xLSTM's) and its keywords, in the blocks
            ``layer_linear`` marks (default every block; a dict there overrides
            ``linear_attention``'s keywords in that block, as MiniMax's decay rates by
            depth); the others keep attention, or
            ``latent_attention`` (Qwen3-Next and Qwen3.5: three of four linear; Kimi
            Linear: three of four KDA, latent attention between). The caches then hold
            those blocks' convolution windows and states.
        attn_gate: gate the attention's output by ``sigmoid(x W_gate)`` before its
            projection (Qwen3-Next, Qwen3.5; :class:`MultiHeadAttention`'s
            ``output_gate``): ``True`` a gate per head and feature, ``"head"`` one per head.
        attn_experts: ``dict(experts=, top_k=, out_bias=)``: every attention block a
            :class:`MixtureOfAttention` (JetMoE), ``heads`` heads per expert sharing as
            many key/value heads. ``return_router_logits=True`` gives its router's
            logits too, before the block's MLP's (JetMoE balances both).
        normed_residual: MiniMax-01's blocks, each sublayer added to its normalised
            input (:class:`TransformerBlock`'s): a dict of ``(alpha, beta)`` for the
            ``"attention"`` blocks' mixer, the ``"linear"`` ones' and the ``"mlp"``
            (default ``(1, 1)`` each).
        parallel_linear: the ``layer_linear`` blocks run attention and the linear mixer
            side by side on the same normalised input and add their outputs (Falcon-H1:
            every block); ``True``, or a dict of scales ``attn_in``, ``attn_out``,
            ``linear_in``, ``linear_out`` (:class:`TransformerBlock`). Such a block has two
            cache entries.
        mlp_scales: ``(gate, out)`` multipliers of the dense SwiGLU MLPs
            (:class:`SwiGLU`'s ``scales``; Falcon-H1's ``mlp_multipliers``).
        layer_experts: which blocks have the mixture (the others a dense MLP of
            ``mlp_hidden``), e.g. Qwen-MoE's ``mlp_only_layers`` or DeepSeek's dense first
            layers; the router logits come from those blocks only.
        norm, mlp, bias: ``"layer"``, ``"rms"`` (RMSNorm) or ``"rms+1"`` (Gemma's,
            scaling by ``1 + weight``) for the blocks' and the final norm; ``"gelu"``,
            ``"swiglu"`` (:class:`SwiGLU`, ``mlp_ratio * dim`` hidden units),
            ``"geglu"`` (its tanh-GELU gate, as Gemma), ``"relu2"`` (squared ReLU, not
            gated: Nemotron-H), ``"xielu"`` (:class:`XIELU`, learned, not gated:
            Apertus) for the MLPs, or ``"none"``: no MLP, each block its token
            mixer alone (Mamba's);
            ``bias=False`` drops the projections', the MLPs', the LayerNorms' and the
            head's biases. A Llama-style model is
            ``position_embedding="rotary", norm="rms", mlp="swiglu", bias=False``.
        qkv_bias: the attention's q/k/v projection bias alone (default ``bias``; Qwen2
            has ``bias=False, qkv_bias=True``).
        out_dim: output head width, or ``None``.
        tie_embeddings: the head is the token embedding's transpose (GPT-2, Gemma): no
            ``head.weight`` parameter. Needs ``vocab_size`` and ``out_dim == vocab_size``
            (``out_dim=None``, as for :func:`torchfn.losses.linear_cross_entropy` with
            ``params["embed.weight"]``, leaves the hidden states).
        mtp: DeepSeek-V3's multi-token prediction depth ``D``: ``D``
            :class:`MultiTokenPrediction` modules (params ``mtp.{k}.*``, each block a
            fresh copy of the last block's design) sharing the embedding and the head.
            The forward's ``return_mtp=True`` then also returns their logits, a tuple of
            ``(B, N - k, V)`` for ``k = 1 .. D``, whose position ``t`` predicts token ``t +
            k + 1`` (for :func:`torchfn.losses.multi_token_prediction`). Needs token input,
            an output head and no learned positions. ``mtp_depth=k, mtp_hidden=h`` runs
            depth ``k`` alone, as a draft model (``x``: the tokens ``t + k`` (B, n);
            ``h``: depth ``k - 1``'s states at ``t`` (B, n, dim), from ``return_hidden``
            for ``k = 1``); it returns ``(logits, h_k)``, and ``(logits, h_k, cache)``
            with a ``KVCache`` of that depth's block: see
            :func:`torchfn.models.mtp_speculative_generate`.
        mlp_ratio, dropout, causal: block settings; ``causal`` masks future positions.
        mlp_hidden: the MLPs' width, instead of ``mlp_ratio * dim`` (Llama 3 8B: 14336
            for dim 4096).
        norm_eps: the norms' epsilon (Llama's ``rms_norm_eps``); None: torch's default.
        window: sliding-window attention, as ``torchfn.kernels.attention``'s (e.g.
            ``causal=True, window=(255, None)``: each token sees itself and 255 before).
        layer_windows: a window per block instead (None: full attention), e.g. Gemma 2's
            alternation ``[(4095, None), None] * (depth // 2)``; not with ``window``.
        head_dim, qk_norm: the heads' width (default ``dim // heads``) and an RMSNorm on
            each head's queries and keys, as :class:`MultiHeadAttention`'s (``True``: of
            the blocks' ``norm`` kind; or a kind, e.g. ``"rms_plain"``, without a weight).
        rotary_dim: rotate only each head's first ``rotary_dim`` features (partial
            rotary, as GPT-NeoX and Phi-4-mini); default all.
        layer_rotary: a ``(rotary_base, rotary_scaling)`` per block (None: the encoder's;
            False: no position embedding in that block, NoPE, as every fourth of
            SmolLM3's), e.g. Gemma 3's base 10000 on its windowed layers and 1e6, scaled,
            on the others.
        attn_scale: the attention scores' scale instead of ``1 / sqrt(head_dim)``.
        post_norms: a norm on each sublayer's output as well (Gemma 2 and 3).
        pre_norms: ``False`` drops the norms on the sublayers' inputs; with
            ``post_norms=True`` that is OLMo 2's block. Either may be a dict by the
            blocks' mixer, ``{"attention": ..., "linear": ...}`` (default: the plain
            bool's default): OLMo Hybrid normalises its attention blocks' outputs and its
            linear-attention blocks' inputs.
        qk_norm_scope: ``"head"`` (one norm per head's features), ``"all"`` (over all
            heads' at once, OLMo 2) or ``"rotated"`` (per head, after the rotary
            embedding, Hunyuan).
        embed_scale: multiplies the token embeddings (Gemma: ``sqrt(dim)``, rounded to
            their dtype).
        logit_softcap: the head's outputs become ``cap * tanh(out / cap)`` (Gemma 2: 30).
        softcap: attention logit soft-capping (Gemma 2 uses 50), as the kernel's.
        attn_dropout: attention dropout (on the probabilities, in the fused kernel), keyed
            by ``Model.apply``'s ``key`` in train mode.
        latent_attention: DeepSeek's multi-head latent attention in every block instead
            (:class:`LatentAttention`): a dict of its ``kv_rank``, ``rope_dim``,
            ``nope_dim``, ``v_dim``, ``q_rank``, ``latent_eps``; needs
            ``position_embedding="rotary"`` and leaves ``kv_heads``, ``head_dim``,
            ``qk_norm``, ``rotary_dim``, ``qkv_bias``, ``attn_sinks``, ``out_bias`` and
            ``rotary_interleaved`` unset. The cache then holds each token's latent and
            rotary key. With ``indexer`` (DeepSeek Sparse Attention) the forward's
            ``return_indexer_loss=True`` returns ``(out, losses)`` (``(out, logits,
            losses)`` with ``return_router_logits``): each indexed block's
            :meth:`LightningIndexer.loss`, a scalar, which trains the indexers alone (add
            their sum to the model's loss).
        attn_sinks: a learned attention sink per head in every block (gpt-oss).
        out_bias: the attention output projection's bias alone (default ``bias``).
        parallel_residual: each block adds attention and MLP of its input side by side
            (GPT-NeoX / Pythia): ``x + Attn(LN1(x)) + MLP(LN2(x))``; ``"shared"``: with one
            norm, ``x + Attn(LN(x)) + MLP(LN(x))`` (GPT-J, Phi-2).
        head_bias: the head's bias alone (default ``bias``; GPT-NeoX has biases
            everywhere but there).
        rotary_interleaved: rotate feature pairs ``(2i, 2i + 1)`` (GPT-J, Cohere).
        logit_scale: multiplies the head's outputs (Cohere: 0.0625; Granite: one over its
            ``logits_scaling``).
        residual_scale: multiplies each sublayer's output before the residual add
            (Granite's ``residual_multiplier``).
        attend: the attention function (default ``torchfn.kernels.attention``).
        remat: recompute each block's activations in the backward (``torchfn.remat``):
            ``True`` keeps only the blocks' inputs, a policy from
            ``torchfn.checkpoint_policies`` keeps what it names (``dots_saveable``:
            the projections' outputs). Dropout masks are the same as without remat.

    Example::

        >>> from torchfn import random
        >>> import torchfn
        >>> model = torchfn.Model(TransformerEncoder(dim=32, heads=4, depth=2,
        ...                                          vocab_size=100, out_dim=100, causal=True))
        >>> params = model.init(torchfn.random.key(0))
        >>> tokens = random.randint(random.key(3), (2, 16), 0, 100)
        >>> model.apply(params, tokens).shape
        torch.Size([2, 16, 100])
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        depth: int,
        *,
        vocab_size: int | None = None,
        in_dim: int | None = None,
        max_len: int = 256,
        out_dim: int | None = None,
        mlp_ratio: int = 4,
        mlp_hidden: int | None = None,
        norm_eps: float | None = None,
        dropout: float = 0.0,
        causal: bool = False,
        window: int | tuple[int | None, int | None] | None = None,
        softcap: float | None = None,
        attn_dropout: float = 0.0,
        kv_heads: int | None = None,
        position_embedding: str = "learned",
        rotary_base: float = 10000.0,
        rotary_scaling: dict | None = None,
        rotary_dim: int | None = None,
        norm: str = "layer",
        mlp: str = "gelu",
        bias: bool = True,
        qkv_bias: bool | None = None,
        head_dim: int | None = None,
        qk_norm: bool | str = False,
        layer_windows: Sequence[int | tuple[int | None, int | None] | None] | None = None,
        layer_rotary: Sequence[tuple[float, dict | None] | None] | None = None,
        attn_scale: float | None = None,
        post_norms: bool | dict = False,
        pre_norms: bool | dict = True,
        qk_norm_scope: str = "head",
        embed_scale: float | None = None,
        logit_softcap: float | None = None,
        experts: int | None = None,
        top_k: int = 2,
        moe_options: dict | None = None,
        expert_hidden: int | None = None,
        layer_experts: Sequence[bool] | None = None,
        layer_attention: Sequence[dict | None] | None = None,
        latent_attention: dict | None = None,
        linear_attention: dict | None = None,
        layer_linear: Sequence[bool] | None = None,
        layer_parts: Sequence[str] | None = None,
        attn_gate: bool | str = False,
        attn_experts: dict | None = None,
        parallel_linear: bool | dict = False,
        mlp_scales: tuple[float, float] | None = None,
        normed_residual: dict | None = None,
        attn_sinks: bool = False,
        out_bias: bool | None = None,
        parallel_residual: bool | str = False,
        head_bias: bool | None = None,
        rotary_interleaved: bool = False,
        logit_scale: float | None = None,
        residual_scale: float | None = None,
        attend: AttendFn | None = None,
        remat: bool | Callable[..., bool] = False,
        tie_embeddings: bool = False,
        mtp: int = 0,
    ) -> None:
        super().__init__()
        _check_dims(dim=dim, heads=heads, depth=depth, max_len=max_len, mlp_ratio=mlp_ratio)
        self.remat = remat_policy(remat, "TransformerEncoder")
        self._stochastic = dropout > 0 or attn_dropout > 0
        if vocab_size is not None and in_dim is not None:
            raise ValueError(
                f"give vocab_size (token input) or in_dim (feature input), not both: "
                f"got vocab_size={vocab_size}, in_dim={in_dim}"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if position_embedding not in ("learned", "rotary", "none"):
            raise ValueError(f"position_embedding must be 'learned', 'rotary' or 'none', "
                             f"got {position_embedding!r}")
        self.position_embedding, self.causal = position_embedding, causal
        self.experts = experts
        self.tokens = vocab_size is not None
        if vocab_size is not None:
            _check_dims(vocab_size=vocab_size)
            self.embed: nn.Module = nn.Embedding(vocab_size, dim)
        else:
            _check_dims(in_dim=in_dim or dim)
            self.embed = nn.Linear(in_dim or dim, dim)
        self.max_len = max_len
        if position_embedding == "learned":
            self.pos = nn.Embedding(max_len, dim)
        self.drop = nn.Dropout(dropout)
        if layer_windows is None:
            layer_windows = [window] * depth
        elif window is not None or isinstance(layer_windows, (str, tuple)) \
                or len(layer_windows) != depth:
            raise ValueError(f"layer_windows must be a list of depth = {depth} windows (None: "
                             f"full attention), given without window; got layer_windows="
                             f"{layer_windows!r}, window={window!r}")
        if layer_rotary is None:
            layer_rotary = [None] * depth
        elif position_embedding != "rotary" or isinstance(layer_rotary, (str, tuple)) \
                or len(layer_rotary) != depth:
            raise ValueError(f"layer_rotary must be a list of depth = {depth} (base, scaling) "
                             f"pairs or None, with position_embedding='rotary'; got "
                             f"{layer_rotary!r}")
        ropes = [(rotary_base, rotary_scaling) if r is None else False if r is False
                 else tuple(r) for r in layer_rotary]  # False: no rotary in that block
        for name, value in (("embed_scale", embed_scale), ("logit_softcap", logit_softcap),
                            ("logit_scale", logit_scale)):
            if value is not None and (isinstance(value, bool) or not isinstance(
                    value, (int, float)) or not value > 0):
                raise ValueError(f"{name} must be a number > 0 or None, got {value!r}")
        self.embed_scale, self.logit_softcap = embed_scale, logit_softcap
        self.logit_scale = logit_scale
        if moe_options and experts is None:
            raise ValueError(f"moe_options need experts, got moe_options={moe_options}")
        if layer_experts is None:
            layer_experts = [experts is not None] * depth
        elif experts is None or isinstance(layer_experts, (str, tuple)) \
                or len(layer_experts) != depth or not any(layer_experts):
            raise ValueError(f"layer_experts must be a list of depth = {depth} bools, some "
                             f"True, with experts; got layer_experts={layer_experts!r}, "
                             f"experts={experts!r}")
        self._sparse = [bool(x) for x in layer_experts]
        if layer_attention is None:
            layer_attention = [None] * depth
        elif isinstance(layer_attention, (str, tuple, dict)) or len(layer_attention) != depth:
            raise ValueError(f"layer_attention must be a list of depth = {depth} dicts (or "
                             f"None), got {layer_attention!r}")
        if layer_linear is None:
            layer_linear = [linear_attention is not None] * depth
        elif linear_attention is None or isinstance(layer_linear, (str, tuple)) \
                or len(layer_linear) != depth or not all(
                    isinstance(x, (bool, dict)) for x in layer_linear):
            raise ValueError(f"layer_linear must be a list of depth = {depth} bools (or dicts "
                             f"of keywords overriding linear_attention's in that block), with "
                             f"linear_attention; got layer_linear={layer_linear!r}, "
                             f"linear_attention={linear_attention!r}")
        kinds = ["linear" if linear is not False else "attention" for linear in layer_linear]
        pres = [_by_kind("pre_norms", pre_norms, True)[k] for k in kinds]
        posts = [_by_kind("post_norms", post_norms, False)[k] for k in kinds]
        residuals = [None] * depth  # normed_residual's (mixer, MLP) factors per block
        if normed_residual is not None:
            if not isinstance(normed_residual, dict) or not set(normed_residual) <= {
                    "attention", "linear", "mlp"} or not all(
                    _pair(v) for v in normed_residual.values()):
                raise ValueError(f"normed_residual must be a dict of (alpha, beta) pairs for "
                                 f"'attention', 'linear' and 'mlp' (default (1, 1)), got "
                                 f"{normed_residual!r}")
            pairs = {k: (1.0, 1.0) for k in ("attention", "linear", "mlp")} | normed_residual
            residuals = [(pairs["linear" if linear is not False else "attention"], pairs["mlp"])
                         for linear in layer_linear]
        if layer_parts is None:
            layer_parts = ["both"] * depth
        elif isinstance(layer_parts, (str, tuple)) or len(layer_parts) != depth \
                or not set(layer_parts) <= {"both", "mixer", "mlp"}:
            raise ValueError(f"layer_parts must be a list of depth = {depth} of 'both', 'mixer' "
                             f"or 'mlp', got {layer_parts!r}")
        self.blocks = nn.ModuleList(
            TransformerBlock(dim, heads, mlp_ratio=mlp_ratio, mlp_hidden=mlp_hidden,
                             norm_eps=norm_eps, dropout=dropout, causal=causal,
                             window=layer_window, softcap=softcap, attn_dropout=attn_dropout,
                             kv_heads=kv_heads,
                             rotary=position_embedding == "rotary" and rope is not False,
                             rotary_base=rope[0] if rope else rotary_base,
                             rotary_scaling=rope[1] if rope else None,
                             rotary_dim=rotary_dim,
                             norm=norm, mlp="none" if part == "mixer" else mlp, bias=bias,
                             qkv_bias=qkv_bias, mixer=part != "mlp",
                             head_dim=head_dim, qk_norm=qk_norm, attn_scale=attn_scale,
                             post_norms=post, pre_norms=pre,
                             qk_norm_scope=qk_norm_scope,
                             experts=experts if sparse else None, top_k=top_k,
                             moe_options=moe_options if sparse else None,
                             expert_hidden=expert_hidden,
                             latent_attention=None if linear is not False else
                             latent_attention,
                             attn_sinks=attn_sinks, out_bias=out_bias,
                             parallel=parallel_residual,
                             rotary_interleaved=rotary_interleaved,
                             residual_scale=residual_scale, attend=attend,
                             attn_options=None if options is None else dict(options),
                             linear_attention=_block_linear(linear_attention, linear),
                             parallel_linear=parallel_linear if linear is not False else False,
                             mlp_scales=None if sparse or part == "mixer" else mlp_scales,
                             normed_residual=residual, attn_gate=attn_gate,
                             attn_experts=attn_experts)
            for layer_window, rope, sparse, options, linear, part, residual, pre, post in zip(
                layer_windows, ropes, self._sparse, layer_attention, layer_linear, layer_parts,
                residuals, pres, posts)
        )
        # blocks with the same rotary settings (and rotated width) share one cos / sin
        # table per forward
        ropes = [(r, getattr(b.attn, "rotary_dim", None)) for r, b in zip(ropes, self.blocks)]
        self._rope_first = [ropes.index(r) for r in ropes]
        # each block's cache entries (start, stop): one a token mixer, in order
        ends = list(accumulate(b.cache_entries for b in self.blocks))
        self._slots = {i: (end - b.cache_entries, end) for i, (b, end) in enumerate(
            zip(self.blocks, ends)) if b.cache_entries}
        self._entries = ends[-1]
        self.ln = make_norm(norm, dim, bias, norm_eps)
        if tie_embeddings and (vocab_size is None or out_dim not in (None, vocab_size)):
            raise ValueError(f"tie_embeddings needs token input and out_dim = vocab_size (or "
                             f"None); got vocab_size={vocab_size}, out_dim={out_dim}")
        self.tied = tie_embeddings and out_dim is not None
        self.head = nn.Identity() if out_dim is None or self.tied else nn.Linear(
            dim, out_dim, bias=bias if head_bias is None else head_bias)
        if isinstance(mtp, bool) or not isinstance(mtp, int) or mtp < 0:
            raise ValueError(f"mtp must be an int >= 0, got {mtp!r}")
        if mtp and (vocab_size is None or out_dim is None or position_embedding == "learned"):
            raise ValueError(f"mtp needs token input, an output head and no learned positions; "
                             f"got vocab_size={vocab_size}, out_dim={out_dim}, "
                             f"position_embedding={position_embedding!r}")
        self.mtp = nn.ModuleList(MultiTokenPrediction(
            dim, copy.deepcopy(self.blocks[-1]), norm=norm, bias=bias, eps=norm_eps)
            for _ in range(mtp))

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None,
                segment_ids: Tensor | None = None, positions: Tensor | None = None,
                cache: KVCache | None = None, return_router_logits: bool = False,
                return_indexer_loss: bool = False, return_mtp: bool = False,
                return_hidden: bool = False, mtp_depth: int | None = None,
                mtp_hidden: Tensor | None = None) -> Tensor | tuple:
        if mtp_depth is not None or mtp_hidden is not None:
            if return_router_logits or return_indexer_loss or return_mtp or return_hidden \
                    or segment_ids is not None:
                raise ValueError("TransformerEncoder: mtp_depth runs one multi-token "
                                 "prediction depth alone; it takes no segment_ids and no "
                                 "return_* options")
            return self._mtp_step(x, mtp_depth, mtp_hidden, key_padding_mask, positions, cache)
        if return_mtp and (not self.mtp or cache is not None):
            raise ValueError(f"TransformerEncoder: return_mtp needs mtp >= 1 and no cache; got "
                             f"mtp={len(self.mtp)}, cache="
                             f"{type(cache).__name__ if cache is not None else None}")
        routers = [int(self._sparse[i]) + isinstance(b.attn, MixtureOfAttention)
                   for i, b in enumerate(self.blocks)]  # each block's routers
        if return_router_logits and (not any(routers) or cache is not None):
            raise ValueError("TransformerEncoder: return_router_logits needs experts and no "
                             f"cache; got experts={self.experts}, cache="
                             f"{type(cache).__name__ if cache is not None else None}")
        indexed = [getattr(b.attn, "indexer", None) is not None for b in self.blocks]
        if return_indexer_loss and (not any(indexed) or cache is not None):
            raise ValueError("TransformerEncoder: return_indexer_loss needs a latent attention "
                             "with an indexer (latent_attention=dict(indexer=...)) and no "
                             f"cache; got {sum(indexed)} indexed blocks, cache="
                             f"{type(cache).__name__ if cache is not None else None}")
        one = x.dim() == (1 if self.tokens else 2)  # a single example: add a batch dim
        if one:
            x = x.unsqueeze(0)
            key_padding_mask = None if key_padding_mask is None else key_padding_mask[None]
            segment_ids = None if segment_ids is None else segment_ids[None]
            positions = None if positions is None or positions.dim() == 1 else positions[None]
        n = x.shape[1]
        start: int | Tensor = 0
        static = isinstance(cache, StaticKVCache)
        if cache is not None:
            if not self._entries:
                raise ValueError("TransformerEncoder: cache needs a block with a token mixer")
            cache = check_cache(cache, self._entries, "TransformerEncoder")
            start = cache.length  # a tensor for a StaticKVCache
            if segment_ids is not None:
                raise ValueError("TransformerEncoder: cache does not take segment_ids "
                                 "(decode one document per row)")
        if segment_ids is not None and tuple(segment_ids.shape) != tuple(x.shape[:2]):
            raise ValueError(f"segment_ids must have shape (B, N) = {tuple(x.shape[:2])}, "
                             f"got {tuple(segment_ids.shape)}")
        if positions is None:
            positions = token_positions(n, x.device, start, segment_ids)  # (N,) or (B, N)
        elif not isinstance(positions, Tensor) or positions.shape[-1] != n \
                or positions.dim() not in (1, 2):
            raise ValueError(f"positions must be a tensor (N,) or (B, N) with N = {n}, got "
                             f"{getattr(positions, 'shape', positions)}")
        h = self._embed(x)  # (B, N, dim)
        if self.position_embedding == "learned":
            if static and (cache.capacity or 0) > self.max_len:
                raise ValueError(f"StaticKVCache capacity {cache.capacity} exceeds "
                                 f"max_len={self.max_len}")
            if not static and start + n > self.max_len:  # given positions must be < max_len
                raise ValueError(f"sequence length {start + n} exceeds max_len={self.max_len}")
            h = h + self.pos(positions)
        h = self.drop(h)
        tables: dict[int, RotaryTable] = {}  # one cos / sin table per rotary setting
        rotary = self.position_embedding == "rotary"
        new_keys, new_values, router_logits, index_losses = [], [], [], []
        for i, block in enumerate(self.blocks):
            block_positions = None
            if getattr(block.attn, "needs_positions", False):  # chunks, temperature
                block_positions = positions
            elif rotary and getattr(block.attn, "rotary", False):  # (NoPE, GatedDeltaNet: none)
                first = self._rope_first[i]
                if first not in tables:
                    tables[first] = block.attn.rotary_table(positions, h.dtype)  # = first's
                block_positions = tables[first]
            if cache is not None and block.attn is None:  # an MLP alone: nothing cached
                h = block(h)
                continue
            if cache is not None:
                h, layer = block(h, key_padding_mask, None, block_positions,
                                 cache.layers(*self._slots[i]))
                # layer: this block's keys and values, cached and new
                new_keys += layer.keys
                new_values += layer.values
                continue
            args = (h, key_padding_mask, segment_ids, block_positions)
            routed = return_router_logits and routers[i] > 0
            index = return_indexer_loss and indexed[i]
            if routed or index:
                args += (None, routed, index)
            if self.remat is None:
                h = block(*args)
            else:
                h = call_remat(block, self.remat, *args, stochastic=self._stochastic)
            if routed or index:
                h, *aux = h  # the routers' logits (B, N, E), then the indexer's loss
                if routed:
                    router_logits += [t.squeeze(0) if one else t for t in aux[:routers[i]]]
                if index:
                    index_losses.append(aux[-1])  # a scalar
        h = self.ln(h)
        out = self._logits(h)  # (B, N, out_dim)
        out = out.squeeze(0) if one else out
        aux = ((tuple(router_logits),) if return_router_logits else ()) \
            + ((tuple(index_losses),) if return_indexer_loss else ())
        if return_mtp:
            mtp = self._mtp(h, x, key_padding_mask, segment_ids, positions)
            aux += (tuple(t.squeeze(0) for t in mtp) if one else mtp,)
        if return_hidden:  # the final states (B, N, dim), after the final norm
            aux += (h.squeeze(0) if one else h,)
        if cache is not None:
            aux += (StaticKVCache(tuple(new_keys), tuple(new_values), layer.length) if static
                    else KVCache(tuple(new_keys), tuple(new_values)),)
        return (out, *aux) if aux else out

    def _logits(self, h: Tensor) -> Tensor:
        """The head on normalised states ``(B, N, dim) -> (B, N, out_dim)``."""
        out = h @ self.embed.weight.T if self.tied else self.head(h)
        if self.logit_scale is not None:  # Cohere: the logits times a constant
            out = out * self.logit_scale
        if self.logit_softcap is not None:  # Gemma 2: cap * tanh(logits / cap)
            out = torch.tanh(out / self.logit_softcap) * self.logit_softcap
        return out

    def _mtp_step(self, x: Tensor, depth: object, hidden: object,
                  key_padding_mask: Tensor | None, positions: Tensor | None,
                  cache: object) -> tuple:
        """Multi-token prediction depth ``depth`` alone: the tokens ``t + depth`` ``x`` (B, n)
        and depth ``depth - 1``'s states ``hidden`` (B, n, dim) at ``t`` -> its logits (B, n,
        V) and states (B, n, dim), and its block's cache when given one."""
        if isinstance(depth, bool) or not isinstance(depth, int) \
                or not 1 <= depth <= len(self.mtp):
            raise ValueError(f"TransformerEncoder: mtp_depth must be an int in [1, "
                             f"{len(self.mtp)}] (the model's mtp), got {depth!r}")
        if not isinstance(x, Tensor) or x.dim() != 2 or not isinstance(hidden, Tensor) \
                or tuple(hidden.shape) != (*x.shape, self.embed.weight.shape[1]):
            raise ValueError(f"TransformerEncoder: mtp_depth needs tokens (B, n) and "
                             f"mtp_hidden (B, n, {self.embed.weight.shape[1]}), got "
                             f"{tuple(getattr(x, 'shape', ()))} and "
                             f"{tuple(getattr(hidden, 'shape', ()))}")
        n, start = x.shape[1], 0
        if cache is not None:
            if not isinstance(cache, KVCache):
                raise TypeError(f"TransformerEncoder: mtp_depth takes a KVCache (KVCache() to "
                                f"start), got {type(cache).__name__}")
            cache = check_cache(cache, self.mtp[depth - 1].block.cache_entries,
                                "TransformerEncoder")
            start = cache.length
        if positions is None:
            positions = token_positions(n, x.device, start, None)  # (n,)
        elif not isinstance(positions, Tensor) or positions.shape[-1] != n \
                or positions.dim() not in (1, 2):
            raise ValueError(f"positions must be a tensor (N,) or (B, N) with N = {n}, got "
                             f"{getattr(positions, 'shape', positions)}")
        h = self._depth(depth, hidden, self._embed(x), key_padding_mask, None, positions, cache)
        if cache is not None:
            h, cache = h
        logits = self._logits(self.mtp[depth - 1].norm(h))  # (B, n, V)
        return (logits, h) if cache is None else (logits, h, cache)

    def _embed(self, x: Tensor) -> Tensor:
        """The token embeddings ``(B, N) -> (B, N, dim)``, scaled by ``embed_scale`` (in
        their dtype, as Gemma rounds it)."""
        h = self.embed(x)
        if self.embed_scale is not None:
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype, device=h.device)
        return h

    def _depth(self, k: int, hidden: Tensor, embedded: Tensor, key_padding_mask: Tensor | None,
               segment_ids: Tensor | None, positions: Tensor, cache: object = None) -> object:
        """Multi-token prediction depth ``k`` on the states ``hidden`` and the embeddings
        ``embedded`` ``(B, m, dim)`` at ``positions`` (made a rotary table where the block
        rotates): ``h_k`` ``(B, m, dim)``, and the block's cache when given one."""
        module = self.mtp[k - 1]
        attn = module.block.attn
        if self.position_embedding == "rotary" and getattr(attn, "rotary", False) \
                and not getattr(attn, "needs_positions", False):
            positions = attn.rotary_table(positions, hidden.dtype)
        return module(hidden, embedded, key_padding_mask, segment_ids, positions, cache)

    def _mtp(self, h: Tensor, x: Tensor, key_padding_mask: Tensor | None,
             segment_ids: Tensor | None, positions: Tensor) -> tuple[Tensor, ...]:
        """The multi-token prediction depths' logits ``(B, N - k, V)``, ``k = 1 .. D``,
        from the final states ``h`` ``(B, N, dim)`` and the tokens ``x`` ``(B, N)``: depth
        ``k`` reads ``h_{k-1}`` at ``t`` and the embedding of ``x[t + k]``."""
        embedded = self._embed(x)  # (B, N, dim)
        n, out = x.shape[1], []
        for k, module in enumerate(self.mtp, start=1):
            m = n - k  # the positions t whose token t + k exists
            if m < 1:
                raise ValueError(f"TransformerEncoder: return_mtp needs more than mtp = "
                                 f"{len(self.mtp)} tokens, got {n}")
            mask = None if key_padding_mask is None else \
                key_padding_mask[:, :m] & key_padding_mask[:, k:]
            h = self._depth(k, h[:, :m], embedded[:, k:], mask,
                            None if segment_ids is None else segment_ids[:, :m],
                            positions[..., :m])
            out.append(self._logits(module.norm(h)))  # (B, m, V)
        return tuple(out)
