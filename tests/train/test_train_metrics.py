"""Pure metric accumulators equal torchmetrics on random data, accumulated over batches."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torchfn.train import metrics

tm = pytest.importorskip("torchmetrics", reason="torchmetrics is the oracle (dev extra)")
from torchmetrics import classification as tmc  # noqa: E402


def batches(seed, n_batches, batch, num_classes):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        if num_classes is None:
            preds = torch.rand(batch, generator=g)
            target = torch.randint(0, 2, (batch,), generator=g)
        else:
            preds = torch.randn(batch, num_classes, generator=g)
            # few classes present sometimes: exercises the absent-class rules
            target = torch.randint(0, max(2, num_classes - 1), (batch,), generator=g)
        out.append((preds, target))
    return out


def accumulate(metric, data):
    state = metric.init()
    for preds, target in data:
        state = metric.update(state, preds, target)
    return metric.compute(state)


def oracle(tm_metric, data):
    for preds, target in data:
        tm_metric.update(preds, target)
    return tm_metric.compute()


ORACLES = {
    "accuracy": (tmc.BinaryAccuracy, tmc.MulticlassAccuracy),
    "precision": (tmc.BinaryPrecision, tmc.MulticlassPrecision),
    "recall": (tmc.BinaryRecall, tmc.MulticlassRecall),
    "f1_score": (tmc.BinaryF1Score, tmc.MulticlassF1Score),
}


@given(
    name=st.sampled_from(sorted(ORACLES)),
    num_classes=st.sampled_from([None, 3, 5]),
    average=st.sampled_from(["micro", "macro"]),
    top_k=st.sampled_from([1, 2]),
    batch=st.integers(1, 12),
    seed=st.integers(0, 10_000),
)
def test_equals_torchmetrics(name, num_classes, average, top_k, batch, seed):
    if num_classes is None:
        top_k = 1
    data = batches(seed, 3, batch, num_classes)
    ours = getattr(metrics, name)(num_classes, top_k=top_k, average=average)
    binary, multi = ORACLES[name]
    ref = binary() if num_classes is None else multi(num_classes, top_k=top_k, average=average)
    got, want = accumulate(ours, data), oracle(ref, data)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-6, atol=1e-7)


def test_binary_logits_and_hard_labels():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(20, generator=g) * 3
    target = torch.randint(0, 2, (20,), generator=g)
    f1 = metrics.f1_score(logits=True)
    want = tmc.BinaryF1Score()(torch.sigmoid(logits), target)
    torch.testing.assert_close(f1.compute(f1.update(f1.init(), logits, target)).float(), want)
    hard = (torch.sigmoid(logits) > 0.5).long()
    torch.testing.assert_close(f1.compute(f1.update(f1.init(), hard, target)).float(), want)


def test_zero_division_is_zero():
    p = metrics.precision(3, average="macro")
    s = p.update(p.init(), torch.tensor([0, 0]), torch.tensor([1, 1]))  # class 0: tp+fp>0, tp=0
    assert float(p.compute(s)) == 0.0
    b = metrics.precision()
    s = b.update(b.init(), torch.zeros(4), torch.ones(4, dtype=torch.long))  # nothing predicted
    assert float(b.compute(s)) == 0.0


@given(sizes=st.lists(st.integers(1, 6), min_size=1, max_size=4), seed=st.integers(0, 1000))
def test_mean_equals_torchmetrics(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    m, ref = metrics.mean(), tm.MeanMetric()
    state = m.init()
    for n in sizes:
        v, w = torch.randn(n, generator=g), torch.rand(n, generator=g) + 0.1
        state = m.update(state, v, w)
        ref.update(v, w)
    torch.testing.assert_close(m.compute(state).float(), ref.compute())


def test_state_is_a_pytree_and_update_is_pure():
    acc = metrics.accuracy(4)
    s0 = acc.init()
    s1 = acc.update(s0, torch.randn(5, 4), torch.tensor([0, 1, 2, 3, 0]))
    assert int(s0["n"]) == 0 and int(s1["n"]) == 5
    assert all(isinstance(v, torch.Tensor) for v in s1.values())


def test_bad_input():
    with pytest.raises(ValueError, match="num_classes must be an int >= 2"):
        metrics.accuracy(1)
    with pytest.raises(ValueError, match="top_k must be an int >= 1"):
        metrics.accuracy(3, top_k=0)
    with pytest.raises(ValueError, match="top_k needs num_classes"):
        metrics.accuracy(top_k=2)
    with pytest.raises(ValueError, match="top_k must be <= num_classes=3"):
        metrics.recall(3, top_k=4)
    with pytest.raises(ValueError, match="average must be 'micro' or 'macro'"):
        metrics.f1_score(3, average="weighted")
    acc = metrics.accuracy(3)
    with pytest.raises(ValueError, match="same batch size"):
        acc.update(acc.init(), torch.randn(4, 3), torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="binary preds must have shape"):
        metrics.accuracy().update(metrics.accuracy().init(), torch.rand(4, 2),
                                  torch.zeros(4, dtype=torch.long))
