"""GraphConv and GraphAttention on edge lists: equal to the dense-adjacency layers on the
same graph, to PyTorch Geometric's GCNConv and TransformerConv, and under vmap / grad /
jvp / torch.compile; padded == unpadded under vmap for every edge-list layer."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.func import grad, jvp, vmap

import torchfn
from torchfn import random
from torchfn.models import GATConv, GINConv, GraphAttention, GraphConv, SAGEConv


def _model(layer, seed=0):
    model = torchfn.Model(layer.double())
    params = model.init(random.key(seed))
    keys = random.split(random.key(seed + 1), len(params))
    params = {k: v + 0.1 * random.normal(keys[i], v.shape, v.dtype)  # biases off zero
              for i, (k, v) in enumerate(sorted(params.items()))}
    return model, params


def _directed(seed, B, N, F, p=0.35):
    """Features, a directed bool adjacency (self loops on some nodes), and its edges
    (``adj[..., i, j]`` is the edge j -> i) listed in a shuffled order."""
    k1, k2, k3 = random.split(random.key(seed), 3)
    x = random.normal(k1, (*B, N, F), torch.float64)
    adj = random.bernoulli(k2, p, (*B, N, N))
    return x, adj, k3


def _edges_of(adj, key):
    """``(2, E)`` (source, target) edges of one (N, N) adjacency, shuffled."""
    i, j = adj.nonzero().T
    order = random.permutation(key, len(i))
    return torch.stack([j, i])[:, order]


@given(seed=st.integers(0, 2**16), N=st.integers(1, 9), weighted=st.booleans(),
       self_loops=st.booleans())
def test_graph_conv_on_edges_equals_it_on_the_adjacency(seed, N, weighted, self_loops):
    model, params = _model(GraphConv(4, 5, self_loops=self_loops), seed)
    x, adj, key = _directed(seed, (), N, 4)
    edges = _edges_of(adj, key)
    w = random.uniform(random.key(seed + 3), (edges.shape[1],), torch.float64, 0.5, 2.0)
    dense = torch.zeros(N, N, dtype=torch.float64)
    dense[edges[1], edges[0]] = w if weighted else 1.0
    got = model.apply(params, x, edges=edges, edge_weight=w if weighted else None)
    assert torch.allclose(got, model.apply(params, x, dense), atol=1e-12)


@given(seed=st.integers(0, 2**16), N=st.integers(1, 9), heads=st.sampled_from([1, 2]),
       self_loops=st.booleans())
def test_graph_attention_on_edges_equals_it_on_the_adjacency(seed, N, heads, self_loops):
    model, params = _model(GraphAttention(4, heads=heads, self_loops=self_loops), seed)
    x, adj, key = _directed(seed, (), N, 4)
    got = model.apply(params, x, edges=_edges_of(adj, key))
    assert torch.allclose(got, model.apply(params, x, adj), atol=1e-12)


@pytest.mark.parametrize("layer", [GraphConv(4, 3), GraphAttention(4, heads=2)],
                         ids=["conv", "attention"])
def test_batched_graphs_with_shared_or_own_edges(layer):
    model, params = _model(layer)
    x, adj, key = _directed(1, (3,), 6, 4)
    shared = _edges_of(adj[0], key)
    want = torch.stack([model.apply(params, x[b], adj[0]) for b in range(3)])
    assert torch.allclose(model.apply(params, x, edges=shared), want, atol=1e-12)
    own = [_edges_of(adj[b], key) for b in range(3)]
    E = min(e.shape[1] for e in own)  # a common E: drop the extra edges from adj too
    own = torch.stack([e[:, :E] for e in own])  # (3, 2, E)
    dense = torch.zeros_like(adj)
    for b in range(3):
        dense[b, own[b, 1], own[b, 0]] = True
    assert torch.allclose(model.apply(params, x, edges=own), model.apply(params, x, dense),
                          atol=1e-12)


@pytest.mark.parametrize(
    "layer",
    [GraphConv(4, 3), GraphAttention(4, heads=2), GATConv(4, 3, heads=2),
     SAGEConv(4, 3), SAGEConv(4, 3, aggr="max"), GINConv(nn.Linear(4, 3), train_eps=True)],
    ids=["conv", "attention", "gat", "sage-mean", "sage-max", "gin"],
)
def test_padded_edge_lists_under_vmap_equal_each_graph_alone(layer):
    """Graphs with 5, 9 and 13 edges padded to 16: the padding weighs 0 (GraphConv) or is
    masked out (``edge_mask``, every other layer); vmap over the graphs == each unpadded
    graph alone, and per-graph gradients too."""
    model, params = _model(layer)
    x, adj, key = _directed(2, (3,), 7, 4)
    lists = [_edges_of(adj[b], key)[:, :n] for b, n in enumerate((5, 9, 13))]
    pad = lambda e: torch.cat([e, torch.zeros(2, 16 - e.shape[1], dtype=e.dtype)], 1)  # noqa: E731
    edges = torch.stack([pad(e) for e in lists])  # (3, 2, 16): padding 0 -> 0
    real = torch.arange(16) < torch.tensor([5, 9, 13])[:, None]  # (3, 16)
    arg = "edge_weight" if isinstance(layer, GraphConv) else "edge_mask"
    extra = real.double() if arg == "edge_weight" else real

    def one(p, x, e, m):
        return model.apply(p, x, edges=e, **{arg: m})

    out = vmap(one, in_dims=(None, 0, 0, 0))(params, x, edges, extra)
    loss = lambda p, x, e, m: one(p, x, e, m).pow(2).sum()  # noqa: E731
    per = vmap(grad(loss), in_dims=(None, 0, 0, 0))(params, x, edges, extra)
    for b, e in enumerate(lists):
        assert torch.allclose(out[b], model.apply(params, x[b], edges=e), atol=1e-12)
        g = grad(lambda p, x=x[b], e=e: model.apply(p, x, edges=e).pow(2).sum())(params)
        assert all(torch.allclose(per[k][b], g[k], atol=1e-12) for k in g)


@pytest.mark.parametrize("layer", [GraphConv(4, 3), GraphAttention(4, heads=2)],
                         ids=["conv", "attention"])
def test_grad_jvp_and_compile_equal_the_dense_layer(layer):
    model, params = _model(layer)
    x, adj, key = _directed(3, (), 8, 4)
    edges = _edges_of(adj, key)
    on_edges = lambda p, x: model.apply(p, x, edges=edges).pow(2).sum()  # noqa: E731
    on_adj = lambda p, x: model.apply(p, x, adj).pow(2).sum()  # noqa: E731
    ge, gd = grad(on_edges, argnums=(0, 1))(params, x), grad(on_adj, argnums=(0, 1))(params, x)
    assert torch.allclose(ge[1], gd[1], atol=1e-12)
    assert all(torch.allclose(ge[0][k], gd[0][k], atol=1e-12) for k in gd[0])
    dx = random.normal(random.key(4), x.shape, torch.float64)
    _, te = jvp(lambda x: model.apply(params, x, edges=edges), (x,), (dx,))
    _, td = jvp(lambda x: model.apply(params, x, adj), (x,), (dx,))
    assert torch.allclose(te, td, atol=1e-12)
    f = torch.compile(lambda x, e: model.apply(params, x, edges=e), fullgraph=True)
    assert torch.allclose(f(x, edges), model.apply(params, x, adj), atol=1e-12)


@given(seed=st.integers(0, 2**16), N=st.integers(2, 9))
def test_graph_conv_equals_pyg_gcnconv(seed, N):
    """PyTorch Geometric's GCNConv (add_remaining_self_loops, symmetric normalisation by
    the in-degree) on the same directed, weighted edge list, in float64."""
    pyg = pytest.importorskip("torch_geometric.nn", reason="PyG is the peer compared to")
    model, params = _model(GraphConv(4, 5), seed)
    x, adj, key = _directed(seed, (), N, 4)
    edges = _edges_of(adj, key)
    w = random.uniform(random.key(seed + 3), (edges.shape[1],), torch.float64, 0.5, 2.0)
    peer = pyg.GCNConv(4, 5).double()
    with torch.no_grad():
        peer.lin.weight.copy_(params["linear.weight"])
        peer.bias.copy_(params["bias"])
    want = peer(x, edges, w)
    assert torch.allclose(model.apply(params, x, edges=edges, edge_weight=w), want, atol=1e-12)


@given(seed=st.integers(0, 2**16), N=st.integers(2, 9), heads=st.sampled_from([1, 2]))
def test_graph_attention_equals_pyg_transformerconv(seed, N, heads):
    """PyTorch Geometric's TransformerConv without its skip (root_weight=False): the
    softmax of q_i . k_j / sqrt(d) over each node's incoming edges, then our output
    layer. Without self loops, as TransformerConv adds none."""
    pyg = pytest.importorskip("torch_geometric.nn", reason="PyG is the peer compared to")
    model, params = _model(GraphAttention(4, heads=heads, self_loops=False), seed)
    x, adj, key = _directed(seed, (), N, 4)
    edges = _edges_of(adj, key)
    peer = pyg.TransformerConv(4, 4 // heads, heads=heads, root_weight=False).double()
    wq, wk, wv = params["qkv.weight"].chunk(3)
    bq, bk, bv = params["qkv.bias"].chunk(3)
    with torch.no_grad():
        for lin, w, b in [(peer.lin_query, wq, bq), (peer.lin_key, wk, bk),
                          (peer.lin_value, wv, bv)]:
            lin.weight.copy_(w)
            lin.bias.copy_(b)
    want = peer(x, edges) @ params["out.weight"].T + params["out.bias"]
    assert torch.allclose(model.apply(params, x, edges=edges), want, atol=1e-12)


E2 = torch.tensor([[0, 1], [1, 2]])
@pytest.mark.parametrize(
    "layer, kwargs, match",
    [
        (GraphConv(4, 3), dict(adj=torch.zeros(3, 3), edges=E2), "exactly one of adj.*both"),
        (GraphConv(4, 3), dict(), "exactly one of adj.*neither"),
        (GraphConv(4, 3), dict(edges=E2.double()), "int64 or int32 tensor"),
        (GraphConv(4, 3), dict(edges=E2.T.reshape(1, 4)), r"\(2, E\)"),
        (GraphConv(4, 3), dict(edges=torch.tensor([[0, 3]] * 2)), r"in \[0, 3\).*0 to 3"),
        (GraphConv(4, 3), dict(edges=torch.tensor([[0, -1]] * 2)), "from -1 to 0"),
        (GraphConv(4, 3), dict(edges=E2, edge_weight=torch.ones(3)), r"shape \(2,\)"),
        (GraphConv(4, 3), dict(edges=E2, edge_weight=torch.ones(2, dtype=torch.long)),
         "edge_weight must be floating point"),
        (GraphConv(4, 3), dict(adj=torch.ones(3, 3), edge_weight=torch.ones(2)),
         "edge_weight goes with edges"),
        (GraphConv(4, 3), dict(edges=E2.expand(2, 2, 2)), "batch dims"),
        (GraphAttention(4), dict(edges=E2, edge_mask=torch.ones(2)), "edge_mask must be a bool"),
        (GraphAttention(4), dict(edges=E2, edge_mask=torch.ones(5, dtype=torch.bool)),
         r"edge_mask must have shape \(2,\)"),
        (GraphAttention(4), dict(adj=torch.ones(3, 3, dtype=torch.bool),
                                 edge_mask=torch.ones(2, dtype=torch.bool)),
         "edge_mask goes with edges"),
    ],
)
def test_bad_edge_input_gets_a_clear_error(layer, kwargs, match):
    with pytest.raises(ValueError, match=match):
        layer(torch.zeros(3, 4), **kwargs)
