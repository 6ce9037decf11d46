"""Bench: autoregressive decoding with ``models.generate`` (KV cache), and the cost of
rotary position embeddings. CPU, float32.

* ``test_generate``: a causal ``TransformerEncoder(dim=256, heads=8, depth=4)``, 4 prompts
  of 64 tokens, 128 new tokens, greedy. ``cached``: ``generate`` (the prompt once, then
  one call per token against the ``KVCache``); ``uncached``: the loop a pure-function
  user writes without a cache, the whole sequence through the model for every token.
  Also ``kv_heads=1`` (multi-query: an 8x smaller cache) with the cache, and a
  ``StaticKVCache`` (fixed shapes) eager and under ``torch.compile(fullgraph=True)``
  (compiled before the timing: the prefill and the step, once each).
* ``test_rotary``: ``rotary_embedding`` on (B, H, N, D) = (8, 8, 1024, 64) against the
  usual implementation (Hugging Face's Llama): float32 cos/sin tables built once and
  indexed per call. torchfn builds its table from float64 angles on every call.
* ``test_generate_deepseek_vs_transformers``: DeepSeek-V3's latent attention and
  mixture, decoding with its latent cache, absorbed and expanded, against transformers.
* ``test_generate_deepseek_v32_vs_transformers``: the same model with DeepSeek Sparse
  Attention (a lightning indexer, each query's best 128 keys), from 512-token prompts.
* ``test_llama4_prefill_vs_transformers``: a Llama 4 (chunks of 512 on three layers of
  four) on one 4096-token sequence, forward and forward+backward, against transformers
  (SDPA given its chunked causal mask as a dense (N, N) bool tensor).
* ``test_lm_step``: one gradient of the next-token loss, (B, N) = (8, 256), learned
  positions against rotary: what rotary costs in training.

Run: ``pytest bench/test_bench_decoding.py --benchmark-only --benchmark-columns=min,median``.
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F

import torchfn
from torchfn import random
from torchfn.models import (
    StaticKVCache,
    TransformerEncoder,
    deepseek_from_pretrained,
    generate,
    llama4_from_hf,
    llama_from_hf,
    mtp_speculative_generate,
    rotary_embedding,
)

V = 1000


def lm(**kw):
    net = TransformerEncoder(dim=256, heads=8, depth=4, vocab_size=V, out_dim=V, causal=True,
                             max_len=512, **kw)
    model = torchfn.Model(net)
    return model, model.init(random.key(0))


def uncached(model, params, prompt, steps):
    seq = prompt
    for _ in range(steps):
        nxt = model.apply(params, seq)[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        seq = torch.cat((seq, nxt), dim=-1)
    return seq


@pytest.mark.parametrize("how", ["cached", "uncached", "cached, kv_heads=1", "static",
                                 "static, compiled"])
def test_generate(benchmark, how):
    model, params = lm(kv_heads=1) if how.endswith("kv_heads=1") else lm()
    prompt = random.randint(random.key(1), (4, 64), 0, V)
    run = uncached if how == "uncached" else generate
    kw = {}
    if how.startswith("static"):
        kw = dict(cache=StaticKVCache.allocate(model, 4, 192))
    if how == "static, compiled":
        torch._dynamo.reset()
        model = torch.compile(model, fullgraph=True)
        with torch.no_grad():
            run(model, params, prompt, 128, **kw)  # compile the prefill and the step
    with torch.no_grad():
        out = benchmark.pedantic(run, (model, params, prompt, 128), kw, rounds=3,
                                 iterations=1)
    assert out.shape == (4, 192)


def hf_rotary(x, cos, sin):
    """Hugging Face Llama's ``apply_rotary_pos_emb`` on tables made once (float32)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("how", ["torchfn", "precomputed float32 table"])
def test_rotary(benchmark, how):
    x = random.normal(random.key(0), (8, 8, 1024, 64))
    pos = torch.arange(1024)
    if how == "torchfn":
        out = benchmark(rotary_embedding, x, pos)
    else:
        inv = 10000.0 ** (-torch.arange(0, 64, 2).float() / 64)
        ang = pos.float()[:, None] * inv  # (N, D/2)
        emb = torch.cat((ang, ang), dim=-1)  # (N, D)
        cos, sin = emb.cos(), emb.sin()
        out = benchmark(lambda: hf_rotary(x, cos[pos], sin[pos]))
    torch.testing.assert_close(out, rotary_embedding(x.double(), pos).float(), rtol=0,
                               atol=2e-3)


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_lm_step(benchmark, positions):
    model, params = lm(position_embedding=positions)
    tokens = random.randint(random.key(2), (8, 257), 0, V)

    def loss(p):
        logits = model.apply(p, tokens[:, :-1])  # (B, N, V)
        return F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:])

    grads = benchmark.pedantic(torch.func.grad(loss), (params,), rounds=5, iterations=1)
    assert set(grads) == set(params)


