"""Bench: linear attention on the CPU, float32: the gated delta rule (Gated DeltaNet) and a
Qwen3.5 model; Mamba-2's mixer and a Granite 4.0-H model.

* ``test_delta_rule``: ``kernels.gated_delta_rule`` against transformers' own PyTorch
  implementations of it (what transformers runs without flash-linear-attention, i.e. on
  every CPU): the chunked one (the same WY algorithm) and the token-by-token recurrence.
  B=1, 8 value heads (4 query/key heads), N=4096, Dk = Dv = 128; forward, and forward
  plus the gradient in every input.
* ``test_generate_qwen3_5_vs_transformers``: greedy decoding of one small Qwen3.5 (three
  Gated DeltaNet layers, one gated attention), 4 prompts of 256 tokens, 64 new tokens,
  against transformers' ``generate``.
* ``test_mamba2``: ``models.Mamba2`` against transformers' ``Mamba2Mixer`` (its PyTorch
  path, which runs without the mamba-ssm kernels, i.e. on every CPU), the same weights:
  B=1, N=4096, dim 512, 16 heads of 64, state 128, one group; forward, and forward plus
  the gradient in every parameter.
* ``test_mamba``: ``models.Mamba`` (Mamba-1) against transformers' ``MambaMixer`` (its
  PyTorch path: a loop over tokens), the same weights: B=1, N=2048, dim 512, inner 1024,
  state 16; forward, and forward plus the gradient in every parameter (transformers'
  backward through its token loop takes minutes: one round).
* ``test_generate_granite_hybrid_vs_transformers``: greedy decoding of one small Granite
  4.0-H (three Mamba-2 blocks, one attention; a mixture of 4 experts and a shared MLP),
  4 prompts of 256 tokens, 64 new tokens, against transformers' ``generate``.
* ``test_kda``: Kimi Delta Attention's rule (a decay per key channel) against
  transformers' ``chunk_kimi_delta_attention``; B=1, 4 heads, N=2048, D=128.
* ``test_generate_hybrids_vs_transformers``: the same for small Falcon-H1 (attention
  beside Mamba-2 in every block), Jamba (Mamba-1 blocks, one attention, mixtures in
  every other block), LFM2 (short convolutions and attention), MiniMax-01 (lightning
  attention and attention, mixtures), Kimi Linear (KDA and latent attention,
  mixtures), OLMo Hybrid (Gated DeltaNet and post-norm attention) and RecurrentGemma
  (Griffin's recurrent blocks and local attention) and xLSTM (mLSTM blocks) models.
* ``test_mlstm``: ``kernels.mlstm`` (xLSTM's matrix memory) against transformers' native
  chunkwise mLSTM (what its xLSTM runs without the mlstm_kernels package, i.e. on every
  CPU): B=1, 4 heads, N=2048, Dk = Dv = 128, chunks of 64; forward, and forward plus the
  gradient in every input.
* ``test_rg_lru``: ``models.RGLRU`` (Griffin's recurrent block) against transformers'
  ``RecurrentGemmaRecurrentBlock`` (a loop over tokens), the same weights: B=1, N=2048,
  dim = width = 512, 8 gate blocks; forward, and forward plus the gradient in every
  parameter.

Run: ``pytest bench/test_bench_linear_attention.py --benchmark-only
--benchmark-columns=min,median``.
"""

import contextlib
import functools

import pytest
import torch

import torchfn
from torchfn import random
from torchfn.kernels import gated_delta_rule, mlstm
from torchfn.models import RGLRU, Mamba, Mamba2, from_pretrained, generate, qwen3_next_from_hf

B, HK, HV, N, D = 1, 4, 8, 4096, 128


def _inputs(requires_grad):
    keys = random.split(random.key(0), 5)
    q = random.normal(keys[0], (B, HK, N, D))
    k = torch.nn.functional.normalize(random.normal(keys[1], (B, HK, N, D)), dim=-1)
    v = random.normal(keys[2], (B, HV, N, D))
    g = -random.uniform(keys[3], (B, HV, N)) * 0.1
    beta = random.uniform(keys[4], (B, HV, N))
    return [x.requires_grad_(requires_grad) for x in (q, k, v, g, beta)]


