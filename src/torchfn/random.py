"""Explicit PRNG keys (``torchfn.random``); implementation in ``torchfn.core.random``."""

from torchfn.core.random import *  # noqa: F401,F403
from torchfn.core.random import __all__  # noqa: F401
