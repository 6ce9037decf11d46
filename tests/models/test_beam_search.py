"""``beam_search`` against greedy decoding (one beam) and against enumerating every
continuation (enough beams to be exact)."""

from __future__ import annotations

import itertools

import pytest
import torch

import torchfn
from torchfn import random
from torchfn.models import TransformerEncoder, beam_search, generate

V = 4


def lm(seed=0, vocab=V, **kw):
    model = torchfn.Model(TransformerEncoder(dim=8, heads=2, depth=2, vocab_size=vocab,
                                             out_dim=vocab, causal=True, **kw))
    params = {k: v.double() * 3 for k, v in model.init(random.key(seed)).items()}
    return model, params


def log_prob(model, params, seqs, p):
    """Sum of the log-probabilities of seqs[:, p:] given what precedes, by one forward."""
    logp = torch.log_softmax(model.apply(params, seqs[:, :-1]).double(), -1)
    return logp[:, p - 1:].gather(-1, seqs[:, p:, None])[..., 0].sum(-1)


def test_one_beam_is_greedy_decoding():
    model, params = lm(1, vocab=11, position_embedding="rotary", kv_heads=1)
    prompt = random.randint(random.key(2), (3, 5), 0, 11)
    best, score = beam_search(model, params, prompt, 9, beams=1)
    assert torch.equal(best, generate(model, params, prompt, 9))
    torch.testing.assert_close(score, log_prob(model, params, best, 5))


@pytest.mark.parametrize("steps", [2, 3])
def test_enough_beams_find_the_most_likely_continuations(steps):
    """With V^(steps-1) beams no prefix is ever dropped: the K returned beams are the K
    most likely of all V^steps continuations, with their exact log-probabilities."""
    model, params = lm(3)
    prompt = torch.tensor([[1, 3], [2, 0]])
    k = V ** (steps - 1)
    seqs, scores = beam_search(model, params, prompt, steps, beams=k, return_all=True)
    conts = torch.tensor(list(itertools.product(range(V), repeat=steps)))
    for i in range(2):
        full = torch.cat((prompt[i].expand(len(conts), -1), conts), 1)
        exact = log_prob(model, params, full, 2)  # (V^steps,)
        top = exact.topk(k)
        torch.testing.assert_close(scores[i], top.values, rtol=0, atol=1e-10)
        assert torch.equal(seqs[i, 0], full[top.indices[0]])
        torch.testing.assert_close(log_prob(model, params, seqs[i], 2), scores[i])
    # fewer beams can miss the best: it never beats the exhaustive search
    few, few_score = beam_search(model, params, prompt, steps, beams=2)
    assert (few_score <= scores[:, 0] + 1e-12).all()


def test_eos_finishes_a_beam_and_the_length_penalty_ranks_by_mean():
    model, params = lm(5, vocab=6)
    prompt = torch.tensor([2, 4, 1])
    seqs, scores = beam_search(model, params, prompt, 6, beams=6, return_all=True)
    eos = int(seqs[0, 4])  # the best beam's second token: it ends there
    ended, ended_scores = beam_search(model, params, prompt, 6, beams=6, eos=eos,
                                      return_all=True)
    for seq, score in zip(ended, ended_scores):
        hit = (seq[3:] == eos).nonzero()
        if len(hit):  # padded with eos after its first one; scored up to it
            cut = 3 + int(hit[0]) + 1
            assert (seq[cut:] == eos).all()
            torch.testing.assert_close(score, log_prob(model, params, seq[None, :cut], 3)[0])
        else:
            torch.testing.assert_close(score, log_prob(model, params, seq[None], 3)[0])
    # length_penalty=1 ranks by the mean log-probability per generated token
    _, mean_scores = beam_search(model, params, prompt, 6, beams=6, eos=eos,
                                 length_penalty=1.0, return_all=True)
    assert (mean_scores[:-1] >= mean_scores[1:]).all()
    lengths = torch.tensor([int((s[3:] == eos).nonzero()[0]) + 1 if (s[3:] == eos).any()
                            else 6 for s in ended])  # generated tokens up to eos
    assert 1 <= int((lengths < 6).sum()) < 6  # some beams ended early, some did not
    torch.testing.assert_close(mean_scores.sort(descending=True).values,
                               (ended_scores / lengths).sort(descending=True).values)


def test_errors_are_named():
    model, params = lm()
    prompt = torch.tensor([[1, 2]])
    with pytest.raises(ValueError, match="beams must be an int >= 1"):
        beam_search(model, params, prompt, 3, beams=0)
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        beam_search(model, params, prompt, 0)
    with pytest.raises(TypeError, match="eos must be an int token id"):
        beam_search(model, params, prompt, 3, eos=1.5)
    with pytest.raises(ValueError, match="prompt must be a non-empty int tensor"):
        beam_search(model, params, prompt[:, :0], 3)
