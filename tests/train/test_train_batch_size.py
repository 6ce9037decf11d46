"""find_batch_size: halves on (simulated) out-of-memory until the trial fits."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torchfn.train import _batch_size, find_batch_size, is_out_of_memory


@pytest.fixture(autouse=True)
def releases(monkeypatch):
    """Count the memory releases between tries (gc.collect is slow with torch loaded)."""
    calls = []
    monkeypatch.setattr(_batch_size, "_release", lambda: calls.append(1))
    return calls


def trial_fitting(limit, error=torch.OutOfMemoryError):
    tried = []

    def fn(batch_size):
        tried.append(batch_size)
        if batch_size > limit:
            raise error("CUDA out of memory. Tried to allocate 2.00 GiB")
        return torch.ones(batch_size).sum()

    return fn, tried


@given(start=st.integers(1, 4096), limit=st.integers(1, 4096))
def test_halves_until_it_fits(start, limit):
    fn, tried = trial_fitting(limit)
    size, result = find_batch_size(fn, start)
    assert size <= limit and float(result) == size
    assert tried == [start // 2**i or 1 for i in range(len(tried))]  # halving sequence
    assert tried[-1] == size and all(t > limit for t in tried[:-1])  # the first that fits


def test_runtime_error_out_of_memory_and_min_size(releases):
    fn, tried = trial_fitting(10, error=RuntimeError)
    assert find_batch_size(fn, 64)[0] == 8
    assert len(releases) == 3  # memory released before each retry
    fn, tried = trial_fitting(3)
    with pytest.raises(torch.OutOfMemoryError):
        find_batch_size(fn, 64, min_size=16)
    assert tried == [64, 32, 16]


def test_other_errors_propagate_at_once():
    calls = []

    def fn(b):
        calls.append(b)
        raise ValueError("shape mismatch")

    with pytest.raises(ValueError, match="shape mismatch"):
        find_batch_size(fn, 64)
    assert calls == [64]
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory"))
    assert not is_out_of_memory(RuntimeError("size mismatch"))


def test_bad_input():
    with pytest.raises(ValueError, match="start must be an int >= 1, got 0"):
        find_batch_size(lambda b: b, 0)
    with pytest.raises(ValueError, match="min_size must be an int >= 1"):
        find_batch_size(lambda b: b, 8, min_size=0)
    with pytest.raises(ValueError, match="min_size must be <= start=8, got 9"):
        find_batch_size(lambda b: b, 8, min_size=9)
    with pytest.raises(TypeError, match="fn must be callable"):
        find_batch_size(3, 8)