def _transformers(name):
    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next",
                                   reason="the peer of this bench")
    fn = getattr(modeling, name)

    def run(q, k, v, g, beta):  # its layout: (B, N, H, D)
        out, _ = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), g.transpose(1, 2),
                    beta.transpose(1, 2))
        return out.transpose(1, 2)
    return run


IMPLS = {
    "torchfn": lambda *a: gated_delta_rule(*a),
    "transformers chunked": "torch_chunk_gated_delta_rule",
    "transformers recurrent": "torch_recurrent_gated_delta_rule",
}


@pytest.mark.parametrize("mode", ["forward", "forward+backward"])
@pytest.mark.parametrize("impl", list(IMPLS))
def test_delta_rule(benchmark, impl, mode):
    if impl == "transformers recurrent" and mode == "forward+backward":
        pytest.skip("4096 sequential steps through autograd: minutes; the forward shows it")
    benchmark.group = f"gated delta rule N={N} D={D} {mode}"
    fn = IMPLS[impl] if callable(IMPLS[impl]) else _transformers(IMPLS[impl])
    args = _inputs(mode != "forward")
    want = gated_delta_rule(*[x.detach().double() for x in args]).float()
    if mode == "forward":
        with torch.no_grad():
            out = benchmark.pedantic(fn, args=args, rounds=3, warmup_rounds=1)
        assert torch.allclose(out, want, atol=1e-3)
        return
    do = random.normal(random.key(9), want.shape)
    grads = benchmark.pedantic(lambda: torch.autograd.grad(fn(*args), args, do), rounds=3,
                               warmup_rounds=1)
    assert all(torch.isfinite(x).all() for x in grads)


def hf_qwen3_5(seed=0):
    """A float32 transformers Qwen3.5 (dim 256, 4 blocks: three Gated DeltaNet of 8 value
    heads and 4 query/key heads of 64, then gated attention of 8 heads of 32 with 2 kv
    heads; SwiGLU 688; vocab 1000) and the same weights through ``qwen3_next_from_hf``."""
    transformers = pytest.importorskip("transformers", reason="the peer of this bench")
    config = transformers.AutoConfig.for_model(
        "qwen3_5_text", hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, intermediate_size=688, vocab_size=1000,
        linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=64,
        linear_value_head_dim=64)
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    module, params = qwen3_next_from_hf(config.to_dict(), hf.state_dict())
    return hf, torchfn.Model(module), params


@pytest.mark.parametrize("how", ["torchfn", "transformers"])
def test_generate_qwen3_5_vs_transformers(benchmark, how):
    hf, model, params = hf_qwen3_5()
    prompt = random.randint(random.key(1), (4, 256), 1, 1000)
    if how == "torchfn":
        run = lambda: generate(model, params, prompt, 64)  # noqa: E731
    else:
        run = lambda: hf.generate(prompt, attention_mask=torch.ones_like(prompt),  # noqa: E731
                                  max_new_tokens=64, min_new_tokens=64, do_sample=False,
                                  pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        out = benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=1)
    assert out.shape == (4, 320)


MAMBA_NAMES = {"in_proj.weight": "in_proj.weight", "conv1d.weight": "conv.weight",
               "conv1d.bias": "conv.bias", "dt_bias": "dt_bias", "A_log": "A_log", "D": "D",
               "norm.weight": "norm.weight", "out_proj.weight": "out.weight"}


