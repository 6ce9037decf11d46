"""CTC decoding: with beams wide enough never to prune, prefix beam search finds the most
likely labeling found by brute force over every path, and its score is that labeling's
log-probability, ``-losses.ctc_loss``; greedy decoding is the best path; input lengths
cut the frames."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchfn import losses, random
from torchfn.models import ctc_decode


def _labelings(logp, blank):
    """Every labeling's probability, summed over the C^T paths that collapse to it."""
    T, C = logp.shape
    out: dict[tuple, float] = {}
    for path in itertools.product(range(C), repeat=T):
        merged = [c for i, c in enumerate(path) if i == 0 or c != path[i - 1]]
        label = tuple(c for c in merged if c != blank)
        out[label] = out.get(label, 0.0) + math.exp(sum(logp[t, c] for t, c in
                                                        enumerate(path)))
    return out


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), T=st.integers(1, 5), C=st.integers(2, 3),
       sharp=st.floats(0.5, 3.0))
def test_unpruned_beam_search_is_the_exact_maximum(seed, T, C, sharp):
    logits = sharp * random.normal(random.key(seed), (T, C), dtype=torch.float64)
    blank = seed % C
    logp = logits.log_softmax(-1).tolist()
    probs = _labelings(torch.tensor(logp, dtype=torch.float64), blank)
    labels, score = ctc_decode(logits, blank=blank, beam_width=C ** T)
    best = max(probs.values())
    assert probs[tuple(labels)] == pytest.approx(best, rel=1e-9)
    assert score == pytest.approx(math.log(probs[tuple(labels)]), rel=1e-9, abs=1e-12)
    if labels:  # the score is -ctc_loss of the labeling
        loss = losses.ctc_loss(logits, torch.tensor(labels), blank=blank, reduction="sum")
        assert score == pytest.approx(-loss.item(), rel=1e-9)


def test_greedy_is_the_best_path_and_beams_find_what_it_misses():
    probs = torch.tensor([[0.6, 0.4]] * 3, dtype=torch.float64)  # blank 0, label 1
    assert ctc_decode(probs.log())[0] == []  # the best path: all blanks, 0.216
    labels, score = ctc_decode(probs.log(), beam_width=8)
    assert labels == [1] and score == pytest.approx(math.log(0.688))  # six paths
    assert score > math.log(0.216)
    path_score = ctc_decode(probs.log())[1]
    assert path_score == pytest.approx(3 * math.log(0.6))


def test_batches_and_input_lengths():
    logits = random.normal(random.key(1), (3, 6, 4), dtype=torch.float64)
    lengths = torch.tensor([6, 3, 0])
    out = ctc_decode(logits, lengths, beam_width=5)
    assert out[2] == ([], 0.0)
    for b in range(2):
        assert out[b] == ctc_decode(logits[b, :int(lengths[b])], beam_width=5)


@pytest.mark.parametrize("call, match", [
    (lambda x: ctc_decode(x[0, 0]), r"logits must be a float \(B, T, C\) or \(T, C\)"),
    (lambda x: ctc_decode(x, blank=4), r"blank must be a class index in \[0, 4\)"),
    (lambda x: ctc_decode(x, beam_width=0), "beam_width must be an int >= 1"),
    (lambda x: ctc_decode(x, torch.tensor([3, 9])), r"input_lengths must be 2 lengths in "
     r"\[0, 5\]"),
])
def test_bad_input_is_named(call, match):
    with pytest.raises(ValueError, match=match):
        call(random.normal(random.key(0), (2, 5, 4)))
