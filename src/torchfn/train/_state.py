"""The train state: everything a train step reads and writes, as one pytree."""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from torchfn.optim import NoOpLossScale

__all__ = ["TrainState"]


class TrainState(NamedTuple):
    """Params, model state, optimizer state, loss scale, step and key.

    A NamedTuple, so it is a pytree for ``torchfn.tree``, optree and
    ``torch.func`` alike: ``vmap`` a train step over stacked states to train an
    ensemble, ``torchfn.save`` it as a checkpoint, ``_replace`` a field.

    Fields:
        params: the parameter pytree (floating-point tensors).
        model_state: buffers such as BatchNorm statistics (``{}`` if none).
        opt_state: the optimizer's state, ``optimizer.init(params)``.
        loss_scale: a ``torchfn.optim.DynamicLossScale`` (or
            ``StaticLossScale``), or ``NoOpLossScale()`` when loss scaling is
            off (an empty pytree rather than ``None``, so ``vmap`` over a
            state needs no special ``in_dims``).
        step: number of steps taken, a 0-d int64 tensor.
        key: the root PRNG key. It never changes: step ``i`` uses
            ``fold_in(key, i)``, so a resumed run draws the same randomness.

    Example::

        >>> import torch
        >>> import torchfn
        >>> state = torchfn.TrainState.create({"w": torch.zeros(3)}, torchfn.optim.sgd(0.1),
        ...                                   key=torchfn.random.key(0))
        >>> int(state.step), state.params["w"].shape, state.model_state
        (0, torch.Size([3]), {})
        >>> state = state._replace(step=state.step + 1)      # a new state; the old one is kept
        >>> int(state.step)
        1
    """

    params: Any
    model_state: Any
    opt_state: Any
    loss_scale: Any
    step: torch.Tensor
    key: torch.Tensor

    @classmethod
    def create(
        cls,
        params: Any,
        optimizer: Any,
        *,
        key: torch.Tensor,
        model_state: Any = None,
        loss_scale: Any = None,
    ) -> TrainState:
        """A step-0 state: ``opt_state = optimizer.init(params)``.

        ``model_state`` defaults to ``{}`` and ``loss_scale`` to
        ``NoOpLossScale()`` (off).

        Example::

            >>> import torch, torchfn
            >>> params = {"w": torch.zeros(3)}
            >>> state = torchfn.TrainState.create(
            ...     params, torchfn.optim.sgd(0.1), key=torchfn.random.key(0))
            >>> int(state.step)
            0
        """
        leaves = optree.tree_leaves(params)
        if not leaves:
            raise ValueError("params must contain at least one tensor, got an empty pytree")
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point():
                raise TypeError(
                    "params must be a pytree of floating-point tensors, got a leaf of type "
                    f"{type(leaf).__name__}"
                    + (f" with dtype {leaf.dtype}" if isinstance(leaf, torch.Tensor) else "")
                )
        if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
            raise TypeError(
                "optimizer must be a gradient transformation with init/update, got "
                f"{type(optimizer).__name__}"
            )
        if not isinstance(key, torch.Tensor):
            raise TypeError(f"key must be a torchfn.random key tensor, got {type(key).__name__}")
        if loss_scale is not None and not all(
            callable(getattr(loss_scale, m, None)) for m in ("scale", "unscale", "adjust")
        ):
            raise TypeError(
                "loss_scale must be a torchfn.optim loss scale (scale/unscale/adjust) or None, "
                f"got {type(loss_scale).__name__}"
            )
        return cls(
            params=params,
            model_state={} if model_state is None else model_state,
            opt_state=optimizer.init(params),
            loss_scale=NoOpLossScale() if loss_scale is None else loss_scale,
            step=torch.zeros((), dtype=torch.int64, device=leaves[0].device),
            key=key,
        )
