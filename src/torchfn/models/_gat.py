"""``GATConv``: the graph attention layer of Velickovic et al. (2018), on dense adjacency or
edge lists (the conventions of ``_graph.py``: ``adj[..., i, j]`` / an edge ``(j, i)`` is
the edge from ``j`` into ``i``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchfn.core.segment import _softmax, _sum
from torchfn.models._graph import _attention_edges, _check_graph, _with_self_loops

__all__ = ["GATConv"]


class GATConv(nn.Module):
    """Graph attention (GAT): each node attends to its in-neighbours with additive scores.

    With ``h = x W^T`` split into ``heads`` heads of ``out_dim`` features,
    ``e_ij = LeakyReLU(a_dst . h_i + a_src . h_j)`` for an edge ``j -> i``, the weights
    ``alpha_ij`` are the softmax of ``e_ij`` over ``i``'s in-neighbours (and, with
    ``self_loops``, ``i`` itself), and node ``i`` gets ``sum_j alpha_ij h_j`` per head,
    the heads concatenated (``concat=True``: ``(..., N, heads * out_dim)``) or averaged
    (``(..., N, out_dim)``), plus a bias. A node with no in-neighbours gets the bias.

    ``x: (..., N, in_dim)`` and the graph as ``adj: (..., N, N)`` bool or
    ``edges: (..., 2, E)`` (with an optional bool ``edge_mask: (..., E)``, False
    dropping an edge: padding). The parameters and the result are those of PyTorch
    Geometric's ``GATConv`` (the tests hold them equal in float64), except that a node's
    existing self loops are kept as given, where PyG replaces them by one.

    Example::

        >>> import torch, torchfn
        >>> from torchfn import random
        >>> model = torchfn.Model(GATConv(3, 8, heads=2))
        >>> params = model.init(random.key(0))
        >>> x = random.normal(random.key(1), (5, 3))                  # (N, in_dim)
        >>> ring = torch.stack([torch.arange(5), torch.arange(5).roll(-1)])  # (2, E)
        >>> model.apply(params, x, edges=ring).shape                  # (N, heads * out_dim)
        torch.Size([5, 16])
        >>> adj = torch.zeros(5, 5, dtype=torch.bool)
        >>> adj[ring[1], ring[0]] = True                              # the same graph
        >>> torch.allclose(model.apply(params, x, adj), model.apply(params, x, edges=ring))
        True
    """

    def __init__(self, in_dim: int, out_dim: int, heads: int = 1, concat: bool = True,
                 negative_slope: float = 0.2, self_loops: bool = True, bias: bool = True):
        super().__init__()
        for arg, v in (("in_dim", in_dim), ("out_dim", out_dim), ("heads", heads)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"GATConv: {arg} must be an int >= 1, got {v!r}")
        self.in_dim, self.out_dim, self.heads = in_dim, out_dim, heads
        self.concat, self.negative_slope, self.self_loops = concat, negative_slope, self_loops
        self.linear = nn.Linear(in_dim, heads * out_dim, bias=False)
        self.att_src = nn.Parameter(torch.empty(heads, out_dim))
        self.att_dst = nn.Parameter(torch.empty(heads, out_dim))
        self.bias = nn.Parameter(torch.empty(heads * out_dim if concat else out_dim)) if bias \
            else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Glorot-uniform weights and attention vectors, a zero bias (as PyG's GATConv)."""
        nn.init.xavier_uniform_(self.linear.weight)
        for a in (self.att_src, self.att_dst):  # fan as PyG's glorot: (heads, out) -> both
            bound = (6.0 / (a.shape[-2] + a.shape[-1])) ** 0.5
            nn.init.uniform_(a, -bound, bound)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor, adj: Tensor | None = None, *, edges: Tensor | None = None,
                edge_mask: Tensor | None = None) -> Tensor:
        _check_graph("GATConv", x, adj, self.in_dim, edges)
        h = self.linear(x).unflatten(-1, (self.heads, self.out_dim))  # (..., N, heads, out)
        a_src = (h * self.att_src).sum(-1)  # (..., N, heads)
        a_dst = (h * self.att_dst).sum(-1)  # (..., N, heads)
        if edges is not None:
            out = self._on_edges(x, h, a_src, a_dst, edges, edge_mask)  # (..., N, heads, out)
        else:
            if edge_mask is not None:
                raise ValueError("GATConv: edge_mask goes with edges; with adj, leave the "
                                 "masked edges out of adj")
            if adj.dtype != torch.bool:
                raise ValueError(f"GATConv: adj must be a bool tensor, got {adj.dtype}")
            mask = _with_self_loops(adj) if self.self_loops else adj  # (..., N, N)
            e = a_dst.transpose(-1, -2).unsqueeze(-1) + a_src.transpose(-1, -2).unsqueeze(-2)
            e = F.leaky_relu(e, self.negative_slope)  # (..., heads, N, N): [h, i, j]
            e = e.masked_fill(~mask.unsqueeze(-3), -torch.inf)
            m = e.detach().amax(-1, keepdim=True).nan_to_num(neginf=0.0)  # empty rows -> 0
            w = (e - m).exp()
            p = w / w.sum(-1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)
            out = (p @ h.transpose(-2, -3)).transpose(-2, -3)  # (..., N, heads, out)
        out = out.flatten(-2) if self.concat else out.mean(-2)
        return out if self.bias is None else out + self.bias  # (..., N, heads * out or out)

    def _on_edges(self, x: Tensor, h: Tensor, a_src: Tensor, a_dst: Tensor, edges: Tensor,
                  edge_mask: Tensor | None) -> Tensor:
        lead, N = x.shape[:-2], x.shape[-2]
        M = lead.numel() * N  # nodes of all graphs
        src, dst, keep = _attention_edges("GATConv", x, edges, edge_mask, self.self_loops)
        a_src, a_dst = a_src.reshape(M, self.heads), a_dst.reshape(M, self.heads)
        e = F.leaky_relu(a_src.index_select(0, src) + a_dst.index_select(0, dst),
                         self.negative_slope)  # (E', heads)
        if keep is not None:
            e = e.masked_fill(~keep.unsqueeze(-1), -torch.inf)
        p = _softmax(e, dst, M)  # (E', heads): sums to 1 over each node's incoming edges
        msg = p.unsqueeze(-1) * h.reshape(M, self.heads, self.out_dim).index_select(0, src)
        return _sum(msg, dst, M).reshape(*lead, N, self.heads, self.out_dim)
