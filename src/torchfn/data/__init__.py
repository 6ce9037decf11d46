"""Embedded data sets and keyed batching."""

from torchfn.data._digits import load_digits, train_test_split
from torchfn.data._spread import class_spread
from torchfn.data._toys import (
    checkerboard,
    eight_gaussians,
    eight_gaussians_centers,
    energy_distance,
    mode_shares,
    modes_covered,
    rings,
    swiss_roll,
    two_moons,
)

__all__ = [
    # 8x8 digits (torchfn.data._digits)
    "load_digits",
    "train_test_split",
    "class_spread",
    # 2-D toys and sample metrics (torchfn.data._toys)
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
