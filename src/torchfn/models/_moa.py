"""Mixture of attention heads (Zhang et al. 2022; JetMoE): each token routes to ``top_k`` of
``experts`` query / output projection pairs that share one set of keys and values."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from torchfn.models._attention import MultiHeadAttention
from torchfn.models._mlp import _check_dims
from torchfn.models._moe import _batched_transform_active

__all__ = ["MixtureOfAttention"]


class MixtureOfAttention(MultiHeadAttention):
    """Attention whose query and output projections are experts: ``(B, N, dim) -> (B, N,
    dim)``.

    A router scores the ``experts`` per token; the token's ``top_k`` best (weights: the
    softmax of their logits) each project it to ``heads`` queries of ``head_dim``
    (``q_experts`` ``(E, heads head_dim, dim)``). All ``top_k * heads`` queries attend over
    one set of ``heads`` keys and values (``kv`` ``(2 heads head_dim, dim)``: grouped-query
    attention, each key/value head shared by the ``top_k`` queries routed to it), and
    each expert's heads go back through its own output projection (``out_experts``
    ``(E, dim, heads head_dim)``), weighted and summed, plus ``out_bias`` ``(dim,)``
    (``out_bias=False``: none). The cache holds the ``heads`` keys and values, as a
    :class:`MultiHeadAttention` with ``heads`` key/value heads: routing adds nothing to it.

    Two exact computations of the same projections, as :class:`MoE`'s: in eager mode
    (also under ``grad`` and ``jvp``) the (token, slot) pairs are sorted by expert and
    each expert projects its own; under ``vmap`` and ``torch.compile``, where the groups'
    sizes cannot depend on the data, every expert projects every token and the chosen
    ones are kept (``experts / top_k`` times the work). Other keywords (``causal``, ``window``,
    ``rotary``, ...) are :class:`MultiHeadAttention`'s.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import MixtureOfAttention
        >>> moa = MixtureOfAttention(32, 2, experts=4, top_k=2, head_dim=8, causal=True,
        ...                          rotary=True)
        >>> model = torchfn.Model(moa)
        >>> params = model.init(torchfn.random.key(0))
        >>> sorted((n, tuple(p.shape)) for n, p in params.items())
        [('kv.weight', (32, 32)), ('out_bias', (32,)), ('out_experts', (4, 32, 16)), \
('q_experts', (4, 16, 32)), ('router.weight', (4, 32))]
        >>> model.apply(params, torch.ones(2, 5, 32)).shape
        torch.Size([2, 5, 32])
    """

    def __init__(self, dim: int, heads: int, *, experts: int, top_k: int,
                 head_dim: int | None = None, out_bias: bool = True, **options) -> None:
        _check_dims(heads=heads, experts=experts, top_k=top_k)
        if top_k > experts:
            raise ValueError(f"top_k must be <= experts = {experts}, got top_k={top_k}")
        for name in ("kv_heads", "v_dim", "output_gate", "qkv_bias"):
            if options.get(name):
                raise ValueError(f"MixtureOfAttention takes no {name}, got {options[name]!r}")
        if head_dim is None and dim % heads:
            raise ValueError(f"dim must be divisible by heads, got dim={dim}, heads={heads} "
                             "(or give head_dim)")
        hd = dim // heads if head_dim is None else head_dim
        # the kernels see top_k * heads query heads over heads key/value heads
        super().__init__(dim, top_k * heads, kv_heads=heads, head_dim=hd, bias=False,
                         **{k: v for k, v in options.items() if k not in (
                             "kv_heads", "v_dim", "output_gate", "qkv_bias", "bias")})
        self.experts, self.top_k, self.expert_heads = experts, top_k, heads
        inner = heads * hd
        self.router = nn.Linear(dim, experts, bias=False)
        self.kv = nn.Linear(dim, 2 * inner, bias=False)  # [k | v]
        self.q_experts = nn.Parameter(torch.empty(experts, inner, dim))
        self.out_experts = nn.Parameter(torch.empty(experts, dim, inner))
        self.out_bias = nn.Parameter(torch.empty(dim)) if out_bias else None
        self.reset_parameters()

    def _projections(self, dim: int, qkv_bias: bool, out_bias: bool,
                     output_gate: bool) -> None:
        """None here: the experts' projections are made in ``__init__``."""

    def reset_parameters(self) -> None:
        """The experts' matrices as ``nn.Linear``'s (uniform in ``±1/sqrt(fan_in)``), the
        output bias 0."""
        super().reset_parameters()
        if not hasattr(self, "q_experts"):  # (called by the parent before they exist)
            return
        for w in (self.q_experts, self.out_experts):
            bound = 1 / math.sqrt(w.shape[-1])
            nn.init.uniform_(w, -bound, bound)
        if self.out_bias is not None:
            nn.init.zeros_(self.out_bias)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(logits (B, N, E), weights (B, N, top_k), experts (B, N, top_k))``: the
        softmax over each token's ``top_k`` best logits (float32 or wider), in ``x``'s
        dtype."""
        logits = self.router(x).to(torch.promote_types(x.dtype, torch.float32))
        top, chosen = logits.topk(self.top_k, dim=-1)
        return logits, top.softmax(-1).to(x.dtype), chosen

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, object]:
        """Each token's queries from its chosen experts, ordered so that query head
        ``j * top_k + s`` (slot ``s``, head ``j``) reads key/value head ``j``."""
        _, weights, chosen = self.route(x)
        if _batched_transform_active():  # every expert on every token, the chosen kept
            q = torch.einsum("bnd,eod->bneo", x, self.q_experts)  # (B, N, E, heads D)
            q = q.gather(2, chosen[..., None].expand(-1, -1, -1, q.shape[-1]))  # (B,N,k,hD)
        else:  # each (token, slot) through its own expert
            rows = x.unsqueeze(2).expand(-1, -1, self.top_k, -1)  # (B, N, k, dim)
            q = _by_expert(rows, chosen, self.q_experts)  # (B, N, k, h D)
        q = q.unflatten(-1, (self.expert_heads, -1)).transpose(2, 3)  # (B, N, h, k, D)
        k, v = self.kv(x).chunk(2, dim=-1)  # (B, N, h D) each
        return q.flatten(2), k, v, (weights, chosen)

    def _output(self, o: Tensor, x: Tensor, context: object) -> Tensor:
        """Each slot's heads through its expert's output projection, weighted, summed."""
        weights, chosen = context
        b, n, _ = o.shape
        o = o.unflatten(-1, (self.expert_heads, self.top_k, -1)).transpose(2, 3)  # (B,N,k,h,D)
        o = (weights[..., None, None] * o).flatten(3)  # (B, N, k, h D)
        if not _batched_transform_active():  # each slot through its own expert, summed
            out = _by_expert(o, chosen, self.out_experts).sum(2)  # (B, N, dim)
            return out if self.out_bias is None else out + self.out_bias
        mix = o.new_zeros(b, n, self.experts, o.shape[-1]).scatter_add(
            2, chosen[..., None].expand(-1, -1, -1, o.shape[-1]), o)  # (B, N, E, h D)
        out = torch.einsum("bneo,edo->bnd", mix, self.out_experts)  # (B, N, dim)
        return out if self.out_bias is None else out + self.out_bias

    def extra_repr(self) -> str:
        return (f"heads={self.expert_heads}, head_dim={self.head_dim}, "
                f"experts={self.experts}, top_k={self.top_k}")


def _by_expert(rows: Tensor, chosen: Tensor, weight: Tensor) -> Tensor:
    """``rows`` ``(..., i)`` each through its expert's matrix ``weight[chosen]`` ``(o,
    i)``: ``(..., o)``, the rows sorted by expert and each expert's multiplied at once
    (eager mode: the groups' sizes are read)."""
    flat, expert = rows.reshape(-1, rows.shape[-1]), chosen.reshape(-1)  # (R, i), (R,)
    order = expert.argsort(stable=True)
    counts = torch.bincount(expert, minlength=weight.shape[0]).tolist()
    parts = flat[order].split(counts)
    out = torch.cat([p @ weight[e].T for e, p in enumerate(parts)])  # (R, o), sorted
    return out[order.argsort()].reshape(*rows.shape[:-1], weight.shape[1])
