"""Bench: ``torchfn.while_loop`` / ``cond`` under ``vmap`` against code without them, CPU.

* ``while_loop``: Newton's square root of 4096 numbers spread over 12 decades, each to
  its own tolerance. Peers: the hand-batched loop (``torch.where`` on a mask, a host
  read of ``mask.any()`` per iteration: what one writes for the whole batch), and a
  Python loop over the examples (what ``vmap`` replaces).
* ``cond``: ``sqrt`` where x > 0 else ``-x**2`` on 4096 numbers with its gradient;
  peer: the hand-written double ``torch.where`` (both branches, safe operands).

Run: ``pytest bench/test_bench_control_flow.py --benchmark-only
--benchmark-columns=min,median``; ratios are median torchfn / median peer.
"""

import pytest
import torch
from torch.func import grad, vmap

import torchfn
from torchfn import random

N = 4096


def values():
    return 10 ** random.uniform(random.key(0), (N,), minval=-6.0, maxval=6.0,
                                dtype=torch.float64)


def newton(a):  # one example
    return torchfn.while_loop(lambda x: (x * x - a).abs() > 1e-12 * a,
                              lambda x: 0.5 * (x + a / x), a)


def hand_batched(a):
    x = a.clone()
    while True:
        go = (x * x - a).abs() > 1e-12 * a
        if not bool(go.any()):
            return x
        x = torch.where(go, 0.5 * (x + a / x), x)


def per_example(a):
    out = []
    for v in a[:256]:  # 1/16 of the batch, scaled by 16 in RESULTS
        x = v.clone()
        while (x * x - v).abs() > 1e-12 * v:
            x = 0.5 * (x + v / x)
        out.append(x)
    return torch.stack(out)


WHILE = {"torchfn_vmap": vmap(newton), "hand_batched": hand_batched,
         "python_per_example_256": per_example}


@pytest.mark.parametrize("impl", list(WHILE))
def test_while_loop_newton(benchmark, impl):
    a = values()
    got = WHILE[impl](a)
    torch.testing.assert_close(got, a[: len(got)].sqrt())
    benchmark(WHILE[impl], a)


def branchy(x):
    return torchfn.cond(x > 0, torch.sqrt, lambda x: -x * x, x)


def double_where(x):
    pos = x > 0
    safe = torch.where(pos, x, torch.ones_like(x))
    return torch.where(pos, torch.sqrt(safe), -x * x)


COND = {"torchfn_vmap": vmap(grad(branchy)),
        "double_where": grad(lambda x: double_where(x).sum())}


@pytest.mark.parametrize("impl", list(COND))
def test_cond_gradient(benchmark, impl):
    x = random.normal(random.key(1), (N,), dtype=torch.float64)
    torch.testing.assert_close(COND[impl](x), COND["double_where"](x))
    benchmark(COND[impl], x)
