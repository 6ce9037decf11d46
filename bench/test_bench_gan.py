"""The WGAN-GP critic step: ``losses.gradient_penalty`` (per-example ``vmap(grad)``,
or with ``batched=True`` one gradient of the summed scores; differentiated again with
``torch.func.grad``) vs the usual PyTorch code, which takes
``autograd.grad(D(x_hat).sum(), x_hat, create_graph=True)`` over the whole batch (right
only when the critic treats examples independently) and calls ``.backward()``.

Run (about half a minute):
    .venv/bin/pytest bench/test_bench_gan.py --benchmark-only -q -p no:randomly \\
        --benchmark-columns=min,median,mean

Groups: ``critic-step-<model>``: the critic loss with its penalty and the gradient in
the critic's parameters, batch 64, for ``models.ConvCritic`` on 8x8 digits (width 32,
class-conditional) and an ``MLP`` critic on 2-D points (2-128-128-1).
"""

import pytest
import torch

import torchfn
from torchfn import random
from torchfn.losses import gradient_penalty, wgan_losses
from torchfn.models import MLP, ConvCritic

B = 64


def _setup(model):
    if model == "conv":
        net = ConvCritic(8, 1, 32, num_classes=10)
        shape, cond = (B, 1, 8, 8), (random.randint(random.key(3), (B,), 0, 10),)
    else:
        net = MLP(2, (128, 128), 1, activation="relu")
        shape, cond = (B, 2), ()
    real = random.normal(random.key(1), shape)
    fake = random.normal(random.key(2), shape)
    return net, real, fake, cond


@pytest.mark.parametrize("impl", ["torchfn gradient_penalty", "torchfn batched=True",
                                  "torch autograd.grad(sum)"])
@pytest.mark.parametrize("model", ["conv", "mlp"])
def test_critic_step(benchmark, model, impl):
    benchmark.group = f"critic-step-{model}"
    net, real, fake, cond = _setup(model)
    critic = torchfn.Model(net)
    params = {k: v.detach() for k, v in net.named_parameters()}
    score = (lambda p, x, *c: critic.apply(p, x, *c)) if model == "conv" else (
        lambda p, x: critic.apply(p, x).squeeze(-1))
    key = random.key(4)

    batched = impl.endswith("batched=True")

    def ours(p):
        loss, _ = wgan_losses(score(p, real, *cond), score(p, fake, *cond))
        return loss + 10 * gradient_penalty(score, p, real, fake, key, cond=cond,
                                            batched=batched)

    e = random.uniform(key, (B,)).reshape(B, *([1] * (real.dim() - 1)))  # the same points

    def D(x):  # the module itself, batched: (B, ...) -> (B,)
        s = net(x, *cond)
        return s if model == "conv" else s.squeeze(-1)

    def theirs():
        net.zero_grad(set_to_none=True)
        x_hat = (e * real + (1 - e) * fake).requires_grad_()
        (g,) = torch.autograd.grad(D(x_hat).sum(), x_hat, create_graph=True)
        penalty = (g.flatten(1).norm(dim=1) - 1).square().mean()
        loss = D(fake).mean() - D(real).mean() + 10 * penalty
        loss.backward()
        return {k: v.grad for k, v in net.named_parameters()}

    if impl.startswith("torchfn"):
        got = benchmark.pedantic(torch.func.grad(ours), args=(params,), rounds=20,
                                 warmup_rounds=2)
        want = theirs()
    else:
        got = benchmark.pedantic(theirs, rounds=20, warmup_rounds=2)
        want = torch.func.grad(ours)(params)
    assert all(torch.allclose(got[k], want[k], atol=1e-4, rtol=1e-4) for k in want)
