"""GAN losses: the WGAN-GP penalty equals a per-example autograd loop (value and its
gradient w.r.t. critic params, grad-of-grad); WGAN and non-saturating losses vs formulas."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import torchfn
from torchfn import random
from torchfn.losses import gan_losses, gradient_penalty, wgan_losses
from torchfn.models import MLP


def critic_params(seed, d, h=6):
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(h, d, generator=g, dtype=torch.float64),
        "b1": torch.randn(h, generator=g, dtype=torch.float64),
        "w2": torch.randn(h, generator=g, dtype=torch.float64),
    }


def critic(p, x):  # one example (d,) -> ()
    return p["w2"] @ torch.tanh(p["w1"] @ x + p["b1"])


def loop_penalty(p, real, fake, key):
    e = random.uniform(key, (real.shape[0],), dtype=real.dtype)
    terms = []
    for i in range(real.shape[0]):
        xi = (e[i] * real[i] + (1 - e[i]) * fake[i]).detach().requires_grad_()
        (gi,) = torch.autograd.grad(critic(p, xi), xi, create_graph=True)
        terms.append((gi.norm() - 1) ** 2)
    return torch.stack(terms).mean()


@given(seed=st.integers(0, 2**16), b=st.integers(1, 5), d=st.integers(1, 4))
def test_penalty_and_its_param_gradient_equal_autograd_loop(seed, b, d):
    p = critic_params(seed, d)
    g = torch.Generator().manual_seed(seed + 1)
    real = torch.randn(b, d, generator=g, dtype=torch.float64)
    fake = torch.randn(b, d, generator=g, dtype=torch.float64)
    key = random.key(seed)
    ours = gradient_penalty(critic, p, real, fake, key)
    pl = {k: v.clone().requires_grad_() for k, v in p.items()}
    ref = loop_penalty(pl, real, fake, key)
    torch.testing.assert_close(ours, ref.detach(), rtol=1e-10, atol=1e-12)
    # grad-of-grad: d penalty / d critic params
    ours_g = torch.func.grad(lambda q: gradient_penalty(critic, q, real, fake, key))(p)
    ref_g = torch.autograd.grad(ref, list(pl.values()))
    for k, r in zip(pl, ref_g):
        torch.testing.assert_close(ours_g[k], r, rtol=1e-9, atol=1e-12)


def test_penalty_with_model_critic_and_image_shapes():
    critic_model = torchfn.Model(MLP(12, (8,), 1, activation="tanh"))
    params = critic_model.init(random.key(0))
    g = torch.Generator().manual_seed(0)
    real, fake = torch.randn(3, 3, 4, generator=g), torch.randn(3, 3, 4, generator=g)
    fn = lambda p, x: critic_model.apply(p, x.reshape(-1))  # noqa: E731 -- (3, 4) -> (1,)
    per = gradient_penalty(fn, params, real, fake, random.key(1), reduction="none")
    assert per.shape == (3,)
    torch.testing.assert_close(per.mean(), gradient_penalty(fn, params, real, fake, random.key(1)))
    grads = torch.func.grad(lambda p: gradient_penalty(fn, p, real, fake, random.key(1)))(params)
    assert all(torch.isfinite(v).all() for v in grads.values())
    assert grads["net.0.weight"].abs().sum() > 0


def test_conditional_penalty_equals_the_loop_with_each_examples_label():
    """``cond=(labels,)``: each example's gradient is in x with its own label held fixed."""
    p = critic_params(0, 3)
    emb = random.normal(random.key(5), (4, 3), torch.float64)  # a label embedding (4 classes)
    cond_critic = lambda p, x, y: critic(p, x * F.embedding(y, emb))  # noqa: E731  one example
    g = torch.Generator().manual_seed(0)
    real = torch.randn(5, 3, generator=g, dtype=torch.float64)
    fake = torch.randn(5, 3, generator=g, dtype=torch.float64)
    labels = torch.tensor([0, 3, 1, 3, 2])
    ours = gradient_penalty(cond_critic, p, real, fake, random.key(1), cond=(labels,),
                            reduction="none")
    e = random.uniform(random.key(1), (5,), dtype=real.dtype)
    for i in range(5):
        xi = (e[i] * real[i] + (1 - e[i]) * fake[i]).requires_grad_()
        (gi,) = torch.autograd.grad(cond_critic(p, xi, labels[i]), xi)
        torch.testing.assert_close(ours[i], (gi.norm() - 1) ** 2, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match=r"cond\[0\] must be a tensor with the batch size 5"):
        gradient_penalty(cond_critic, p, real, fake, random.key(1), cond=(labels[:4],))
    with pytest.raises(TypeError, match="cond must be a tuple"):
        gradient_penalty(cond_critic, p, real, fake, random.key(1), cond=labels)


