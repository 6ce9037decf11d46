"""Classification losses equal torch.nn.functional's, in float64, on random data."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from torchfn.losses import accuracy, binary_cross_entropy_with_logits, cross_entropy


def data(seed, b, c, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(b, c, generator=g, dtype=dtype)
    labels = torch.randint(0, c, (b,), generator=g)
    soft = torch.softmax(torch.randn(b, c, generator=g, dtype=dtype), -1)
    return logits, labels, soft


@given(
    seed=st.integers(0, 2**16),
    b=st.integers(1, 6),
    c=st.integers(1, 5),
    smoothing=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
    reduction=st.sampled_from(["mean", "sum", "none"]),
)
def test_cross_entropy_equals_torch(seed, b, c, smoothing, reduction):
    logits, labels, soft = data(seed, b, c)
    for target in (labels, soft):
        ours = cross_entropy(logits, target, label_smoothing=smoothing, reduction=reduction)
        ref = F.cross_entropy(logits, target, label_smoothing=smoothing, reduction=reduction)
        torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)


def test_cross_entropy_per_example_vmap_equals_batch_and_grads_match():
    logits, labels, _ = data(1, 5, 4)
    per = torch.func.vmap(lambda lg, y: cross_entropy(lg, y, label_smoothing=0.2))(logits, labels)
    torch.testing.assert_close(per, cross_entropy(logits, labels, label_smoothing=0.2,
                                                  reduction="none"))
    g = torch.func.grad(lambda lg: cross_entropy(lg, labels, label_smoothing=0.2))(logits)
    ref = logits.clone().requires_grad_()
    F.cross_entropy(ref, labels, label_smoothing=0.2).backward()
    torch.testing.assert_close(g, ref.grad)


@given(seed=st.integers(0, 2**16), shape=st.sampled_from([(3,), (2, 4), (1, 2, 3)]),
       pos=st.sampled_from([None, 0.5, 3.0]), reduction=st.sampled_from(["mean", "sum", "none"]))
def test_bce_with_logits_equals_torch(seed, shape, pos, reduction):
    g = torch.Generator().manual_seed(seed)
    x = 4 * torch.randn(shape, generator=g, dtype=torch.float64)
    y = torch.rand(shape, generator=g, dtype=torch.float64)
    pw = None if pos is None else torch.full(shape[-1:], pos, dtype=torch.float64)
    ours = binary_cross_entropy_with_logits(x, y, pos_weight=pw, reduction=reduction)
    ref = F.binary_cross_entropy_with_logits(x, y, pos_weight=pw, reduction=reduction)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)


def test_bce_stable_at_large_logits():
    x = torch.tensor([200.0, -200.0])
    y = torch.tensor([0.0, 1.0])
    torch.testing.assert_close(binary_cross_entropy_with_logits(x, y, reduction="none"),
                               torch.tensor([200.0, 200.0]))


def test_accuracy_multiclass_and_binary():
    logits, labels, _ = data(2, 20, 3)
    expect = (logits.argmax(-1) == labels).double().mean()
    assert accuracy(logits, labels) == expect
    x = torch.randn(10, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = (torch.arange(10) % 2).double()
    assert accuracy(x, y) == ((x > 0).double() == y).double().mean()


def test_bad_input():
    logits, labels, soft = data(0, 4, 3)
    with pytest.raises(ValueError, match="labels must be in \\[0, 3\\)"):
        cross_entropy(logits, torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="logits.shape\\[:-1\\]"):
        cross_entropy(logits, labels[:3])
    with pytest.raises(ValueError, match="soft .* labels must have logits' shape"):
        cross_entropy(logits, soft[:, :2])
    with pytest.raises(ValueError, match="label_smoothing must be in \\[0, 1\\], got 1.5"):
        cross_entropy(logits, labels, label_smoothing=1.5)
    with pytest.raises(ValueError, match="reduction must be one of"):
        cross_entropy(logits, labels, reduction="avg")
    with pytest.raises(TypeError, match="logits must be a floating-point Tensor"):
        cross_entropy(labels, labels)
    with pytest.raises(ValueError, match="targets must have logits' shape"):
        binary_cross_entropy_with_logits(logits, soft[:, :2])
    with pytest.raises(ValueError, match="labels must have shape"):
        accuracy(logits, labels[:2])