@pytest.mark.parametrize("mode", ["forward", "forward+backward"])
@pytest.mark.parametrize("how", ["torchfn", "transformers"])
def test_mamba2(benchmark, how, mode):
    transformers = pytest.importorskip("transformers", reason="the peer of this bench")
    from transformers.models.mamba2 import modeling_mamba2

    benchmark.group = f"mamba2 mixer N=4096 dim=512 {mode}"
    config = transformers.Mamba2Config(hidden_size=512, num_heads=16, head_dim=64,
                                       state_size=128, n_groups=1, expand=2, chunk_size=64,
                                       num_hidden_layers=1)
    torch.manual_seed(0)
    hf = modeling_mamba2.Mamba2Mixer(config, 0)
    params = {MAMBA_NAMES[n]: t.detach() for n, t in hf.state_dict().items()}
    model = torchfn.Model(Mamba2(512, 16, head_dim=64, state_dim=128))
    x = random.normal(random.key(0), (1, 4096, 512))
    want = model.apply(params, x)
    if how == "torchfn":
        if mode == "forward":
            run = lambda: model.apply(params, x)  # noqa: E731
        else:
            run = lambda: torch.func.grad(  # noqa: E731
                lambda p: model.apply(p, x).square().mean())(params)
    else:
        weights = list(hf.parameters())
        if mode == "forward":
            run = lambda: hf(x)  # noqa: E731
        else:
            run = lambda: torch.autograd.grad(hf(x).square().mean(), weights)  # noqa: E731
    with torch.no_grad() if mode == "forward" else contextlib.nullcontext():
        out = benchmark.pedantic(run, rounds=3, warmup_rounds=1)
    if mode == "forward":
        assert torch.allclose(out, want, atol=1e-4)


def hf_granite_hybrid(tmp_path, seed=0):
    """A float32 transformers Granite 4.0-H (dim 256, 4 blocks: Mamba-2 of 8 heads of 64,
    state 64, except block 3, attention of 8 heads with 2 kv heads; each with a mixture of
    4 experts of 128, 2 chosen, and a shared SwiGLU of 256; vocab 1000) and the same
    weights, saved by transformers and read back through ``from_pretrained``."""
    transformers = pytest.importorskip("transformers", reason="the peer of this bench")
    config = transformers.AutoConfig.for_model(
        "granitemoehybrid", hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, intermediate_size=128, shared_intermediate_size=256,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=1000, mamba_n_heads=8,
        mamba_d_head=64, mamba_d_state=64, mamba_n_groups=1,
        layer_types=["mamba", "mamba", "attention", "mamba"])
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf.save_pretrained(tmp_path)  # the checkpoint's names, not the loaded model's
    module, params, _, _ = from_pretrained(tmp_path)
    return hf, torchfn.Model(module), params


@pytest.mark.parametrize("how", ["torchfn", "transformers"])
def test_generate_granite_hybrid_vs_transformers(benchmark, how, tmp_path):
    hf, model, params = hf_granite_hybrid(tmp_path)
    prompt = random.randint(random.key(1), (4, 256), 1, 1000)
    if how == "torchfn":
        run = lambda: generate(model, params, prompt, 64)  # noqa: E731
    else:
        run = lambda: hf.generate(prompt, attention_mask=torch.ones_like(prompt),  # noqa: E731
                                  max_new_tokens=64, min_new_tokens=64, do_sample=False,
                                  pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        out = benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=1)
    assert out.shape == (4, 320)


@pytest.mark.parametrize("mode", ["forward", "forward+backward"])
@pytest.mark.parametrize("how", ["torchfn", "transformers"])
def test_kda(benchmark, how, mode):
    """Kimi Delta Attention's rule (a decay per key channel): ``kernels.gated_delta_rule``
    with ``log_decay`` ``(B, H, N, Dk)`` against transformers' ``chunk_kimi_delta_attention``
    (its PyTorch path: every pair of a chunk decayed channel by channel, ``(C, C, Dk)`` a
    chunk). B=1, 4 heads, N=2048, Dk = Dv = 128, chunks of 64; queries and keys
    L2-normalised by both."""
    benchmark.group = f"kda rule N=2048 {mode}"
    keys = random.split(random.key(0), 5)
    b, h, n, d = 1, 4, 2048, 128
    q, k, v = (random.normal(key, (b, h, n, d)) for key in keys[:3])
    g = -random.uniform(keys[3], (b, h, n, d)) * 0.5
    beta = random.uniform(keys[4], (b, h, n))
    args = [x.requires_grad_(mode != "forward") for x in (q, k, v, g, beta)]
    if how == "torchfn":
        def fn(q, k, v, g, beta):
            norm = torch.nn.functional.normalize
            return gated_delta_rule(norm(q, dim=-1), norm(k, dim=-1), v, g, beta)
    else:
        modeling = pytest.importorskip(
            "transformers.models.kimi_linear.modeling_kimi_linear", reason="the peer")

        def fn(q, k, v, g, beta):  # its layout: (B, N, H, D)
            out, _ = modeling.chunk_kimi_delta_attention(
                *(x.transpose(1, 2) for x in (q, k, v, g, beta)), use_qk_l2norm_in_kernel=True)
            return out.transpose(1, 2)
    if mode == "forward":
        run = lambda: fn(*args)  # noqa: E731
    else:
        run = lambda: torch.autograd.grad(fn(*args).square().sum(), args)  # noqa: E731
    with torch.no_grad() if mode == "forward" else contextlib.nullcontext():
        benchmark.pedantic(run, rounds=3, warmup_rounds=1)


