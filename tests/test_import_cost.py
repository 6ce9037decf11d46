"""Importing torchfn's modules must not import triton or torch._dynamo.

The Triton interpreter is chosen by TRITON_INTERPRET when ``triton.language`` is first
imported (tests/kernels/conftest.py sets it). A torchfn module that imports dynamo at
import time (``@torch.compiler.disable`` does) imports triton with it, and once that
happens during test collection every interpreted kernel fails with "Cannot call
@triton.jit'd outside of the scope of a kernel". It also costs every user the import.
"""

import json
import subprocess
import sys

MODULES = ["torchfn", "torchfn.random", "torchfn.optim", "torchfn.models", "torchfn.losses",
           "torchfn.transforms", "torchfn.train", "torchfn.data", "torchfn.kernels"]


def test_import_does_not_pull_in_triton_or_dynamo():
    # one fresh process imports the modules in turn and reports what each import brought
    # in (a module imported clean stays clean, so the first offender is named); a process
    # per module cost 2-2.7 s each on 2 cores
    code = ("import importlib, json, sys\n"
            "heavy = ('triton', 'torch._dynamo', 'torch._inductor')\n"
            "out = {}\n"
            f"for name in {MODULES!r}:\n"
            "    importlib.import_module(name)\n"
            "    out[name] = [m for m in heavy if m in sys.modules]\n"
            "print(json.dumps(out))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PATH": "", "PYTHONNOUSERSITE": "1"})
    pulled = json.loads(out.stdout.strip().splitlines()[-1])
    assert list(pulled) == MODULES
    for module in MODULES:
        assert pulled[module] == [], f"import {module} imported {pulled[module]}"
