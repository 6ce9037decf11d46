"""Shared helpers for the attention tests.

Without CUDA the Triton kernels run in the Triton interpreter, which must be switched
on before ``triton.language`` is imported: conftest modules load before the test
modules, so it is set here, at import time.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(max |b|, 1) in float64.

    The floor 1 is the scale of the unit-normal test data: a result much smaller
    than the terms it is summed from (dk with one visible key is exactly 0 in exact
    arithmetic, but is summed from O(1) terms that cancel) is judged against them.
    """
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item()


class Data:
    """Seeded random tensors (never zeros) for one test case."""

    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)

    def normal(self, *shape, dtype=torch.float64) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g, dtype=torch.float64).to(dtype)

    def bools(self, *shape, p: float = 0.7) -> torch.Tensor:
        return torch.rand(*shape, generator=self.g) < p

    def qkv(self, B, H, Hkv, Nq, Nk, D, dtype=torch.float64):
        return (
            self.normal(B, H, Nq, D, dtype=dtype),
            self.normal(B, Hkv, Nk, D, dtype=dtype),
            self.normal(B, Hkv, Nk, D, dtype=dtype),
        )


@pytest.fixture(scope="session")
def rel_err():
    """``rel_err(a, b)`` = max |a - b| / max(max |b|, 1)."""
    return _rel_err


@pytest.fixture(scope="session")
def data():
    """``data(seed)`` -> a :class:`Data` source."""
    return Data


@pytest.fixture(autouse=True)
def _private_tuning_cache(tmp_path_factory, monkeypatch):
    """The GPU autotuner's on-disk picks go to a per-test directory, never the user's."""
    monkeypatch.setenv("TORCHFN_TRITON_TUNE_CACHE", str(tmp_path_factory.mktemp("tuning")))
