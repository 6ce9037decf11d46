"""Importing torchfn's modules must not import triton or torch._dynamo.

The Triton interpreter is chosen by TRITON_INTERPRET when ``triton.language`` is first
imported (tests/kernels/conftest.py sets it). A torchfn module that imports dynamo at
import time (``@torch.compiler.disable`` does) imports triton with it, and once that
happens during test collection every interpreted kernel fails with "Cannot call
@triton.jit'd outside of the scope of a kernel". It also costs every user the import.
"""

import subprocess
import sys

import pytest

MODULES = ["torchfn", "torchfn.random", "torchfn.optim", "torchfn.models", "torchfn.losses",
           "torchfn.transforms", "torchfn.train", "torchfn.data", "torchfn.kernels"]


@pytest.mark.parametrize("module", MODULES)
def test_import_does_not_pull_in_triton_or_dynamo(module):
    code = (f"import sys, {module}\n"
            "heavy = [m for m in ('triton', 'torch._dynamo', 'torch._inductor') "
            "if m in sys.modules]\n"
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PATH": "", "PYTHONNOUSERSITE": "1"})
    assert out.stdout.strip() == "", f"import {module} imported {out.stdout.strip()}"
