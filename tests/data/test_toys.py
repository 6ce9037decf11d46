"""2-D toy data sets (keyed) and the sample-quality metrics."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torchfn import data, random

TOYS = {
    "eight_gaussians": data.eight_gaussians,
    "two_moons": data.two_moons,
    "swiss_roll": data.swiss_roll,
    "rings": data.rings,
    "checkerboard": data.checkerboard,
}


@pytest.mark.parametrize("name", list(TOYS))
def test_shape_dtype_keys_and_vmap(name):
    f = TOYS[name]
    x = f(random.key(0), 257)
    assert x.shape == (257, 2) and x.dtype == torch.float32 and torch.isfinite(x).all()
    assert torch.equal(x, f(random.key(0), 257))
    assert not torch.allclose(x, f(random.key(1), 257))
    assert f(random.key(0), 8, dtype=torch.float64).dtype == torch.float64
    keys = random.split(random.key(2), 3)
    torch.testing.assert_close(
        torch.func.vmap(lambda k: f(k, 16))(keys), torch.stack([f(k, 16) for k in keys])
    )


def test_eight_gaussians_mixture_law():
    x = data.eight_gaussians(random.key(0), 8000, dtype=torch.float64)
    c = data.eight_gaussians_centers(dtype=torch.float64)
    d = torch.cdist(x, c)
    mode = d.argmin(1)
    counts = torch.bincount(mode, minlength=8).double()
    assert ((counts - 1000).abs() < 4 * math.sqrt(8000 * 0.125 * 0.875)).all(), counts
    resid = x - c[mode]
    std = math.sqrt(2) / 4
    assert (resid.std(0) / std - 1).abs().max() < 0.05
    torch.testing.assert_close(
        c.norm(dim=1), torch.full((8,), 2 * math.sqrt(2), dtype=torch.float64)
    )


def test_shapes_of_the_other_toys():
    n = 4000
    r = data.rings(random.key(0), n, noise=0.0, dtype=torch.float64).norm(dim=1)
    assert torch.isin(
        r.round(decimals=6), torch.tensor([0.75, 1.5, 2.25, 3.0], dtype=torch.float64)
    ).all()
    cb = data.checkerboard(random.key(0), n, dtype=torch.float64)
    assert cb.abs().max() <= 4
    cell = torch.floor(cb / 2).long()  # the 2x2 cells of [-4, 4]^2
    assert ((cell[:, 0] + cell[:, 1]) % 2 == 0).all()  # only one colour of the board
    m = data.two_moons(random.key(0), n, noise=0.0, dtype=torch.float64)
    upper = (m + torch.tensor([0.5, 0.25], dtype=torch.float64)).norm(dim=1)
    lower = (
        m
        + torch.tensor([0.5, 0.25], dtype=torch.float64)
        - torch.tensor([1.0, 0.5], dtype=torch.float64)
    ).norm(dim=1)
    assert (torch.minimum((upper - 1).abs(), (lower - 1).abs()) < 1e-9).all()
    sr = data.swiss_roll(random.key(0), n, noise=0.0, dtype=torch.float64)
    rad = sr.norm(dim=1) * 5
    assert rad.min() >= 1.5 * math.pi - 1e-9 and rad.max() <= 4.5 * math.pi + 1e-9


def test_energy_distance():
    x = data.eight_gaussians(random.key(0), 800)
    y = data.eight_gaussians(random.key(1), 800)
    z = data.eight_gaussians(random.key(2), 800, radius=2.0)
    same, diff = data.energy_distance(x, y).item(), data.energy_distance(x, z).item()
    assert abs(same) < 0.02 and diff > 0.1
    # formula check on tiny inputs
    a = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    b = torch.tensor([[0.0, 3.0], [0.0, 4.0], [1.0, 1.0]])
    xy = torch.cdist(a.double(), b.double()).mean()
    expect = 2 * xy - 1.0 - (1 + math.sqrt(5) + math.sqrt(10)) / 3  # U-statistics
    torch.testing.assert_close(data.energy_distance(a, b), expect)
    torch.testing.assert_close(data.energy_distance(a, b), data.energy_distance(b, a))


@given(seed=st.integers(0, 2**31 - 1))
def test_modes_covered(seed):
    c = data.eight_gaussians_centers()
    x = data.eight_gaussians(random.key(seed), 1000)
    assert data.modes_covered(x, c, radius=1.0) == 1.0
    half = x[torch.cdist(x, c).argmin(1) < 4]  # only modes 0..3
    assert data.modes_covered(half, c, radius=1.0) == 0.5
    shares = data.mode_shares(x, c, radius=1.0)
    assert shares.shape == (8,) and 0.9 < shares.sum() <= 1.0


def test_bad_input():
    with pytest.raises(ValueError, match="n must be an int >= 1, got 0"):
        data.eight_gaussians(random.key(0), 0)
    with pytest.raises(ValueError, match="noise must be >= 0"):
        data.two_moons(random.key(0), 4, noise=-0.1)
    with pytest.raises(ValueError, match="radii must be"):
        data.rings(random.key(0), 4, radii=())
    with pytest.raises(ValueError, match="x and y must have the same dim"):
        data.energy_distance(torch.zeros(3, 2), torch.zeros(3, 3))
    with pytest.raises(ValueError, match=r"samples must be a floating-point \(n, d\) Tensor"):
        data.modes_covered(torch.zeros(3), torch.zeros(8, 2), radius=1.0)
    with pytest.raises(ValueError, match="radius must be > 0"):
        data.modes_covered(torch.zeros(3, 2), torch.zeros(8, 2), radius=0.0)
    with pytest.raises(ValueError, match=r"centers must be a \(K, 2\) Tensor"):
        data.mode_shares(torch.zeros(3, 2), torch.zeros(8, 3), radius=1.0)
