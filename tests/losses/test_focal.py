"""Focal losses: against the RetinaNet formula (torchvision's) element by element; gamma = 0
is cross entropy; float32 stays within 1e-5 of float64 on confident predictions (where
``1 - p`` cancels); one example under vmap equals its row of the batch."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import vmap

from torchfn import losses, random


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), gamma=st.floats(0.0, 4.0),
       alpha=st.one_of(st.none(), st.floats(0.0, 1.0)))
def test_sigmoid_focal_loss_equals_retinanets_formula(seed, gamma, alpha):
    k1, k2 = random.split(random.key(seed))
    x = 3 * random.normal(k1, (4, 3), dtype=torch.float64)
    y = random.uniform(k2, (4, 3), dtype=torch.float64).round()  # 0/1 targets
    got = losses.sigmoid_focal_loss(x, y, alpha=alpha, gamma=gamma, reduction="none")
    for i in range(4):
        for j in range(3):
            xi, yi = x[i, j].item(), y[i, j].item()
            p = 1 / (1 + math.exp(-xi))
            ce = -(yi * math.log(p) + (1 - yi) * math.log(1 - p))
            p_t = p * yi + (1 - p) * (1 - yi)
            want = ce * (1 - p_t) ** gamma
            if alpha is not None:
                want *= alpha * yi + (1 - alpha) * (1 - yi)
            assert got[i, j].item() == pytest.approx(want, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(
        losses.sigmoid_focal_loss(x, y, alpha=alpha, gamma=gamma), got.mean())


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), gamma=st.floats(0.0, 4.0), weighted=st.booleans())
def test_focal_loss_equals_its_formula(seed, gamma, weighted):
    k = random.split(random.key(seed), 3)
    logits = 3 * random.normal(k[0], (5, 4), dtype=torch.float64)
    labels = random.randint(k[1], (5,), 0, 4)
    alpha = random.uniform(k[2], (4,), dtype=torch.float64) if weighted else None
    got = losses.focal_loss(logits, labels, gamma=gamma, alpha=alpha, reduction="none")
    for i in range(5):
        logp = F.log_softmax(logits[i], -1)[labels[i]].item()
        want = -((1 - math.exp(logp)) ** gamma) * logp
        if weighted:
            want *= alpha[labels[i]].item()
        assert got[i].item() == pytest.approx(want, rel=1e-9, abs=1e-14)


def test_gamma_zero_is_cross_entropy():
    logits = random.normal(random.key(1), (6, 5), dtype=torch.float64)
    labels = random.randint(random.key(2), (6,), 0, 5)
    torch.testing.assert_close(losses.focal_loss(logits, labels, gamma=0.0),
                               F.cross_entropy(logits, labels))
    weights = torch.tensor([0.5, 1.0, 2.0, 1.0, 0.1], dtype=torch.float64)
    torch.testing.assert_close(losses.focal_loss(logits, labels, gamma=0.0, alpha=weights,
                                                 reduction="sum"),
                               F.cross_entropy(logits, labels, weight=weights,
                                               reduction="sum"))
    y = (random.uniform(random.key(3), (6, 5), dtype=torch.float64) > 0.5).double()
    torch.testing.assert_close(losses.sigmoid_focal_loss(logits, y, alpha=None, gamma=0.0),
                               F.binary_cross_entropy_with_logits(logits, y))


@pytest.mark.parametrize("margin", [5.0, 10.0, 15.0])
def test_float32_is_accurate_on_confident_predictions(margin):
    """``p_y`` near 1, where ``log_softmax`` and ``1 - p`` lose digits: float32 stays
    within 1e-5 of float64 (``F.cross_entropy`` itself is off by more at margin 15)."""
    logits = torch.tensor([[margin, 0.0, -1.0], [0.0, margin, 0.5]], dtype=torch.float64)
    labels = torch.tensor([0, 1])
    want = losses.focal_loss(logits, labels, reduction="none")
    got = losses.focal_loss(logits.float(), labels, reduction="none")
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0.0)
    assert want.min() > 0
    y = torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64)
    x = torch.tensor([[margin, -margin, -margin]], dtype=torch.float64)
    torch.testing.assert_close(losses.sigmoid_focal_loss(x.float(), y.float(), gamma=2.0,
                                                         reduction="none").double(),
                               losses.sigmoid_focal_loss(x, y, reduction="none"), rtol=1e-5,
                               atol=0.0)


def test_one_example_under_vmap_equals_the_batch():
    logits = random.normal(random.key(4), (5, 3), dtype=torch.float64)
    labels = random.randint(random.key(5), (5,), 0, 3)
    got = vmap(lambda x, y: losses.focal_loss(x, y, reduction="none"))(logits, labels)
    torch.testing.assert_close(got, losses.focal_loss(logits, labels, reduction="none"))


@pytest.mark.parametrize("call, match", [
    (lambda x: losses.sigmoid_focal_loss(x, x[0]), r"targets must have logits' shape"),
    (lambda x: losses.sigmoid_focal_loss(x, x, alpha=1.5), r"alpha must be in \[0, 1\]"),
    (lambda x: losses.sigmoid_focal_loss(x, x, gamma=-1.0), "gamma must be a float >= 0"),
    (lambda x: losses.focal_loss(x, torch.tensor([0, 1])), "labels: integer labels must"),
    (lambda x: losses.focal_loss(x, torch.ones(3)), "labels must be integer class indices, got"),
    (lambda x: losses.focal_loss(x, torch.tensor([0, 1, 3])), r"labels must be in \[0, 3\)"),
    (lambda x: losses.focal_loss(x, torch.tensor([0, 1, 2]), alpha=torch.ones(2)),
     r"alpha must have shape \(3,\)"),
])
def test_bad_input_is_named(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call(random.normal(random.key(0), (3, 3)))
