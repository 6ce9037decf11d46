"""``mtp_speculative_generate``: greedy equals the model's own greedy decoding; every
round's drafts equal what the MTP depths predict on the whole sequence without caches;
sampled continuations follow the model's exact (enumerated) distribution. And the
encoder's two pieces it runs on: ``return_hidden`` and ``mtp_depth``."""

from __future__ import annotations

import pytest
import torch
from _sampling import target_distribution
from scipy import stats

import torchfn
from torchfn import random
from torchfn.models import (
    KVCache,
    TransformerEncoder,
    _mtp_decode,
    generate,
    mtp_speculative_generate,
)

KW = dict(dim=16, heads=2, depth=2, causal=True, norm="rms", position_embedding="rotary",
          mlp_hidden=24)
LATENT = dict(kv_rank=12, rope_dim=6, nope_dim=4, v_dim=10, q_rank=16)


def lm(mtp, vocab, seed=0, scale=3.0, **kw):
    """A float64 causal LM with ``mtp`` depths; weights scaled up: peaked distributions."""
    model = torchfn.Model(TransformerEncoder(**{**KW, **kw}, vocab_size=vocab, out_dim=vocab,
                                             mtp=mtp).double())
    return model, {n: t * scale for n, t in model.init(random.key(seed)).items()}


@pytest.mark.parametrize("mtp, lookahead, prompt_len, kw", [
    (1, None, 4, {}), (2, 2, 1, {}), (3, 2, 3, {}), (1, 3, 4, {}),
    (2, None, 3, dict(latent_attention=LATENT, experts=4, top_k=2))])
def test_greedy_equals_the_models_greedy_decoding(mtp, lookahead, prompt_len, kw):
    model, params = lm(mtp, 7, **kw)
    prompt = random.randint(random.key(2), (3, prompt_len), 0, 7)
    out, info = mtp_speculative_generate(model, params, prompt, 13, lookahead=lookahead,
                                         return_stats=True)
    assert torch.equal(out, generate(model, params, prompt, 13))
    k = lookahead or mtp
    assert info["draft_calls"] == k * (info["rounds"] - (prompt_len == 1))
    assert info["target_calls"] == info["rounds"] + (prompt_len > 1)
    assert info["accepted"] + 3 * info["rounds"] >= 3 * 13
    assert torch.equal(mtp_speculative_generate(model, params, prompt[1], 13,
                                                lookahead=lookahead), out[1])


def chained_draft_logits(model, params, tokens, at, k, depth):
    """Draft ``k``'s logits at position ``at``, without a cache: the model's final states
    on ``tokens`` (1, N), then depths ``1 .. k`` chained through ``mtp_depth`` (past the
    model's ``depth``, its last one again)."""
    _, h = model.apply(params, tokens, return_hidden=True)
    n = tokens.shape[1]
    for j in range(1, k + 1):
        logits, h = model.apply(params, tokens[:, j:], mtp_depth=min(j, depth),
                                mtp_hidden=h[:, :n - j])
    return logits[0, at]


@pytest.mark.parametrize("mtp, lookahead, seed", [(3, 3, 4), (2, 3, 5)])
def test_each_rounds_drafts_are_the_depths_predictions_on_the_whole_sequence(
        monkeypatch, mtp, lookahead, seed):
    """Records every round's draft distributions, drafts and kept counts (sampling), then
    recomputes each row's draft distributions on its true tokens and the drafts before,
    no cache (``return_mtp``; past the model's depths, its last depth chained again): the
    caches' bookkeeping (kept entries, masked draft entries, positions) is exact, for rows
    that keep different numbers of drafts."""
    model, params = lm(mtp, 3, seed=seed, scale=2.0)  # 3 tokens: drafts often right
    rounds = []

    def recording(logits, drafted, q, *rest):
        n, nxt = verify(logits, drafted, q, *rest)
        rounds.append(([t.clone() for t in q], drafted.clone(), n.clone()))
        return n, nxt

    verify = _mtp_decode.verify
    monkeypatch.setattr(_mtp_decode, "verify", recording)
    prompt = random.randint(random.key(1), (5, 4), 0, 3)
    steps = 16
    out = mtp_speculative_generate(model, params, prompt, steps, key=random.key(seed),
                                   lookahead=lookahead)
    kept = torch.stack([n for *_, n in rounds])  # (R, B)
    assert all((kept == i).any() for i in range(4))  # rows keep 0, 1, 2 and 3 drafts
    length = torch.full((5,), 4)
    checked = 0
    for q, drafted, n in rounds:
        for row in range(5):
            if length[row] + 3 > 4 + steps:  # drafts past the returned tokens
                continue
            seq = out[row, :length[row]].tolist()
            for j in range(1, 4):
                tokens = torch.tensor(seq + drafted[row, :j - 1].tolist())[None]
                if j <= mtp:
                    logits = model.apply(params, tokens, return_mtp=True)[1][j - 1][
                        0, length[row] - 2]
                    torch.testing.assert_close(logits, chained_draft_logits(
                        model, params, tokens, length[row] - 2, j, mtp), rtol=1e-10,
                        atol=1e-10)
                else:
                    logits = chained_draft_logits(model, params, tokens, length[row] - 2, j,
                                                  mtp)
                torch.testing.assert_close(q[j - 1][row], torch.softmax(logits, -1),
                                           rtol=1e-9, atol=1e-12)
                checked += 1
        length = length + n + 1
    assert checked >= 30


