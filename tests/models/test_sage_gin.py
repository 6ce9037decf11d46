"""aggregate_neighbours, SAGEConv and GINConv: the aggregation equals a loop over the
nodes, dense == edges, and both equal PyTorch Geometric's layers in float64 (padded
edge lists under vmap: test_graph_edges.py)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.func import jvp

import torchfn
from torchfn import random
from torchfn.models import MLP, GINConv, SAGEConv, aggregate_neighbours


def _graph(seed, B, N, F=4, p=0.35):
    k1, k2, k3 = random.split(random.key(seed), 3)
    x = random.normal(k1, (*B, N, F), torch.float64)
    adj = random.bernoulli(k2, p, (*B, N, N))  # adj[..., i, j]: the edge j -> i
    return x, adj, k3


def _edges_of(adj, key):
    i, j = adj.nonzero().T
    return torch.stack([j, i])[:, random.permutation(key, len(i))]


def _model(layer, seed=0):
    model = torchfn.Model(layer.double())
    params = model.init(random.key(seed))
    keys = random.split(random.key(seed + 1), len(params))
    params = {k: v + 0.1 * random.normal(keys[i], v.shape, v.dtype)  # eps, biases off zero
              for i, (k, v) in enumerate(sorted(params.items()))}
    return model, params


@given(seed=st.integers(0, 2**16), N=st.integers(1, 8),
       how=st.sampled_from(["sum", "mean", "max"]))
def test_aggregation_is_the_loop_on_adj_and_on_edges(seed, N, how):
    x, adj, key = _graph(seed, (), N)
    reduce = {"sum": lambda r: r.sum(0), "mean": lambda r: r.mean(0),
              "max": lambda r: r.amax(0)}[how]
    want = torch.stack([reduce(x[adj[i]]) if adj[i].any() else torch.zeros(4, dtype=x.dtype)
                        for i in range(N)])
    assert torch.allclose(aggregate_neighbours(x, adj, how=how), want, atol=1e-12)
    got = aggregate_neighbours(x, edges=_edges_of(adj, key), how=how)
    assert torch.allclose(got, want, atol=1e-12)


@given(seed=st.integers(0, 2**16), N=st.integers(2, 9),
       aggr=st.sampled_from(["sum", "mean", "max"]))
def test_sage_equals_pyg_sageconv(seed, N, aggr):
    pyg = pytest.importorskip("torch_geometric.nn", reason="PyG is the peer compared to")
    model, params = _model(SAGEConv(4, 3, aggr=aggr), seed)
    x, adj, key = _graph(seed, (), N)
    edges = _edges_of(adj, key)
    peer = pyg.SAGEConv(4, 3, aggr=aggr).double()
    peer.load_state_dict(params)
    want = peer(x, edges)
    assert torch.allclose(model.apply(params, x, edges=edges), want, atol=1e-12)
    assert torch.allclose(model.apply(params, x, adj), want, atol=1e-12)


@given(seed=st.integers(0, 2**16), N=st.integers(2, 9), train_eps=st.booleans())
def test_gin_equals_pyg_ginconv(seed, N, train_eps):
    pyg = pytest.importorskip("torch_geometric.nn", reason="PyG is the peer compared to")
    model, params = _model(GINConv(MLP(4, (6,), 3), eps=0.3, train_eps=train_eps), seed)
    x, adj, key = _graph(seed, (), N)
    edges = _edges_of(adj, key)
    peer = pyg.GINConv(MLP(4, (6,), 3), eps=0.3, train_eps=train_eps).double()
    peer.nn.load_state_dict({k[4:]: v for k, v in params.items() if k.startswith("mlp.")})
    # (GINConv resets its nn when built: load the weights after) and its eps was made
    # in float32 before .double(): 0.3 rounded; set it in float64
    eps = params["eps"] if train_eps else torch.tensor(0.3, dtype=torch.float64)
    with torch.no_grad():
        peer.eps.copy_(eps.reshape(1))
    want = peer(x, edges)
    assert torch.allclose(model.apply(params, x, edges=edges), want, atol=1e-12)
    assert torch.allclose(model.apply(params, x, adj), want, atol=1e-12)


def test_jvp_and_batched_dense_graphs():
    model, params = _model(SAGEConv(4, 3))
    x, adj, key = _graph(3, (2,), 6)
    out = model.apply(params, x, adj)
    assert torch.allclose(out[1], model.apply(params, x[1], adj[1]), atol=1e-12)
    edges = _edges_of(adj[0], key)
    dx = random.normal(random.key(4), x[0].shape, torch.float64)
    _, te = jvp(lambda x: model.apply(params, x, edges=edges), (x[0],), (dx,))
    _, td = jvp(lambda x: model.apply(params, x, adj[0]), (x[0],), (dx,))
    assert torch.allclose(te, td, atol=1e-12)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x: aggregate_neighbours(x, torch.ones(3, 3, dtype=torch.bool), how="min"),
         "how must be one of"),
        (lambda x: aggregate_neighbours(x, torch.ones(3, 3)), "adj must be a bool tensor"),
        (lambda x: aggregate_neighbours(x, edges=torch.tensor([[0], [1]]),
                                        edge_mask=torch.ones(1)), "edge_mask must be a bool"),
        (lambda x: SAGEConv(4, 2)(x), "exactly one of adj"),
        (lambda x: SAGEConv(4, 2, aggr="lstm"), "aggr must be one of"),
        (lambda x: GINConv(lambda h: h), "mlp must be an nn.Module"),
    ],
)
def test_bad_input_gets_a_clear_error(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call(torch.zeros(3, 4))
