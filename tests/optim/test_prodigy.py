"""Prodigy equals the ``prodigyopt`` package (its authors' code) in float64, the
skipped steps of an all-zero start included, and it finds a step size untuned."""

import contextlib
import io

import optree
import pytest
import torch
from _optim_problem import assert_trees_close, grads_at, make_data
from prodigyopt import Prodigy

from torchfn import optim

CASES = [
    dict(),
    dict(weight_decay=0.1),
    dict(weight_decay=0.1, decouple=False, use_bias_correction=True),
    dict(betas=(0.0, 0.99), safeguard_warmup=True, d_coef=0.5, growth_rate=1.3),
    dict(slice_p=3, beta3=0.9, d0=1e-4, eps=1e-6),
]


def _both(kwargs, grads_of, steps, dtype=torch.float64):
    """Final params of ours and of prodigyopt, fed the same gradients."""
    params, xs, ys = make_data(steps=steps, dtype=dtype)
    leaves = {k: (v[0] if k == "net" else v).clone().requires_grad_(True)
              for k, v in params.items()}
    with contextlib.redirect_stdout(io.StringIO()):  # it prints about weight decay
        opt = Prodigy(list(leaves.values()), **kwargs)
    tx = optim.prodigy(**kwargs)
    state = tx.init(params)
    for t in range(steps):
        grads = grads_of(params, xs[t], ys[t], t)
        updates, state = tx.update(grads, state, params)
        params = optim.apply_updates(params, updates)
        for k, p in leaves.items():
            p.grad = (grads[k][0] if k == "net" else grads[k]).clone()
        opt.step()
    theirs = {k: v.detach() for k, v in leaves.items()}
    theirs["net"] = [theirs["net"]]
    return params, theirs, state, opt


@pytest.mark.parametrize("kwargs", CASES, ids=[str(i) for i in range(len(CASES))])
def test_matches_prodigyopt_in_float64(kwargs):
    ours, theirs, state, opt = _both(kwargs, lambda p, x, y, t: grads_at(p, x, y), 40)
    start, _, _ = make_data(dtype=torch.float64)
    assert float((theirs["w"] - start["w"]).abs().max()) > 1e-3  # it moved
    assert_trees_close(ours, theirs, rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(float(state.d), opt.param_groups[0]["d"], rtol=1e-9, atol=0)


def test_all_zero_gradients_skip_the_step_as_prodigyopt_does():
    def grads_of(p, x, y, t):
        g = grads_at(p, x, y)
        return optree.tree_map(torch.zeros_like, g) if t < 3 else g

    ours, theirs, state, opt = _both(dict(use_bias_correction=True), grads_of, 20)
    assert_trees_close(ours, theirs, rtol=1e-7, atol=1e-9)
    assert int(state.count) == 17  # the three skipped steps were not counted


def test_float32_tracks_prodigyopt_over_the_first_steps():
    ours, theirs, _, _ = _both(dict(), lambda p, x, y, t: grads_at(p, x, y), 20, torch.float32)
    assert_trees_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_bad_input():
    with pytest.raises(ValueError, match="d0 must be > 0, got 0"):
        optim.prodigy(d0=0)
    with pytest.raises(ValueError, match="slice_p must be >= 1"):
        optim.prodigy(slice_p=0)
    with pytest.raises(ValueError, match=r"beta3 must be in \[0, 1\)"):
        optim.prodigy(beta3=1.5)
    tx = optim.prodigy()
    with pytest.raises(ValueError, match="prodigy needs params"):
        tx.update({"w": torch.ones(2)}, tx.init({"w": torch.ones(2)}))
