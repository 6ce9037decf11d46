"""2-D toy distributions (the FFJORD set) drawn from keys, and sample-quality metrics.

Every sampler is ``f(key, n, ..., dtype=torch.float32) -> (n, 2)``; the default
constants follow FFJORD's ``toy_data.py`` (Grathwohl et al. 2019), so plots and numbers
compare with the literature.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from torchfn import random

__all__ = [
    "eight_gaussians",
    "eight_gaussians_centers",
    "two_moons",
    "swiss_roll",
    "rings",
    "checkerboard",
    "energy_distance",
    "mode_shares",
    "modes_covered",
]

_SQRT2 = math.sqrt(2.0)


def _check_n(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")


def _check_pos(name: str, value: float, allow_zero: bool = True) -> None:
    if not (value >= 0 if allow_zero else value > 0):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def eight_gaussians_centers(
    radius: float = 2 * _SQRT2, dtype: torch.dtype = torch.float32
) -> Tensor:
    """The ``(8, 2)`` mode centres ``radius * (cos(k pi/4), sin(k pi/4))``, ``k = 0..7``.

    Example::

        >>> eight_gaussians_centers(1.0)[2].round().tolist()
        [0.0, 1.0]
    """
    angles = torch.arange(8, dtype=torch.float64) * (math.pi / 4)
    return (radius * torch.stack([angles.cos(), angles.sin()], dim=1)).to(dtype)


def eight_gaussians(
    key: Tensor,
    n: int,
    *,
    radius: float = 2 * _SQRT2,
    std: float = _SQRT2 / 4,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """A mixture of 8 equally weighted isotropic Gaussians on a circle: ``(n, 2)``.

    Defaults are FFJORD's ``8gaussians`` (centres at radius ``4/sqrt(2)``, std ``0.5/sqrt(2)``).

    Example::

        >>> eight_gaussians(random.key(0), 5).shape
        torch.Size([5, 2])
    """
    _check_n(n)
    _check_pos("radius", radius, allow_zero=False)
    _check_pos("std", std)
    k_mode, k_noise = random.split(key)
    mode = random.randint(k_mode, (n,), 0, 8).long()  # (n,)
    centers = eight_gaussians_centers(radius, torch.float64)[mode]  # (n, 2)
    x = centers + std * random.normal(k_noise, (n, 2), dtype=torch.float64)
    return x.to(dtype)


def two_moons(
    key: Tensor, n: int, *, noise: float = 0.1, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Two interleaved half circles (as sklearn's ``make_moons``), centred at 0: ``(n, 2)``.

    Upper moon ``(cos a, sin a)``, lower ``(1 - cos a, 1/2 - sin a)``, ``a ~ U(0, pi)``, each
    point on either with probability 1/2, shifted by ``-(1/2, 1/4)``, plus ``noise * N(0, I)``.

    Example::

        >>> two_moons(random.key(0), 5).shape
        torch.Size([5, 2])
    """
    _check_n(n)
    _check_pos("noise", noise)
    k_side, k_angle, k_noise = random.split(key, 3)
    lower = random.uniform(k_side, (n,), dtype=torch.float64) < 0.5  # (n,)
    a = math.pi * random.uniform(k_angle, (n,), dtype=torch.float64)  # (n,)
    upper_pts = torch.stack([a.cos(), a.sin()], dim=1)  # (n, 2)
    lower_pts = torch.stack([1.0 - a.cos(), 0.5 - a.sin()], dim=1)
    x = torch.where(lower[:, None], lower_pts, upper_pts) - torch.tensor(
        [0.5, 0.25], dtype=torch.float64
    )
    x = x + noise * random.normal(k_noise, (n, 2), dtype=torch.float64)
    return x.to(dtype)


def swiss_roll(
    key: Tensor, n: int, *, noise: float = 0.2, dtype: torch.dtype = torch.float32
) -> Tensor:
    """FFJORD's 2-D swiss roll: ``u = 1.5 pi (1 + 2 U(0,1))``, ``(u cos u, u sin u) / 5`` + noise.

    Example::

        >>> swiss_roll(random.key(0), 5).shape
        torch.Size([5, 2])
    """
    _check_n(n)
    _check_pos("noise", noise)
    k_u, k_noise = random.split(key)
    u = 1.5 * math.pi * (1.0 + 2.0 * random.uniform(k_u, (n,), dtype=torch.float64))  # (n,)
    x = torch.stack([u * u.cos(), u * u.sin()], dim=1) / 5.0  # (n, 2)
    x = x + noise * random.normal(k_noise, (n, 2), dtype=torch.float64)
    return x.to(dtype)


