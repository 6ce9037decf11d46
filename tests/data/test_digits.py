"""The embedded 8x8 digits and the keyed train/test split."""

import csv
import gzip
from importlib import resources

import pytest
import torch

from torchfn import random
from torchfn.data import load_digits, train_test_split


def test_load_digits_shapes_range_and_labels():
    x, y = load_digits()
    assert x.shape == (1797, 64) and x.dtype == torch.float32
    assert y.shape == (1797,) and y.dtype == torch.int64
    assert float(x.min()) == 0.0 and float(x.max()) == 1.0
    # class counts of scikit-learn's load_digits (external reference)
    assert y.bincount().tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    assert torch.equal(x * 16, (x * 16).round())  # integer intensities 0..16


def test_matches_the_csv_read_independently():
    with resources.files("torchfn.data").joinpath("digits.csv.gz").open("rb") as f:
        rows = list(csv.reader(gzip.decompress(f.read()).decode().splitlines()))
    x, y = load_digits()
    for i in (0, 1, 500, 1796):
        assert x[i].tolist() == [int(v) / 16 for v in rows[i][:64]]
        assert int(y[i]) == int(rows[i][64])


def test_fresh_tensors_each_call():
    x, _ = load_digits()
    x[0] = 5.0
    assert float(load_digits()[0][0].max()) <= 1.0


def test_train_test_split_partitions_by_key():
    x, y = load_digits()
    (x_tr, y_tr), (x_te, y_te) = train_test_split(random.key(0), x, y, test_fraction=0.2)
    assert len(x_te) == round(1797 * 0.2) and len(x_tr) + len(x_te) == 1797
    ids = torch.arange(1797)
    (i_tr,), (i_te,) = train_test_split(random.key(0), ids, test_fraction=0.2)
    assert torch.equal(torch.sort(torch.cat([i_tr, i_te])).values, ids)
    assert torch.equal(x_te, x[i_te]) and torch.equal(y_tr, y[i_tr])  # same key, same split
    (j_tr,), _ = train_test_split(random.key(1), ids, test_fraction=0.2)
    assert not torch.equal(i_tr, j_tr)


def test_split_bad_input():
    x, y = load_digits()
    with pytest.raises(ValueError, match="test_fraction"):
        train_test_split(random.key(0), x, test_fraction=1.0)
    with pytest.raises(ValueError, match="leading size"):
        train_test_split(random.key(0), x, y[:10])
    with pytest.raises(ValueError, match="at least one array"):
        train_test_split(random.key(0))
