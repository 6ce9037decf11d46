"""Shared fixtures. The `key` fixture's seed shows in every failure message."""

import os

import pytest
from hypothesis import settings

settings.register_profile("ci", max_examples=15, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=25, deadline=None)
# HYPOTHESIS_PROFILE=stress: many more random examples, to hunt edge cases before a release
settings.register_profile("stress", max_examples=300, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# Inductor's C++ builds, like torch's threads below, get each xdist worker's share of the
# cores. By default inductor starts a pool of compile processes (2 on 2 cores) in every
# worker; on 2 cores the pools only compete: a cold first compile took 34.5 s with the
# pool, 25 s without (read when torch._inductor.config is first imported, so set here).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_CORES_PER_WORKER = max(1, (os.cpu_count() or 1) // _WORKERS)
if _WORKERS > 1:
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(_CORES_PER_WORKER))


def pytest_configure(config):
    """Under pytest-xdist, give each worker its share of the cores for torch's threads.

    With ``-n auto`` on 2 cores, two workers of 2 OpenMP threads each oversubscribe
    the machine: a test of many small ops that shares the cores with a worker running
    large ones stalls at every fork/join (measured: a 1.2 s test took 38 s beside a
    matmul loop, and 316 s in the suite; 2.4 s with one thread)."""
    if _WORKERS > 1:
        import torch

        torch.set_num_threads(_CORES_PER_WORKER)


@pytest.fixture(params=[0], ids=lambda s: f"seed={s}")
def seed(request):
    return request.param


@pytest.fixture
def key(seed):
    from torchfn import random

    return random.key(seed)


@pytest.fixture
def fresh_dynamo():
    """Reset dynamo before and after the test. After a graph break inside ``vmap(grad)``
    under ``torch.compile``, a later ``torch.compile(grad(g), fullgraph=True)`` of another
    function fails ("Unsupported functorch tracing attempt") until dynamo is reset; tests
    that break the graph there must not leave that state to the tests after them."""
    import torch

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def example():
    """``example("dp_lora")``: ``examples/dp_lora.py`` loaded as a module."""
    import importlib.util
    from pathlib import Path

    examples = Path(__file__).resolve().parents[1] / "examples"

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"example_{name}", examples / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
