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


SHAPES = {"w": (6, 4), "u": (3, 5), "s": ()}


def random_tree(seed, steps, shapes=SHAPES):
    """(params, [grads] * steps): random trees of ``shapes`` (a matrix, a vector's worth
    of entries in another matrix, a scalar by default)."""
    gen = torch.Generator().manual_seed(seed)
    params = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=gen) for k, s in shapes.items()} for _ in range(steps)]
    return params, grads


def check_pure_update(tx):
    """Two updates of ``tx``: the second leaves its params, grads and state untouched and
    moves every leaf. Returns the new state."""
    import optree

    params, grads = random_tree(0, 2)
    _, state = tx.update(grads[0], tx.init(params), params)
    snapshot = [x.clone() for x in optree.tree_leaves((params, grads[1], state))]
    updates, new_state = tx.update(grads[1], state, params)
    assert all(torch.equal(a, b) for a, b in
               zip(snapshot, optree.tree_leaves((params, grads[1], state))))
    assert all(float(u.abs().max()) > 0 for u in optree.tree_leaves(updates))
    return new_state


def check_ensemble_and_compile(tx):
    """Three steps of ``tx``: ``vmap`` over an ensemble of three members equals a loop
    over them, and ``torch.compile(fullgraph=True)`` of one member's step equals eager."""
    import optree

    from torchfn import optim

    members = [random_tree(10 + i, 3) for i in range(3)]
    stack = lambda trees: optree.tree_map(lambda *x: torch.stack(x), *trees)  # noqa: E731

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optim.apply_updates(p, u), s

    params = [m[0] for m in members]
    states = [tx.init(p) for p in params]
    p_stack, s_stack = stack(params), stack(states)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    p_comp, s_comp = params[0], states[0]
    for t in range(3):
        p_stack, s_stack = torch.vmap(step)(p_stack, s_stack, stack([m[1][t] for m in members]))
        p_comp, s_comp = compiled(p_comp, s_comp, members[0][1][t])
        for i in range(3):
            params[i], states[i] = step(params[i], states[i], members[i][1][t])
    assert_trees_close(p_stack, stack(params), rtol=1e-6, atol=1e-6)
    assert_trees_close(s_stack, stack(states), rtol=1e-6, atol=1e-6)
    assert_trees_close(p_comp, params[0], rtol=1e-6, atol=1e-7)
