"""class_spread: 1 for the data against itself, 0 for a collapsed generator, the
pairwise-distance formula per class, and bad input."""

import pytest
import torch

from torchfn import random
from torchfn.data import class_spread, load_digits


def test_one_for_the_data_and_zero_for_one_image_per_class():
    x, y = load_digits()  # (N, 64), (N,)
    assert abs(float(class_spread(x, y, x, y)) - 1) < 1e-12
    firsts = torch.stack([x[y == c][0] for c in range(10)])  # one image per digit
    collapsed = firsts.repeat_interleave(5, dim=0)  # (50, 64): five copies of each
    assert float(class_spread(collapsed, torch.arange(10).repeat_interleave(5), x, y)) == 0


def test_the_formula_and_image_shapes():
    k1, k2 = random.split(random.key(0))
    data = random.normal(k1, (40, 1, 4, 4), torch.float64)
    data_labels = torch.arange(40) % 2
    samples = 3 * random.normal(k2, (10, 1, 4, 4), torch.float64)
    labels = torch.arange(10) % 2
    want = torch.stack([
        torch.pdist(samples[labels == c].flatten(1)).mean()
        / torch.pdist(data[data_labels == c].flatten(1)).mean() for c in (0, 1)
    ]).mean()
    assert torch.allclose(class_spread(samples, labels, data, data_labels), want)
    # only the classes the samples have count
    one = class_spread(samples[labels == 1], labels[labels == 1], data, data_labels)
    assert torch.allclose(one, want.new_tensor(float(
        torch.pdist(samples[labels == 1].flatten(1)).mean()
        / torch.pdist(data[data_labels == 1].flatten(1)).mean())))


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.zeros(4, 2), torch.zeros(4), torch.zeros(4, 2), torch.zeros(4).long()),
         "labels must be an int tensor"),
        ((torch.zeros(4, 2), torch.zeros(3).long(), torch.zeros(4, 2), torch.zeros(4).long()),
         r"labels must be an int tensor \(4,\)"),
        ((torch.zeros(4, 2), torch.zeros(4).long(), torch.zeros(4, 3), torch.zeros(4).long()),
         "must share the shape of one example"),
        ((torch.zeros(4), torch.zeros(4).long(), torch.zeros(4, 2), torch.zeros(4).long()),
         r"samples must be a float tensor \(n, \.\.\.\)"),
        ((torch.zeros(4, 2), torch.tensor([0, 0, 0, 1]), torch.zeros(4, 2), torch.zeros(4).long()),
         "class 1 has 1 samples and 0 data rows"),
    ],
)
def test_bad_input_gets_a_clear_error(args, match):
    with pytest.raises(ValueError, match=match):
        class_spread(*args)
