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
    if not m.name.startswith(ELSEWHERE) and m.name != "torchfn.__main__"  # runs the command
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    flags = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS
    result = doctest.testmod(module, optionflags=flags)
    assert result.failed == 0, f"{result.failed} doctest failures in {name}"



def test_every_public_name_has_an_example():
    """Each callable in the subpackages' ``__all__`` and the flat API shows an example
    (exceptions and NamedTuple records excepted)."""
    missing = []
    for package in ("models", "losses", "transforms", "train", "data", "tree"):
        mod = importlib.import_module(f"torchfn.{package}")
        for name in getattr(mod, "__all__", []):
            obj = getattr(mod, name)
            record = isinstance(obj, type) and (
                issubclass(obj, Exception) or hasattr(obj, "_fields")
            )
            if callable(obj) and not record and ">>>" not in (obj.__doc__ or ""):
                missing.append(f"torchfn.{package}.{name}")
    for name in ("Model", "save", "load", "remat", "checkpoint_name", "scan",
                 "make_train_step", "fit", "segment_sum", "segment_mean", "segment_max",
                 "segment_min", "segment_softmax"):
        if ">>>" not in (getattr(torchfn, name).__doc__ or ""):
            missing.append(f"torchfn.{name}")
    assert not missing, f"no docstring example: {missing}"
