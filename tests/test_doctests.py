"""Every docstring example in torchfn runs and prints what it claims.

torchfn.optim, torchfn.kernels and torchfn.core.random run theirs in their own test
folders (the kernels need the Triton interpreter switched on first).
"""

import doctest
import importlib
import pkgutil

import pytest

import torchfn

ELSEWHERE = ("torchfn.optim", "torchfn.kernels", "torchfn.core.random")
MODULES = sorted(
    m.name for m in pkgutil.walk_packages(torchfn.__path__, "torchfn.")
    if not m.name.startswith(ELSEWHERE)
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    flags = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS
    result = doctest.testmod(module, optionflags=flags)
    assert result.failed == 0, f"{result.failed} doctest failures in {name}"

