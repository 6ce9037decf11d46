"""Bench: ``torchfn.remat`` with checkpoint policies against ``torch.utils.checkpoint``, CPU.

Eight pre-LN MLP blocks ``x + W2 gelu(W1 LN(x))`` (B = 256, D = 256, hidden 1024,
fp32), the parameters' gradient by ``torch.autograd.grad`` so every variant runs the
same way (``torch.utils.checkpoint`` does not work under ``torch.func``):

* ``plain``: no rematerialisation (the time to beat, the most memory);
* ``remat`` / ``torch_checkpoint``: recompute each block, keep its input;
* ``remat_dots`` / ``torch_sac``: keep the matrix products' outputs, recompute the
  LayerNorm and GELU (torch's selective activation checkpointing with the same ops).

Each case also records (``extra_info``, from ``torchfn.train.PeakMemory``) the bytes
the forward keeps for the backward and the peak bytes of forward and backward
(the (D, H) gradients alone are 16 MiB of it). A last pair runs per-example gradients
(``vmap(grad)``, where torch's checkpoint raises) with and without ``remat_dots``.

Run: ``pytest bench/test_bench_remat.py --benchmark-only --benchmark-columns=min,median``;
ratios are median over median.
"""

import functools

import optree
import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, vmap
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import torchfn
from torchfn import checkpoint_policies as cp
from torchfn import random
from torchfn.train import PeakMemory

aten = torch.ops.aten
B, D, H, DEPTH = 256, 256, 1024, 8


def block(p, x):  # x: (B, D)
    h = F.layer_norm(x, (D,))
    return x + F.gelu(h @ p["w1"]) @ p["w2"]


def _sac_policy(ctx, op, *args, **kwargs):
    keep = op in (aten.mm.default, aten.addmm.default)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


BLOCKS = {
    "plain": block,
    "remat": torchfn.remat(block),
    "remat_dots": torchfn.remat(block, policy=cp.dots_saveable),
    "torch_checkpoint": lambda p, x: checkpoint(block, p, x, use_reentrant=False),
    "torch_sac": lambda p, x: checkpoint(
        block, p, x, use_reentrant=False,
        context_fn=functools.partial(create_selective_checkpoint_contexts, _sac_policy)),
}


def loss(blk, ps, x):
    for p in ps:
        x = blk(p, x)
    return x.square().mean()


def inputs():
    ks = random.split(random.key(0), 2 * DEPTH + 1)
    ps = [{"w1": random.normal(ks[2 * i], (D, H)) / D**0.5,
           "w2": random.normal(ks[2 * i + 1], (H, D)) / H**0.5} for i in range(DEPTH)]
    return ps, random.normal(ks[-1], (B, D))


def param_grads(blk, ps, x):
    leaves = [{k: v.requires_grad_() for k, v in p.items()} for p in ps]
    return torch.autograd.grad(loss(blk, leaves, x), optree.tree_leaves(leaves))


@pytest.mark.parametrize("impl", list(BLOCKS))
def test_deep_mlp_grad(benchmark, impl):
    ps, x = inputs()
    blk = BLOCKS[impl]
    want = param_grads(block, ps, x)
    leaves = [{k: v.detach().requires_grad_() for k, v in p.items()} for p in ps]
    with PeakMemory() as mem:
        out = loss(blk, leaves, x)
        kept = mem.current  # what the forward keeps for the backward
        got = torch.autograd.grad(out, optree.tree_leaves(leaves))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    benchmark.extra_info["kept_MiB"] = round(kept / 2**20, 2)
    benchmark.extra_info["peak_MiB"] = round(mem.peak / 2**20, 2)
    benchmark(param_grads, blk, ps, x)


@pytest.mark.parametrize("impl", ["plain", "remat_dots"])
def test_per_example_grads(benchmark, impl):
    ps, x = inputs()
    ps, x = ps[:4], x[:32]
    blk = BLOCKS[impl]
    f = vmap(grad(lambda ps, xi: loss(blk, ps, xi[None])), in_dims=(None, 0))
    want = vmap(grad(lambda ps, xi: loss(block, ps, xi[None])), in_dims=(None, 0))(ps, x)
    for a, b in zip(optree.tree_leaves(f(ps, x)), optree.tree_leaves(want)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    benchmark(f, ps, x)
