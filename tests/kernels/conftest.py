"""Shared helpers for the attention tests.

Without CUDA the Triton kernels run in the Triton interpreter, which must be switched
on before ``triton.language`` is imported: conftest modules load before the test
modules, so it is set here, at import time.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import inspect  # noqa: E402

import pytest  # noqa: E402


def _patch_the_language_once_per_launch():
    """Test-speed shim for Triton's interpreter (3.x): same kernels, same numbers.

    A launch patches ``triton.language`` with the interpreter's builtins (one
    ``inspect.getmembers`` sweep of ``tl``, ``tl.tensor`` and ``tl.math``) and undoes it
    when the grid is done; but every call of a ``@triton.jit`` helper *inside* the kernel
    sweeps again, though the same modules are patched already (and a helper's sweep is
    never undone). Our kernels call helpers in their inner loops, so the sweeps took a
    quarter of the interpreter's time (cProfile: 5.9 s of 22 s in ``_patch_builtin`` for
    the EARLY_DP tests). Here a helper call skips the sweep when this launch has already
    swept every language module the helper sees. Where Triton's interpreter is laid out
    otherwise, nothing is changed.
    """
    try:
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:
        return
    needed = ("_patch_lang", "_LangPatchScope", "GridExecutor", "InterpretedFunction")
    if not all(hasattr(interp, n) for n in needed) or getattr(interp, "_torchfn_once", False):
        return
    patch_lang, run = interp._patch_lang, interp.GridExecutor.__call__
    launch = {"running": False, "patched": frozenset()}  # the modules this launch patched

    seen_by = {}  # fn -> the language modules in its globals

    def langs(fn):
        if fn not in seen_by:
            seen_by[fn] = frozenset(id(m) for m in fn.__globals__.values()
                                    if inspect.ismodule(m) and m in (tl, tl.core))
        return seen_by[fn]

    def patch_lang_once(fn):
        seen = langs(fn)
        if launch["running"] and seen <= launch["patched"]:
            return interp._LangPatchScope()  # nothing to undo: the launch undoes its own
        scope = patch_lang(fn)
        if launch["running"]:
            launch["patched"] |= seen
        return scope

    def run_marked(self, *args, **kwargs):
        launch.update(running=True, patched=frozenset())
        try:
            return run(self, *args, **kwargs)
        finally:
            launch.update(running=False, patched=frozenset())

    interp._patch_lang = patch_lang_once
    interp.GridExecutor.__call__ = run_marked
    interp._torchfn_once = True


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_the_language_once_per_launch()


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
