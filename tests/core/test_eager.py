"""``plain``: the one test of plain eager mode that the samplers and attention's shortcuts share."""

import doctest

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from torchfn.core import _eager


def test_docstring_examples():
    failed, tried = doctest.testmod(_eager)[:2]
    assert tried > 0 and failed == 0


def test_plain_only_outside_tracing_transforms_and_subclasses():
    x = torch.ones(3)
    seen = []
    make_fx(lambda t: (seen.append(_eager.plain(t)), t + 1)[1])(x)  # a dispatch mode
    torch.func.grad(lambda t: (seen.append(_eager.plain(t)), t.sum())[1])(x)
    seen.append(_eager.plain(torch.nn.Parameter(x)))  # a subclass
    assert _eager.plain(x) and seen == [False, False, False]
