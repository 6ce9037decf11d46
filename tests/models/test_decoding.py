"""KV-cache decoding: cached == re-running the whole sequence; grouped-query attention ==
full attention with repeated key/value heads; ``generate`` and ``sample_logits`` against
the greedy loop and the closed-form distribution."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

import torchfn
from torchfn import random
from torchfn.models import (
    KVCache,
    MultiHeadAttention,
    StaticKVCache,
    TransformerBlock,
    TransformerEncoder,
    generate,
    sample_logits,
)

V = 11
VARIANTS = {
    "learned": dict(),
    "rotary": dict(position_embedding="rotary"),
    "rotary, multi-query": dict(position_embedding="rotary", kv_heads=1),
    "grouped-query, window": dict(kv_heads=2, window=(3, None)),
    "softcap, no positions": dict(softcap=5.0, position_embedding="none"),
    "llama-style": dict(position_embedding="rotary", kv_heads=2, norm="rms", mlp="swiglu",
                        bias=False),
    # wider heads than dim // heads, RMSNorm on q and k, a window on the first layer only
    "qwen3-style": dict(position_embedding="rotary", kv_heads=2, norm="rms", mlp="swiglu",
                        bias=False, head_dim=6, qk_norm=True, layer_windows=[(3, None), None],
                        rotary_dim=4),  # and partial rotary, as Phi-4-mini
    # norms on the sublayers' outputs only, q/k norms over all heads (OLMo 2)
    "olmo2-style": dict(position_embedding="rotary", kv_heads=2, norm="rms", mlp="swiglu",
                        bias=False, pre_norms=False, post_norms=True, qk_norm=True,
                        qk_norm_scope="all"),
    # sandwich norms, GeGLU, scaled embeddings, capped scores and logits, a scale of
    # its own, and a RoPE base per layer
    "gemma-style": dict(position_embedding="rotary", kv_heads=2, norm="rms+1", mlp="geglu",
                        bias=False, head_dim=6, qk_norm=True, post_norms=True, attn_scale=0.3,
                        embed_scale=4.0, softcap=3.0, logit_softcap=5.0,
                        layer_windows=[(3, None), None], layer_rotary=[(100.0, None), None]),
}


def lm(seed=0, **kw):
    net = TransformerEncoder(dim=16, heads=4, depth=2, vocab_size=V, out_dim=V, causal=True,
                             max_len=32, **kw)
    model = torchfn.Model(net)
    params = {k: v.double() for k, v in model.init(random.key(seed)).items()}
    return model, params


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("chunks", [(12,), (5, 1, 1, 1, 1, 1, 1, 1), (3, 4, 5)])
def test_cached_chunks_equal_the_whole_sequence(variant, chunks):
    """Prefill then decode (one token or several per call): every position's logits are the
    uncached forward's."""
    model, params = lm(**VARIANTS[variant])
    tokens = random.randint(random.key(1), (3, 12), 0, V)
    full = model.apply(params, tokens)  # (B, N, V)
    cache, outs, at = KVCache(), [], 0
    for n in chunks:
        out, cache = model.apply(params, tokens[:, at:at + n], cache=cache)
        outs.append(out)
        at += n
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=0, atol=1e-12)
    heads = VARIANTS[variant].get("kv_heads", 4)
    assert cache.length == 12 and len(cache.keys) == 2
    hd = VARIANTS[variant].get("head_dim", 4)
    assert cache.keys[0].shape == cache.values[1].shape == (3, heads, 12, hd)