@pytest.mark.parametrize("conditional", [False, True])
def test_batched_penalty_equals_the_per_example_one(conditional):
    """batched=True (one gradient of the summed scores) == vmap(grad) per example, value
    and gradient in the critic's parameters, for a critic that keeps examples apart."""
    from torchfn.models import ConvCritic

    net = ConvCritic(8, 1, 4, num_classes=3 if conditional else None).double()
    model = torchfn.Model(net)
    p = model.init(random.key(0))
    real, fake = random.normal(random.key(1), (2, 5, 1, 8, 8), torch.float64)
    cond = (random.randint(random.key(2), (5,), 0, 3),) if conditional else ()
    f = lambda p, b: gradient_penalty(model.apply, p, real, fake, random.key(3),  # noqa: E731
                                      cond=cond, batched=b)
    torch.testing.assert_close(f(p, True), f(p, False), rtol=1e-10, atol=1e-12)
    g1, g2 = torch.func.grad(f)(p, True), torch.func.grad(f)(p, False)
    for k in g2:
        torch.testing.assert_close(g1[k], g2[k], rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match=r"batch's scores of shape \(5,\) or \(5, 1\)"):
        gradient_penalty(lambda p, x, *c: model.apply(p, x, *c).sum(), p, real, fake,
                         random.key(3), cond=cond, batched=True)


def test_penalty_is_deterministic_per_key_and_differs_across_keys():
    p = critic_params(0, 3)
    g = torch.Generator().manual_seed(0)
    real = torch.randn(6, 3, generator=g, dtype=torch.float64)
    fake = torch.randn(6, 3, generator=g, dtype=torch.float64)
    a = gradient_penalty(critic, p, real, fake, random.key(1), reduction="none")
    b = gradient_penalty(critic, p, real, fake, random.key(1), reduction="none")
    c = gradient_penalty(critic, p, real, fake, random.key(2), reduction="none")
    assert torch.equal(a, b) and not torch.equal(a, c)


@given(seed=st.integers(0, 2**16), b=st.integers(1, 6))
def test_wgan_and_nonsaturating_losses(seed, b):
    g = torch.Generator().manual_seed(seed)
    real = 3 * torch.randn(b, generator=g, dtype=torch.float64)
    fake = 3 * torch.randn(b + 1, generator=g, dtype=torch.float64)
    d_loss, g_loss = wgan_losses(real, fake)
    torch.testing.assert_close(d_loss, fake.mean() - real.mean())
    torch.testing.assert_close(g_loss, -fake.mean())
    d_loss, g_loss = gan_losses(real, fake)
    bce = F.binary_cross_entropy_with_logits
    torch.testing.assert_close(
        d_loss, bce(real, torch.ones_like(real)) + bce(fake, torch.zeros_like(fake)))
    torch.testing.assert_close(g_loss, bce(fake, torch.ones_like(fake)))


def test_bad_input():
    p = critic_params(0, 3)
    real = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"must share a shape .* \(4, 3\) and \(3, 3\)"):
        gradient_penalty(critic, p, real, real[:3], random.key(0))
    with pytest.raises(ValueError, match=r"critic_fn must return one example's score .*\(2,\)"):
        gradient_penalty(lambda p, x: x[:2], p, real, real, random.key(0))
    with pytest.raises(ValueError, match="reduction must be one of"):
        gradient_penalty(critic, p, real, real, random.key(0), reduction="median")
    with pytest.raises(TypeError, match="fake_scores must be a floating-point Tensor"):
        wgan_losses(torch.ones(2), torch.ones(2, dtype=torch.int64))
