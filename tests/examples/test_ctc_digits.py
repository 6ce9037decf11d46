"""examples/ctc_digits.py: strips hold their digits where the layout says, greedy decoding
merges repeats and drops blanks, and CTC alone (no positions) teaches the reader to read
held-out strips; DP-SGD runs through the same loss per example under vmap."""

import math

import torch

from torchfn import random
from torchfn.data import load_digits


def test_strips_hold_their_digits(example):
    ctc = example("ctc_digits")
    x, y = load_digits()
    images = x.view(-1, 8, 8)
    strips, targets, counts, used = ctc.compose(random.key(0), images, y, 20, 3, 2)
    assert strips.shape == (20, 3 * 8 + 4 * 2, 8)
    assert counts.min() >= 1 and counts.max() <= 3
    assert (used <= strips.shape[1]).all() and (used >= 8 * counts).all()
    for i in range(20):
        assert strips[i, used[i]:].abs().sum() == 0  # nothing past the used width
        # every digit's columns are in the strip, left to right, with gaps between
        col = 0
        for d in range(int(counts[i])):
            matches = [c for c in range(col, strips.shape[1] - 7)
                       if any(torch.equal(strips[i, c:c + 8], im.T)
                              for im in images[y == targets[i, d]])]
            assert matches, f"strip {i}: digit {d} not found"
            col = matches[0] + 8
        assert (targets[i, int(counts[i]):] == 0).all()


def test_greedy_decoding_merges_repeats_and_drops_blanks(example):
    ctc = example("ctc_digits")
    B = ctc.BLANK
    path = [B, 3, 3, B, 3, 7, 7, 7, B, B, 1, 1]
    logits = torch.nn.functional.one_hot(torch.tensor([path, path]), B + 1).float()
    assert ctc.greedy_decode(logits, torch.tensor([12, 7])) == [[3, 3, 7, 1], [3, 3, 7]]
    assert ctc.edit_distance([3, 3, 7, 1], [3, 7, 2]) == 2


def test_ctc_teaches_it_to_read(example):
    ctc = example("ctc_digits")
    m = ctc.main(["--steps", "300", "--max-digits", "3"])
    assert m["before"]["sequence_accuracy"] < 0.1
    assert m["after"]["sequence_accuracy"] > 0.5
    assert m["after"]["digit_error_rate"] < 0.25 < m["before"]["digit_error_rate"]


def test_dp_sgd_trains_through_per_example_ctc(example):
    ctc = example("ctc_digits")
    m = ctc.main(["--dp", "--steps", "40", "--max-digits", "2", "--batch-size", "32"])
    assert m["loss_last"] < m["loss_first"]
    assert 0 < m["epsilon"] < math.inf
