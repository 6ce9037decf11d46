"""Graph layers on dense adjacency matrices: ``GraphConv`` (GCN) and ``GraphAttention``.

A graph is node features ``x: (N, F)`` and an adjacency ``adj: (N, N)`` (bool, or float
edge weights), optionally with leading batch dims. Dense adjacency keeps every graph
a pair of tensors, so ``vmap`` over graphs, per-graph gradients and ``jvp`` need
nothing special (pad graphs of different sizes to one N; padded nodes without edges
stay isolated).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["GraphConv", "GraphAttention"]


def _check_graph(name: str, x: object, adj: object, features: int) -> None:
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() < 2:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{name}: x must be a float tensor (..., N, {features}), got {got}")
    if x.shape[-1] != features:
        raise ValueError(f"{name}: x must have {features} features in its last dim, "
                         f"got shape {tuple(x.shape)}")
    N = x.shape[-2]
    if not isinstance(adj, Tensor) or adj.dim() < 2 or adj.shape[-2:] != (N, N):
        got = tuple(adj.shape) if isinstance(adj, Tensor) else type(adj).__name__
        raise ValueError(f"{name}: adj must be (..., {N}, {N}) for x with N={N} nodes, "
                         f"got {got}")
    if adj.shape[:-2] != x.shape[:-2] and adj.dim() > 2:
        raise ValueError(f"{name}: adj's batch dims {tuple(adj.shape[:-2])} must equal x's "
                         f"{tuple(x.shape[:-2])} (or adj be one (N, N) graph for all)")


def _with_self_loops(adj: Tensor) -> Tensor:
    eye = torch.eye(adj.shape[-1], dtype=torch.bool, device=adj.device)
    if adj.dtype == torch.bool:
        return adj | eye
    return adj + eye.to(adj.dtype) * (adj.diagonal(dim1=-2, dim2=-1) == 0).unsqueeze(-1)


class GraphConv(nn.Module):
    """Kipf & Welling's graph convolution: ``D^-1/2 (A + I) D^-1/2 x W^T + b``.

    ``x: (..., N, in_dim)``, ``adj: (..., N, N)`` (bool or float weights; a self loop is
    added where the diagonal is 0 unless ``self_loops=False``) -> ``(..., N, out_dim)``.
    ``D`` is the degree (row sums) of the adjacency used.

    Example::

        >>> import torch, torchfn
        >>> from torchfn import random
        >>> model = torchfn.Model(GraphConv(3, 8))
        >>> params = model.init(random.key(0))
        >>> x = random.normal(random.key(1), (5, 3))              # (N, F): 5 nodes
        >>> adj = torch.eye(5, dtype=torch.bool).roll(1, 0)        # a directed ring
        >>> model.apply(params, x, adj | adj.T).shape
        torch.Size([5, 8])
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

    def forward(self, x: Tensor, adj: Tensor) -> Tensor:
        _check_graph("GraphConv", x, adj, self.in_dim)
        a = _with_self_loops(adj) if self.self_loops else adj
        a = a.to(x.dtype)  # (..., N, N)
        d = a.sum(-1).clamp_min(torch.finfo(x.dtype).tiny).rsqrt()  # (..., N); isolated -> 0 rows
        out = (d.unsqueeze(-1) * a * d.unsqueeze(-2)) @ self.linear(x)  # (..., N, out)
        return out if self.bias is None else out + self.bias


class GraphAttention(nn.Module):
    """Multi-head dot-product self-attention restricted to the edges of a graph.

    As graph transformers (Dwivedi & Bresson 2021) do, not GAT's additive scores: node
    ``i`` attends to its neighbours ``j`` (``adj[i, j]`` True) and, with ``self_loops``,
    to itself; a node with no neighbours gets 0. ``x: (..., N, dim)``,
    ``adj: (..., N, N)`` bool -> ``(..., N, dim)``. The attention is
    ``torchfn.kernels.attention`` with the adjacency as its boolean mask: fused on a
    GPU, and it works under ``vmap``, ``grad``, ``jvp`` and ``torch.compile``.

    Example::

        >>> import torch, torchfn
        >>> from torchfn import random
        >>> model = torchfn.Model(GraphAttention(16, heads=4))
        >>> params = model.init(random.key(0))
        >>> x = random.normal(random.key(1), (2, 6, 16))          # (B, N, dim)
        >>> adj = random.bernoulli(random.key(2), 0.3, (2, 6, 6))  # (B, N, N)
        >>> model.apply(params, x, adj).shape
        torch.Size([2, 6, 16])
    """

    def __init__(self, dim: int, heads: int = 1, self_loops: bool = True):
        super().__init__()
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or dim % heads:
            raise ValueError(f"GraphAttention: heads must be an int >= 1 dividing dim={dim}, "
                             f"got {heads!r}")
        self.dim, self.heads, self.self_loops = dim, heads, self_loops
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: Tensor, adj: Tensor) -> Tensor:
        from torchfn.kernels import attention

        _check_graph("GraphAttention", x, adj, self.dim)
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
