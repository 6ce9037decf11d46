"""GATConv: the same on dense adjacency and on edge lists, equal to PyTorch Geometric's
GATConv in float64, and under grad / jvp / compile (padded edge lists under vmap:
test_graph_edges.py)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.func import grad, jvp

import torchfn
from torchfn import random
from torchfn.models import GATConv


def _model(layer, seed=0):
    model = torchfn.Model(layer.double())
    params = model.init(random.key(seed))
    keys = random.split(random.key(seed + 1), len(params))
    params = {k: v + 0.1 * random.normal(keys[i], v.shape, v.dtype)  # the bias off zero
              for i, (k, v) in enumerate(sorted(params.items()))}
    return model, params


def _graph(seed, B, N, F, p=0.35):
    """Features, a directed bool adjacency (some self loops) and its (source, target)
    edges (``adj[..., i, j]`` is the edge j -> i), shuffled."""
    k1, k2, k3 = random.split(random.key(seed), 3)
    x = random.normal(k1, (*B, N, F), torch.float64)
    adj = random.bernoulli(k2, p, (*B, N, N))
    return x, adj, k3


def _edges_of(adj, key):
    i, j = adj.nonzero().T
    return torch.stack([j, i])[:, random.permutation(key, len(i))]


def _reference(params, x, adj, heads, out, concat, slope=0.2):
    """GAT written out with loops over heads and nodes, from the paper."""
    N = x.shape[0]
    h = (x @ params["linear.weight"].T).reshape(N, heads, out)
    rows = []
    for i in range(N):
        per_head = []
        for k in range(heads):
            nbrs = adj[i].nonzero().flatten()
            if len(nbrs) == 0:
                per_head.append(torch.zeros(out, dtype=x.dtype))
                continue
            e = torch.nn.functional.leaky_relu(
                params["att_dst"][k] @ h[i, k] + h[nbrs, k] @ params["att_src"][k], slope)
            per_head.append(e.softmax(0) @ h[nbrs, k])
        stacked = torch.stack(per_head)  # (heads, out)
        rows.append(stacked.flatten() if concat else stacked.mean(0))
    return torch.stack(rows) + params["bias"]


@given(seed=st.integers(0, 2**16), N=st.integers(1, 8), heads=st.sampled_from([1, 3]),
       concat=st.booleans(), self_loops=st.booleans())
def test_dense_and_edges_equal_the_loop(seed, N, heads, concat, self_loops):
    model, params = _model(GATConv(4, 5, heads=heads, concat=concat, self_loops=self_loops),
                           seed)
    x, adj, key = _graph(seed, (), N, 4)
    mask = adj | torch.eye(N, dtype=torch.bool) if self_loops else adj
    want = _reference(params, x, mask, heads, 5, concat)
    assert torch.allclose(model.apply(params, x, adj), want, atol=1e-12)
    assert torch.allclose(model.apply(params, x, edges=_edges_of(adj, key)), want, atol=1e-12)


@given(seed=st.integers(0, 2**16), N=st.integers(2, 9), heads=st.sampled_from([1, 2]),
       concat=st.booleans())
def test_equals_pyg_gatconv(seed, N, heads, concat):
    pyg = pytest.importorskip("torch_geometric.nn", reason="PyG is the peer compared to")
    model, params = _model(GATConv(4, 3, heads=heads, concat=concat), seed)
    x, adj, key = _graph(seed, (), N, 4)
    edges = _edges_of(adj, key)  # unique edges, some self loops: PyG keeps one of each
    peer = pyg.GATConv(4, 3, heads=heads, concat=concat).double()
    with torch.no_grad():
        peer.lin.weight.copy_(params["linear.weight"])
        peer.att_src.copy_(params["att_src"][None])
        peer.att_dst.copy_(params["att_dst"][None])
        peer.bias.copy_(params["bias"])
    assert torch.allclose(model.apply(params, x, edges=edges), peer(x, edges), atol=1e-12)


def test_batched_dense_grad_jvp_and_compile():
    model, params = _model(GATConv(4, 3, heads=2))
    x, adj, key = _graph(3, (2,), 6, 4)
    out = model.apply(params, x, adj)
    assert torch.allclose(out[1], model.apply(params, x[1], adj[1]), atol=1e-12)
    edges = _edges_of(adj[0], key)
    on_edges = lambda p, x: model.apply(p, x, edges=edges).pow(2).sum()  # noqa: E731
    on_adj = lambda p, x: model.apply(p, x, adj[0]).pow(2).sum()  # noqa: E731
    ge, gd = grad(on_edges)(params, x[0]), grad(on_adj)(params, x[0])
    assert all(torch.allclose(ge[k], gd[k], atol=1e-12) for k in gd)
    dx = random.normal(random.key(4), x[0].shape, torch.float64)
    _, te = jvp(lambda x: model.apply(params, x, edges=edges), (x[0],), (dx,))
    _, td = jvp(lambda x: model.apply(params, x, adj[0]), (x[0],), (dx,))
    assert torch.allclose(te, td, atol=1e-12)
    f = torch.compile(lambda x, e: model.apply(params, x, edges=e), fullgraph=True)
    assert torch.allclose(f(x[0], edges), out[0], atol=1e-12)


def test_a_node_without_in_neighbours_gets_the_bias():
    model, params = _model(GATConv(4, 3, heads=2, self_loops=False))
    x, adj, _ = _graph(4, (), 5, 4)
    adj[0] = False  # node 0 receives nothing
    out = model.apply(params, x, adj)
    assert torch.isfinite(out).all() and torch.allclose(out[0], params["bias"])
    g = grad(lambda x: model.apply(params, x, adj).sum())(x)
    assert torch.isfinite(g).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(adj=torch.ones(3, 3)), "adj must be a bool tensor"),
        (dict(edges=torch.tensor([[0, 1], [1, 2]]), edge_mask=torch.ones(2)),
         "edge_mask must be a bool tensor"),
        (dict(adj=torch.ones(3, 3, dtype=torch.bool), edge_mask=torch.ones(2, dtype=torch.bool)),
         "edge_mask goes with edges"),
        (dict(), "exactly one of adj"),
        (dict(edges=torch.tensor([[0, 5]] * 2)), r"in \[0, 3\)"),
    ],
)
def test_bad_input_gets_a_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GATConv(4, 2)(torch.zeros(3, 4), **kwargs)


def test_bad_sizes():
    with pytest.raises(ValueError, match="heads must be an int >= 1, got 0"):
        GATConv(4, 2, heads=0)
