"""Neighbourhood aggregation layers: ``SAGEConv`` (GraphSAGE) and ``GINConv`` (GIN), on
dense adjacency or edge lists (the conventions of ``_graph.py``: ``adj[..., i, j]`` / an
edge ``(j, i)`` is the edge from ``j`` into ``i``)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from torchfn.core.segment import _extreme, _sum
from torchfn.models._graph import _check_edges, _check_graph, _flat_edges, _flat_per_edge

__all__ = ["SAGEConv", "GINConv", "aggregate_neighbours"]

_HOW = ("sum", "mean", "max")


def aggregate_neighbours(x: Tensor, adj: Tensor | None = None, *, edges: Tensor | None = None,
                         edge_mask: Tensor | None = None, how: str = "sum") -> Tensor:
    """Each node's in-neighbours' features, summed, averaged or maxed.

    ``x: (..., N, F)`` and the graph as ``adj: (..., N, N)`` bool or ``edges: (..., 2, E)``
    (with an optional bool ``edge_mask: (..., E)``, False dropping an edge) ->
    ``(..., N, F)``: row ``i`` combines ``x[j]`` over the edges ``j -> i`` (an edge listed
    twice counts twice). A node without in-neighbours gets 0, for ``"max"`` too (as
    PyTorch Geometric's aggregations).

    Example::

        >>> import torch
        >>> x = torch.tensor([[1.0], [2.0], [4.0]])                 # (N, F)
        >>> edges = torch.tensor([[0, 1, 2], [2, 2, 0]])             # 0 -> 2, 1 -> 2, 2 -> 0
        >>> aggregate_neighbours(x, edges=edges, how="mean").flatten()
        tensor([4.0000, 0.0000, 1.5000])
    """
    if how not in _HOW:
        raise ValueError(f"how must be one of {_HOW}, got {how!r}")
    if not isinstance(x, Tensor) or x.dim() < 2:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"aggregate_neighbours: x must be a float tensor (..., N, F), got {got}")
    _check_graph("aggregate_neighbours", x, adj, x.shape[-1], edges)
    if edges is None:
        if edge_mask is not None:
            raise ValueError("aggregate_neighbours: edge_mask goes with edges; with adj, "
                             "leave the masked edges out of adj")
        if adj.dtype != torch.bool:
            raise ValueError(f"aggregate_neighbours: adj must be a bool tensor, got {adj.dtype}")
        if how == "max":  # (..., N, N, F): fine for the small graphs adj is for
            scores = x.unsqueeze(-3).masked_fill(~adj.unsqueeze(-1), -torch.inf)
            return scores.amax(-2).masked_fill(~adj.any(-1, keepdim=True), 0.0)
        a = adj.to(x.dtype)
        total = a @ x  # (..., N, F)
        return total if how == "sum" else total / a.sum(-1, keepdim=True).clamp_min(1)
    _check_edges("aggregate_neighbours", x, edges, {"edge_mask": edge_mask})
    if edge_mask is not None and edge_mask.dtype != torch.bool:
        raise ValueError(f"aggregate_neighbours: edge_mask must be a bool tensor, "
                         f"got {edge_mask.dtype}")
    lead, N, F = x.shape[:-2], x.shape[-2], x.shape[-1]
    M = lead.numel() * N  # nodes of all graphs
    src, dst = _flat_edges(x, edges)  # (G*E,) each
    msg = x.reshape(M, F).index_select(0, src)  # (G*E, F)
    keep = None if edge_mask is None else _flat_per_edge(edge_mask, lead).unsqueeze(-1)
    if how == "max":
        if keep is not None:
            msg = msg.masked_fill(~keep, -torch.inf)
        out = _extreme(msg, dst, M, "amax")  # (M, F), -inf where nothing came
        out = out.masked_fill(out == -torch.inf, 0.0)
    else:
        if keep is not None:
            msg = msg * keep.to(x.dtype)
        out = _sum(msg, dst, M)  # (M, F)
        if how == "mean":
            ones = x.new_ones(src.shape) if keep is None else keep.squeeze(-1).to(x.dtype)
            out = out / _sum(ones, dst, M).clamp_min(1).unsqueeze(-1)
    return out.reshape(*lead, N, F)


class SAGEConv(nn.Module):
    """GraphSAGE (Hamilton et al. 2017): ``out_i = W_n agg_{j -> i} x_j + W_r x_i + b``.

    ``agg`` is ``aggr``: ``"mean"`` (default), ``"sum"`` or ``"max"`` of the in-neighbours'
    features (0 for a node without any). ``x: (..., N, in_dim)`` and the graph as
    ``adj: (..., N, N)`` bool or ``edges: (..., 2, E)`` (optional bool ``edge_mask``)
    -> ``(..., N, out_dim)``. The parameters (``lin_l``: neighbours, with the bias;
    ``lin_r``: the node itself) and the result are those of PyTorch Geometric's
    ``SAGEConv`` (the tests hold them equal in float64).

    Example::

        >>> import torch, torchfn
        >>> from torchfn import random
        >>> model = torchfn.Model(SAGEConv(3, 8))
        >>> params = model.init(random.key(0))
        >>> x = random.normal(random.key(1), (5, 3))                  # (N, in_dim)
        >>> ring = torch.stack([torch.arange(5), torch.arange(5).roll(-1)])  # (2, E)
        >>> model.apply(params, x, edges=ring).shape
        torch.Size([5, 8])
    """

    def __init__(self, in_dim: int, out_dim: int, aggr: str = "mean", bias: bool = True):
        super().__init__()
        if aggr not in _HOW:
            raise ValueError(f"SAGEConv: aggr must be one of {_HOW}, got {aggr!r}")
        self.in_dim, self.aggr = in_dim, aggr
        self.lin_l = nn.Linear(in_dim, out_dim, bias=bias)  # the neighbours
        self.lin_r = nn.Linear(in_dim, out_dim, bias=False)  # the node itself

    def forward(self, x: Tensor, adj: Tensor | None = None, *, edges: Tensor | None = None,
                edge_mask: Tensor | None = None) -> Tensor:
        _check_graph("SAGEConv", x, adj, self.in_dim, edges)
        agg = aggregate_neighbours(x, adj, edges=edges, edge_mask=edge_mask, how=self.aggr)
        return self.lin_l(agg) + self.lin_r(x)


class GINConv(nn.Module):
    """The graph isomorphism network layer (Xu et al. 2019):
    ``out_i = mlp((1 + eps) x_i + sum_{j -> i} x_j)``.

    ``mlp`` is any module on the last dim (for example ``models.MLP``); ``eps`` is a
    constant, or a learned parameter with ``train_eps=True``. ``x: (..., N, F)`` and the
    graph as ``adj: (..., N, N)`` bool or ``edges: (..., 2, E)`` (optional bool
    ``edge_mask``) -> ``mlp``'s output per node. As PyTorch Geometric's ``GINConv``
    (the tests hold them equal in float64).

    Example::

        >>> import torch, torchfn
        >>> from torchfn import random
        >>> from torchfn.models import MLP
        >>> model = torchfn.Model(GINConv(MLP(3, (16,), 8), train_eps=True))
        >>> params = model.init(random.key(0))
        >>> x = random.normal(random.key(1), (5, 3))                  # (N, F)
        >>> ring = torch.stack([torch.arange(5), torch.arange(5).roll(-1)])  # (2, E)
        >>> model.apply(params, x, edges=ring).shape, float(params["eps"])
        (torch.Size([5, 8]), 0.0)
    """

    def __init__(self, mlp: nn.Module, eps: float = 0.0, train_eps: bool = False):
        super().__init__()
        if not isinstance(mlp, nn.Module):
            raise TypeError(f"GINConv: mlp must be an nn.Module, got {type(mlp).__name__}")
        self.mlp, self._eps0 = mlp, float(eps)
        self.eps = nn.Parameter(torch.tensor(self._eps0)) if train_eps else self._eps0

    def reset_parameters(self) -> None:
        """A learned ``eps`` starts at the given value (the mlp resets itself)."""
        if isinstance(self.eps, nn.Parameter):
            with torch.no_grad():
                self.eps.fill_(self._eps0)

    def forward(self, x: Tensor, adj: Tensor | None = None, *, edges: Tensor | None = None,
                edge_mask: Tensor | None = None) -> Tensor:
        agg = aggregate_neighbours(x, adj, edges=edges, edge_mask=edge_mask, how="sum")
        return self.mlp((1 + self.eps) * x + agg)
