"""DeepSeek Sparse Attention (``LatentAttention(indexer=...)``) on its own: each query
attends to exactly the keys a per-query loop of the indexer's formula picks, documents
and padding stay apart, the caches equal the whole sequence, and per-sample gradients
and jvp go through the discrete choice. test_deepseek_transformers.py compares
DeepSeek-V3.2 and GLM-5 models with transformers."""

from __future__ import annotations

import pytest
import torch
from _cached import logits_through_cache
from _transforms import check_vmap_grad_and_jvp

import torchfn
from torchfn import optim, random
from torchfn.models import KVCache, LatentAttention, StaticKVCache, TransformerEncoder
from torchfn.models._rotary import apply_rotary, rotary_table

DIMS = dict(kv_rank=12, rope_dim=6, nope_dim=4, v_dim=10, q_rank=16)
INDEXER = dict(heads=8, head_dim=10, topk=4)


def dsa(seed=0, **kw):
    """A float64 sparse LatentAttention Model and params, and its input x ``(2, 11, 24)``."""
    model = torchfn.Model(LatentAttention(24, 3, **DIMS, indexer=INDEXER, **kw).double())
    params = model.init(random.key(seed))
    x = random.normal(random.key(seed + 1), (2, 11, 24), dtype=torch.float64)
    return model, params, x


def index_scores(params, x):
    """``(B, N, N)``: the indexer's score ``sum_j w_j relu(q_j . k_s / sqrt(D))`` of
    every query ``t`` and key ``s``, one query, key and head at a time."""
    p = {n.removeprefix("indexer."): t for n, t in params.items() if n.startswith("indexer.")}
    b, n, _ = x.shape
    heads, d = p["weights.weight"].shape[0], p["k.weight"].shape[0]
    table = rotary_table(torch.arange(n), DIMS["rope_dim"], dtype=torch.float64)
    q_lat = torch.nn.functional.rms_norm(x @ params["q_a.weight"].T, (DIMS["q_rank"],),
                                         params["q_norm.weight"], eps=1e-6)
    q = apply_rotary((q_lat @ p["q.weight"].T).unflatten(-1, (heads, d)).transpose(1, 2),
                     table)  # (B, Hi, N, D)
    k = torch.nn.functional.layer_norm(x @ p["k.weight"].T, (d,), p["k_norm.weight"],
                                       p["k_norm.bias"], eps=1e-6)
    k = apply_rotary(k, table)  # (B, N, D)
    w = (x @ p["weights.weight"].T) * heads ** -0.5  # (B, N, Hi)
    return torch.stack([torch.stack([torch.stack([
        sum(w[i, t, j] * torch.relu(q[i, j, t] @ k[i, s] / d ** 0.5) for j in range(heads))
        for s in range(n)]) for t in range(n)]) for i in range(b)])


def chosen_by_loop(params, x, topk):
    """``(B, N, N)`` bool: for each query ``t`` the ``topk`` keys ``s <= t`` of highest
    indexer score."""
    scores = index_scores(params, x)
    b, n, _ = x.shape
    keep = torch.zeros(b, n, n, dtype=torch.bool)
    for i in range(b):
        for t in range(n):
            keep[i, t, scores[i, t, :t + 1].argsort(descending=True)[:topk]] = True
    return keep


def attention_over(params, x, keep, probabilities=False):
    """The latent attention of ``x`` with each query seeing the keys ``keep`` marks:
    softmax over those keys alone, in float64, by hand (or its probabilities ``(B, H,
    N, N)``)."""
    h, (dn, dr, dv, r) = 3, (DIMS["nope_dim"], DIMS["rope_dim"], DIMS["v_dim"],
                             DIMS["kv_rank"])
    n = x.shape[1]
    table = rotary_table(torch.arange(n), dr, dtype=torch.float64)
    q_lat = torch.nn.functional.rms_norm(x @ params["q_a.weight"].T, (DIMS["q_rank"],),
                                         params["q_norm.weight"], eps=1e-6)
    q = (q_lat @ params["q_b.weight"].T).unflatten(-1, (h, dn + dr)).transpose(1, 2)
    latent, k_rope = (x @ params["kv_a.weight"].T).split([r, dr], -1)
    latent = torch.nn.functional.rms_norm(latent, (r,), params["kv_norm.weight"], eps=1e-6)
    kv = (latent @ params["kv_b.weight"].T).unflatten(-1, (h, dn + dv)).transpose(1, 2)
    k = torch.cat((kv[..., :dn], apply_rotary(k_rope, table)[:, None].expand(-1, h, -1, -1)),
                  -1)
    q = torch.cat((q[..., :dn], apply_rotary(q[..., dn:], table)), -1)
    scores = (q @ k.transpose(-1, -2)) * (dn + dr) ** -0.5  # (B, H, N, N)
    p = scores.masked_fill(~keep[:, None], float("-inf")).softmax(-1)
    if probabilities:
        return p
    o = p @ kv[..., dn:]  # (B, H, N, dv)
    return o.transpose(1, 2).flatten(2) @ params["out.weight"].T


