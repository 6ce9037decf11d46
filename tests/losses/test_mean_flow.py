"""MeanFlow: the exact average velocity of Gaussian data samples exactly in one step, is
where the loss's gradient vanishes (and elsewhere it does not), and the loss trains
through a Transformer with torchfn attention, whose jvp SDPA cannot take."""

import math

import pytest
import torch
from torch.func import grad, vmap

from torchfn import losses, random
from torchfn.transforms import diffusion as D


def exact_average_velocity(m, s):
    """u(z, r, t) = (z - z_r) / (t - r) along the flow of x0 ~ N(m, s^2 I), which maps
    z_t to (1 - r) m + sqrt(V(r) / V(t)) (z_t - (1 - t) m), V(t) = (1 - t)^2 s^2 + t^2;
    at r = t the velocity itself."""

    def u(z, r, t):
        t, r = t[:, None], r[:, None]
        var = lambda a: (1 - a) ** 2 * s**2 + a**2  # noqa: E731
        dev = z - (1 - t) * m
        velocity = (t - (1 - t) * s**2) / var(t) * dev - m
        gap = t - r
        safe = torch.where(gap > 1e-9, gap, torch.ones_like(gap))
        z_r = (1 - r) * m + torch.sqrt(var(r) / var(t)) * dev
        return torch.where(gap > 1e-9, (z - z_r) / safe, velocity)

    return u


@pytest.mark.parametrize("steps", [1, 2, 5])
def test_the_exact_average_velocity_samples_exactly(steps):
    m, s = 0.7, 0.4
    chain = D.mean_flow_sample(exact_average_velocity(m, s), (128, 3), random.key(0),
                               steps=steps, dtype=torch.float64, return_chain=True)
    assert chain.shape == (steps + 1, 128, 3)
    torch.testing.assert_close(chain[-1], m + s * chain[0], rtol=1e-12, atol=1e-12)


def test_the_loss_gradient_vanishes_at_the_exact_average_velocity():
    """With plain squared error (adaptive_p=0) the target's mean given z_t is the exact
    u at u: d loss / d m_hat is 0 up to noise there, and clearly positive past it (one
    key: the same draws)."""
    m, s = 0.6, 0.8
    x0 = m + s * random.normal(random.key(1), (40_000, 2), dtype=torch.float64)

    def loss(m_hat):
        return losses.mean_flow_loss(exact_average_velocity(m_hat, s), x0, random.key(2),
                                     ratio=0.5, adaptive_p=0.0)

    at_truth = grad(loss)(torch.tensor(m, dtype=torch.float64)).item()
    past = grad(loss)(torch.tensor(m + 0.5, dtype=torch.float64)).item()
    assert past > 0.5 and abs(at_truth) < 0.05 * past, (at_truth, past)


def test_with_r_equal_t_the_target_is_the_velocity():
    """ratio=0: every r = t, the jvp term vanishes and the loss is flow matching's
    squared error summed over coordinates (checked against the conditional velocity
    recomputed from the same draws)."""
    x0 = random.normal(random.key(3), (64, 2), dtype=torch.float64)
    seen = {}

    def u(z, r, t):
        seen["z"], seen["r"], seen["t"] = z, r, t
        return 0.3 * z

    got = losses.mean_flow_loss(u, x0, random.key(4), ratio=0.0, adaptive_p=0.0)
    assert torch.equal(seen["r"], seen["t"])
    t = seen["t"][:, None]
    v = (seen["z"] - x0) / t  # eps - x0, with eps = (z - (1 - t) x0) / t
    want = (0.3 * seen["z"] - v).pow(2).sum(1).mean()
    assert got.item() == pytest.approx(want.item(), rel=1e-10)


def test_adaptive_weighting_is_the_papers():
    x0 = random.normal(random.key(5), (32, 2), dtype=torch.float64)
    u = lambda z, r, t: torch.tanh(z) * (1 + t - r)[:, None]  # noqa: E731
    weighted = losses.mean_flow_loss(u, x0, random.key(6), adaptive_p=1.0, adaptive_c=1e-3)
    errors = losses.mean_flow_loss(u, x0, random.key(6), adaptive_p=0.0)
    assert weighted.item() < 1.0 < errors.item()  # |e|^2 / (|e|^2 + c) < 1 per example


def test_trains_through_a_transformer_with_torchfn_attention(grad_matches_materialised):
    """The loss takes a jvp of the network, and its gradient a reverse pass over that:
    both go through models.TransformerEncoder's attention. The gradient equals the same
    model's with the materialised reference attention (plain torch ops). Not a finite
    difference: the target's gradient is stopped, so the loss's gradient is not the
    derivative of its value."""
    grad_matches_materialised(lambda net, x0: losses.mean_flow_loss(
        lambda z, r, t: net(z + t[:, None, None] - 0.5 * r[:, None, None]), x0,
        random.key(9), ratio=1.0, adaptive_p=0.0))


def test_vmap_per_example_losses_equal_a_loop():
    x0 = random.normal(random.key(10), (5, 3))
    keys = random.split(random.key(11), 5)
    u = lambda z, r, t: torch.sin(z) * t[:, None] + r[:, None]  # noqa: E731

    def one(x, k):
        return losses.mean_flow_loss(u, x[None], k, ratio=1.0)

    torch.testing.assert_close(vmap(one)(x0, keys),
                               torch.stack([one(x0[i], keys[i]) for i in range(5)]))


def test_bad_input():
    x0, key = torch.ones(4, 2), random.key(0)
    u = lambda z, r, t: z  # noqa: E731
    with pytest.raises(ValueError, match=r"ratio must lie in \[0, 1\]"):
        losses.mean_flow_loss(u, x0, key, ratio=1.5)
    with pytest.raises(ValueError, match="adaptive_p must be a float >= 0"):
        losses.mean_flow_loss(u, x0, key, adaptive_p=-1.0)
    with pytest.raises(ValueError, match=r"must return x0's shape \(4, 2\), got \(4,\)"):
        losses.mean_flow_loss(lambda z, r, t: t, x0, key)
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        D.mean_flow_sample(u, (4, 2), key, steps=0)
    assert math.isfinite(losses.mean_flow_loss(u, x0, key).item())
