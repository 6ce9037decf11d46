"""A module's sub-block under ``torchfn.remat``, inside ``Model.apply`` too.

``remat`` differentiates only what it is given, so the block's parameters (which
``Model.apply`` has swapped in) go in as arguments and the block runs on them by
``functional_call``. Dropout inside the block is keyed by the running
``Model.apply``: the block's draws continue the apply's count, and the
recomputation in the backward starts again from the same count, so it draws the
same masks, and a remat'd model gives the outputs and gradients of the plain one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchfn.core import checkpoint_policies
from torchfn.core._dropout import _ACTIVE, KeyedRandomness, forward_ad_active


def remat_policy(remat: Any, who: str) -> Callable[..., bool] | None:
    """``remat=`` of a model: False (off: None), True (recompute all) or a policy."""
    if remat is False or remat is None:
        return None
    if remat is True:
        return checkpoint_policies.nothing_saveable
    if callable(remat):
        return remat
    raise TypeError(f"{who}: remat must be a bool or a policy from "
                    f"torchfn.checkpoint_policies, got {remat!r}")


def call_remat(block: nn.Module, policy: Callable[..., bool], *args: Any,
               stochastic: bool = False) -> Any:
    """``block(*args)``, recomputed in the backward as ``policy`` says."""
    from torchfn.core.remat import remat

    mode = _ACTIVE.get()
    if mode is None and stochastic and block.training:
        raise ValueError(
            "remat: this block draws dropout masks in train mode, and outside "
            "torchfn.Model.apply they come from torch's global RNG, which the backward's "
            "recomputation would not repeat; run the model through Model.apply(..., key=k)"
        )
    start = None if mode is None else mode.count
    drawn: list[int] = []

    def run(params, buffers, args, key):
        keyed = contextlib.nullcontext()
        if mode is not None:  # continue the apply's draws, from the same count each time
            keyed = KeyedRandomness(key, math_attention=forward_ad_active())
            keyed.count = start
        with keyed:
            out = torch.func.functional_call(block, {**params, **buffers}, args)
        if mode is not None:
            drawn.append(keyed.count)
        return out

    params = dict(block.named_parameters())
    buffers = dict(block.named_buffers())
    out = remat(run, policy=policy)(params, buffers, args, None if mode is None else mode.key)
    if mode is not None:
        mode.count = drawn[0]
    return out