@pytest.mark.parametrize("how", ["cached", "static", "static, compiled"])
def test_generate_small(benchmark, how):
    """A model where per-op overhead dominates (dim 64, 2 blocks, one prompt of 16, 128
    new tokens): what compiling the fixed-shape step saves."""
    net = TransformerEncoder(dim=64, heads=4, depth=2, vocab_size=32, out_dim=32,
                             causal=True, max_len=256, position_embedding="rotary")
    model = torchfn.Model(net)
    params = model.init(random.key(0))
    prompt = random.randint(random.key(1), (1, 16), 0, 32)
    kw = dict(cache=StaticKVCache.allocate(net, 1, 144)) if how != "cached" else {}
    if how == "static, compiled":
        torch._dynamo.reset()
        model = torch.compile(model, fullgraph=True)
        with torch.no_grad():
            generate(model, params, prompt, 128, **kw)
    with torch.no_grad():
        out = benchmark.pedantic(generate, (model, params, prompt, 128), kw, rounds=5,
                                 iterations=1)
    assert out.shape == (1, 144)


def hf_llama(seed=0):
    """A float32 transformers Llama of the bench's size (dim 256, 8 heads, 4 blocks,
    SwiGLU 688, vocab 1000) and the same weights through ``llama_from_hf``."""
    transformers = pytest.importorskip("transformers", reason="the peer of this bench")
    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=8,
                                      num_hidden_layers=4, intermediate_size=688,
                                      vocab_size=V, max_position_embeddings=512)
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(config).eval()
    module, params = llama_from_hf(config.to_dict(), hf.state_dict())
    return hf, torchfn.Model(module), params


@pytest.mark.parametrize("how", ["torchfn", "transformers"])
def test_generate_llama_vs_transformers(benchmark, how):
    """Greedy decoding of one Llama, 4 prompts of 64 tokens, 128 new: ``generate`` with
    its KVCache against transformers' ``generate`` (its DynamicCache, SDPA attention)."""
    hf, model, params = hf_llama()
    prompt = random.randint(random.key(1), (4, 64), 0, V)
    if how == "torchfn":
        run = lambda: generate(model, params, prompt, 128)  # noqa: E731
    else:
        run = lambda: hf.generate(prompt, max_new_tokens=128, min_new_tokens=128,  # noqa: E731
                                  do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        out = benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=1)
    assert out.shape == (4, 192)


def hf_deepseek(tmp_path, seed=0, sparse=False):
    """A float32 transformers DeepSeek-V3 of the bench's width (dim 256, 8 heads, 4 blocks,
    latent rank 128, query rank 192, head dims 64 + 32 and 64; the last 3 blocks a mixture
    of 8 experts of 128, 2 chosen, and a shared one), saved and read back through
    ``deepseek_from_pretrained``. ``sparse``: DeepSeek-V3.2, the same with a lightning
    indexer of 8 heads of 64 in every block, each query attending to its best 128 keys."""
    transformers = pytest.importorskip("transformers", reason="the peer of this bench")
    kind = transformers.DeepseekV32Config if sparse else transformers.DeepseekV3Config
    extra = dict(index_n_heads=8, index_head_dim=64, index_topk=128) if sparse else {}
    config = kind(
        hidden_size=256, num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=4,
        intermediate_size=688, moe_intermediate_size=128, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
        topk_group=1, kv_lora_rank=128, q_lora_rank=192, qk_rope_head_dim=32,
        qk_nope_head_dim=64, v_head_dim=64, vocab_size=V, max_position_embeddings=1024,
        **extra)
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf.save_pretrained(tmp_path)
    module, params, state, _ = deepseek_from_pretrained(tmp_path)
    return hf, module, params, state


