"""Bench (c): the Adam update alone on ~1M float32 params, in 4 and in 80 leaves, CPU.

One call = one optimizer step that leaves new params:

* ``torchfn``: ``optim.adam`` update + ``apply_updates`` (pure, new tensors).
* ``torchfn_compiled``: the same function under ``torch.compile(fullgraph=True)``.
* ``torchopt``: ``torchopt.adam`` with ``inplace=False`` + ``apply_updates(inplace=False)``
  (its C++ op does not load on torch 2.13; this is its Python path).
* ``torch_foreach`` / ``torch_fused``: ``torch.optim.Adam(foreach=True | fused=True).step()``,
  in place (fused Adam exists on CPU in torch 2.13).

Groups ``adam_update_4_leaves`` and ``adam_update_80_leaves``. Run:
``pytest bench/test_bench_optim.py --benchmark-only -p no:randomly
--benchmark-columns=min,median,mean``; ratios are median torchfn / median peer.
"""

import pytest
import torch
import torchopt

from torchfn import optim

SHAPES = {4: [(512, 500)] * 4, 80: [(128, 100)] * 80}  # 1,024,000 params either way
IMPLS = ["torchfn", "torchfn_compiled", "torchopt", "torch_foreach", "torch_fused"]


def make_tree(n_leaves):
    g = torch.Generator().manual_seed(n_leaves)
    params = {f"p{i:02d}": torch.randn(s, generator=g) for i, s in enumerate(SHAPES[n_leaves])}
    grads = {k: torch.randn(v.shape, generator=g) * 1e-2 for k, v in params.items()}
    return params, grads


def functional_step(impl, params, grads):
    """A zero-argument callable doing one step; state and params carried in a closure."""
    if impl == "torchopt":
        tx = torchopt.adam(1e-3)

        def update(g, s, p):
            u, s = tx.update(g, s, params=p, inplace=False)
            return torchopt.apply_updates(p, u, inplace=False), s

    else:
        tx = optim.adam(1e-3)

        def update(g, s, p):
            u, s = tx.update(g, s, p)
            return optim.apply_updates(p, u), s

        if impl == "torchfn_compiled":
            update = torch.compile(update, fullgraph=True)
    carry = {"p": params, "s": tx.init(params)}

    def step():
        carry["p"], carry["s"] = update(grads, carry["s"], carry["p"])

    return step


def module_step(impl, params, grads):
    leaves = [p.clone().requires_grad_(True) for p in params.values()]
    for p, g in zip(leaves, grads.values()):
        p.grad = g.clone()
    kw = {"foreach": True} if impl == "torch_foreach" else {"fused": True}
    opt = torch.optim.Adam(leaves, lr=1e-3, **kw)
    return opt.step


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n_leaves", [4, 80])
def test_adam_update(benchmark, n_leaves, impl):
    benchmark.group = f"adam_update_{n_leaves}_leaves"
    params, grads = make_tree(n_leaves)
    make = module_step if impl.startswith("torch_") else functional_step
    step = make(impl, params, grads)
    for _ in range(3):  # warm up (and compile)
        step()
    benchmark.pedantic(step, rounds=20, iterations=1, warmup_rounds=2)