HYBRIDS = {  # float32, dim 256, 4 blocks, vocab 1000, as Granite's above
    # every block attention (8 heads, 2 kv) beside Mamba-2 (8 heads of 64, state 64), then
    # SwiGLU 688; multipliers away from 1
    "falcon_h1": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=2, intermediate_size=688, vocab_size=1000,
                      mamba_d_ssm=512, mamba_n_heads=8, mamba_d_state=64, mamba_rms_norm=True,
                      key_multiplier=0.5, ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 2.0],
                      mlp_multipliers=[0.75, 1.4], embedding_multiplier=2.0),
    # Mamba blocks (inner 512, state 16) but block 1 attention (8 heads, 2 kv); blocks 1
    # and 3 a mixture of 4 experts of 256, 2 chosen, the others SwiGLU 256
    "jamba": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, intermediate_size=256, vocab_size=1000, num_experts=4,
                  num_experts_per_tok=2, attn_layer_period=4, attn_layer_offset=1,
                  expert_layer_period=2, expert_layer_offset=1),
    # gated short convolutions but blocks 1 and 3 attention (8 heads, 2 kv); SwiGLU 688
    "lfm2": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, intermediate_size=1032, vocab_size=1000,
                 layer_types=["conv", "full_attention", "conv", "full_attention"]),
    # lightning attention (8 heads of 32) but blocks 1 and 3 attention (8 heads, 2 kv);
    # mixtures of 4 experts of 256, 2 chosen
    "minimax": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=2, intermediate_size=256, vocab_size=1000,
                    num_local_experts=4, num_experts_per_tok=2, block_size=64),
    # KDA (8 heads of 32) but block 3 latent attention without rotary; block 0 SwiGLU
    # 688, the others mixtures of 8 experts of 128 (2 chosen) and a shared one
    "kimi_linear": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=8, intermediate_size=688, moe_intermediate_size=128,
                        vocab_size=1000, num_experts=8, num_experts_per_tok=2, kv_lora_rank=64,
                        qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                        linear_head_dim=32, linear_num_heads=8, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2, layer_types=["linear_attention"] * 3 +
                        ["full_attention"]),
    # Gated DeltaNet (8 heads, keys 24, values 48, beta in (0, 2)) but block 3 OLMo 2
    # attention (8 heads, 2 kv) without rotary, as released; SwiGLU 688
    "olmo_hybrid": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=2, intermediate_size=688, vocab_size=1000,
                        pad_token_id=0, eos_token_id=2,
                        rope_parameters={"rope_type": "default", "rope_theta": None}),
    # Griffin: RG-LRU blocks (width 256, 8 gate blocks) but block 2 multi-query attention
    # in a window of 128, half of each head rotated; GeGLU 344
    "recurrent_gemma": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                            num_key_value_heads=1, intermediate_size=688, vocab_size=1000,
                            attention_window_size=128),
    # xLSTM 7B's blocks: mLSTM (4 heads, keys 32, values 64), SwiGLU 704
    "xlstm": dict(hidden_size=256, num_hidden_layers=4, num_heads=4, vocab_size=1000,
                  chunk_size=64, pad_token_id=0, eos_token_id=2),
    # Ling 3: KDA with full-rank gates and the bounded decay (8 heads of 32) but block 3
    # rotary latent attention gated per head; block 0 SwiGLU 688, the others mixtures of 8
    # experts of 128 (2 chosen, 2 groups) and a shared one
    "bailing_hybrid": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                           num_key_value_heads=8, head_dim=32, intermediate_size=688,
                           moe_intermediate_size=128, vocab_size=1000, num_local_experts=8,
                           num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=64,
                           q_lora_rank=96, qk_rope_head_dim=16, qk_nope_head_dim=32,
                           v_head_dim=32, first_k_dense_replace=1, layer_group_size=4,
                           pad_token_id=0, eos_token_id=2),
    # JetMoE (not a hybrid): attention as 8 experts of 4 heads of 32 sharing their keys and
    # values, 2 chosen; mixtures of 8 SwiGLU experts of 256, 2 chosen
    "jetmoe": dict(hidden_size=256, num_hidden_layers=4, num_key_value_heads=4,
                   kv_channels=32, intermediate_size=256, vocab_size=1000,
                   num_local_experts=8, num_experts_per_tok=2),
}