@pytest.mark.parametrize("absorb", [True, False])
def test_each_query_attends_to_the_keys_a_loop_of_the_indexer_picks(absorb):
    """The layer's output is attention over exactly the ``topk`` keys per query that a
    loop of the indexer's formula picks (all keys for the first ``topk`` queries), on
    both of MLA's paths; the indexer does change the output (it is not dense)."""
    model, params, x = dsa(absorb=absorb)
    keep = chosen_by_loop(params, x, INDEXER["topk"])
    assert keep.sum(-1).tolist() == [[min(t + 1, 4) for t in range(11)]] * 2
    want = attention_over(params, x, keep)
    torch.testing.assert_close(model.apply(params, x), want, rtol=1e-10, atol=1e-12)
    blocked = LatentAttention(24, 3, **DIMS, indexer=INDEXER, absorb=absorb).double()
    blocked.indexer.query_block = 3  # the scores 3 queries at a time: the same choice
    torch.testing.assert_close(torchfn.Model(blocked).apply(params, x), want, rtol=1e-10,
                               atol=1e-12)
    dense = attention_over(params, x, torch.ones(11, 11, dtype=torch.bool).tril()[None])
    assert (dense[:, 4:] - want[:, 4:]).abs().max() > 1e-3
    torch.testing.assert_close(dense[:, :4], want[:, :4], rtol=1e-10, atol=1e-12)


def test_documents_and_padding_stay_apart():
    """Two documents packed in one row (``segment_ids``) give each document's output
    alone: the indexer picks a query's keys in its own document only; a left-padded row
    gives the unpadded one's (padding never chosen)."""
    model, params, x = dsa()
    seg = torch.tensor([[0] * 6 + [1] * 5] * 2)
    packed = model.apply(params, x, segment_ids=seg)
    torch.testing.assert_close(packed[:, :6], model.apply(params, x[:, :6]), rtol=1e-10,
                               atol=1e-12)
    alone = model.apply(params, x[:, 6:])  # positions from 0 again, as segment_ids give
    torch.testing.assert_close(packed[:, 6:], alone, rtol=1e-10, atol=1e-12)
    pad = torch.ones(2, 11, dtype=torch.bool)
    pad[1, :3] = False
    positions = torch.stack((torch.arange(11), (torch.arange(11) - 3).clamp_min(0)))
    padded = model.apply(params, x, pad, positions=positions)
    torch.testing.assert_close(padded[1, 3:], model.apply(params, x[1:, 3:])[0], rtol=1e-10,
                               atol=1e-12)


def test_both_caches_equal_the_whole_sequence():
    """Prefill then a token at a time through a KVCache and a StaticKVCache, each
    holding the indexer's keys after the rotary keys: the whole sequence at once."""
    model, params, x = dsa()
    want = model.apply(params, x)
    torch.testing.assert_close(logits_through_cache(model, params, x, 3), want, rtol=1e-10,
                               atol=1e-12)
    static = StaticKVCache.allocate(model, 2, 16, dtype=torch.float64)
    assert static.values[0].shape == (2, 1, 16, DIMS["rope_dim"] + INDEXER["head_dim"])
    torch.testing.assert_close(logits_through_cache(model, params, x, 5, static), want,
                               rtol=1e-10, atol=1e-12)
    _, cache = model.apply(params, x[:, :5], cache=KVCache())
    assert cache.values[0].shape == (2, 1, 5, DIMS["rope_dim"] + INDEXER["head_dim"])


