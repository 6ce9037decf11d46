"""GraphConv and GraphAttention: the formulas, permutation equivariance, locality, and
one graph at a time under vmap / grad / jvp."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.func import grad, jacrev, jvp, vmap

import torchfn
from torchfn import random
from torchfn.models import GraphAttention, GraphConv


def _graph(seed, B, N, F, p=0.3, dtype=torch.float64):
    k1, k2 = random.split(random.key(seed))
    x = random.normal(k1, (*B, N, F), dtype)
    adj = random.bernoulli(k2, p, (*B, N, N))
    return x, adj | adj.transpose(-1, -2)  # undirected


def _model(layer, seed=0):
    model = torchfn.Model(layer.double())
    params = model.init(random.key(seed))
    keys = random.split(random.key(seed + 1), len(params))
    params = {k: v + 0.1 * random.normal(keys[i], v.shape, v.dtype)  # biases off zero
              for i, (k, v) in enumerate(sorted(params.items()))}
    return model, params


@given(seed=st.integers(0, 2**16), N=st.integers(1, 9), batch=st.sampled_from([(), (3,)]))
def test_graph_conv_is_the_normalised_propagation(seed, N, batch):
    model, params = _model(GraphConv(4, 5), seed)
    x, adj = _graph(seed, batch, N, 4)
    a = (adj | torch.eye(N, dtype=torch.bool)).double()  # a self loop on every node
    d = a.sum(-1).rsqrt()
    want = (d[..., :, None] * a * d[..., None, :]) @ (x @ params["linear.weight"].T)
    assert torch.allclose(model.apply(params, x, adj), want + params["bias"], atol=1e-12)


def test_graph_conv_takes_edge_weights_and_keeps_given_self_loops():
    model, params = _model(GraphConv(4, 5))
    x, adj = _graph(0, (), 6, 4)
    w = adj.double() * random.uniform(random.key(3), (6, 6), torch.float64)
    w.diagonal().fill_(2.0)  # self loops already given: kept, not added again
    d = w.sum(-1).rsqrt()
    want = (d[:, None] * w * d[None, :]) @ (x @ params["linear.weight"].T) + params["bias"]
    assert torch.allclose(model.apply(params, x, w), want, atol=1e-12)


@given(seed=st.integers(0, 2**16), N=st.integers(2, 9), heads=st.sampled_from([1, 2]))
def test_graph_attention_is_softmax_over_the_neighbours(seed, N, heads):
    model, params = _model(GraphAttention(4, heads=heads), seed)
    x, adj = _graph(seed, (2,), N, 4)
    q, k, v = (x @ params["qkv.weight"].T + params["qkv.bias"]).chunk(3, dim=-1)
    split = lambda t: t.unflatten(-1, (heads, -1)).transpose(1, 2)  # noqa: E731 (B, h, N, d)
    s = split(q) @ split(k).transpose(-1, -2) * (4 // heads) ** -0.5  # (B, h, N, N)
    mask = (adj | torch.eye(N, dtype=torch.bool))[:, None]
    o = (s.masked_fill(~mask, -torch.inf).softmax(-1) @ split(v)).transpose(1, 2).flatten(-2)
    want = o @ params["out.weight"].T + params["out.bias"]
    assert torch.allclose(model.apply(params, x, adj), want, atol=1e-12)


@pytest.mark.parametrize("layer", [GraphConv(4, 4), GraphAttention(4, heads=2)],
                         ids=["conv", "attention"])
def test_relabelling_the_nodes_relabels_the_output(layer):
    model, params = _model(layer)
    x, adj = _graph(1, (), 7, 4)
    perm = random.permutation(random.key(9), 7)
    out = model.apply(params, x, adj)
    permuted = model.apply(params, x[perm], adj[perm][:, perm])
    assert torch.allclose(permuted, out[perm], atol=1e-12)


@pytest.mark.parametrize("layer", [GraphConv(4, 4), GraphAttention(4, heads=2)],
                         ids=["conv", "attention"])
def test_a_node_sees_only_its_neighbours(layer):
    model, params = _model(layer)
    x, adj = _graph(2, (), 8, 4)
    J = jacrev(lambda x: model.apply(params, x, adj))(x)  # (N, 4, N, 4)
    reach = J.abs().sum((1, 3)) > 0  # (N, N): output i depends on input j
    assert torch.equal(reach, adj | torch.eye(8, dtype=torch.bool))


@pytest.mark.parametrize("layer", [GraphConv(4, 3), GraphAttention(4, heads=2)],
                         ids=["conv", "attention"])
def test_vmap_per_graph_grads_and_jvp(layer):
    model, params = _model(layer)
    x, adj = _graph(3, (4,), 6, 4)
    batch = model.apply(params, x, adj)
    assert torch.allclose(vmap(lambda x, a: model.apply(params, x, a))(x, adj), batch,
                          atol=1e-12)
    loss = lambda p, x, a: model.apply(p, x, a).pow(2).mean()  # noqa: E731  ONE graph
    per = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, adj)
    for b in range(4):
        g = grad(loss)(params, x[b], adj[b])
        assert all(torch.allclose(per[k][b], g[k], atol=1e-12) for k in g)
    dx = random.normal(random.key(5), x[0].shape, torch.float64)
    f = lambda x: model.apply(params, x, adj[0])  # noqa: E731
    _, out_t = jvp(f, (x[0],), (dx,))
    assert torch.allclose(out_t, (jacrev(f)(x[0]) * dx).sum((-2, -1)), atol=1e-12)


def test_an_isolated_node_without_self_loop_gets_zero_attention():
    model, params = _model(GraphAttention(4, self_loops=False))
    x, adj = _graph(4, (), 5, 4)
    adj[0], adj[:, 0] = False, False
    out = model.apply(params, x, adj)
    assert torch.allclose(out[0], params["out.bias"])  # o = 0, then the output layer


@pytest.mark.parametrize(
    "layer, x, adj, match",
    [
        (GraphConv(4, 3), torch.zeros(5, 3), torch.zeros(5, 5), "x must have 4 features"),
        (GraphConv(4, 3), torch.zeros(5, 4), torch.zeros(5, 4), r"adj must be \(\.\.\., 5, 5\)"),
        (GraphConv(4, 3), torch.zeros(2, 5, 4), torch.zeros(3, 5, 5), "batch dims"),
        (GraphAttention(4), torch.zeros(5, 4), torch.zeros(5, 5), "adj must be a bool tensor"),
        (GraphConv(4, 3), torch.zeros(4), torch.zeros(4, 4), r"x must be a float tensor"),
    ],
)
def test_bad_input_gets_a_clear_error(layer, x, adj, match):
    with pytest.raises(ValueError, match=match):
        layer(x, adj)


def test_heads_must_divide_dim():
    with pytest.raises(ValueError, match="heads must be an int >= 1 dividing dim=6, got 4"):
        GraphAttention(6, heads=4)
