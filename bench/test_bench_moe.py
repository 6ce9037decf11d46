"""Bench: ``models.MoE`` against Hugging Face Mixtral's MoE loop, CPU fp32.

T = 2048 tokens (B=4 rows of 512), dim 256, SwiGLU experts of 512 hidden units, 8
experts, top 2 (Mixtral's routing). Three computations of the same function:

- ``hf loop``: Mixtral's ``MixtralSparseMoeBlock`` as Hugging Face writes it (transformers
  is not installed here; written out below): a one-hot expert mask, a loop over the
  experts with ``torch.where`` finding each one's tokens, ``index_add_`` of the weighted
  outputs.
- ``torchfn sparse`` (eager): one argsort groups the tokens by expert, one ``split``.
- ``torchfn dense`` (what ``vmap`` and ``torch.compile`` run): every expert on every token.

Forward, and forward+backward in all the weights (``grad``). The outputs are checked equal.

Run: ``pytest bench/test_bench_moe.py --benchmark-only --benchmark-columns=min,median``.
"""

import pytest
import torch
import torch.nn.functional as F

import torchfn
from torchfn import random
from torchfn.models import MoE, _moe

B, N, DIM, HIDDEN, E, K = 4, 512, 256, 512, 8, 2


def hf_mixtral_moe(p, x):
    """Mixtral's sparse MoE block, the loop of Hugging Face's ``MixtralSparseMoeBlock``."""
    tokens = x.reshape(-1, DIM)  # (T, dim)
    logits = tokens @ p["router.weight"].T
    weights = F.softmax(logits, dim=1, dtype=torch.float)
    weights, chosen = torch.topk(weights, K, dim=-1)
    weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
    out = torch.zeros_like(tokens)
    mask = F.one_hot(chosen, num_classes=E).permute(2, 1, 0)  # (E, k, T)
    for e in range(E):
        slot, rows = torch.where(mask[e])
        t = tokens[rows]
        h = (F.silu(t @ p["gate"][e].T) * (t @ p["up"][e].T)) @ p["down"][e].T
        out = out.index_add(0, rows, h * weights[rows, slot, None])
    return out.reshape(x.shape)


def setup():
    model = torchfn.Model(MoE(DIM, HIDDEN, E, K))
    params = model.init(random.key(0))
    x = random.normal(random.key(1), (B, N, DIM))
    return model, params, x


def run(how, model):
    if how == "hf loop":
        return hf_mixtral_moe
    return lambda p, x: model.apply(p, x)


CASES = ["hf loop", "torchfn sparse", "torchfn dense"]


@pytest.fixture
def computation(request, monkeypatch):
    how = request.param
    if how == "torchfn dense":
        monkeypatch.setattr(_moe, "_batched_transform_active", lambda: True)
    return how


@pytest.mark.parametrize("computation", CASES, indirect=True)
def test_forward(benchmark, computation):
    model, params, x = setup()
    f = run(computation, model)
    out = benchmark.pedantic(f, (params, x), rounds=10, iterations=1, warmup_rounds=1)
    torch.testing.assert_close(out, hf_mixtral_moe(params, x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("computation", CASES, indirect=True)
def test_forward_backward(benchmark, computation):
    model, params, x = setup()
    f = run(computation, model)
    step = torch.func.grad(lambda p, x: f(p, x).square().mean())
    g = benchmark.pedantic(step, (params, x), rounds=10, iterations=1, warmup_rounds=1)
    want = torch.func.grad(lambda p, x: hf_mixtral_moe(p, x).square().mean())(params, x)
    for name in want:
        torch.testing.assert_close(g[name], want[name], rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("how", ["dense", "capacity 1.25", "capacity 2.0"])
def test_per_sample_gradients(benchmark, how):
    """``vmap(grad)`` over the 4 rows (per-sample gradients, as DP-SGD needs): the dense
    computation vmap takes without a capacity, against ``capacity_factor`` (fixed-shape
    expert buffers of ceil(factor * 512 * 2 / 8) tokens per row; 2.0 drops nothing
    here only if the routing is balanced enough, so its values are not compared)."""
    factor = None if how == "dense" else float(how.split()[1])
    model = torchfn.Model(MoE(DIM, HIDDEN, E, K, capacity_factor=factor))
    params = model.init(random.key(0))
    x = random.normal(random.key(1), (B, N, DIM))
    per = torch.func.vmap(torch.func.grad(lambda p, xi: model.apply(p, xi).square().mean()),
                          in_dims=(None, 0))
    g = benchmark.pedantic(per, (params, x), rounds=3, iterations=1, warmup_rounds=1)
    assert g["up"].shape == (B, E, HIDDEN, DIM)
