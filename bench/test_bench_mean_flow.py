"""Bench: one gradient of ``losses.mean_flow_loss`` (and of ``losses.scm_loss``) through a
Transformer, CPU, float32.

The loss's target is a ``jvp`` of the network, and its gradient a reverse pass over
that, through attention. SDPA has no forward-mode rule, so a PyTorch user today writes
attention in plain ops (softmax of the materialised scores) to train MeanFlow with a
Transformer; that is the peer. ``models.TransformerEncoder(dim=64, heads=4, depth=2)``
on 32k feature tokens a batch, as (B, N) = (128, 256) and (32, 1024):

* ``torchfn``: the default attention (``torchfn.kernels.attention``: its fused jvp and
  the differentiable jvp Function of its reverse-over-forward rule);
* ``materialised``: ``softmax(q k^T / sqrt(d)) v`` in torch ops (``attend=``).

Also the flow-matching loss's gradient with torchfn attention, the cost MeanFlow adds
to (no jvp). sCM's loss (``test_scm_grad``) also takes a jvp of the network, but its
gradient flows only through the jvp's primal output: no reverse pass over forward mode.

Run: ``pytest bench/test_bench_mean_flow.py --benchmark-only
--benchmark-columns=min,median``.
"""

import pytest
import torch

import torchfn
from torchfn import losses, random


def materialised(q, k, v, key_padding_mask=None, causal=False):
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # (B, H, N, N)
    return torch.softmax(scores, dim=-1) @ v


def setup(attend, n):
    enc = torchfn.Model(torchfn.models.TransformerEncoder(dim=64, heads=4, depth=2,
                                                          max_len=n, attend=attend))
    params = enc.init(random.key(0))
    x0 = random.normal(random.key(1), (32768 // n, n, 64))  # 32k tokens a batch

    def u(params):
        return lambda z, r, t: enc.apply(params, z + t[:, None, None] - r[:, None, None])

    return params, x0, u


@pytest.mark.parametrize("impl", ["torchfn", "materialised", "flow_matching"])
@pytest.mark.parametrize("n", [256, 1024])
def test_mean_flow_grad(benchmark, impl, n):
    benchmark.group = f"mean_flow_grad_N{n}"
    params, x0, u = setup(materialised if impl == "materialised" else None, n)
    if impl == "flow_matching":
        def loss(p):
            return losses.flow_matching_loss(lambda z, t: u(p)(z, t, t), x0, random.key(2))
    else:
        def loss(p):
            return losses.mean_flow_loss(u(p), x0, random.key(2))
    step = torch.func.grad(loss)
    step(params)
    benchmark.pedantic(step, args=(params,), rounds=5, iterations=1, warmup_rounds=1)


@pytest.mark.parametrize("impl", ["torchfn", "materialised"])
@pytest.mark.parametrize("n", [256, 1024])
def test_scm_grad(benchmark, impl, n):
    benchmark.group = f"scm_grad_N{n}"
    params, x0, u = setup(materialised if impl == "materialised" else None, n)

    def loss(p):
        return losses.scm_loss(lambda x_in, t: u(p)(x_in, t, t), x0, random.key(2),
                               time_scale=10.0)

    step = torch.func.grad(loss)
    step(params)
    benchmark.pedantic(step, args=(params,), rounds=5, iterations=1, warmup_rounds=1)