def test_per_sample_gradients_and_jvp_go_through_the_choice():
    """``vmap(grad)`` equals a loop of ``grad`` (the indexer's params at zero gradient:
    the choice is discrete); ``jvp`` equals a central difference (the choice does not
    move under a small enough step)."""
    model, params, x = dsa()
    per = check_vmap_grad_and_jvp(model, params, x, eps=1e-7)
    assert all(per[n].abs().max() == 0 for n in params if n.startswith("indexer."))
    assert per["q_b.weight"].abs().max() > 0


def test_bad_indexer_options_are_named():
    with pytest.raises(ValueError, match="indexer must be a dict of heads, head_dim and "
                                         "topk, got {'heads': 2}"):
        LatentAttention(24, 3, **DIMS, indexer={"heads": 2})
    with pytest.raises(ValueError, match="indexer needs q_rank"):
        LatentAttention(24, 3, **dict(DIMS, q_rank=None), indexer=INDEXER)
    with pytest.raises(ValueError, match="topk must be an int >= 1, got 0"):
        LatentAttention(24, 3, **DIMS, indexer=dict(INDEXER, topk=0))
    with pytest.raises(ValueError, match="indexer head_dim must be >= the rotary rope_dim "
                                         "6, got 4"):
        LatentAttention(24, 3, **DIMS, indexer=dict(INDEXER, head_dim=4))
    model, params, x = dsa()
    plain = KVCache((torch.zeros(2, 1, 3, 12, dtype=torch.float64),),
                    (torch.zeros(2, 1, 3, 6, dtype=torch.float64),))  # no indexer keys
    with pytest.raises(ValueError, match=r"rotary keys \(B, 1, L, 16\), got \(2, 1, 3, 12\)"):
        model.apply(params, x, cache=plain)


def kl_by_loop(params, x, keep):
    """The indexer loss by hand: the mean over query rows of ``KL(p || softmax(I))`` over
    the row's ``keep`` keys, ``p`` the attention's probabilities averaged over heads."""
    p = attention_over(params, x, keep, probabilities=True).mean(1)  # (B, N, N)
    scores = index_scores(params, x)
    kls = [(p[i, t, k] * (p[i, t, k].log() - scores[i, t, k].log_softmax(-1))).sum()
           for i in range(x.shape[0]) for t in range(x.shape[1])
           for k in [keep[i, t]] if k.any()]
    return torch.stack(kls).mean()


@pytest.mark.parametrize("absorb", [True, False])
def test_indexer_loss_is_the_kl_a_loop_computes(absorb):
    """``return_indexer_loss=True``: the KL of the heads' mean attention against the
    indexer's softmax, over each query's chosen keys (sparse stage), or over every key it
    may see when ``topk`` covers them (dense warm-up: the same params); blocked scores
    give the same loss."""
    model, params, x = dsa(absorb=absorb)
    out, loss = model.apply(params, x, return_indexer_loss=True)
    torch.testing.assert_close(out, model.apply(params, x), rtol=0, atol=0)
    torch.testing.assert_close(loss, kl_by_loop(params, x, chosen_by_loop(params, x, 4)),
                               rtol=1e-10, atol=0)
    dense = LatentAttention(24, 3, **DIMS, indexer=dict(INDEXER, topk=11), absorb=absorb)
    dense.double().indexer.query_block = 3
    _, warm = torchfn.Model(dense).apply(params, x, return_indexer_loss=True)
    causal = torch.ones(11, 11, dtype=torch.bool).tril().expand(2, 11, 11)
    torch.testing.assert_close(warm, kl_by_loop(params, x, causal), rtol=1e-10, atol=0)