def test_grouped_query_attention_equals_full_attention_with_repeated_heads():
    """kv_heads = 2 of 4: query head h reads key/value head h // 2, i.e. the same as a
    4-head model whose key and value projections repeat each head twice."""
    gqa = torchfn.Model(MultiHeadAttention(16, 4, kv_heads=2, causal=True))
    full = torchfn.Model(MultiHeadAttention(16, 4, causal=True))
    p = {k: v.double() for k, v in gqa.init(random.key(0)).items()}
    q_w, k_w, v_w = p["qkv.weight"].split([16, 8, 8])
    q_b, k_b, v_b = p["qkv.bias"].split([16, 8, 8])
    rep = lambda t: t.reshape(2, 4, *t.shape[1:]).repeat_interleave(2, 0).flatten(0, 1)  # noqa: E731
    pf = dict(p, **{"qkv.weight": torch.cat([q_w, rep(k_w), rep(v_w)]),
                    "qkv.bias": torch.cat([q_b, rep(k_b), rep(v_b)])})
    x = random.normal(random.key(1), (2, 9, 16), torch.float64)
    torch.testing.assert_close(gqa.apply(p, x), full.apply(pf, x), rtol=0, atol=1e-12)
    assert p["qkv.weight"].shape == (32, 16)  # q: 16 rows, k and v: 8 each


def test_llama_style_block_is_rmsnorm_swiglu_without_biases():
    """norm="rms", mlp="swiglu", bias=False: the block computes
    x + attn(rms(x)), then + down(silu(gate(rms(x))) * up(rms(x))), with no bias anywhere."""
    kw = dict(kv_heads=2, rotary=True, norm="rms", mlp="swiglu", bias=False, causal=True)
    model = torchfn.Model(TransformerBlock(16, 4, mlp_ratio=3, **kw))
    p = {k: v.double() for k, v in model.init(random.key(0)).items()}
    p = {k: v + 0.1 * random.normal(random.key(1), v.shape, v.dtype) for k, v in p.items()}
    assert sorted(p) == ["attn.out.weight", "attn.qkv.weight", "ln1.weight", "ln2.weight",
                         "mlp.down.weight", "mlp.gate.weight", "mlp.up.weight"]
    x = random.normal(random.key(2), (2, 5, 16), torch.float64)
    attn = torchfn.Model(MultiHeadAttention(16, 4, kv_heads=2, rotary=True, bias=False,
                                            causal=True))

    def rms(y, w):
        return y * torch.rsqrt(y.square().mean(-1, keepdim=True) + torch.finfo(y.dtype).eps) * w

    h = x + attn.apply({k[5:]: v for k, v in p.items() if k.startswith("attn.")},
                       rms(x, p["ln1.weight"]))
    z = rms(h, p["ln2.weight"])
    mlp = (torch.nn.functional.silu(z @ p["mlp.gate.weight"].T) * (z @ p["mlp.up.weight"].T)
           ) @ p["mlp.down.weight"].T
    torch.testing.assert_close(model.apply(p, x), h + mlp, rtol=0, atol=1e-12)
    assert p["mlp.gate.weight"].shape == (48, 16)  # mlp_ratio * dim hidden units


def test_default_transformer_keeps_its_parameter_names_and_shapes():
    """Checkpoints of the learned-position, full-head model still load."""
    params = torchfn.Model(TransformerEncoder(dim=16, heads=2, depth=1, vocab_size=V)).init(
        random.key(0))
    assert params["pos.weight"].shape == (256, 16)
    assert params["blocks.0.attn.qkv.weight"].shape == (48, 16)
    rotary = torchfn.Model(TransformerEncoder(dim=16, heads=2, depth=1, vocab_size=V,
                                              position_embedding="rotary")).init(random.key(0))
    assert "pos.weight" not in rotary


@pytest.mark.parametrize("variant", ["learned", "rotary, multi-query"])
def test_greedy_generate_equals_rerunning_the_model_for_every_token(variant):
    model, params = lm(**VARIANTS[variant])
    prompt = random.randint(random.key(2), (3, 4), 0, V)
    out = generate(model, params, prompt, 8)
    seq = prompt
    for _ in range(8):  # the uncached loop: the whole sequence for each token
        seq = torch.cat((seq, model.apply(params, seq)[:, -1].argmax(-1, keepdim=True)), -1)
    assert torch.equal(out, seq)
    assert torch.equal(generate(model, params, prompt[0], 8), seq[0])  # (P,) prompt


