"""Graph layers on an edge list: ``torchfn.models`` vs PyTorch Geometric, same weights,
same run, and torchfn's own dense-adjacency path on the same graph.

Run (about a minute):
    .venv/bin/pytest bench/test_bench_graph.py --benchmark-only -q -p no:randomly \\
        --benchmark-columns=min,median,mean

The graph: N=4096 nodes, 16 random in-edges per node (E=65536, directed, no self
loops), 64 features
in and out, fp32. Groups:

- ``gcn-fwd-bwd``: forward and backward of ``out.pow(2).mean()``: ``GraphConv`` on
  ``edges``, PyG's ``GCNConv`` (its normalisation cache off, as in training on changing
  graphs), and ``GraphConv`` on the dense (N, N) adjacency.
- ``attention-fwd-bwd``: the same for ``GraphAttention`` (4 heads) against PyG's
  ``TransformerConv(root_weight=False)`` followed by the same output layer.
- ``gat-fwd-bwd``: ``GATConv`` (4 heads of 16, concatenated) against PyG's ``GATConv``.
- ``sage-fwd-bwd``: ``SAGEConv`` (mean) against PyG's ``SAGEConv``.
- ``gcn-per-graph``: per-graph gradients of a 2-layer GCN over 16 small graphs (N=64,
  E=512 each, each with its own edges): ``vmap(grad)`` of torchfn's edge-list layers
  against a Python loop of PyG's. ``GCNConv`` fails under ``vmap`` over edge lists (its
  ``add_remaining_self_loops`` indexes with a boolean mask), and a PyG ``Batch`` of the
  graphs gives one gradient for all of them, so the loop is what a PyG user writes.
"""

import pytest
import torch
from torch import nn
from torch.func import grad, vmap

import torchfn
from torchfn import random
from torchfn.models import GATConv, GraphAttention, GraphConv, SAGEConv

pyg = pytest.importorskip("torch_geometric.nn", reason="PyG is the peer compared to")

N, DEG, F = 4096, 16, 64


def _graph(N=N, deg=DEG, seed=0):
    k1, k2 = random.split(random.key(seed))
    x = random.normal(k1, (N, F))  # (N, F)
    dst = torch.arange(N).repeat_interleave(deg)  # (E,): deg in-edges per node
    src = (dst + random.randint(k2, (N * deg,), 1, N)) % N  # (E,), no self loops: GCNConv
    # keeps one of a node's duplicate self loops, where torchfn adds their weights up
    return x, torch.stack([src, dst])  # (2, E)


def _pair_gcn():
    ours = GraphConv(F, F)
    theirs = pyg.GCNConv(F, F, cached=False)
    with torch.no_grad():
        theirs.lin.weight.copy_(ours.linear.weight)
        theirs.bias.copy_(ours.bias)
    return ours, theirs


