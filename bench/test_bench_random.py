"""torchfn.random.normal vs torch.randn, 10M float32 samples, eager and compiled.

Run:
    .venv/bin/pytest bench/test_bench_random.py --benchmark-only -q -p no:randomly \
        --benchmark-columns=min,median,mean

Report median(torchfn) / median(torch.randn) per group. Targets: eager <= 6x,
compiled <= 1.0x. The compiled case pays its cold compile (tens of seconds)
outside the timed rounds.
"""

from __future__ import annotations

import pytest
import torch

from torchfn import random

N = 10_000_000


@pytest.fixture(scope="module")
def key():
    return random.key(0)


@pytest.mark.benchmark(group="normal-10M-eager")
def test_torchfn_normal_eager(benchmark, key):
    out = benchmark.pedantic(random.normal, args=(key, (N,)), rounds=7, warmup_rounds=1)
    assert out.shape == (N,)


@pytest.mark.benchmark(group="normal-10M-eager")
def test_torch_randn_eager(benchmark):
    out = benchmark.pedantic(torch.randn, args=(N,), rounds=7, warmup_rounds=1)
    assert out.shape == (N,)


@pytest.mark.benchmark(group="normal-10M-compiled")
def test_torchfn_normal_compiled(benchmark, key):
    f = torch.compile(lambda k: random.normal(k, (N,)), fullgraph=True)
    f(key)  # cold compile, not timed
    out = benchmark.pedantic(f, args=(key,), rounds=7, warmup_rounds=1)
    assert torch.equal(out[:1000], random.normal(key, (1000,))) or torch.allclose(
        out[:1000], random.normal(key, (1000,)), rtol=1e-6, atol=1e-6
    )


@pytest.mark.benchmark(group="normal-10M-compiled")
def test_torch_randn_vs_compiled(benchmark):
    out = benchmark.pedantic(torch.randn, args=(N,), rounds=7, warmup_rounds=1)
    assert out.shape == (N,)


@pytest.mark.benchmark(group="bits-10M-eager")
def test_torchfn_bits_eager(benchmark, key):
    out = benchmark.pedantic(random.bits, args=(key, (N,)), rounds=5, warmup_rounds=1)
    assert out.shape == (N,)


@pytest.mark.benchmark(group="bits-10M-eager")
def test_torch_randint_bits_eager(benchmark):
    out = benchmark.pedantic(
        torch.randint,
        args=(0, 2**31 - 1, (N,)),
        kwargs={"dtype": torch.int32},
        rounds=5,
        warmup_rounds=1,
    )
    assert out.shape == (N,)


# Small draws (4096 floats: a batch of noise for a small model): per-call overhead, not
# throughput. A draw that fits one chunk takes the in-place eager path; "out-of-place"
# forces the path such draws took before (what vmap / grad wrappers still take).
SMALL = (128, 32)


def _out_of_place(monkeypatch):
    from torchfn.core import _threefry

    monkeypatch.setattr(_threefry, "one_chunk", lambda n: False)


@pytest.mark.parametrize("impl", ["torchfn", "torchfn out-of-place", "torch.randn"])
def test_small_normal_eager(benchmark, key, impl, monkeypatch):
    benchmark.group = "normal-4096-eager"
    want = random.normal(key, SMALL)
    if impl == "torch.randn":
        out = benchmark.pedantic(torch.randn, args=SMALL, rounds=200, warmup_rounds=10)
        assert out.shape == want.shape
        return
    if impl == "torchfn out-of-place":
        _out_of_place(monkeypatch)
    out = benchmark.pedantic(random.normal, args=(key, SMALL), rounds=200, warmup_rounds=10)
    assert torch.equal(out, want)  # both paths give the same bits


@pytest.mark.parametrize("impl", ["torchfn", "torchfn out-of-place", "torch.randint"])
def test_small_bits_eager(benchmark, key, impl, monkeypatch):
    benchmark.group = "bits-4096-eager"
    want = random.bits(key, SMALL, torch.int32)
    if impl == "torch.randint":
        out = benchmark.pedantic(torch.randint, args=(0, 2**31 - 1, SMALL),
                                 kwargs={"dtype": torch.int32}, rounds=200, warmup_rounds=10)
        assert out.shape == want.shape
        return
    if impl == "torchfn out-of-place":
        _out_of_place(monkeypatch)
    out = benchmark.pedantic(random.bits, args=(key, SMALL, torch.int32), rounds=200,
                             warmup_rounds=10)
    assert torch.equal(out, want)


@pytest.mark.parametrize("impl", ["torchfn", "tensor path"])
def test_split_256(benchmark, key, impl, monkeypatch):
    """One key per example of a batch of 256: numpy hashes it now; "tensor path" is the
    out-of-place torch hash such splits took before (and take under transforms)."""
    benchmark.group = "split-256"
    want = random.split(key, 256)
    if impl == "tensor path":
        _out_of_place(monkeypatch)
    out = benchmark.pedantic(random.split, args=(key, 256), rounds=200, warmup_rounds=10)
    assert torch.equal(out, want)


# --------------------------------------------------- the gamma family and exponential
# 1M samples each against torch's own samplers (global RNG), eager.
M = 1_000_000


@pytest.mark.benchmark(group="gamma-1M-eager")
def test_torchfn_gamma(benchmark, key):
    out = benchmark.pedantic(random.gamma, args=(key, 2.0, (M,)), rounds=5, warmup_rounds=1)
    assert out.shape == (M,)


@pytest.mark.benchmark(group="gamma-1M-eager")
def test_torch_standard_gamma(benchmark):
    alpha = torch.full((M,), 2.0)
    out = benchmark.pedantic(torch._standard_gamma, args=(alpha,), rounds=5, warmup_rounds=1)
    assert out.shape == (M,)


@pytest.mark.benchmark(group="beta-1M-eager")
def test_torchfn_beta(benchmark, key):
    out = benchmark.pedantic(random.beta, args=(key, 0.4, 0.4, (M,)), rounds=5, warmup_rounds=1)
    assert out.shape == (M,)


@pytest.mark.benchmark(group="beta-1M-eager")
def test_torch_beta(benchmark):
    dist = torch.distributions.Beta(torch.tensor(0.4), torch.tensor(0.4))
    out = benchmark.pedantic(dist.sample, args=((M,),), rounds=5, warmup_rounds=1)
    assert out.shape == (M,)


@pytest.mark.benchmark(group="exponential-10M-eager")
def test_torchfn_exponential(benchmark, key):
    out = benchmark.pedantic(random.exponential, args=(key, (N,)), rounds=5, warmup_rounds=1)
    assert out.shape == (N,)


@pytest.mark.benchmark(group="exponential-10M-eager")
def test_torch_exponential(benchmark):
    out = benchmark.pedantic(lambda: torch.empty(N).exponential_(), rounds=5, warmup_rounds=1)
    assert out.shape == (N,)