def test_sampled_generate_is_keyed_and_vmaps_over_keys():
    model, params = lm(**VARIANTS["rotary"])
    prompt = random.randint(random.key(2), (2, 3), 0, V)
    keys = random.split(random.key(5), 6)
    batched = torch.vmap(lambda k: generate(model, params, prompt, 6, key=k, top_p=0.9))(keys)
    looped = torch.stack([generate(model, params, prompt, 6, key=k, top_p=0.9) for k in keys])
    assert torch.equal(batched, looped)
    assert batched.shape == (6, 2, 9)
    assert len({tuple(b.flatten().tolist()) for b in batched}) > 1  # the keys differ


@pytest.mark.parametrize("variant", ["learned", "rotary"])
def test_left_padded_prompts_decode_as_each_row_alone(variant):
    """Rows of different prompt lengths, padded on the left: each row's greedy continuation
    is that of its prompt run alone."""
    model, params = lm(**VARIANTS[variant])
    short, long_ = random.randint(random.key(3), (3,), 0, V), random.randint(
        random.key(4), (6,), 0, V)
    prompt = torch.stack((torch.cat((torch.zeros(3, dtype=torch.long), short)), long_))
    mask = torch.stack((torch.arange(6) >= 3, torch.ones(6, dtype=torch.bool)))
    both = generate(model, params, prompt, 7, prompt_mask=mask)
    assert torch.equal(both[0, 3:], generate(model, params, short, 7))
    assert torch.equal(both[1], generate(model, params, long_, 7))


def _truncated_probs(logits, temperature, top_k, top_p, min_p=None):
    """The sampler's target, written out in float64: softmax(l / T) restricted to the top-k
    then to the smallest most-likely set reaching top_p, renormalised."""
    p = torch.softmax(logits.double() / temperature, -1)
    order = p.argsort(descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    if top_k is not None:
        kth = p[order[top_k - 1]]
        keep_k = p >= kth
    else:
        keep_k = torch.ones_like(keep)
    q = torch.where(keep_k, p, 0) / torch.where(keep_k, p, 0).sum()
    mass = 0.0
    for i in q.argsort(descending=True).tolist():
        if q[i] == 0 or (top_p is not None and mass >= top_p):
            break
        keep[i] = True
        mass += q[i].item()
    out = torch.where(keep, q, 0)
    if min_p:  # then the tokens below min_p times the most likely
        out = torch.where(out >= min_p * out.max(), out, 0)
    return out / out.sum()


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, None, None, None), (0.5, None, None, None), (2.0, 3, None, None),
    (1.0, None, 0.6, None), (0.8, 4, 0.9, None), (1.0, 2, 0.99, None),
    (1.0, None, None, 0.3), (1.5, None, 0.95, 0.2)])
def test_sample_logits_draws_the_truncated_softmax(temperature, top_k, top_p, min_p):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, 0.0, -1.0])
    target = _truncated_probs(logits, temperature, top_k, top_p, min_p)
    n = 20000
    draws = torch.vmap(lambda k: sample_logits(k, logits, temperature=temperature, top_k=top_k,
                                               top_p=top_p, min_p=min_p))(
        random.split(random.key(0), n))
    counts = torch.bincount(draws, minlength=6).double()
    assert (counts[target == 0] == 0).all()
    live = target > 0
    if live.sum() > 1:
        p = stats.chisquare(counts[live].numpy(), n * target[live].numpy()).pvalue
        assert p > 1e-4, (counts, n * target)


def test_sample_logits_greedy_and_ties():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    assert torch.equal(sample_logits(None, logits), logits.argmax(-1))
    assert torch.equal(sample_logits(random.key(0), logits, temperature=0), logits.argmax(-1))
    # top_k=1 keeps both tied maxima of row 0 (as Hugging Face's filter does)
    keys = random.split(random.key(1), 200)
    draws = torch.vmap(lambda k: sample_logits(k, logits, top_k=1))(keys)  # (200, 2)
    assert set(draws[:, 0].tolist()) == {1, 2} and set(draws[:, 1].tolist()) == {0}