@pytest.mark.parametrize("how", ["torchfn", "transformers"])
@pytest.mark.parametrize("kind", list(HYBRIDS))
def test_generate_hybrids_vs_transformers(benchmark, kind, how, tmp_path):
    """Greedy decoding, 4 prompts of 256 tokens, 64 new tokens, against transformers'
    ``generate`` on the same weights (saved by transformers, read by ``from_pretrained``;
    a model's router state bound)."""
    transformers = pytest.importorskip("transformers", reason="the peer of this bench")
    benchmark.group = f"generate {kind}"
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(kind, **HYBRIDS[kind]),
        experts_implementation="eager").eval()
    hf.save_pretrained(tmp_path)
    module, params, state, _ = from_pretrained(tmp_path)
    prompt = random.randint(random.key(1), (4, 256), 1, 1000)
    if how == "torchfn":
        model = functools.partial(torchfn.Model(module).apply, state=state or None)
        run = lambda: generate(model, params, prompt, 64)  # noqa: E731
    else:
        run = lambda: hf.generate(prompt, attention_mask=torch.ones_like(prompt),  # noqa: E731
                                  max_new_tokens=64, min_new_tokens=64, do_sample=False,
                                  pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        out = benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=1)
    assert out.shape == (4, 320)


@pytest.mark.parametrize("mode", ["forward", "forward+backward"])
@pytest.mark.parametrize("how", ["torchfn", "transformers"])
def test_mlstm(benchmark, how, mode):
    """xLSTM's mLSTM rule, the same inputs: ours against transformers'
    ``mlstm_chunkwise_native_autograd`` (both chunked by 64; xLSTM 7B's gates: input
    gates around -2, forget gates around 4)."""
    benchmark.group = f"mlstm rule N=2048 {mode}"
    keys = random.split(random.key(0), 5)
    b, h, n, d = 1, 4, 2048, 128
    q, k, v = (random.normal(key, (b, h, n, d)) for key in keys[:3])
    i = random.normal(keys[3], (b, h, n)) - 2
    f = random.normal(keys[4], (b, h, n)) + 4
    args = [x.requires_grad_(mode != "forward") for x in (q, k, v, i, f)]
    if how == "torchfn":
        fn = functools.partial(mlstm, chunk=64)
    else:
        modeling = pytest.importorskip(
            "transformers.models.xlstm.modeling_xlstm", reason="the peer")

        def fn(q, k, v, i, f):
            return modeling.mlstm_chunkwise_native_autograd(q, k, v, i, f, chunk_size=64)
    if mode == "forward":
        run = lambda: fn(*args)  # noqa: E731
    else:
        run = lambda: torch.autograd.grad(fn(*args).square().sum(), args)  # noqa: E731
    with torch.no_grad() if mode == "forward" else contextlib.nullcontext():
        benchmark.pedantic(run, rounds=3, warmup_rounds=1)