@pytest.mark.parametrize("prompt_len", [64, 512])
@pytest.mark.parametrize("how", ["torchfn", "torchfn-expanded", "transformers"])
def test_generate_deepseek_vs_transformers(benchmark, how, prompt_len, tmp_path):
    """Greedy decoding of one DeepSeek-V3, 4 prompts, 64 new tokens. ``torchfn``:
    ``generate`` with the latent cache, each step absorbed (attention in the latent
    space); ``torchfn-expanded``: the same cache, each step expanding every cached latent
    into keys and values (``absorb=False``), as transformers does; ``transformers``: its
    ``generate`` (a cache of latents, SDPA attention)."""
    hf, module, params, state = hf_deepseek(tmp_path)
    if how == "torchfn-expanded":
        for block in module.blocks:
            block.attn.absorb = False
    model = torchfn.Model(module)
    prompt = random.randint(random.key(1), (4, prompt_len), 0, V)
    if how.startswith("torchfn"):
        step = lambda p, *a, **k: model.apply(p, *a, state=state, **k)  # noqa: E731
        run = lambda: generate(step, params, prompt, 64)  # noqa: E731
    else:
        run = lambda: hf.generate(prompt, max_new_tokens=64, min_new_tokens=64,  # noqa: E731
                                  do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        out = benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=1)
    assert out.shape == (4, prompt_len + 64)


def with_mtp_layer(hf, folder, agree=False):
    """Appends an MTP layer to the checkpoint in ``folder`` (``model.layers.{n}.*``: the
    last block's tensors, norms of ones, an ``eh_proj`` of the model's init scale, copies of
    the embedding and the head) and says so in its config; returns transformers' model
    read back, set to find that layer (transformers 5.24 looks for ``model.layers.61``).
    ``agree``: the model's final norm and the MTP's head norm are zeros, so every logit is
    0 and both pick token 0: every draft is kept, with every block's work unchanged."""
    import json

    from safetensors.torch import load_file, save_file

    transformers = pytest.importorskip("transformers", reason="the peer of this bench")
    sd = load_file(folder / "model.safetensors")
    n, dim = hf.config.num_hidden_layers, hf.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    layer = {f"model.layers.{n}." + k.removeprefix(f"model.layers.{n - 1}."): t.clone()
             for k, t in sd.items() if k.startswith(f"model.layers.{n - 1}.")}
    mtp = {f"model.layers.{n}.{k}": t for k, t in {
        "enorm.weight": torch.ones(dim), "hnorm.weight": torch.ones(dim),
        "shared_head.norm.weight": torch.ones(dim),
        "eh_proj.weight": 0.02 * torch.randn(dim, 2 * dim, generator=gen),
        "shared_head.head.weight": sd["lm_head.weight"].clone(),
        "embed_tokens.weight": sd["model.embed_tokens.weight"].clone()}.items()}
    if agree:
        sd["model.norm.weight"] = torch.zeros(dim)
        mtp[f"model.layers.{n}.shared_head.norm.weight"] = torch.zeros(dim)
    save_file({**sd, **layer, **mtp}, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=1)))
    out = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    out._keys_to_ignore_on_load_unexpected = {rf"model\.layers\.{n}\..*"}
    out.generation_config.eos_token_id = None
    return out


@pytest.mark.parametrize("drafts", ["kept", "rejected"])
@pytest.mark.parametrize("how", ["torchfn", "torchfn-mtp", "transformers", "transformers-mtp"])
def test_mtp_decoding_deepseek_vs_transformers(benchmark, how, drafts, tmp_path):
    """Greedy decoding of one DeepSeek-V3 with an MTP layer (the bench's model), one prompt
    of 64 tokens (transformers' MTP decoding takes one row), 64 new tokens. ``-mtp``: the
    MTP layer drafts one token a round and the model checks it (``mtp_speculative_generate``;
    transformers' ``generate(use_mtp=True)``); without: plain ``generate``. Both decoders
    draft the same tokens from the same weights, so they keep the same drafts: all of them
    (``kept``: zeroed final norms, so every logit is 0 and every pick token 0), or almost
    none (``rejected``: untrained). The times compare the implementations' rounds."""
    hf, _, _, _ = hf_deepseek(tmp_path)
    hf = with_mtp_layer(hf, tmp_path, agree=drafts == "kept")
    module, params, state, _ = deepseek_from_pretrained(tmp_path, mtp=1)
    model = torchfn.Model(module)
    step = lambda p, *a, **k: model.apply(p, *a, state=state, **k)  # noqa: E731
    prompt = random.randint(random.key(1), (1, 64), 0, V)
    runs = {
        "torchfn": lambda: generate(step, params, prompt, 64),
        "torchfn-mtp": lambda: mtp_speculative_generate(step, params, prompt, 64),
        "transformers": lambda: hf.generate(prompt, max_new_tokens=64, min_new_tokens=64,
                                            do_sample=False, pad_token_id=0),
        "transformers-mtp": lambda: hf.generate(prompt, max_new_tokens=64, min_new_tokens=64,
                                                do_sample=False, pad_token_id=0, use_mtp=True),
    }
    with torch.no_grad():
        out = benchmark.pedantic(runs[how], rounds=3, iterations=1, warmup_rounds=1)
        assert torch.equal(out, runs["torchfn"]())