def test_cache_and_generate_errors_are_named():
    model, params = lm()
    tokens = torch.zeros(1, 4, dtype=torch.long)
    enc = torchfn.Model(TransformerEncoder(dim=16, heads=2, depth=1, vocab_size=V))
    with pytest.raises(ValueError, match="cache needs causal=True"):
        enc.apply(enc.init(random.key(0)), tokens, cache=KVCache())
    with pytest.raises(ValueError, match="cache does not take segment_ids"):
        model.apply(params, tokens, segment_ids=torch.zeros(1, 4, dtype=torch.long),
                    cache=KVCache())
    _, one = torchfn.Model(TransformerEncoder(dim=16, heads=4, depth=1, vocab_size=V,
                                              causal=True)).apply(
        {k: v.double() for k, v in torchfn.Model(TransformerEncoder(
            dim=16, heads=4, depth=1, vocab_size=V, causal=True)).init(random.key(0)).items()},
        tokens, cache=KVCache())
    with pytest.raises(ValueError, match="cache must hold 0 or 2 layers"):
        model.apply(params, tokens, cache=one)
    with pytest.raises(TypeError, match="cache must be a torchfn.models.KVCache"):
        model.apply(params, tokens, cache=(one.keys, one.values))
    _, full = model.apply(params, torch.zeros(1, 30, dtype=torch.long), cache=KVCache())
    with pytest.raises(ValueError, match="sequence length 34 exceeds max_len=32"):
        model.apply(params, tokens, cache=full)
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        generate(model, params, tokens, 0)
    with pytest.raises(TypeError, match="eos must be an int token id or None"):
        generate(model, params, tokens, 2, eos=torch.tensor(1))
    with pytest.raises(ValueError, match="prompt must be a non-empty int tensor"):
        generate(model, params, tokens.float(), 2)
    with pytest.raises(ValueError, match="prompt_mask must be a bool tensor"):
        generate(model, params, tokens, 2, prompt_mask=torch.ones(1, 3, dtype=torch.bool))
    for kw, match in ((dict(temperature=-1.0), "temperature must be"),
                      (dict(top_k=0), "top_k must be an int >= 1"),
                      (dict(top_p=1.5), r"top_p must be a number in \(0, 1\]"),
                      (dict(min_p=-0.1), r"min_p must be a number in \[0, 1\]")):
        with pytest.raises(ValueError, match=match):
            sample_logits(random.key(0), torch.zeros(3), **kw)
    with pytest.raises(ValueError, match="kv_heads must divide heads = 4"):
        MultiHeadAttention(16, 4, kv_heads=3)
    with pytest.raises(ValueError, match="rotary needs an even head dim"):
        MultiHeadAttention(12, 4, rotary=True)
    with pytest.raises(ValueError, match="position_embedding must be"):
        TransformerEncoder(dim=16, heads=2, depth=1, vocab_size=V, position_embedding="alibi")
    with pytest.raises(ValueError, match="norm must be 'layer', 'rms', 'rms\\+1' or "
                                         "'rms_plain', got 'batch'"):
        TransformerEncoder(dim=16, heads=2, depth=1, vocab_size=V, norm="batch")
    with pytest.raises(ValueError, match="mlp must be 'gelu', 'gelu_tanh', 'relu2', 'xielu', "
                                         "'swiglu', 'geglu' or 'none', got 'relu'"):
        TransformerEncoder(dim=16, heads=2, depth=1, vocab_size=V, mlp="relu")
    with pytest.raises(ValueError, match=r"layer_windows must be a list of depth = 2 "):
        TransformerEncoder(dim=16, heads=2, depth=2, vocab_size=V, layer_windows=[None])
    with pytest.raises(ValueError, match=r"given without window; got layer_windows=\[None, "
                                         r"None\], window=4"):
        TransformerEncoder(dim=16, heads=2, depth=2, vocab_size=V, window=4,
                           layer_windows=[None, None])
    with pytest.raises(ValueError, match="head_dim must be"):
        TransformerEncoder(dim=16, heads=2, depth=1, vocab_size=V, head_dim=0)
    with pytest.raises(ValueError, match="rotary needs an even head dim, got 5"):
        TransformerEncoder(dim=16, heads=2, depth=1, vocab_size=V, head_dim=5,
                           position_embedding="rotary")
    with pytest.raises(ValueError, match=r"dim must be divisible by heads, got dim=16, heads=3 "
                                         r"\(or give head_dim\)"):
        TransformerEncoder(dim=16, heads=3, depth=1, vocab_size=V)
    TransformerEncoder(dim=16, heads=3, depth=1, vocab_size=V, head_dim=4)  # then it may
    with pytest.raises(ValueError, match=r"layer_rotary must be a list of depth = 2 "):
        TransformerEncoder(dim=16, heads=2, depth=2, vocab_size=V, layer_rotary=[None, None])
    with pytest.raises(ValueError, match=r"layer_rotary must be a list of depth = 2 "):
        TransformerEncoder(dim=16, heads=2, depth=2, vocab_size=V, layer_rotary=[None],
                           position_embedding="rotary")
    for name in ("embed_scale", "logit_softcap", "attn_scale"):
        with pytest.raises(ValueError, match=f"{'scale' if name == 'attn_scale' else name} "
                                             r"must be a number > 0 or None, got -1"):
            TransformerEncoder(dim=16, heads=2, depth=1, vocab_size=V, **{name: -1})
    with pytest.raises(ValueError, match=r"rotary_dim must be an even int in 2..head_dim = 8, "
                                         r"got 5"):
        TransformerEncoder(dim=16, heads=2, depth=1, vocab_size=V, rotary_dim=5,
                           position_embedding="rotary")
    with pytest.raises(ValueError, match="qk_norm_scope must be 'head', 'all' or 'rotated', "
                                         "got 'row'"):
        TransformerEncoder(dim=16, heads=2, depth=1, vocab_size=V, qk_norm=True,
                           qk_norm_scope="row")
    with pytest.raises(ValueError, match="pre_norms=False needs post_norms=True"):
        TransformerEncoder(dim=16, heads=2, depth=1, vocab_size=V, pre_norms=False)
    with pytest.raises(ValueError, match="mlp must be 'gelu', 'gelu_tanh', 'relu2', 'xielu'"):
        TransformerEncoder(dim=16, heads=2, depth=1, vocab_size=V, mlp="reglu")
    with pytest.raises(ValueError, match="mlp='none' \\(a mixer alone\\) takes neither"):
        TransformerEncoder(dim=16, heads=2, depth=1, vocab_size=V, mlp="none", experts=2)
    with pytest.raises(ValueError, match="layer_parts must be a list of depth = 2 of 'both', "):
        TransformerEncoder(dim=16, heads=2, depth=2, vocab_size=V, layer_parts=["mlp", "x"])
    mlps = torchfn.Model(TransformerEncoder(dim=16, heads=2, depth=1, vocab_size=V, causal=True,
                                            layer_parts=["mlp"]))
    with pytest.raises(ValueError, match="cache needs a block with a token mixer"):
        mlps.apply(mlps.init(random.key(0)), tokens, cache=KVCache())


