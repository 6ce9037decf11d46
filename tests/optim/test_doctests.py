"""The docstring examples of torchfn.optim run and print what they claim."""

import doctest
import importlib
import pkgutil

import pytest

import torchfn.optim

MODULES = sorted(
    m.name for m in pkgutil.iter_modules(torchfn.optim.__path__, "torchfn.optim.")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} doctest failures in {name}"
