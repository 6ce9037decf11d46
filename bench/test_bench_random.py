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
