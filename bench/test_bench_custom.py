"""Bench: ``torchfn.custom_vjp`` / ``custom_jvp`` against a hand-written autograd.Function, CPU.

The peer is what a PyTorch user writes today for the same rule: an
``autograd.Function`` with ``setup_context``, ``generate_vmap_rule`` and a
``backward`` (plus a ``jvp`` for forward mode). Both compute the same thing; the
ratio is the cost of torchfn's argument handling (binding, pytree flattening,
checking the rule's output).

* ``small``: gradient reversal on a (256,) tensor under ``torch.func.grad``: nearly
  all per-call overhead.
* ``mlp``: per-example gradients (``vmap(grad)``, B = 64) of a 2-layer MLP (256 -> 512
  -> 10) whose activation is a softplus with its own derivative: custom_jvp (reverse
  mode by transposing the rule) against a Function with a hand-written backward.

Run: ``pytest bench/test_bench_custom.py --benchmark-only --benchmark-columns=min,median``;
ratios are median torchfn / median hand-written.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, vmap

import torchfn
from torchfn import random

# -- gradient reversal ----------------------------------------------------------------


@torchfn.custom_vjp
def reverse_ours(x, lam):
    return x


reverse_ours.defvjp(lambda x, lam: (x, lam), lambda lam, g: (-lam * g, None))


class _Reverse(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, lam):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.lam = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return -ctx.lam * g, None


def reverse_peer(x, lam):
    return _Reverse.apply(x, lam)


# -- softplus activation --------------------------------------------------------------


@torchfn.custom_jvp
def softplus_ours(x):
    return F.softplus(x)


@softplus_ours.defjvp
def _softplus_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return None, torch.sigmoid(x) * t


class _Softplus(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return F.softplus(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return torch.sigmoid(x) * g


def softplus_peer(x):
    return _Softplus.apply(x)


def mlp_loss(act):
    def loss(params, x, y):  # one example: x (256,), y ()
        h = act(params["w1"] @ x + params["b1"])
        return F.cross_entropy(params["w2"] @ h + params["b2"], y)

    return loss


def mlp_inputs():
    ks = random.split(random.key(0), 6)
    params = {"w1": random.normal(ks[0], (512, 256)) / 16, "b1": random.normal(ks[1], (512,)),
              "w2": random.normal(ks[2], (10, 512)) / 22, "b2": random.normal(ks[3], (10,))}
    x = random.normal(ks[4], (64, 256))
    y = random.randint(ks[5], (64,), 0, 10)
    return params, x, y


@pytest.mark.parametrize("impl", ["torchfn", "hand_written"])
def test_small_gradient_reversal(benchmark, impl):
    fn = reverse_ours if impl == "torchfn" else reverse_peer
    x = random.normal(random.key(1), (256,))
    g = grad(lambda x: (fn(x, 0.5) * x).sum())
    want = grad(lambda x: (reverse_peer(x, 0.5) * x).sum())(x)
    torch.testing.assert_close(g(x), want)
    benchmark(g, x)


@pytest.mark.parametrize("impl", ["torchfn", "hand_written"])
def test_mlp_per_example_grads(benchmark, impl):
    act = softplus_ours if impl == "torchfn" else softplus_peer
    params, x, y = mlp_inputs()
    f = vmap(grad(mlp_loss(act)), in_dims=(None, 0, 0))
    want = vmap(grad(mlp_loss(F.softplus)), in_dims=(None, 0, 0))(params, x, y)
    for a, b in zip(f(params, x, y).values(), want.values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    benchmark(f, params, x, y)
