"""The runnable examples in the attention modules' docstrings (those that need no triton)."""

import doctest
import importlib

import pytest

MODULES = ["torchfn.kernels._dispatch", "torchfn.kernels._dropout", "torchfn.kernels._reference",
           "torchfn.kernels._split_kv", "torchfn.kernels._ordered_dq",
           "torchfn.kernels._second_order"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    failed, tried = doctest.testmod(importlib.import_module(name),
                                    optionflags=doctest.NORMALIZE_WHITESPACE)[:2]
    assert tried > 0 and failed == 0, f"{failed} of {tried} doctest examples failed in {name}"