@pytest.mark.parametrize("how", ["torchfn", "transformers"])
def test_generate_deepseek_v32_vs_transformers(benchmark, how, tmp_path):
    """Greedy decoding of one DeepSeek-V3.2 (DeepSeek Sparse Attention: past 128 keys the
    indexer picks each query's best 128), 4 prompts of 512 tokens, 64 new tokens.
    ``torchfn``: ``generate`` with the latent cache (the indexer's keys in it too), each
    step absorbed; ``transformers``: its ``generate`` (its cache of latents and indexer
    keys, SDPA attention through the indexer's mask)."""
    hf, module, params, state = hf_deepseek(tmp_path, sparse=True)
    model = torchfn.Model(module)
    prompt = random.randint(random.key(1), (4, 512), 0, V)
    if how == "torchfn":
        step = lambda p, *a, **k: model.apply(p, *a, state=state, **k)  # noqa: E731
        run = lambda: generate(step, params, prompt, 64)  # noqa: E731
    else:
        run = lambda: hf.generate(prompt, max_new_tokens=64, min_new_tokens=64,  # noqa: E731
                                  do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        out = benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=1)
    assert out.shape == (4, 576)


def hf_llama4(seed=0, moe=True):
    """A float32 transformers Llama 4 text model (dim 256, 8 heads of 32, 2 kv heads, 4
    blocks; chunks of 512 on the three rotary ones, the fourth NoPE with temperature
    tuning; blocks 2 and 4 a mixture of 4 experts of 256 and a shared one, 1 chosen; the
    dense blocks SwiGLU 688; vocab 1000; ``moe=False``: every block dense) and the same
    weights through ``llama4_from_hf``."""
    transformers = pytest.importorskip("transformers", reason="the peer of this bench")
    config = transformers.Llama4TextConfig(
        hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
        num_hidden_layers=4, intermediate_size=256, intermediate_size_mlp=688,
        num_local_experts=4, interleave_moe_layer_step=2, attention_chunk_size=512,
        vocab_size=V, max_position_embeddings=8192, moe_layers=None if moe else [])
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    module, params = llama4_from_hf(config.to_dict(), hf.state_dict())
    return hf.eval(), torchfn.Model(module), params


@pytest.mark.parametrize("blocks", ["moe", "dense"])
@pytest.mark.parametrize("mode", ["forward", "forward+backward"])
@pytest.mark.parametrize("how", ["torchfn", "transformers"])
def test_llama4_prefill_vs_transformers(benchmark, how, mode, blocks):
    """One sequence of 4096 tokens through a Llama 4: the logits (``forward``), or the
    gradient of the next-token loss in every parameter (``forward+backward``).
    ``dense``: no mixture (transformers runs every expert on every token), so what is
    left is the attention."""
    hf, model, params = hf_llama4(moe=blocks == "moe")
    tokens = random.randint(random.key(2), (1, 4096), 0, V)
    benchmark.group = f"llama4 N=4096 chunk=512 {blocks} {mode}"
    if how == "torchfn":
        def loss(p):
            return F.cross_entropy(model.apply(p, tokens[:, :-1])[0], tokens[0, 1:])
        run = (lambda: model.apply(params, tokens)) if mode == "forward" else \
            (lambda: torch.func.grad(loss)(params))
    else:
        weights = [p for p in hf.parameters()]

        def run():
            if mode == "forward":
                return hf(tokens).logits
            out = hf(tokens[:, :-1]).logits[0]
            return torch.autograd.grad(F.cross_entropy(out, tokens[0, 1:]), weights)
    with torch.no_grad() if mode == "forward" else contextlib.nullcontext():
        out = benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=1)
    assert out is not None
