"""Regression losses equal torch.nn.functional's (float64, random data)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from torchfn.losses import huber, l1, mse


@given(
    seed=st.integers(0, 2**16),
    shape=st.sampled_from([(5,), (3, 4), (2, 1, 3)]),
    delta=st.floats(0.1, 3.0),
    reduction=st.sampled_from(["mean", "sum", "none"]),
)
def test_equal_torch(seed, shape, delta, reduction):
    g = torch.Generator().manual_seed(seed)
    pred = 2 * torch.randn(shape, generator=g, dtype=torch.float64)
    target = torch.randn(shape, generator=g, dtype=torch.float64)
    pairs = [
        (mse(pred, target, reduction=reduction), F.mse_loss(pred, target, reduction=reduction)),
        (l1(pred, target, reduction=reduction), F.l1_loss(pred, target, reduction=reduction)),
        (huber(pred, target, delta=delta, reduction=reduction),
         F.huber_loss(pred, target, delta=delta, reduction=reduction)),
    ]
    for ours, ref in pairs:
        torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)


def test_huber_gradient_equals_torch():
    g = torch.Generator().manual_seed(3)
    pred = 2 * torch.randn(7, generator=g, dtype=torch.float64)
    target = torch.randn(7, generator=g, dtype=torch.float64)
    ours = torch.func.grad(lambda p: huber(p, target, delta=0.7))(pred)
    ref = pred.clone().requires_grad_()
    F.huber_loss(ref, target, delta=0.7).backward()
    torch.testing.assert_close(ours, ref.grad)


def test_bad_input():
    a, b = torch.ones(3), torch.ones(1, 3)
    with pytest.raises(ValueError, match=r"target must have pred's shape \(3,\), got \(1, 3\)"):
        mse(a, b)
    with pytest.raises(ValueError, match="delta must be > 0, got 0"):
        huber(a, a, delta=0)
    with pytest.raises(ValueError, match="reduction must be one of"):
        l1(a, a, reduction="max")
    with pytest.raises(TypeError, match="target must be a floating-point Tensor"):
        l1(a, torch.ones(3, dtype=torch.int64))
