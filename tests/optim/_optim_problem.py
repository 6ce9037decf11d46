"""A small regression problem shared by the optimizer tests (float32, random, never zeros)."""

from __future__ import annotations

import torch


def make_data(seed: int = 0, steps: int = 100, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    params = {
        "w": torch.randn(6, 4, generator=gen, dtype=dtype),
        "b": torch.randn(4, generator=gen, dtype=dtype),
        "net": [torch.randn(4, 3, generator=gen, dtype=dtype)],
    }
    xs = torch.randn(steps, 16, 6, generator=gen, dtype=dtype)
    ys = torch.randn(steps, 16, 3, generator=gen, dtype=dtype)
    return params, xs, ys


def loss_fn(params, x, y):
    h = torch.tanh(x @ params["w"] + params["b"])
    return ((h @ params["net"][0] - y) ** 2).mean()


def grads_at(params, x, y):
    leaves = [params["w"], params["b"], params["net"][0]]
    leaves = [p.detach().requires_grad_(True) for p in leaves]
    p = {"w": leaves[0], "b": leaves[1], "net": [leaves[2]]}
    g = torch.autograd.grad(loss_fn(p, x, y), leaves)
    return {"w": g[0], "b": g[1], "net": [g[2]]}


def run_ours(tx, steps: int = 100, seed: int = 0):
    from torchfn.optim import apply_updates

    params, xs, ys = make_data(seed, steps)
    state = tx.init(params)
    for t in range(steps):
        grads = grads_at(params, xs[t], ys[t])
        updates, state = tx.update(grads, state, params)
        params = apply_updates(params, updates)
    return params


def run_torch(opt_cls, steps: int = 100, seed: int = 0, scheduler=None, **kwargs):
    params, xs, ys = make_data(seed, steps)
    leaves = [params["w"].clone().requires_grad_(True), params["b"].clone().requires_grad_(True),
              params["net"][0].clone().requires_grad_(True)]
    opt = opt_cls(leaves, **kwargs)
    sched = scheduler(opt) if scheduler is not None else None
    for t in range(steps):
        opt.zero_grad()
        p = {"w": leaves[0], "b": leaves[1], "net": [leaves[2]]}
        loss_fn(p, xs[t], ys[t]).backward()
        opt.step()
        if sched is not None:
            sched.step()
    return {"w": leaves[0].detach(), "b": leaves[1].detach(), "net": [leaves[2].detach()]}


def run_torchopt(tx, steps: int = 100, seed: int = 0):
    import torchopt

    params, xs, ys = make_data(seed, steps)
    state = tx.init(params)
    for t in range(steps):
        grads = grads_at(params, xs[t], ys[t])
        updates, state = tx.update(grads, state, params=params, inplace=False)
        params = torchopt.apply_updates(params, updates, inplace=False)
    return params


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6, equal_nan=False):
    import optree

    la, sa = optree.tree_flatten(a)
    lb, sb = optree.tree_flatten(b)
    assert sa == sb, (sa, sb)
    for x, y in zip(la, lb):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol, equal_nan=equal_nan)
