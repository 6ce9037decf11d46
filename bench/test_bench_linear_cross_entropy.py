"""Bench: ``losses.linear_cross_entropy`` against ``F.cross_entropy(h @ W.T, y)``, CPU fp32.

An LM head's loss and its gradient in ``(h, W)``: N = 2048 predicted tokens (B=2 rows of
1024), D = 256, V = 32000 (Llama 2's vocabulary). The plain form holds the (N, V)
logits (262 MB), their log-softmax and the gradient; torchfn holds one (chunk, V) block
at a time. Peak memory is measured apart (``train.PeakMemory``) and stored in each
row's ``extra_info``. Liger-Kernel's fused linear cross entropy is the same algorithm as
a Triton kernel (GPU only); it is not installed here.

Run: ``pytest bench/test_bench_linear_cross_entropy.py --benchmark-only
--benchmark-columns=min,median``.
"""

import pytest
import torch
import torch.nn.functional as F

from torchfn import random
from torchfn.losses import linear_cross_entropy
from torchfn.train import PeakMemory

N, D, V = 2048, 256, 32000


def data():
    h = random.normal(random.key(0), (N, D))
    w = random.normal(random.key(1), (V, D)) * D ** -0.5
    y = random.randint(random.key(2), (N,), 0, V)
    return h, w, y


def loss_fn(how):
    if how == "plain":
        return lambda h, w, y: F.cross_entropy(h @ w.T, y)
    chunk = int(how.split("=")[1])
    return lambda h, w, y: linear_cross_entropy(h, w, y, chunk_size=chunk)


CASES = ["plain", "torchfn chunk=1024", "torchfn chunk=256"]


@pytest.mark.parametrize("how", CASES)
def test_loss_and_grad(benchmark, how):
    h, w, y = data()
    step = torch.func.grad_and_value(loss_fn(how), argnums=(0, 1))
    with PeakMemory() as mem:
        step(h, w, y)
    benchmark.extra_info["peak_MiB"] = round(mem.peak / 2**20, 1)
    (gh, gw), loss = benchmark.pedantic(step, (h, w, y), rounds=3, iterations=1)
    (rh, rw), want = torch.func.grad_and_value(loss_fn("plain"), argnums=(0, 1))(h, w, y)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw, rw, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("how", CASES)
def test_loss_only(benchmark, how):
    h, w, y = data()
    f = loss_fn(how)
    with PeakMemory() as mem:
        f(h, w, y)
    benchmark.extra_info["peak_MiB"] = round(mem.peak / 2**20, 1)
    loss = benchmark.pedantic(f, (h, w, y), rounds=3, iterations=1)
    torch.testing.assert_close(loss, loss_fn("plain")(h, w, y), rtol=1e-5, atol=1e-5)
