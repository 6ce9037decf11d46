"""Federated averaging: fedavg equals the manual weighted mean; vmapped local training
equals a loop over clients; one full-batch local step equals centralised gradient descent."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torchfn import random, tree
from torchfn.transforms import fedavg, federated_round, local_train


def client_trees(seed, c):
    g = torch.Generator().manual_seed(seed)
    return [{"w": torch.randn(3, 2, generator=g, dtype=torch.float64),
             "b": (torch.randn(2, generator=g, dtype=torch.float64),)} for _ in range(c)]


@given(seed=st.integers(0, 2**16), c=st.integers(1, 5), as_list=st.booleans(),
       data=st.data())
def test_fedavg_equals_manual_weighted_mean(seed, c, as_list, data):
    clients = client_trees(seed, c)
    w = data.draw(st.lists(st.floats(0.0, 10.0), min_size=c, max_size=c).filter(
        lambda ws: sum(ws) > 1e-3))
    arg = clients if as_list else tree.stack(clients)
    out = fedavg(arg, torch.tensor(w, dtype=torch.float64))
    total = sum(w)
    expect_w = sum(wi * t["w"] for wi, t in zip(w, clients)) / total
    expect_b = sum(wi * t["b"][0] for wi, t in zip(w, clients)) / total
    torch.testing.assert_close(out["w"], expect_w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out["b"][0], expect_b, rtol=1e-12, atol=1e-12)
    plain = fedavg(arg)
    torch.testing.assert_close(plain["w"], torch.stack([t["w"] for t in clients]).mean(0))


def linreg_step(lr=0.1, batch=4):
    def local_step(p, data, key):  # data: (x (n, 3), y (n,)); a keyed mini-batch
        x, y = data
        idx = random.randint(key, (batch,), 0, x.shape[0])
        xb, yb = x[idx], y[idx]
        g = torch.func.grad(lambda q: ((xb @ q["w"] + q["b"] - yb) ** 2).mean())(p)
        return {k: p[k] - lr * g[k] for k in p}

    return local_step


def federated_problem(seed, c, n=6):
    g = torch.Generator().manual_seed(seed)
    data = (torch.randn(c, n, 3, generator=g, dtype=torch.float64),
            torch.randn(c, n, generator=g, dtype=torch.float64))
    params = {"w": torch.randn(3, generator=g, dtype=torch.float64),
              "b": torch.zeros((), dtype=torch.float64)}
    return params, data


@given(seed=st.integers(0, 2**16), c=st.integers(1, 4), steps=st.integers(1, 3))
def test_vmapped_local_training_equals_loop_over_clients(seed, c, steps):
    params, data = federated_problem(seed, c)
    key = random.key(seed)
    step = linreg_step()
    out = local_train(step, params, data, key, steps)
    keys = random.split(key, c)
    looped = []
    for i in range(c):
        p = params
        for s in range(steps):
            p = step(p, (data[0][i], data[1][i]), random.fold_in(keys[i], s))
        looped.append(p)
    for k in params:
        torch.testing.assert_close(out[k], torch.stack([p[k] for p in looped]), rtol=1e-12,
                                   atol=1e-12)
    weights = torch.arange(1, c + 1, dtype=torch.float64)
    new = federated_round(step, params, data, key, steps, weights=weights)
    ref = fedavg(looped, weights)
    for k in params:
        torch.testing.assert_close(new[k], ref[k], rtol=1e-12, atol=1e-12)


def test_one_full_batch_local_step_equals_centralised_gradient_descent():
    params, (x, y) = federated_problem(0, 3, n=5)
    loss = lambda q, x, y: ((x @ q["w"] + q["b"] - y) ** 2).mean()  # noqa: E731

    def full_batch(p, data, key):
        g = torch.func.grad(loss)(p, *data)
        return {k: p[k] - 0.1 * g[k] for k in p}

    new = federated_round(full_batch, params, (x, y), random.key(0), 1)
    g = torch.func.grad(loss)(params, x.reshape(15, 3), y.reshape(15))  # all data at once
    for k in params:
        torch.testing.assert_close(new[k], params[k] - 0.1 * g[k], rtol=1e-12, atol=1e-12)


def test_bad_input():
    clients = client_trees(0, 3)
    with pytest.raises(ValueError, match=r"weights must have shape \(3,\), one per client, got"):
        fedavg(clients, [1.0, 2.0])
    with pytest.raises(ValueError, match="weights must be finite and non-negative"):
        fedavg(clients, [1.0, -1.0, 2.0])
    with pytest.raises(ValueError, match="weights must sum to > 0"):
        fedavg(clients, [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="weights must be finite and non-negative"):
        fedavg(clients, [1.0, float("nan"), 1.0])
    with pytest.raises(ValueError, match="client_params must hold at least one client"):
        fedavg([])
    params, data = federated_problem(0, 2)
    with pytest.raises(ValueError, match="local_steps must be an int >= 1, got 0"):
        federated_round(linreg_step(), params, data, random.key(0), 0)
    with pytest.raises(ValueError, match="client_data must be stacked"):
        local_train(linreg_step(), params, (data[0], data[1][:1]), random.key(0), 1)
    with pytest.raises(ValueError, match="weights must sum to > 0"):
        federated_round(linreg_step(), params, data, random.key(0), 1, weights=[0, 0])
