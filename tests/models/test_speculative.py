"""``speculative_generate``: greedy equals the target's own greedy decoding; sampled
continuations follow the target's exact (enumerated) distribution, not the draft's."""

from __future__ import annotations

import pytest
import torch
from _sampling import target_distribution
from scipy import stats

import torchfn
from torchfn import random
from torchfn.models import TransformerEncoder, generate, speculative_generate

V = 4


def lm(depth, seed, vocab=V, **kw):
    model = torchfn.Model(TransformerEncoder(dim=8, heads=2, depth=depth, vocab_size=vocab,
                                             out_dim=vocab, causal=True, **kw))
    params = {k: v.double() * 3 for k, v in model.init(random.key(seed)).items()}
    return model, params  # weights x3: peaked, distinct distributions


@pytest.mark.parametrize("lookahead", [1, 3, 5])
def test_greedy_equals_the_targets_greedy_decoding(lookahead):
    (big, pb), (small, ps) = lm(2, 0, vocab=11), lm(1, 1, vocab=11,
                                                   position_embedding="rotary")
    prompt = random.randint(random.key(2), (3, 4), 0, 11)
    out, info = speculative_generate(big, pb, small, ps, prompt, 12, lookahead=lookahead,
                                     return_stats=True)
    assert torch.equal(out, generate(big, pb, prompt, 12))
    # each round adds the kept draft tokens and one more; the target runs once a round
    assert info["target_calls"] == info["rounds"] + 1
    assert info["draft_calls"] == lookahead * info["rounds"]
    assert info["accepted"] + 3 * info["rounds"] >= 3 * 12  # every row made 12 tokens
    # the draft proposing the target's own tokens: every proposal is kept
    _, same = speculative_generate(big, pb, big, pb, prompt, 12, lookahead=lookahead,
                                   return_stats=True)
    assert same["accepted"] == same["proposed"]


@pytest.mark.parametrize("temperature, lookahead, filters", [
    (1.0, 2, {}), (0.7, 3, {}), (1.3, 2, {"top_k": 3}), (5.0, 3, {"top_p": 0.9, "min_p": 0.05})])
def test_samples_follow_the_targets_distribution(temperature, lookahead, filters):
    (big, pb), (small, ps) = lm(2, 0), lm(1, 5)
    prompt = torch.tensor([[1, 3]])
    conts, want = target_distribution(big, pb, prompt, 3, temperature, **filters)
    _, draft_dist = target_distribution(small, ps, prompt, 3, temperature, **filters)
    assert 0.5 * (want - draft_dist).abs().sum() > 0.2  # the draft alone would be caught
    n = 20000
    out, info = speculative_generate(big, pb, small, ps, prompt.expand(n, -1), 3,
                                     key=random.key(7), lookahead=lookahead,
                                     temperature=temperature, return_stats=True, **filters)
    assert 0 < info["accepted"] < info["proposed"]  # both paths taken
    index = (out[:, 2:] * torch.tensor([V * V, V, 1])).sum(-1)  # the continuation's cell
    counts = torch.bincount(index, minlength=V**3).double()
    assert (counts[want == 0] == 0).all()  # nothing the filters drop is ever drawn
    if filters:
        assert (want == 0).any()  # and they do drop something here
    big_cells = want * n >= 5
    observed, expected = counts[big_cells], want[big_cells] * n
    if want[~big_cells].sum() > 0:  # the small cells pooled into one
        observed = torch.cat((observed, counts[~big_cells].sum()[None]))
        expected = torch.cat((expected, want[~big_cells].sum()[None] * n))
    assert stats.chisquare(observed.numpy(), expected.numpy() * observed.sum().item()
                           / expected.sum().item()).pvalue > 1e-4


def test_eos_ends_rows_as_generate_does():
    """With ``eos`` a row is ``eos`` after it draws one, as ``generate`` gives it, greedy
    and sampled alike (for a shared key the streams differ, so only the rule is checked
    there); decoding stops once every row has drawn it."""
    (big, pb), (small, ps) = lm(2, 0, vocab=11), lm(1, 1, vocab=11)
    prompt = random.randint(random.key(2), (3, 4), 0, 11)
    plain = generate(big, pb, prompt, 12)
    eos = int(plain[0, 4 + 3])  # a token row 0 draws at its 4th step
    out = speculative_generate(big, pb, small, ps, prompt, 12, lookahead=3, eos=eos)
    assert torch.equal(out, generate(big, pb, prompt, 12, eos=eos))
    every = int(plain[0, 4])  # row 0's first token: only row 0 surely ends at once
    _, info = speculative_generate(big, pb, small, ps, prompt[:1], 12,
                                   eos=every, return_stats=True)
    assert info["rounds"] == 1  # its first round drew eos: nothing more to decode
    sampled = speculative_generate(big, pb, small, ps, prompt, 12, key=random.key(5),
                                   eos=eos)
    for row in sampled[:, 4:]:
        hit = (row == eos).nonzero()
        if len(hit):
            assert (row[hit[0, 0]:] == eos).all()
    with pytest.raises(TypeError, match="eos must be an int token id or None"):
        speculative_generate(big, pb, small, ps, prompt, 3, eos=2.0)


def test_errors_are_named():
    (big, pb), (small, ps) = lm(1, 0), lm(1, 1)
    prompt = torch.tensor([[1, 2]])
    with pytest.raises(ValueError, match="lookahead must be an int >= 1"):
        speculative_generate(big, pb, small, ps, prompt, 3, lookahead=0)
    with pytest.raises(ValueError, match="temperature must be > 0 when sampling"):
        speculative_generate(big, pb, small, ps, prompt, 3, key=random.key(0), temperature=0)
    with pytest.raises(ValueError, match="prompt must be a non-empty int tensor"):
        speculative_generate(big, pb, small, ps, prompt.float(), 3)
    with pytest.raises(ValueError, match="runs eagerly"):
        torch.vmap(lambda k: speculative_generate(big, pb, small, ps, prompt, 3, key=k))(
            random.split(random.key(0), 2))
    hybrid, ph = lm(2, 2, position_embedding="rotary", layer_linear=[True, False],
                    linear_attention=dict(heads=2, key_dim=4, value_dim=4))
    with pytest.raises(ValueError, match="recurrent layers .* cannot drop the draft's "
                                         "rejected tokens"):
        speculative_generate(hybrid, ph, small, ps, prompt, 3)
