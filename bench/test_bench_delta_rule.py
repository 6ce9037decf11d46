"""Bench: the gated delta rule (Gated DeltaNet) and a Qwen3.5 model on the CPU, float32.

* ``test_delta_rule``: ``kernels.gated_delta_rule`` against transformers' own PyTorch
  implementations of it (what transformers runs without flash-linear-attention, i.e. on
  every CPU): the chunked one (the same WY algorithm) and the token-by-token recurrence.
  B=1, 8 value heads (4 query/key heads), N=4096, Dk = Dv = 128; forward, and forward
  plus the gradient in every input.
* ``test_generate_qwen3_5_vs_transformers``: greedy decoding of one small Qwen3.5 (three
  Gated DeltaNet layers, one gated attention), 4 prompts of 256 tokens, 64 new tokens,
  against transformers' ``generate``.

Run: ``pytest bench/test_bench_delta_rule.py --benchmark-only --benchmark-columns=min,median``.
"""

import pytest
import torch

import torchfn
from torchfn import random
from torchfn.kernels import gated_delta_rule
from torchfn.models import generate, qwen3_next_from_hf

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
