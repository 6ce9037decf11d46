"""Pytree utilities (``torchfn.tree``); implementation in ``torchfn.core.tree``."""

from torchfn.core.tree import *  # noqa: F401,F403
from torchfn.core.tree import __all__  # noqa: F401