@pytest.mark.parametrize("variant", ["rotary, multi-query", "qwen3-style", "gemma-style"])
def test_per_sample_grads_through_a_rotary_gqa_model_equal_the_loop(variant):
    model, params = lm(**VARIANTS[variant])
    tokens = random.randint(random.key(7), (3, 8), 0, V)

    def loss(p, t):  # next-token cross-entropy of one sequence
        logits = model.apply(p, t[:-1])  # (N - 1, V)
        return torch.nn.functional.cross_entropy(logits, t[1:])

    per = torch.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, tokens)
    for i in range(3):
        one = torch.func.grad(loss)(params, tokens[i])
        for name in params:
            torch.testing.assert_close(per[name][i], one[name], rtol=1e-9, atol=1e-12)


def test_eos_ends_each_row_and_the_rest_is_unchanged():
    """With eos, a row is the eos-free generation up to its first eos, then eos to the end;
    under vmap (no early stop) the result is the same."""
    model, params = lm(**VARIANTS["rotary"])
    prompt = random.randint(random.key(2), (4, 3), 0, V)
    free = generate(model, params, prompt, 10, key=random.key(3))
    eos = int(free[0, 5])  # a token that row 0 draws at its third new position
    ended = generate(model, params, prompt, 10, key=random.key(3), eos=eos)
    for row, want in zip(ended, free):
        hit = (want[3:] == eos).nonzero()
        cut = 3 + (int(hit[0]) + 1 if len(hit) else 10)
        assert torch.equal(row[:cut], want[:cut])
        assert (row[cut:] == eos).all()
    batched = torch.vmap(lambda k: generate(model, params, prompt, 10, key=k, eos=eos))(
        torch.stack([random.key(3)]))
    assert torch.equal(batched[0], ended)
    greedy = generate(model, params, prompt[:1], 10)
    stop = int(greedy[0, 4])  # row 0 ends at its second new token: the loop stops early
    every = generate(model, params, prompt[:1], 10, eos=stop)
    first = 3 + int((greedy[0, 3:] == stop).nonzero()[0]) + 1
    assert every.shape == (1, 13) and torch.equal(every[0, :first], greedy[0, :first])
    assert (every[0, first:] == stop).all()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("chunks", [(5, 1, 1, 1, 1, 1, 1, 1), (3, 4, 5)])