@pytest.mark.parametrize("temperature, lookahead, filters", [
    (1.0, 2, {}), (0.8, 1, {"top_k": 3, "min_p": 0.05})])
def test_samples_follow_the_models_distribution(temperature, lookahead, filters):
    model, params = lm(2, 4, seed=3)
    prompt = torch.tensor([[1, 3]])
    conts, want = target_distribution(model, params, prompt, 3, temperature, **filters)
    n = 20000
    out, info = mtp_speculative_generate(model, params, prompt.expand(n, -1), 3,
                                         key=random.key(7), lookahead=lookahead,
                                         temperature=temperature, return_stats=True,
                                         **filters)
    assert 0 < info["accepted"] < info["proposed"]  # both paths taken
    index = (out[:, 2:] * torch.tensor([16, 4, 1])).sum(-1)  # the continuation's cell
    counts = torch.bincount(index, minlength=64).double()
    assert (counts[want == 0] == 0).all()
    big_cells = want * n >= 5
    observed, expected = counts[big_cells], want[big_cells] * n
    if want[~big_cells].sum() > 0:
        observed = torch.cat((observed, counts[~big_cells].sum()[None]))
        expected = torch.cat((expected, want[~big_cells].sum()[None] * n))
    assert stats.chisquare(observed.numpy(), expected.numpy() * observed.sum().item()
                           / expected.sum().item()).pvalue > 1e-4


def test_hidden_and_one_depth_with_a_cache_equal_the_whole_forward():
    """``return_hidden`` with a cache gives the uncached final states; ``mtp_depth=k`` run
    in two cached chunks on them gives ``return_mtp``'s depth-k logits."""
    model, params = lm(2, 11, scale=1.0)
    tokens = random.randint(random.key(0), (2, 9), 0, 11)
    logits, mtp, hidden = model.apply(params, tokens, return_mtp=True, return_hidden=True)
    assert hidden.shape == (2, 9, 16)
    first, h1, cache = model.apply(params, tokens[:, :5], cache=KVCache(), return_hidden=True)
    second, h2, _ = model.apply(params, tokens[:, 5:], cache=cache, return_hidden=True)
    torch.testing.assert_close(torch.cat((h1, h2), 1), hidden, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.cat((first, second), 1), logits, rtol=1e-10, atol=1e-10)
    states = hidden
    for k in (1, 2):
        m = 9 - k
        a, ha, c = model.apply(params, tokens[:, k:k + 4], cache=KVCache(), mtp_depth=k,
                               mtp_hidden=states[:, :4])
        b, hb, c = model.apply(params, tokens[:, k + 4:], cache=c, mtp_depth=k,
                               mtp_hidden=states[:, 4:m])
        torch.testing.assert_close(torch.cat((a, b), 1), mtp[k - 1], rtol=1e-10, atol=1e-10)
        assert c.length == m
        whole, states = model.apply(params, tokens[:, k:], mtp_depth=k, mtp_hidden=states[:, :m])
        torch.testing.assert_close(whole, mtp[k - 1], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(torch.cat((ha, hb), 1), states, rtol=1e-10, atol=1e-10)


def test_eos_ends_rows_as_generate_does():
    model, params = lm(2, 7)
    prompt = random.randint(random.key(2), (3, 3), 0, 7)
    plain = generate(model, params, prompt, 12)
    eos = int(plain[1, 3 + 2])  # a token row 1 draws at its 3rd step
    out = mtp_speculative_generate(model, params, prompt, 12, eos=eos)
    assert torch.equal(out, generate(model, params, prompt, 12, eos=eos))
    _, info = mtp_speculative_generate(model, params, prompt[1:2], 12, eos=int(plain[1, 3]),
                                       return_stats=True)
    assert info["rounds"] == 1  # its first round drew eos: nothing more to decode


def test_errors_are_named():
    model, params = lm(2, 5)
    plain, plain_params = lm(0, 5)
    prompt = torch.tensor([[1, 2]])
    with pytest.raises(ValueError, match="lookahead must be an int >= 1, got 0"):
        mtp_speculative_generate(model, params, prompt, 3, lookahead=0)
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        mtp_speculative_generate(model, params, prompt, 0)
    with pytest.raises(ValueError, match="params hold no multi-token prediction depths"):
        mtp_speculative_generate(plain, plain_params, prompt, 3)
    with pytest.raises(ValueError, match="temperature must be > 0 when sampling"):
        mtp_speculative_generate(model, params, prompt, 3, key=random.key(0), temperature=0)
    with pytest.raises(ValueError, match="runs eagerly"):
        torch.vmap(lambda k: mtp_speculative_generate(model, params, prompt, 3, key=k))(
            random.split(random.key(0), 2))
    hidden = torch.zeros(1, 2, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="mtp_depth must be an int in \\[1, 2\\]"):
        model.apply(params, prompt, mtp_depth=3, mtp_hidden=hidden)
    with pytest.raises(ValueError, match="mtp_hidden \\(B, n, 16\\), got \\(1, 2\\) and "
                                         "\\(1, 3, 16\\)"):
        model.apply(params, prompt, mtp_depth=1, mtp_hidden=hidden[:, [0, 1, 1]])
    with pytest.raises(ValueError, match="takes no segment_ids and no return_"):
        model.apply(params, prompt, mtp_depth=1, mtp_hidden=hidden, return_hidden=True)
    with pytest.raises(TypeError, match="mtp_depth takes a KVCache"):
        model.apply(params, prompt, mtp_depth=1, mtp_hidden=hidden, cache=())
