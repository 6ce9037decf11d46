"""examples/cnf_2d.py: the CNF learns (its NLL falls), and its density is one: integrated
over a grid it sums to 1, which holds only if the flow, the trace integral and the solver
agree (the change of variables, checked numerically)."""

import math

import torch

from torchfn import random


def test_cnf_density_integrates_to_one(example):
    cnf = example("cnf_2d")
    params = cnf.init(random.key(3), 32)
    params["w3"] = params["w3"] * 100  # a flow far from the identity
    side = torch.linspace(-7, 7, 141)
    grid = torch.stack(torch.meshgrid(side, side, indexing="ij"), -1).reshape(-1, 2)
    with torch.no_grad():
        p = cnf.log_prob(params, grid, 1e-6).exp()
    cell = float(side[1] - side[0]) ** 2
    assert abs(float(p.sum()) * cell - 1.0) < 0.01
    base = -0.5 * (grid**2).sum(-1) - math.log(2 * math.pi)
    assert (p.log() - base).abs().max() > 0.5  # the flow does move the density


def test_cnf_learns(example):
    result = example("cnf_2d").main(["--steps", "40", "--batch-size", "128"])
    assert result["test_nll"] < result["first_nll"] - 0.3
    assert math.isfinite(result["test_nll"])
    assert result["samples"].shape == (2000, 2)
