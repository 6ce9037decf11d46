"""Bench: ``losses.ctc_loss`` (the alpha recursion as a Python loop of batched torch ops)
against ``F.ctc_loss`` (torch's fused C++ kernel), CPU, float32.

- ``fwd_bwd``: loss and gradient of a batch, (B, T, C, S) = (16, 200, 40, 50) and
  (32, 100, 30, 20), full lengths.
- ``per_sample``: ``vmap(grad(loss))`` over the batch, the per-example gradients DP-SGD
  clips. ``F.ctc_loss`` has no vmap rule: torch falls back to a loop over the examples
  (with a warning); torchfn's is batched.

Both give the same values (tests/losses/test_ctc.py checks torchfn's against
``F.ctc_loss`` in float64). ``jvp``/``hessian`` have no peer: ``F.ctc_loss`` has no
forward-mode rule.

Run: ``pytest bench/test_bench_ctc.py --benchmark-only --benchmark-columns=min,median``.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, vmap

from torchfn import losses, random

SHAPES = [(16, 200, 40, 50), (32, 100, 30, 20)]


def _inputs(B, T, C, S):
    logits = random.normal(random.key(0), (B, T, C))
    targets = random.randint(random.key(1), (B, S), 1, C)
    return logits, targets


def _torch_loss(logits, targets):  # batch-first in, as torchfn's
    T, S = logits.shape[-2], targets.shape[-1]
    lengths = (torch.full(logits.shape[:-2], T), torch.full(targets.shape[:-1], S))
    return F.ctc_loss(logits.log_softmax(-1).transpose(-3, -2), targets, *lengths)


def _torchfn_loss(logits, targets):
    return losses.ctc_loss(logits, targets)


IMPLS = {"torchfn": _torchfn_loss, "torch": _torch_loss}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("how", ["torchfn", "torch"])
def test_fwd_bwd(benchmark, how, shape):
    logits, targets = _inputs(*shape)
    fn = IMPLS[how]

    def step():
        x = logits.clone().requires_grad_(True)
        loss = fn(x, targets)
        loss.backward()
        return loss, x.grad

    loss, g = benchmark(step)
    x = logits.clone().requires_grad_(True)
    want = _torch_loss(x, targets)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(g, x.grad, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("how", ["torchfn", "torch"])
def test_per_sample(benchmark, how):
    logits, targets = _inputs(*SHAPES[1])
    fn = IMPLS[how]

    def one(x, t):
        return fn(x[None], t[None])

    per_sample = vmap(grad(one))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "no batching rule, looping" warning
        got = benchmark(per_sample, logits, targets)
    x = logits[:2].clone().requires_grad_(True)
    for b in range(2):
        want, = torch.autograd.grad(_torch_loss(x[b:b + 1], targets[b:b + 1]), x)
        torch.testing.assert_close(got[b], want[b], rtol=1e-3, atol=1e-5)
