"""Bench: ``torchfn.associative_scan`` for a linear recurrence, against the sequential loop
and torch's own (private) ``associative_scan``, CPU.

``h[t] = a[t] * h[t-1] + b[t]`` (a diagonal linear RNN / state-space layer), a and b
(T, B, D) with B = 8, D = 256, T in {256, 2048}. One call = the loss
``h.square().mean()`` and its gradient in (a, b) (``torch.func.grad``):

* ``torchfn``: ``associative_scan(compose, (a, b))``, O(log T) rounds of whole-tensor ops;
* ``loop``: the Python loop over t on ``unbind``-ed steps (``torchfn.scan``'s loop,
  without its checks);
* ``torch_hop``: ``torch._higher_order_ops.associative_scan(..., combine_mode="generic")``,
  private API, eager.

Run: ``pytest bench/test_bench_associative_scan.py --benchmark-only
--benchmark-columns=min,median``; ratios are median torchfn / median peer.
"""

import pytest
import torch
from torch._higher_order_ops.associative_scan import associative_scan as torch_scan
from torch.func import grad

import torchfn
from torchfn import random

B, D = 8, 256


def compose(first, second):
    (a1, b1), (a2, b2) = first, second
    return a2 * a1, a2 * b1 + b2


def ours(a, b):
    return torchfn.associative_scan(compose, (a, b))[1]


def loop(a, b):  # unbind, not a[t]: indexing sends a (T, B, D) zero tensor back per step
    h, hs = torch.zeros_like(b[0]), []
    for at, bt in zip(a.unbind(0), b.unbind(0)):
        h = at * h + bt
        hs.append(h)
    return torch.stack(hs)


def torch_hop(a, b):
    return torch_scan(lambda x, y: compose(x, y), (a, b), dim=0, combine_mode="generic")[1]


IMPLS = {"torchfn": ours, "loop": loop, "torch_hop": torch_hop}


def inputs(t):
    k1, k2 = random.split(random.key(t), 2)
    return torch.sigmoid(random.normal(k1, (t, B, D))), random.normal(k2, (t, B, D))


@pytest.mark.parametrize("t", [256, 2048])
@pytest.mark.parametrize("impl", list(IMPLS))
def test_linear_recurrence_grad(benchmark, impl, t):
    a, b = inputs(t)
    f = grad(lambda a, b: IMPLS[impl](a, b).square().mean(), argnums=(0, 1))
    want = grad(lambda a, b: loop(a, b).square().mean(), argnums=(0, 1))(a, b)
    for x, y in zip(f(a, b), want):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-7)
    benchmark(f, a, b)
