"""Whether code runs in plain eager mode, where shortcuts are safe: ``out=`` buffers,
data-dependent shapes, reading values, calling a custom op's body without the op.

>>> import torch
>>> plain(torch.ones(2)), torch.func.vmap(lambda x: torch.tensor(plain(x)))(torch.ones(2))
(True, tensor([False, False]))
"""

from __future__ import annotations

import torch
from torch import Tensor


def plain(t: Tensor) -> bool:
    """True in plain eager mode: a real tensor (not a subclass), not being traced
    (``torch.compile``, ``make_fx``, fake tensors, any dispatch mode), not a functorch
    (``vmap`` / ``grad``) wrapper."""
    if torch.compiler.is_compiling() or type(t) is not Tensor:
        return False
    if torch.utils._python_dispatch._get_current_dispatch_mode() is not None:
        return False
    return not torch._C._functorch.is_functorch_wrapped_tensor(t)
