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
from torchfn import random
from torchfn.models import KVCache, LatentAttention, StaticKVCache
from torchfn.models._rotary import apply_rotary, rotary_table

DIMS = dict(kv_rank=12, rope_dim=6, nope_dim=4, v_dim=10, q_rank=16)
INDEXER = dict(heads=8, head_dim=10, topk=4)


def dsa(seed=0, **kw):
    """A float64 sparse LatentAttention Model and params, and its input x ``(2, 11, 24)``."""
    model = torchfn.Model(LatentAttention(24, 3, **DIMS, indexer=INDEXER, **kw).double())
    params = model.init(random.key(seed))
    x = random.normal(random.key(seed + 1), (2, 11, 24), dtype=torch.float64)
    return model, params, x


def chosen_by_loop(params, x, topk):
    """``(B, N, N)`` bool: for each query ``t`` the ``topk`` keys ``s <= t`` of highest
    ``sum_j w_j relu(q_j . k_s / sqrt(D))``, one query and one head at a time."""
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
    keep = torch.zeros(b, n, n, dtype=torch.bool)
    for i in range(b):
        for t in range(n):
            score = [sum(w[i, t, j] * torch.relu(q[i, j, t] @ k[i, s] / d ** 0.5)
                         for j in range(heads)) for s in range(t + 1)]
            keep[i, t, torch.tensor(score).argsort(descending=True)[:topk]] = True
    return keep


def attention_over(params, x, keep):
    """The latent attention of ``x`` with each query seeing the keys ``keep`` marks:
    softmax over those keys alone, in float64, by hand."""
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
