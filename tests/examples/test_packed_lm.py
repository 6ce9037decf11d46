"""examples/packed_lm.py: packing is lossless, and the packed LM learns each document."""

import pytest
import torch

from torchfn import random


def test_pack_keeps_every_document_whole_and_in_order(example):
    lm = example("packed_lm")
    docs = lm.documents(random.key(0), 50)
    tokens, ids, used = lm.pack(docs, 4, 64)
    assert 0 < used < 50
    for d in range(used):  # each packed document: one contiguous run, in one row
        rows, cols = torch.nonzero(ids == d, as_tuple=True)
        assert rows.unique().numel() == 1
        assert torch.equal(cols, torch.arange(cols[0], cols[0] + len(docs[d])))
        assert torch.equal(tokens[rows[0], cols], docs[d])
    assert ((ids == lm.PAD) == (ids < 0)).all() and (tokens[ids == lm.PAD] == 0).all()


def test_packed_lm_learns_each_document(example):
    result = example("packed_lm").main(["--steps", "80", "--rows", "4", "--seed", "1"])
    # chance is 1/32: the step of a document is read from its own two earlier tokens
    assert result["loss_last"] < result["loss_first"] / 3
    assert result["test_accuracy"] > 0.8


def test_packed_lm_learns_with_muon_and_schedule_free(example):
    lm = example("packed_lm")
    muon = lm.main(["--steps", "60", "--rows", "4", "--seed", "1", "--optimizer", "muon"])
    free = lm.main(["--steps", "60", "--rows", "4", "--seed", "1", "--lr", "2e-2",
                    "--optimizer", "schedule_free"])
    for result in (muon, free):  # schedule-free's accuracy is at its averaged params
        assert result["loss_last"] < result["loss_first"] / 3
        assert result["test_accuracy"] > 0.8


def test_packed_lm_learns_with_soap(example):
    """SOAP's bases (refreshed every 10 steps) on the blocks' matrices, in a real run."""
    result = example("packed_lm").main(["--steps", "60", "--rows", "4", "--seed", "1",
                                        "--lr", "1e-2", "--optimizer", "soap"])
    assert result["loss_last"] < result["loss_first"] / 3
    assert result["test_accuracy"] > 0.8


def test_remat_trains_to_the_same_bits(example):
    """--remat full / dots: each block recomputed in the backward, the run unchanged."""
    lm = example("packed_lm")
    args = ["--steps", "3", "--rows", "2", "--row-len", "64", "--seed", "2"]
    plain = lm.main(args)
    for remat in ("full", "dots"):
        assert lm.main(args + ["--remat", remat]) == plain


def test_rotary_multi_query_lm_continues_progressions(example):
    """Rotary positions, one key/value head: it learns, and its greedy KV-cache
    continuations from left-padded prompts of 3..8 tokens follow the progressions."""
    result = example("packed_lm").main(["--steps", "60", "--rows", "4", "--seed", "1",
                                        "--positions", "rotary", "--kv-heads", "1"])
    assert result["loss_last"] < result["loss_first"] / 3
    assert result["test_accuracy"] > 0.9
    assert result["continuation_accuracy"] > 0.9  # chance: 1/32 per token


def test_speculative_decoding_with_a_trained_draft_equals_plain_decoding(example):
    """--draft-dim: a one-block draft trained on the same batches proposes; greedy
    speculative decoding gives the model's own continuations, most proposals kept."""
    result = example("packed_lm").main(["--steps", "60", "--rows", "4", "--seed", "1",
                                        "--positions", "rotary", "--draft-dim", "32"])
    assert result["equal"]
    assert result["acceptance"] > 0.5
    assert result["target_calls"] < 16 + 1  # fewer model calls than one per token


def test_mixture_of_experts_lm_learns_and_uses_its_experts(example):
    """--experts 4: MoE blocks with the load-balancing loss learn the progressions,
    decode through the KV cache, and route the held-out tokens to every expert."""
    result = example("packed_lm").main(["--steps", "60", "--rows", "4", "--seed", "1",
                                        "--positions", "rotary", "--experts", "4"])
    assert result["loss_last"] < result["loss_first"] / 3
    assert result["test_accuracy"] > 0.9
    assert result["continuation_accuracy"] > 0.9
    for shares in result["expert_shares"]:  # no expert starved (uniform: 0.25 each)
        assert len(shares) == 4 and min(shares) > 0.05
        assert abs(sum(shares) - 1) < 1e-6