def test_static_cache_equals_the_whole_sequence(variant, chunks):
    """A StaticKVCache of 16 slots (12 used): written in place of a copy, attended through
    a mask of written slots; the logits are the uncached forward's."""
    model, params = lm(**VARIANTS[variant])
    tokens = random.randint(random.key(1), (3, 12), 0, V)
    full = model.apply(params, tokens)
    cache = StaticKVCache.allocate(model, 3, 16, dtype=torch.float64)
    empty = cache
    outs, at = [], 0
    for n in chunks:
        out, cache = model.apply(params, tokens[:, at:at + n], cache=cache)
        outs.append(out)
        at += n
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=0, atol=1e-12)
    assert int(cache.length) == 12 and int(empty.length) == 0  # the first one unchanged
    assert (empty.keys[0] == 0).all()


def test_static_generate_equals_dynamic_and_compiles_once(fresh_dynamo):
    """generate with a StaticKVCache: the same tokens as with KVCache (greedy, sampled,
    left-padded); under torch.compile the prefill and the step compile once each,
    however many tokens are made."""
    from torch._dynamo.testing import CompileCounter

    model, params = lm(**VARIANTS["llama-style"])
    prompt = random.randint(random.key(2), (2, 5), 0, V)
    mask = torch.tensor([[False, False, True, True, True], [True] * 5])

    def cache():
        return StaticKVCache.allocate(model, 2, 20, dtype=torch.float64)

    for kw in (dict(), dict(key=random.key(4), top_k=5), dict(prompt_mask=mask)):
        assert torch.equal(generate(model, params, prompt, 9, cache=cache(), **kw),
                           generate(model, params, prompt, 9, **kw))
    counts = []
    for steps in (6, 12):
        torch._dynamo.reset()
        counter = CompileCounter()
        out = generate(torch.compile(model, backend=counter), params, prompt, steps,
                       cache=cache())
        assert torch.equal(out, generate(model, params, prompt, steps))
        counts.append(counter.frame_count)
    torch._dynamo.reset()
    assert counts == [2, 2]