class _PyGAttention(nn.Module):
    """TransformerConv without its skip, then an output layer: ``GraphAttention``."""

    def __init__(self, ours: GraphAttention):
        super().__init__()
        h = ours.heads
        self.conv = pyg.TransformerConv(F, F // h, heads=h, root_weight=False)
        self.out = nn.Linear(F, F)
        with torch.no_grad():
            for lin, w, b in zip((self.conv.lin_query, self.conv.lin_key, self.conv.lin_value),
                                 ours.qkv.weight.chunk(3), ours.qkv.bias.chunk(3)):
                lin.weight.copy_(w)
                lin.bias.copy_(b)
            self.out.load_state_dict(ours.out.state_dict())

    def forward(self, x, edges):
        return self.out(self.conv(x, edges))


@pytest.mark.parametrize("impl", ["torchfn edges", "pyg", "torchfn dense adj"])
@pytest.mark.parametrize("kind", ["gcn", "attention", "gat", "sage"])
def test_fwd_bwd(benchmark, kind, impl):
    benchmark.group = f"{kind}-fwd-bwd"
    x, edges = _graph()
    if kind == "gcn":
        ours, theirs = _pair_gcn()
    elif kind == "sage":
        ours, theirs = SAGEConv(F, F), pyg.SAGEConv(F, F)
        theirs.load_state_dict(ours.state_dict())
    elif kind == "gat":
        ours, theirs = GATConv(F, F // 4, heads=4), pyg.GATConv(F, F // 4, heads=4)
        with torch.no_grad():
            theirs.lin.weight.copy_(ours.linear.weight)
            theirs.att_src.copy_(ours.att_src[None])
            theirs.att_dst.copy_(ours.att_dst[None])
    else:
        ours = GraphAttention(F, heads=4, self_loops=False)
        theirs = _PyGAttention(ours)
    adj = torch.zeros(N, N, dtype=torch.bool)
    adj[edges[1], edges[0]] = True
    if kind == "gcn":  # duplicate random edges add up on the edge list: count them in adj
        adj = torch.zeros(N, N).index_put_((edges[1], edges[0]), torch.ones(N * DEG),
                                           accumulate=True)
    call = {"torchfn edges": lambda: ours(x, edges=edges), "pyg": lambda: theirs(x, edges),
            "torchfn dense adj": lambda: ours(x, adj)}[impl]
    m = theirs if impl == "pyg" else ours

    def step():
        m.zero_grad(set_to_none=True)
        out = call()
        out.pow(2).mean().backward()
        return out

    out = benchmark.pedantic(step, rounds=10, warmup_rounds=2)
    if kind == "gcn" or impl != "torchfn dense adj":  # duplicates count twice on edges
        assert torch.allclose(out, theirs(x, edges) if impl != "pyg" else ours(x, edges=edges),
                              atol=1e-4)


class _GCN2(nn.Module):
    """Two graph convolutions with a ReLU between: ``layer(x, edges)`` for either kind."""

    def __init__(self, l1, l2, pyg_style):
        super().__init__()
        self.l1, self.l2, self.pyg_style = l1, l2, pyg_style

    def forward(self, x, edges):
        conv = (lambda layer, h: layer(h, edges)) if self.pyg_style else (
            lambda layer, h: layer(h, edges=edges))
        return conv(self.l2, conv(self.l1, x).relu())


@pytest.mark.parametrize("impl", ["torchfn vmap(grad)", "pyg loop"])
def test_per_graph_grads(benchmark, impl):
    benchmark.group = "gcn-per-graph"
    graphs = [_graph(64, 8, seed) for seed in range(16)]
    xs = torch.stack([g[0] for g in graphs])  # (16, 64, F)
    edges = torch.stack([g[1] for g in graphs])  # (16, 2, 512)
    (o1, t1), (o2, t2) = _pair_gcn(), _pair_gcn()
    ours = _GCN2(o1, o2, pyg_style=False)
    model, theirs = torchfn.Model(ours), _GCN2(t1, t2, pyg_style=True)
    params = {k: v.detach() for k, v in ours.state_dict().items()}

    def loss(p, x, e):  # ONE graph
        return model.apply(p, x, e).pow(2).mean()

    per_graph = vmap(grad(loss), in_dims=(None, 0, 0))

    def loop():
        rows = []
        for x, e in graphs:
            theirs.zero_grad(set_to_none=True)
            theirs(x, e).pow(2).mean().backward()
            rows.append(theirs.l1.lin.weight.grad)
        return torch.stack(rows)

    if impl == "pyg loop":
        got = benchmark.pedantic(loop, rounds=10, warmup_rounds=1)
        want = per_graph(params, xs, edges)["l1.linear.weight"]
    else:
        got = benchmark.pedantic(per_graph, args=(params, xs, edges), rounds=10,
                                 warmup_rounds=1)["l1.linear.weight"]
        want = loop()
    assert torch.allclose(got, want, atol=1e-5)
