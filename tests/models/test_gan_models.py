"""ConvGenerator and ConvCritic: shapes and range, the projection critic's formula,
examples computed independently (one example == its row of the batch; a Jacobian with
no cross-example blocks), conditioning, and bad input."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.func import jacrev, vmap

import torchfn
from torchfn import random
from torchfn.models import ConvCritic, ConvGenerator


def _pair(S=8, C=1, width=8, classes=10, latent=6, seed=0):
    g = torchfn.Model(ConvGenerator(latent, S, C, width, num_classes=classes).double())
    d = torchfn.Model(ConvCritic(S, C, width, num_classes=classes).double())
    kg, kd = random.split(random.key(seed))
    return g, g.init(kg), d, d.init(kd)


@given(seed=st.integers(0, 2**16), S=st.sampled_from([4, 8, 12]), C=st.sampled_from([1, 3]),
       classes=st.sampled_from([None, 3]))
def test_one_example_is_its_row_of_the_batch(seed, S, C, classes):
    g, gp, d, dp = _pair(S, C, 4, classes, seed=seed)
    z = random.normal(random.key(seed + 1), (5, 6), torch.float64)  # (B, latent)
    y = None if classes is None else random.randint(random.key(seed + 2), (5,), 0, classes)
    cond = () if y is None else (y,)
    x = g.apply(gp, z, *cond)  # (B, C, S, S)
    assert x.shape == (5, C, S, S) and x.abs().max() <= 1
    rows = vmap(lambda z, *c: g.apply(gp, z, *c))(z, *cond)
    assert torch.allclose(rows, x, atol=1e-12)
    s = d.apply(dp, x, *cond)  # (B,)
    assert s.shape == (5,)
    assert torch.allclose(vmap(lambda x, *c: d.apply(dp, x, *c))(x, *cond), s, atol=1e-12)
    grid = d.apply(dp, x.reshape(1, 5, C, S, S), *(c.reshape(1, 5) for c in cond))  # (1, B)
    assert torch.allclose(grid, s[None], atol=1e-12)


def test_critic_is_the_projection_discriminator():
    _, _, d, p = _pair()
    x = random.normal(random.key(1), (4, 1, 8, 8), torch.float64)
    y = torch.tensor([0, 3, 3, 9])
    h = F.leaky_relu(F.conv2d(x, p["conv1.weight"], p["conv1.bias"], stride=2, padding=1), 0.2)
    h = F.leaky_relu(F.conv2d(h, p["conv2.weight"], p["conv2.bias"], stride=2, padding=1), 0.2)
    phi = h.flatten(1)  # (B, features)
    want = phi @ p["score.weight"][0] + p["score.bias"] + (p["embed.weight"][y] * phi).sum(-1)
    assert torch.allclose(d.apply(p, x, y), want, atol=1e-12)


def test_examples_do_not_interact():
    """No BatchNorm: d score_i / d x_j = 0 for i != j, for both players (what an exact
    per-example gradient penalty and per-example gradients need)."""
    g, gp, d, dp = _pair()
    z = random.normal(random.key(2), (3, 6), torch.float64)
    y = torch.tensor([1, 2, 3])
    J = jacrev(lambda z: g.apply(gp, z, y))(z)  # (3, 1, 8, 8, 3, 6)
    J = J.abs().sum((1, 2, 3, 5))  # (3, 3): output example x input example
    assert torch.equal(J > 0, torch.eye(3, dtype=torch.bool))
    x = g.apply(gp, z, y)
    J = jacrev(lambda x: d.apply(dp, x, y))(x).abs().sum((2, 3, 4))  # (3, 3)
    assert torch.equal(J > 0, torch.eye(3, dtype=torch.bool))


def test_the_label_conditions_both_players():
    g, gp, d, dp = _pair()
    z = random.normal(random.key(3), (6,), torch.float64).expand(2, 6)  # one z, two labels
    x = g.apply(gp, z, torch.tensor([1, 7]))
    assert not torch.allclose(x[0], x[1])
    s = d.apply(dp, x[:1].expand(2, 1, 8, 8), torch.tensor([1, 7]))
    assert not torch.allclose(s[0], s[1])


@pytest.mark.parametrize(
    "make, args, match",
    [
        (lambda: ConvGenerator(8, image_size=10), (),
         "image_size must be an int >= 4 divisible by 4"),
        (lambda: ConvCritic(image_size=8, width=0), (), "width must be an int >= 1"),
        (lambda: ConvCritic(num_classes=1), (), "num_classes must be None or an int >= 2"),
        (lambda: ConvGenerator(0), (), "latent_dim must be an int >= 1"),
        (lambda: ConvGenerator(8), (torch.zeros(2, 7),), r"z must be a float tensor \(\.\.\., 8\)"),
        (lambda: ConvGenerator(8, num_classes=3), (torch.zeros(2, 8),), "y must be an int64"),
        (lambda: ConvGenerator(8, num_classes=3), (torch.zeros(2, 8), torch.zeros(3).long()),
         r"with shape \(2,\)"),
        (lambda: ConvGenerator(8), (torch.zeros(2, 8), torch.zeros(2).long()),
         "built without num_classes"),
        (lambda: ConvCritic(8, 3), (torch.zeros(2, 1, 8, 8),),
         r"x must be a float tensor \(\.\.\., 3, 8, 8\)"),
        (lambda: ConvCritic(8, 1, num_classes=3), (torch.zeros(2, 1, 8, 8), torch.zeros(2)),
         "y must be an int64"),
    ],
)
def test_bad_input_gets_a_clear_error(make, args, match):
    with pytest.raises(ValueError, match=match):
        make()(*args)