def test_static_cache_errors_are_named():
    model, params = lm()
    with pytest.raises(ValueError, match="exceed its capacity 4"):
        model.apply(params, torch.zeros(1, 5, dtype=torch.long),
                    cache=StaticKVCache.allocate(model, 1, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="StaticKVCache capacity 40 exceeds max_len=32"):
        model.apply(params, torch.zeros(1, 5, dtype=torch.long),
                    cache=StaticKVCache.allocate(model, 1, 40, dtype=torch.float64))
    with pytest.raises(ValueError, match="8 tokens cached and 1 more exceed its capacity 8"):
        generate(model, params, torch.zeros(1, 4, dtype=torch.long), 6,  # 4 + 5 fed
                 cache=StaticKVCache.allocate(model, 1, 8, dtype=torch.float64))
    windowed, wparams = lm(window=(3, None))
    with pytest.raises(ValueError, match=r"with prompt_mask a StaticKVCache must not wrap"):
        generate(windowed, wparams, torch.zeros(1, 4, dtype=torch.long), 8,
                 prompt_mask=torch.ones(1, 4, dtype=torch.bool),
                 cache=StaticKVCache.allocate(windowed, 1, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="a window of 3 keys wraps around from capacity 8"):
        windowed.apply(wparams, torch.zeros(1, 5, dtype=torch.long),
                       cache=StaticKVCache.allocate(windowed, 1, 4, dtype=torch.float64))
    with pytest.raises(ValueError,
                       match="module has no MultiHeadAttention, LatentAttention or recurrent "):
        StaticKVCache.allocate(torch.nn.Linear(2, 2), 1, 8)
    with pytest.raises(ValueError, match="capacity must be an int >= 1"):
        StaticKVCache.allocate(model, 1, 0)


def test_tied_embeddings_share_one_matrix_and_feed_linear_cross_entropy():
    """tie_embeddings: logits = hidden @ embed.weight^T, no head.weight; its gradient is
    the sum of the embedding's and the head's uses. With out_dim=None the hidden states
    and params["embed.weight"] give losses.linear_cross_entropy the same loss."""
    from torchfn.losses import linear_cross_entropy

    kw = dict(dim=16, heads=2, depth=1, vocab_size=V, causal=True, position_embedding="rotary")
    tied = torchfn.Model(TransformerEncoder(out_dim=V, tie_embeddings=True, **kw))
    params = {k: v.double() for k, v in tied.init(random.key(0)).items()}
    assert "head.weight" not in params and "head.bias" not in params
    hidden = torchfn.Model(TransformerEncoder(out_dim=None, tie_embeddings=True, **kw))
    tokens = random.randint(random.key(1), (2, 9), 0, V)
    torch.testing.assert_close(tied.apply(params, tokens),
                               hidden.apply(params, tokens) @ params["embed.weight"].T)

    def plain_loss(p):
        logits = tied.apply(p, tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, V), tokens[:, 1:].reshape(-1))

    def fused_loss(p):
        return linear_cross_entropy(hidden.apply(p, tokens[:, :-1]), p["embed.weight"],
                                    tokens[:, 1:], chunk_size=5)

    torch.testing.assert_close(fused_loss(params), plain_loss(params))
    g, want = torch.func.grad(fused_loss)(params), torch.func.grad(plain_loss)(params)
    for name in params:
        torch.testing.assert_close(g[name], want[name], rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="tie_embeddings needs token input"):
        TransformerEncoder(dim=16, heads=2, depth=1, in_dim=4, out_dim=V, tie_embeddings=True)


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_a_sliding_window_model_decodes_from_a_ring_buffer(positions):
    """window=(3, None) with a StaticKVCache of 6 slots: 24 tokens (a prefill of 4, then
    chunks of 1 and 2) wrap around the buffer four times; the logits are the full
    forward's, and generate with the ring equals generate with the growing cache."""
    model, params = lm(window=(3, None), position_embedding=positions)
    tokens = random.randint(random.key(5), (2, 24), 0, V)
    cache = StaticKVCache.allocate(model, 2, 6, dtype=torch.float64)
    outs, at = [], 0
    for n in [4] + [1, 2] * 6 + [1] * 2:
        out, cache = model.apply(params, tokens[:, at:at + n], cache=cache)
        outs.append(out)
        at += n
    assert at == 24 and int(cache.length) == 24 and cache.capacity == 6
    torch.testing.assert_close(torch.cat(outs, 1), model.apply(params, tokens), rtol=0,
                               atol=1e-12)
    ring = StaticKVCache.allocate(model, 2, 3 + 5, dtype=torch.float64)  # window + prompt
    assert torch.equal(generate(model, params, tokens[:, :5], 20, cache=ring),
                       generate(model, params, tokens[:, :5], 20))