def test_indexer_loss_trains_the_indexer_alone():
    """Its gradient reaches the indexer's params only (its input is detached);
    ``vmap(grad)`` equals a loop; a left-padded row's loss is the unpadded row's (rows
    without keys drop out); and a few Adam steps of the dense warm-up cut it 5x."""
    model, params, x = dsa()

    def loss(p, xs, *args, **kw):
        return model.apply(p, xs, *args, return_indexer_loss=True, **kw)[1]

    g = torch.func.grad(loss)(params, x)
    assert all((g[n].abs().max() > 0) == n.startswith("indexer.") for n in params)
    per = torch.func.vmap(torch.func.grad(lambda p, xi: loss(p, xi[None])),
                          in_dims=(None, 0))(params, x)
    for i in range(2):
        one = torch.func.grad(loss)(params, x[i:i + 1])
        for n in params:
            torch.testing.assert_close(per[n][i], one[n], rtol=1e-10, atol=1e-12)
    pad = torch.ones(1, 11, dtype=torch.bool)
    pad[0, :3] = False
    positions = (torch.arange(11) - 3).clamp_min(0)[None]
    torch.testing.assert_close(loss(params, x[1:], pad, positions=positions),
                               loss(params, x[1:, 3:]), rtol=1e-10, atol=0)
    warm = torchfn.Model(LatentAttention(24, 3, **DIMS, indexer=dict(INDEXER, topk=11)).double())
    ix = {n: t for n, t in params.items() if n.startswith("indexer.")}
    rest = {n: t for n, t in params.items() if n not in ix}

    def warm_loss(ix):
        return warm.apply({**rest, **ix}, x, return_indexer_loss=True)[1]

    opt = optim.adam(2e-2)
    state, start = opt.init(ix), warm_loss(ix)
    for _ in range(20):
        updates, state = opt.update(torch.func.grad(warm_loss)(ix), state, ix)
        ix = optim.apply_updates(ix, updates)
    assert warm_loss(ix) < start / 5


def test_encoder_returns_each_indexed_blocks_loss():
    """``TransformerEncoder(return_indexer_loss=True)``: one loss per indexed block, each
    its attention's on the block's normalised input; after the router logits with both;
    the same under remat; named errors without an indexer or with a cache."""
    latent = dict(DIMS, indexer=INDEXER)
    kw = dict(vocab_size=13, dim=24, depth=2, heads=3, mlp_hidden=16, norm="rms",
              position_embedding="rotary", latent_attention=latent, causal=True)
    model = torchfn.Model(TransformerEncoder(**kw, experts=4, top_k=2).double())
    params = model.init(random.key(0))
    tokens = torch.randint(0, 13, (2, 11), generator=torch.Generator().manual_seed(0))
    out, losses = model.apply(params, tokens, return_indexer_loss=True)
    torch.testing.assert_close(out, model.apply(params, tokens), rtol=0, atol=0)
    assert len(losses) == 2 and all(loss > 0 for loss in losses)
    h = params["embed.weight"][tokens]
    block0 = {n.removeprefix("blocks.0.attn."): t for n, t in params.items()
              if n.startswith("blocks.0.attn.")}
    n1 = torch.nn.functional.rms_norm(h, (24,), params["blocks.0.ln1.weight"])
    layer = torchfn.Model(LatentAttention(24, 3, **latent).double())
    torch.testing.assert_close(losses[0], layer.apply(block0, n1, return_indexer_loss=True)[1],
                               rtol=1e-10, atol=0)
    _, logits, both = model.apply(params, tokens, return_router_logits=True,
                                  return_indexer_loss=True)
    assert len(logits) == 2 and logits[0].shape == (2, 11, 4)
    torch.testing.assert_close(both, losses, rtol=0, atol=0)
    remat = torchfn.Model(TransformerEncoder(**kw, experts=4, top_k=2, remat=True).double())
    grads = [torch.func.grad(lambda p, m=m: sum(m.apply(p, tokens, return_indexer_loss=True)[1])
                             )(params) for m in (model, remat)]
    for n in params:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-10, atol=1e-14)
    dense = torchfn.Model(TransformerEncoder(**dict(kw, latent_attention=DIMS)).double())
    with pytest.raises(ValueError, match="return_indexer_loss needs a latent attention with "
                                         "an indexer"):
        dense.apply(dense.init(random.key(0)), tokens, return_indexer_loss=True)
    with pytest.raises(ValueError, match="return_indexer_loss needs an indexer and no cache"):
        torchfn.Model(LatentAttention(24, 3, **latent).double()).apply(
            block0, n1, cache=KVCache(), return_indexer_loss=True)
