"""``beam_search`` against greedy decoding (one beam) and against enumerating every
continuation (enough beams to be exact), also through a recurrent (Gated DeltaNet) block."""

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


HYBRID = dict(layer_linear=[True, False], linear_attention=dict(heads=2, key_dim=4, value_dim=4))


@pytest.mark.parametrize("mixer", ["attention", "gated_deltanet"])
@pytest.mark.parametrize("steps", [2, 3])
def test_enough_beams_find_the_most_likely_continuations(steps, mixer):
    """With V^(steps-1) beams no prefix is ever dropped: the K returned beams are the K
    most likely of all V^steps continuations, with their exact log-probabilities. With a
    Gated DeltaNet block its state is reordered with the beams, as the keys are."""
    model, params = lm(3, **(HYBRID if mixer != "attention" else {}))
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
    for penalty in (0.0, 1.0):
        ended, ended_scores = beam_search(model, params, prompt, 6, beams=6, eos=eos,
                                          length_penalty=penalty, return_all=True)
        assert (ended_scores[:-1] >= ended_scores[1:]).all()  # best first
        lengths = []
        for seq, score in zip(ended, ended_scores):
            hit = (seq[3:] == eos).nonzero()
            cut = 3 + int(hit[0]) + 1 if len(hit) else len(seq)
            assert (seq[cut:] == eos).all()  # padded with eos after its first one
            lengths.append(cut - 3)  # scored up to it, over length ** penalty
            torch.testing.assert_close(score, log_prob(model, params, seq[None, :cut], 3)[0]
                                       / (cut - 3) ** penalty)
        assert 1 <= sum(n < 6 for n in lengths) < 6  # some beams ended early, some did not


@pytest.mark.parametrize("penalty", [0.0, 1.0])
def test_with_eos_enough_beams_rank_every_ending_exactly(penalty):
    """With V^steps beams nothing is dropped: every continuation (cut after its first
    eos) is returned, ranked by its log-probability over length ** penalty."""
    model, params = lm(7)
    prompt, steps, eos = torch.tensor([[3, 1]]), 3, 2
    seqs, scores = beam_search(model, params, prompt, steps, beams=V ** steps, eos=eos,
                               length_penalty=penalty, return_all=True)
    endings = set()
    for cont in itertools.product(range(V), repeat=steps):
        cut = cont.index(eos) + 1 if eos in cont else steps
        endings.add(cont[:cut] + (eos,) * (steps - cut))
    endings = torch.tensor(sorted(endings))  # (40, steps): 27 + 9 + 3 + 1
    full = torch.cat((prompt.expand(len(endings), -1), endings), 1)
    exact = []
    for seq in full:
        hit = (seq[2:] == eos).nonzero()
        cut = 2 + int(hit[0]) + 1 if len(hit) else len(seq)
        exact.append(log_prob(model, params, seq[None, :cut], 2)[0] / (cut - 2) ** penalty)
    exact = torch.stack(exact)
    order = exact.argsort(descending=True)
    n = len(endings)
    torch.testing.assert_close(scores[0, :n], exact[order], rtol=0, atol=1e-10)
    assert torch.isinf(scores[0, n:]).all()  # the other slots hold nothing
    assert torch.equal(seqs[0, 0], full[order[0]])


def test_one_beam_with_eos_is_greedy_decoding_with_eos():
    model, params = lm(1, vocab=5)
    prompt = random.randint(random.key(4), (4, 3), 0, 5)
    greedy = generate(model, params, prompt, 8)
    eos = int(greedy[0, 5])  # a token greedy decoding draws
    best, _ = beam_search(model, params, prompt, 8, beams=1, eos=eos)
    assert torch.equal(best, generate(model, params, prompt, 8, eos=eos))


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