@pytest.mark.parametrize("mode", ["forward", "forward+backward"])
@pytest.mark.parametrize("how", ["torchfn", "transformers"])
def test_rg_lru(benchmark, how, mode):
    """Griffin's recurrent block, the same weights: ours (an associative scan) against
    transformers' (a Python loop over tokens in its RG-LRU)."""
    transformers = pytest.importorskip("transformers", reason="the peer of this bench")
    from transformers.models.recurrent_gemma import modeling_recurrent_gemma as modeling

    benchmark.group = f"rg_lru block N=2048 dim=512 {mode}"
    config = transformers.RecurrentGemmaConfig(hidden_size=512, lru_width=512,
                                               num_attention_heads=8, conv1d_width=4)
    torch.manual_seed(0)
    hf = modeling.RecurrentGemmaRecurrentBlock(config, 0)
    for p in hf.parameters():  # transformers leaves the init to its model: a small one
        torch.nn.init.normal_(p, std=0.02)
    names = {"linear_y": "gate", "linear_x": "in_proj", "linear_out": "out",
             "conv_1d": "conv", "rg_lru.": ""}
    params = {}
    for name, p in hf.named_parameters():
        prefix = next(a for a in names if name.startswith(a))
        params[names[prefix] + name[len(prefix):]] = p.detach().clone().requires_grad_(
            mode != "forward")
    x = random.normal(random.key(1), (1, 2048, 512))
    positions = torch.arange(2048)[None]
    if how == "torchfn":
        model = torchfn.Model(RGLRU(512, 8))
        fn = lambda: model.apply(params, x)  # noqa: E731
        wrt = list(params.values())
    else:
        fn = lambda: hf(x, positions, None, use_cache=False)[0]  # noqa: E731
        wrt = list(hf.parameters())
    if mode == "forward":
        run = fn
    else:
        run = lambda: torch.autograd.grad(fn().square().sum(), wrt)  # noqa: E731
    with torch.no_grad() if mode == "forward" else contextlib.nullcontext():
        benchmark.pedantic(run, rounds=3, warmup_rounds=1)


@pytest.mark.parametrize("mode", ["forward", "forward+backward"])
@pytest.mark.parametrize("how", ["torchfn", "transformers"])
def test_mamba(benchmark, how, mode):
    transformers = pytest.importorskip("transformers", reason="the peer of this bench")
    from transformers.models.mamba import modeling_mamba

    benchmark.group = f"mamba mixer N=2048 dim=512 {mode}"
    config = transformers.MambaConfig(hidden_size=512, intermediate_size=1024, state_size=16,
                                      time_step_rank=32, num_hidden_layers=1)
    torch.manual_seed(0)
    hf = modeling_mamba.MambaMixer(config, 0)
    names = {"conv1d.weight": "conv.weight", "conv1d.bias": "conv.bias",
             "out_proj.weight": "out.weight"}
    params = {names.get(n, n): t.detach() for n, t in hf.state_dict().items()}
    model = torchfn.Model(Mamba(512, 1024, state_dim=16, dt_rank=32))
    x = random.normal(random.key(0), (1, 2048, 512))
    want = model.apply(params, x)
    if how == "torchfn":
        run = (lambda: model.apply(params, x)) if mode == "forward" else (  # noqa: E731
            lambda: torch.func.grad(lambda p: model.apply(p, x).square().mean())(params))
    else:
        weights = list(hf.parameters())
        run = (lambda: hf(x)) if mode == "forward" else (  # noqa: E731
            lambda: torch.autograd.grad(hf(x).square().mean(), weights))
    slow = how == "transformers" and mode != "forward"  # its token loop's backward: ~2 min
    with torch.no_grad() if mode == "forward" else contextlib.nullcontext():
        out = benchmark.pedantic(run, rounds=1 if slow else 3, warmup_rounds=0 if slow else 1)
    if mode == "forward":
        assert torch.allclose(out, want, atol=1e-4)