def rings(
    key: Tensor,
    n: int,
    *,
    radii: tuple[float, ...] = (0.75, 1.5, 2.25, 3.0),
    noise: float = 0.08,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Concentric circles (FFJORD's ``rings``): a uniform ring, a uniform angle, plus noise.

    Example::

        >>> rings(random.key(0), 5).shape
        torch.Size([5, 2])
    """
    _check_n(n)
    _check_pos("noise", noise)
    if len(radii) < 1 or any(not r > 0 for r in radii):
        raise ValueError(f"radii must be a non-empty sequence of values > 0, got {radii!r}")
    k_ring, k_angle, k_noise = random.split(key, 3)
    ring = random.randint(k_ring, (n,), 0, len(radii)).long()  # (n,)
    r = torch.tensor(radii, dtype=torch.float64)[ring]  # (n,)
    a = 2 * math.pi * random.uniform(k_angle, (n,), dtype=torch.float64)
    x = r[:, None] * torch.stack([a.cos(), a.sin()], dim=1)  # (n, 2)
    x = x + noise * random.normal(k_noise, (n, 2), dtype=torch.float64)
    return x.to(dtype)


def checkerboard(key: Tensor, n: int, *, dtype: torch.dtype = torch.float32) -> Tensor:
    """Uniform on the 8 dark squares of a 4x4 checkerboard over ``[-4, 4]^2`` (FFJORD).

    Example::

        >>> checkerboard(random.key(0), 5).shape
        torch.Size([5, 2])
    """
    _check_n(n)
    k1, k2, k3 = random.split(key, 3)
    x1 = 4.0 * random.uniform(k1, (n,), dtype=torch.float64) - 2.0  # (n,)
    shift = 2.0 * random.randint(k3, (n,), 0, 2).to(torch.float64)
    x2 = random.uniform(k2, (n,), dtype=torch.float64) - shift + torch.floor(x1) % 2
    return (2.0 * torch.stack([x1, x2], dim=1)).to(dtype)


# ----------------------------------------------------------------------------- metrics


def _check_points(name: str, x: Tensor) -> None:
    if not isinstance(x, Tensor) or not x.dtype.is_floating_point or x.dim() != 2:
        got = f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a floating-point (n, d) Tensor, got {got}")
    if x.shape[0] < 2:
        raise ValueError(f"{name} needs at least 2 points, got {x.shape[0]}")


def energy_distance(x: Tensor, y: Tensor) -> Tensor:
    """Squared energy distance ``2 E|X - Y| - E|X - X'| - E|Y - Y'|`` (Szekely & Rizzo).

    Unbiased U-statistic in float64 (the within-sample means skip the diagonal), so two
    samples of one distribution give about 0 (slightly negative values are possible).
    ``x: (n, d)``, ``y: (m, d)``; returns a float64 scalar. Memory is ``O(n m)``.

    Example::

        >>> x = eight_gaussians(random.key(0), 500); y = eight_gaussians(random.key(1), 500)
        >>> abs(float(energy_distance(x, y))) < 0.05
        True
    """
    _check_points("x", x)
    _check_points("y", y)
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"x and y must have the same dim d, got {x.shape[1]} and {y.shape[1]}")
    x, y = x.detach().to(torch.float64), y.detach().to(torch.float64)
    n, m = x.shape[0], y.shape[0]
    xy = torch.cdist(x, y).mean()
    xx = torch.cdist(x, x).sum() / (n * (n - 1))
    yy = torch.cdist(y, y).sum() / (m * (m - 1))
    return 2 * xy - xx - yy


def mode_shares(samples: Tensor, centers: Tensor, *, radius: float) -> Tensor:
    """``(K,)`` fraction of ``samples: (n, d)`` within ``radius`` of each of ``centers: (K, d)``.

    Example::

        >>> mode_shares(torch.zeros(4, 2), torch.tensor([[0.0, 0.0], [5.0, 5.0]]), radius=1.0)
        tensor([1., 0.], dtype=torch.float64)
    """
    _check_points("samples", samples)
    if (
        not isinstance(centers, Tensor)
        or centers.dim() != 2
        or centers.shape[1] != samples.shape[1]
    ):
        raise ValueError(
            f"centers must be a (K, {samples.shape[1]}) Tensor, got "
            f"{tuple(centers.shape) if isinstance(centers, Tensor) else type(centers).__name__}"
        )
    _check_pos("radius", radius, allow_zero=False)
    d = torch.cdist(samples.detach().to(torch.float64), centers.to(torch.float64))  # (n, K)
    return (d <= radius).to(torch.float64).mean(dim=0)


def modes_covered(
    samples: Tensor, centers: Tensor, *, radius: float, min_share: float | None = None
) -> float:
    """Fraction of the ``K`` modes holding at least ``min_share`` of the samples within ``radius``.

    ``min_share`` defaults to a quarter of the uniform share, ``1 / (4 K)``.

    Example::

        >>> c = eight_gaussians_centers()
        >>> modes_covered(eight_gaussians(random.key(0), 2000), c, radius=1.0)
        1.0
    """
    shares = mode_shares(samples, centers, radius=radius)  # (K,)
    k = shares.shape[0]
    if min_share is None:
        min_share = 1.0 / (4 * k)
    if not 0.0 < min_share <= 1.0:
        raise ValueError(f"min_share must lie in (0, 1], got {min_share}")
    return float((shares >= min_share).to(torch.float64).mean())
