"""Graph layers: ``GraphConv`` (GCN) and ``GraphAttention``, on dense adjacency or edge lists.

A graph is node features ``x: (N, F)`` and either

- a dense adjacency ``adj: (N, N)`` (bool, or float edge weights; ``adj[i, j]`` is the
  edge from node ``j`` into node ``i``): O(N^2) memory, the right choice for small
  graphs, where it runs as a few dense matmuls; or
- an edge list ``edges: (2, E)`` of ``(source, target)`` rows, as PyTorch Geometric's
  ``edge_index`` (``edges[:, e] = (j, i)`` is the edge from ``j`` into ``i``): O(E)
  memory, for large sparse graphs, computed with ``torchfn.segment_sum`` /
  ``segment_softmax``.

Both give the same result for the same graph (the tests hold them to each other and to
PyTorch Geometric's ``GCNConv``), and both allow leading batch dims and work under
``vmap`` over graphs, per-graph gradients and ``jvp``. Pad graphs of different sizes
to one N (padded nodes without edges stay isolated) and edge lists to one E (padding
edges with weight 0 for ``GraphConv``, masked out by ``edge_mask`` for
``GraphAttention``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from torchfn.core._eager import plain
from torchfn.core.segment import _softmax, _sum

__all__ = ["GraphConv", "GraphAttention"]


def _check_graph(name: str, x: object, adj: object, features: int, edges: object) -> None:
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() < 2:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{name}: x must be a float tensor (..., N, {features}), got {got}")
    if x.shape[-1] != features:
        raise ValueError(f"{name}: x must have {features} features in its last dim, "
                         f"got shape {tuple(x.shape)}")
    if (adj is None) == (edges is None):
        raise ValueError(f"{name}: give the graph as exactly one of adj (N, N) and "
                         f"edges (2, E), got {'neither' if adj is None else 'both'}")
    if adj is None:
        return
    N = x.shape[-2]
    if not isinstance(adj, Tensor) or adj.dim() < 2 or adj.shape[-2:] != (N, N):
        got = tuple(adj.shape) if isinstance(adj, Tensor) else type(adj).__name__
        raise ValueError(f"{name}: adj must be (..., {N}, {N}) for x with N={N} nodes, "
                         f"got {got}")
    if adj.shape[:-2] != x.shape[:-2] and adj.dim() > 2:
        raise ValueError(f"{name}: adj's batch dims {tuple(adj.shape[:-2])} must equal x's "
                         f"{tuple(x.shape[:-2])} (or adj be one (N, N) graph for all)")


def _check_edges(name: str, x: Tensor, edges: object, per_edge: dict[str, object]) -> None:
    """``edges: (..., 2, E)`` int with ``...`` empty or x's batch dims; each of
    ``per_edge`` (name -> tensor or None) shaped ``(..., E)`` like it."""
    lead, N = x.shape[:-2], x.shape[-2]
    if (not isinstance(edges, Tensor) or edges.dim() < 2 or edges.shape[-2] != 2
            or edges.dtype not in (torch.int64, torch.int32)):
        got = (f"{edges.dtype} tensor of shape {tuple(edges.shape)}"
               if isinstance(edges, Tensor) else type(edges).__name__)
        raise ValueError(f"{name}: edges must be an int64 or int32 tensor (2, E) of "
                         f"(source, target) rows, got {got}")
    if edges.dim() > 2 and edges.shape[:-2] != lead:
        raise ValueError(f"{name}: edges' batch dims {tuple(edges.shape[:-2])} must equal "
                         f"x's {tuple(lead)} (or edges be one (2, E) list for all)")
    if edges.device != x.device:
        raise ValueError(f"{name}: edges is on {edges.device}, x on {x.device}")
    for arg, t in per_edge.items():
        if t is not None and (not isinstance(t, Tensor) or t.shape != edges.shape[:-2]
                              + edges.shape[-1:]):
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            want = (*edges.shape[:-2], edges.shape[-1])
            raise ValueError(f"{name}: {arg} must have shape {want}, one value per edge "
                             f"of edges {tuple(edges.shape)}, got {got}")
    if plain(edges) and edges.numel():
        lo, hi = edges.min().item(), edges.max().item()
        if lo < 0 or hi >= N:
            raise ValueError(f"{name}: edges must hold node indices in [0, {N}) for x "
                             f"with N={N} nodes, got indices from {lo} to {hi}")


def _flat_edges(x: Tensor, edges: Tensor) -> tuple[Tensor, Tensor]:
    """All graphs of x's batch as one graph of ``M = prod(batch) * N`` nodes: the
    edges of graph ``b`` shifted by ``b * N``. Returns ``(source, target)``, each
    ``(prod(batch) * E,)`` int64."""
    lead, N = x.shape[:-2], x.shape[-2]
    G = lead.numel()
    edges = edges.long().expand(*lead, 2, edges.shape[-1]).reshape(G, 2, -1)  # (G, 2, E)
    offset = torch.arange(G, device=edges.device).mul(N).view(G, 1, 1)
    src, dst = (edges + offset).transpose(0, 1).reshape(2, -1)  # (G*E,) each
    return src, dst


def _flat_per_edge(t: Tensor, lead: torch.Size) -> Tensor:
    """A per-edge ``(..., E)`` value as ``(prod(batch) * E,)``, edges ordered as
    ``_flat_edges``."""
    return t.expand(*lead, t.shape[-1]).reshape(-1)


def _attention_edges(name: str, x: Tensor, edges: Tensor, edge_mask: Tensor | None,
                     self_loops: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """The flat ``(source, target)`` edges of an attention layer, ``(E',)`` each, with
    a self loop appended for every node (``self_loops``), and ``keep: (E',)`` bool (or
    None: all kept): False for masked edges and for an added loop where the node has
    one already."""
    _check_edges(name, x, edges, {"edge_mask": edge_mask})
    if edge_mask is not None and edge_mask.dtype != torch.bool:
        raise ValueError(f"{name}: edge_mask must be a bool tensor, got {edge_mask.dtype}")
    lead, N = x.shape[:-2], x.shape[-2]
    M = lead.numel() * N  # nodes of all graphs
    src, dst = _flat_edges(x, edges)  # (G*E,) each
    keep = None if edge_mask is None else _flat_per_edge(edge_mask, lead)  # (G*E,)
    if self_loops:
        node = torch.arange(M, device=x.device)
        own = (src == dst) if keep is None else (src == dst) & keep
        given = _sum(own.to(x.dtype), dst, M) > 0  # (M,) has a loop already
        kept = torch.ones_like(own) if keep is None else keep
        keep = torch.cat([kept, ~given])  # a loop added only where none was given
        src, dst = torch.cat([src, node]), torch.cat([dst, node])
    return src, dst, keep


def _with_self_loops(adj: Tensor) -> Tensor:
    eye = torch.eye(adj.shape[-1], dtype=torch.bool, device=adj.device)
    if adj.dtype == torch.bool:
        return adj | eye
    return adj + eye.to(adj.dtype) * (adj.diagonal(dim1=-2, dim2=-1) == 0).unsqueeze(-1)


class GraphConv(nn.Module):
    """Kipf & Welling's graph convolution: ``D^-1/2 (A + I) D^-1/2 x W^T + b``.

    ``x: (..., N, in_dim)`` and the graph as ``adj: (..., N, N)`` (bool or float weights)
    or ``edges: (..., 2, E)`` with optional ``edge_weight: (..., E)`` (1 if not given;
    duplicate edges add up) -> ``(..., N, out_dim)``. Unless ``self_loops=False``, a
    self loop of weight 1 is added to each node whose self loops weigh 0 in all (PyTorch
    Geometric's ``add_remaining_self_loops``). ``D`` is each node's weighted in-degree
    (the row sums of ``adj``), as ``GCNConv``'s.

    Example::

        >>> import torch, torchfn
        >>> from torchfn import random
        >>> model = torchfn.Model(GraphConv(3, 8))
        >>> params = model.init(random.key(0))
        >>> x = random.normal(random.key(1), (5, 3))              # (N, F): 5 nodes
        >>> adj = torch.eye(5, dtype=torch.bool).roll(1, 0)        # a directed ring
        >>> model.apply(params, x, adj | adj.T).shape
        torch.Size([5, 8])
        >>> ring = torch.stack([torch.arange(5), torch.arange(5).roll(-1)])  # (2, E)
        >>> edges = torch.cat([ring, ring.flip(0)], dim=1)  # both directions: E = 10
        >>> torch.allclose(model.apply(params, x, edges=edges), model.apply(params, x, adj | adj.T))
        True
    """

    def __init__(self, in_dim: int, out_dim: int, bias: bool = True, self_loops: bool = True):
        super().__init__()
        self.in_dim, self.self_loops = in_dim, self_loops
        self.linear = nn.Linear(in_dim, out_dim, bias=False)
        self.bias = nn.Parameter(torch.zeros(out_dim)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The bias starts at zero (as Kipf & Welling); the weight is ``nn.Linear``'s."""
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor, adj: Tensor | None = None, *, edges: Tensor | None = None,
                edge_weight: Tensor | None = None) -> Tensor:
        _check_graph("GraphConv", x, adj, self.in_dim, edges)
        if edges is not None:
            return self._on_edges(x, edges, edge_weight)
        if edge_weight is not None:
            raise ValueError("GraphConv: edge_weight goes with edges; with adj, put the "
                             "weights in adj")
        a = _with_self_loops(adj) if self.self_loops else adj
        a = a.to(x.dtype)  # (..., N, N)
        d = a.sum(-1).clamp_min(torch.finfo(x.dtype).tiny).rsqrt()  # (..., N); isolated -> 0 rows
        out = (d.unsqueeze(-1) * a * d.unsqueeze(-2)) @ self.linear(x)  # (..., N, out)
        return out if self.bias is None else out + self.bias

    def _on_edges(self, x: Tensor, edges: Tensor, edge_weight: Tensor | None) -> Tensor:
        _check_edges("GraphConv", x, edges, {"edge_weight": edge_weight})
        if edge_weight is not None and not edge_weight.is_floating_point():
            raise ValueError(f"GraphConv: edge_weight must be floating point, "
                             f"got {edge_weight.dtype}")
        lead, N = x.shape[:-2], x.shape[-2]
        M = lead.numel() * N  # nodes of all graphs
        src, dst = _flat_edges(x, edges)  # (G*E,) each
        w = None if edge_weight is None else _flat_per_edge(edge_weight.to(x.dtype), lead)
        deg = _sum(x.new_ones(src.shape) if w is None else w, dst, M)  # (M,) in-degree
        if self.self_loops:  # weight 1 where a node's own loops weigh 0 in all
            own = (src == dst).to(x.dtype) if w is None else w * (src == dst)
            loop = (_sum(own, dst, M) == 0).to(x.dtype)  # (M,)
            deg = deg + loop
        d = deg.clamp_min(torch.finfo(x.dtype).tiny).rsqrt().unsqueeze(-1)  # (M, 1)
        h = d * self.linear(x.reshape(M, self.in_dim))  # (M, out): the source's D^-1/2
        msg = h.index_select(0, src)  # (E, out); unweighted edges need no product per edge
        agg = _sum(msg if w is None else w.unsqueeze(-1) * msg, dst, M)  # (M, out)
        if self.self_loops:
            agg = agg + loop.unsqueeze(-1) * h  # the added loops, per node, not per edge
        out = (d * agg).reshape(*lead, N, -1)  # (..., N, out): the target's D^-1/2
        return out if self.bias is None else out + self.bias


class GraphAttention(nn.Module):
    """Multi-head dot-product self-attention restricted to the edges of a graph.

    As graph transformers (Dwivedi & Bresson 2021) do, not GAT's additive scores: node
    ``i`` attends to its neighbours ``j`` (``adj[i, j]`` True) and, with ``self_loops``,
    to itself; a node with no neighbours gets 0. ``x: (..., N, dim)`` and the graph as
    ``adj: (..., N, N)`` bool or ``edges: (..., 2, E)`` (with an optional bool
    ``edge_mask: (..., E)``, False dropping an edge: padding) -> ``(..., N, dim)``.

    On ``adj`` the attention is ``torchfn.kernels.attention`` with the adjacency as its
    boolean mask: fused on a GPU, and it works under ``vmap``, ``grad``, ``jvp`` and
    ``torch.compile``. On ``edges`` it is a softmax over each node's incoming edges
    (``torchfn.segment_softmax``), O(E) in memory; an edge listed twice is attended to
    twice, where ``adj`` can hold it once.

    Example::

        >>> import torch, torchfn
        >>> from torchfn import random
        >>> model = torchfn.Model(GraphAttention(16, heads=4))
        >>> params = model.init(random.key(0))
        >>> x = random.normal(random.key(1), (2, 6, 16))          # (B, N, dim)
        >>> adj = random.bernoulli(random.key(2), 0.3, (2, 6, 6))  # (B, N, N)
        >>> model.apply(params, x, adj).shape
        torch.Size([2, 6, 16])
        >>> b, i, j = adj.nonzero().T                              # adj[b, i, j]: j -> i
        >>> out = model.apply(params, x[0], edges=torch.stack([j, i])[:, b == 0])
        >>> torch.allclose(out, model.apply(params, x, adj)[0], atol=1e-6)
        True
    """

    def __init__(self, dim: int, heads: int = 1, self_loops: bool = True):
        super().__init__()
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or dim % heads:
            raise ValueError(f"GraphAttention: heads must be an int >= 1 dividing dim={dim}, "
                             f"got {heads!r}")
        self.dim, self.heads, self.self_loops = dim, heads, self_loops
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: Tensor, adj: Tensor | None = None, *, edges: Tensor | None = None,
                edge_mask: Tensor | None = None) -> Tensor:
        from torchfn.kernels import attention

        _check_graph("GraphAttention", x, adj, self.dim, edges)
        if edges is not None:
            return self._on_edges(x, edges, edge_mask)
        if edge_mask is not None:
            raise ValueError("GraphAttention: edge_mask goes with edges; with adj, leave "
                             "the masked edges out of adj")
        if adj.dtype != torch.bool:
            raise ValueError(f"GraphAttention: adj must be a bool tensor, got {adj.dtype}")
        lead, N = x.shape[:-2], x.shape[-2]
        mask = _with_self_loops(adj) if self.self_loops else adj
        h = x.reshape(-1, N, self.dim)  # (B, N, dim)
        mask = mask.expand(*lead, N, N).reshape(-1, 1, N, N)  # (B, 1, N, N)
        q, k, v = self.qkv(h).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        o = attention(q, k, v, mask=mask)  # (B, heads, N, dim / heads)
        o = o.transpose(1, 2).reshape(*lead, N, self.dim)
        return self.out(o)

    def _on_edges(self, x: Tensor, edges: Tensor, edge_mask: Tensor | None) -> Tensor:
        lead, N = x.shape[:-2], x.shape[-2]
        M = lead.numel() * N  # nodes of all graphs
        src, dst, keep = _attention_edges("GraphAttention", x, edges, edge_mask, self.self_loops)
        q, k, v = self.qkv(x.reshape(M, self.dim)).unflatten(-1, (3, self.heads, -1)).unbind(1)
        d = q.shape[-1]  # q, k, v: (M, heads, d)
        s = (q.index_select(0, dst) * k.index_select(0, src)).sum(-1) * d**-0.5  # (E', heads)
        if keep is not None:
            s = s.masked_fill(~keep.unsqueeze(-1), -torch.inf)
        p = _softmax(s, dst, M)  # (E', heads), sums to 1 over each node's incoming edges
        o = _sum(p.unsqueeze(-1) * v.index_select(0, src), dst, M)  # (M, heads, d)
        return self.out(o.reshape(*lead, N, self.dim))