def test_deepseek_style_lm_with_latent_attention_and_loss_free_balancing(example):
    """--routing deepseek --latent-attention: sigmoid routing balanced by the selection
    bias alone (no auxiliary loss) and latent attention learn the progressions and decode
    them through the latent cache; each bias moved by at most rate x steps, and every
    expert keeps a share of the tokens."""
    steps, rate = 60, 0.01
    result = example("packed_lm").main([
        "--steps", str(steps), "--rows", "4", "--seed", "1", "--positions", "rotary",
        "--experts", "4", "--routing", "deepseek", "--bias-rate", str(rate),
        "--latent-attention"])
    assert result["loss_last"] < result["loss_first"] / 3
    assert result["test_accuracy"] > 0.9
    assert result["continuation_accuracy"] > 0.9
    assert sorted(result["router_bias"]) == ["blocks.0.mlp.router_bias",
                                             "blocks.1.mlp.router_bias"]
    for bias in result["router_bias"].values():
        assert any(b != 0 for b in bias) and max(abs(b) for b in bias) <= rate * steps + 1e-6
    for shares in result["expert_shares"]:
        assert len(shares) == 4 and min(shares) > 0.05 and abs(sum(shares) - 1) < 1e-6


def test_deepseek_sparse_attention_lm_learns_and_trains_its_indexers(example):
    """--sparse-topk 8: each query attends to the 8 keys a lightning indexer picks; the
    model learns the progressions and decodes them through the cache, and the indexers'
    own loss (added to the model's, their gradient alone) halves their held-out KL
    against the attention, compared with the same model's untrained indexers."""
    result = example("packed_lm").main([
        "--steps", "60", "--rows", "4", "--seed", "0", "--positions", "rotary",
        "--experts", "4", "--routing", "deepseek", "--bias-rate", "0.01",
        "--latent-attention", "--sparse-topk", "8"])
    assert result["loss_last"] < result["loss_first"] / 3
    assert result["test_accuracy"] > 0.9
    assert result["continuation_accuracy"] > 0.9
    assert 0 < result["index_loss_held_out"] < result["index_loss_held_out_untrained"] / 1.5


def test_multi_token_prediction_learns_the_token_after_next(example):
    """--mtp 1: DeepSeek-V3's multi-token prediction block, trained by its loss beside the
    model's, predicts each document's token after next on held-out rows (chance 1/32);
    drafting with it, self-speculative decoding gives the model's own greedy output in
    fewer of its calls."""
    result = example("packed_lm").main(["--steps", "40", "--rows", "4", "--seed", "0",
                                        "--positions", "rotary", "--mtp", "1"])
    assert result["test_accuracy"] > 0.9
    assert result["mtp_accuracy"] > 0.9
    assert result["mtp_equal"]
    assert result["mtp_acceptance"] > 0.8
    # plain decoding calls the model 16 times (the prompt, then a call a token); one
    # depth drafting, a round yields up to 2 tokens: 9 calls at best
    assert result["mtp_target_calls"] <= 12


# Mamba's run (9 s, its selective scan in Python) is kept out of the default run: the
# hybrid-LM property is covered by the other two mixers, Mamba's layer by
# tests/models/test_mamba_hybrid_transformers.py against transformers
@pytest.mark.parametrize("mixer", ["gated_deltanet", "mamba2",
                                   pytest.param("mamba", marks=pytest.mark.slow)])
def test_hybrid_lm_with_linear_attention_learns_each_document(example, mixer):
    """--mixer: a linear-attention block (Gated DeltaNet, Mamba-2 or Mamba) then attention. The
    packed documents reset its state, and greedy continuation from left-padded prompts
    goes through its cached state."""
    result = example("packed_lm").main(["--steps", "80", "--rows", "4", "--seed", "1",
                                        "--mixer", mixer])
    assert result["loss_last"] < result["loss_first"] / 3
    assert result["test_accuracy"] > 0.9
    assert result["continuation_accuracy"] > 0.9
