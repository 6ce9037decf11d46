"""Classifier-free guidance: one doubled call equals the two separate ones combined,
the rescale equals diffusers' rescale_noise_cfg, the interval switches guidance off
outside it, and the label dropout is keyed, vmap-safe and drops its share."""

import pytest
import torch
from torch.func import vmap

from torchfn import random
from torchfn.transforms import diffusion as D


def net(x, t, y):  # a nonlinear conditional model; y: (B,) labels, 10 = null
    emb = torch.sin(y.float()[:, None] + torch.arange(x.shape[1]).float())
    return torch.tanh(x * (1 + 0.01 * t[:, None])) + emb


def test_one_doubled_call_equals_two_calls_combined():
    x, t = random.normal(random.key(0), (6, 4)), torch.full((6,), 3.0)
    y, null = torch.arange(6), torch.tensor([10])
    calls = []

    def counted(x, t, y):
        calls.append(x.shape[0])
        return net(x, t, y)

    got = D.classifier_free_guidance(counted, y, null, 4.0)(x, t)
    c, u = net(x, t, y), net(x, t, null.expand(6))
    torch.testing.assert_close(got, u + 4.0 * (c - u))
    assert calls == [12]
    calls.clear()
    torch.testing.assert_close(D.classifier_free_guidance(counted, y, null, 1.0)(x, t), c)
    assert calls == [6]  # scale 1: the conditional model, no doubling
    torch.testing.assert_close(D.classifier_free_guidance(net, y, null, 0.0)(x, t), u)


def test_rescale_equals_diffusers():
    guider_utils = pytest.importorskip("diffusers.guiders.guider_utils",
                                       reason="diffusers is the reference")
    x, t = random.normal(random.key(1), (5, 2, 3, 3)), torch.zeros(5)
    y, null = torch.arange(5), torch.full((5,), 10)

    def conv_net(x, t, y):
        return torch.tanh(x) * (1 + y.float()[:, None, None, None])

    got = D.classifier_free_guidance(conv_net, y, null, 7.5, rescale=0.7)(x, t)
    c, u = conv_net(x, t, y), conv_net(x, t, null)
    want = guider_utils.rescale_noise_cfg(u + 7.5 * (c - u), c, guidance_rescale=0.7)
    torch.testing.assert_close(got, want)


def test_interval_guides_only_inside():
    x, y, null = random.normal(random.key(2), (3, 4)), torch.arange(3), torch.tensor([10])
    guided = D.classifier_free_guidance(net, y, null, 5.0, interval=(100.0, 500.0))
    for tv, inside in [(50.0, False), (100.0, True), (300.0, True), (900.0, False)]:
        t = torch.full((3,), tv)
        c, u = net(x, t, y), net(x, t, null.expand(3))
        torch.testing.assert_close(guided(x, t), u + 5.0 * (c - u) if inside else c)


def test_pytree_conditions_and_every_sampler():
    """A dict condition (label and a vector), through a flow sampler and DDIM."""
    cond = {"y": torch.arange(4), "v": torch.ones(4, 2)}
    null = {"y": torch.tensor([10]), "v": torch.zeros(1, 2)}

    def model(x, t, c):
        return 0.1 * x + c["v"] + c["y"].float()[:, None] / 10

    guided = D.classifier_free_guidance(model, cond, null, 2.0)
    x = D.flow_sample(guided, (4, 2), random.key(3), steps=4)
    s = D.linear_schedule(50)
    z = D.ddim_sample(guided, s, (4, 2), random.key(3), steps=5)
    assert x.shape == z.shape == (4, 2) and torch.isfinite(x).all() and torch.isfinite(z).all()


def test_drop_condition_is_keyed_and_drops_its_share():
    y = torch.arange(20_000) % 10
    dropped = D.drop_condition(random.key(4), y, torch.tensor([10]), p=0.1)
    share = (dropped == 10).float().mean().item()
    assert share == pytest.approx(0.1, abs=0.01)
    kept = dropped != 10
    assert torch.equal(dropped[kept], y[kept])
    assert torch.equal(D.drop_condition(random.key(4), y, torch.tensor([10]), p=0.1), dropped)
    keys = random.split(random.key(5), 3)
    one = lambda k: D.drop_condition(k, y[:8], torch.tensor([10]), p=0.5)  # noqa: E731
    assert torch.equal(vmap(one)(keys), torch.stack([one(k) for k in keys]))


def test_bad_input():
    y = torch.arange(4)
    with pytest.raises(ValueError, match=r"null must have cond.s shape \(4,\) with leading"):
        D.classifier_free_guidance(net, y, torch.tensor([10, 10]), 2.0)
    with pytest.raises(ValueError, match=r"rescale must lie in \[0, 1\]"):
        D.classifier_free_guidance(net, y, torch.tensor([10]), 2.0, rescale=2.0)
    with pytest.raises(ValueError, match="interval must be"):
        D.classifier_free_guidance(net, y, torch.tensor([10]), 2.0, interval=(5.0, 1.0))
    with pytest.raises(ValueError, match=r"x must have the condition's batch 4"):
        D.classifier_free_guidance(net, y, torch.tensor([10]), 2.0)(torch.ones(3, 2),
                                                                      torch.zeros(3))
    with pytest.raises(ValueError, match=r"p must be a probability in \[0, 1\]"):
        D.drop_condition(random.key(0), y, torch.tensor([10]), p=1.5)
    with pytest.raises(TypeError, match="cond must be a tensor"):
        D.drop_condition(random.key(0), 3, torch.tensor([10]), p=0.5)
