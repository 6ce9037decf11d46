"""Ensembles: ``n`` independently initialised members as ONE stacked pytree, applied
and trained together with ``vmap`` (one batched kernel per layer instead of a loop)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch.utils._pytree as torch_pytree
from torch import Tensor
from torch.func import vmap

from torchfn import random, tree

__all__ = ["ensemble_init", "ensemble_size", "ensemble_apply", "ensemble_step"]


def ensemble_init(init: Any, key: Tensor, n: int) -> Any:
    """Stack ``n`` independent initialisations: leaves get a leading ``(n, ...)`` dim.

    Member ``i`` is ``init(random.split(key, n)[i])``, so it equals a single model
    initialised with that key.

    Args:
        init: a ``torchfn.Model`` (its ``init`` is used) or a function ``key -> params``.
        key: a ``torchfn.random`` key.
        n: number of members, ``>= 1``.

    Returns:
        The stacked parameter pytree (``torchfn.tree.stack`` of the members).

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import MLP
        >>> model = torchfn.Model(MLP(3, (16,), 1))
        >>> params = ensemble_init(model, torchfn.random.key(0), 5)   # leaves (5, ...)
        >>> x = torchfn.random.normal(torchfn.random.key(1), (8, 3))   # (B, 3), shared
        >>> ensemble_apply(model.apply, params, x).shape
        torch.Size([5, 8, 1])
    """
    init_fn = getattr(init, "init", init)
    if not callable(init_fn):
        raise TypeError(
            f"init must be a torchfn.Model or a function key -> params, got {type(init).__name__}"
        )
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    keys = random.split(key, n)  # (n, 2)
    return tree.stack([init_fn(keys[i]) for i in range(n)])


def ensemble_size(params: Any, *, name: str = "params") -> int:
    """The number of members of a stacked pytree (its common leading dim); raises a
    ``ValueError`` naming the argument (``name``) and the sizes when the leaves disagree.

    Example::

        >>> import torch
        >>> from torchfn.transforms import ensemble_size
        >>> ensemble_size({"w": torch.zeros(5, 3, 2), "b": torch.zeros(5, 2)})   # leaves (5, ...)
        5
    """
    leaves = optree.tree_leaves(params)
    if not leaves:
        raise ValueError(f"{name} must contain at least one tensor, got an empty pytree")
    sizes = {
        tuple(x.shape[:1]) if isinstance(x, Tensor) else type(x).__name__ for x in leaves
    }
    if len(sizes) != 1 or not isinstance(next(iter(sizes)), tuple) or () in sizes:
        raise ValueError(
            f"{name} must be stacked: every leaf a tensor with the same leading (member) "
            f"dim, got leading sizes {sorted(map(str, sizes))}"
        )
    return next(iter(sizes))[0]


def ensemble_apply(
    apply_fn: Callable[..., Any],
    params: Any,
    *inputs: Any,
    split_inputs: bool = False,
    **kwargs: Any,
) -> Any:
    """``vmap(apply_fn)`` over the members: output leaves get a leading ``(n, ...)`` dim.

    Equals stacking ``apply_fn(params_i, *inputs)`` over the members.

    Args:
        apply_fn: ``(params, *inputs, **kwargs) -> out`` for ONE member (e.g.
            ``model.apply``); ``kwargs`` are passed unbatched (e.g. ``state=...``).
        params: stacked parameters from :func:`ensemble_init`, leaves ``(n, ...)``.
        *inputs: shared by every member (default), or with ``split_inputs=True`` one
            slice per member: leaves ``(n, ...)``.

    Returns:
        ``out`` stacked over the members.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import MLP
        >>> from torchfn.transforms import ensemble_apply, ensemble_init
        >>> model = torchfn.Model(MLP(3, (16,), 1))
        >>> params = ensemble_init(model, torchfn.random.key(0), 5)     # leaves (5, ...)
        >>> x = torchfn.random.normal(torchfn.random.key(1), (8, 3))    # (B, 3), shared
        >>> out = ensemble_apply(model.apply, params, x)                # (n, B, 1)
        >>> out.shape
        torch.Size([5, 8, 1])
        >>> member = torchfn.tree.unstack(params)[2]
        >>> bool(torch.allclose(out[2], model.apply(member, x)))
        True
        >>> xs = random.normal(random.key(1), (5, 8, 3))  # (n, B, 3), one per member
        >>> ensemble_apply(model.apply, params, xs, split_inputs=True).shape
        torch.Size([5, 8, 1])
    """
    if not callable(apply_fn):
        raise TypeError(f"apply_fn must be callable, got {type(apply_fn).__name__}")
    n = ensemble_size(params)
    if split_inputs:
        for i, leaf in enumerate(optree.tree_leaves(inputs)):
            if not isinstance(leaf, Tensor) or leaf.dim() == 0 or leaf.shape[0] != n:
                got = tuple(leaf.shape) if isinstance(leaf, Tensor) else type(leaf).__name__
                raise ValueError(
                    f"inputs: with split_inputs=True every input leaf needs a leading "
                    f"member dim of size {n}, got leaf {i} with shape {got}"
                )

    def one(p: Any, *xs: Any) -> Any:
        return apply_fn(p, *xs, **kwargs)

    in_dims = (0,) + ((0 if split_inputs else None),) * len(inputs)
    return vmap(one, in_dims=in_dims)(params, *inputs)


_MAPPED = object()  # marks a tensor leaf of a step's output (mapped by vmap)


def _tensor_dims(tree_: Any) -> Any:
    """``in_dims`` for ``vmap``: 0 at tensor leaves, ``None`` at the rest (in torch's
    pytree, where ``None`` is a leaf)."""
    leaves, spec = torch_pytree.tree_flatten(tree_)
    return torch_pytree.tree_unflatten([0 if isinstance(x, Tensor) else None for x in leaves], spec)


def ensemble_step(
    step: Callable[[Any, Any], tuple[Any, Any]], *, split_batch: bool = False
) -> Callable[[Any, Any], tuple[Any, Any]]:
    """Train all members at once: ``vmap`` a train step over stacked train states.

    ``step(state, batch) -> (state, metrics)`` is one member's step (e.g. from
    ``torchfn.make_train_step``); the result takes a stacked state (``tree.stack`` of
    the members' ``TrainState``s, each with its own key) and returns the stacked new
    state and metrics ``(n,)``. It equals looping ``step`` over the members.

    Args:
        step: one member's pure train step.
        split_batch: ``False``: every member sees the same batch; ``True``: batch
            leaves carry a leading member dim ``(n, ...)`` (e.g. bootstrap resamples).

    Example::

        >>> import torch, torchfn, torch.nn.functional as F
        >>> from torchfn.models import MLP
        >>> model = torchfn.Model(MLP(3, (16,), 1))
        >>> opt = torchfn.optim.sgd(0.1)
        >>> loss_fn = lambda p, s, batch, k: F.mse_loss(model.apply(p, batch[0]), batch[1])
        >>> members = [torchfn.TrainState.create(model.init(k), opt, key=k)
        ...            for k in torchfn.random.split(torchfn.random.key(0), 5)]
        >>> states = torchfn.tree.stack(members)
        >>> step = ensemble_step(torchfn.make_train_step(loss_fn, opt))
        >>> batch = (random.normal(random.key(2), (8, 3)), random.normal(random.key(3), (8, 1)))
        >>> states, metrics = step(states, batch)
        >>> metrics["loss"].shape
        torch.Size([5])
    """
    if not callable(step):
        raise TypeError(f"step must be callable, got {type(step).__name__}")
    if not isinstance(split_batch, bool):
        raise TypeError(f"split_batch must be a bool, got {type(split_batch).__name__}")

    def stacked_step(states: Any, batch: Any) -> tuple[Any, Any]:
        n = ensemble_size(states, name="states")
        if split_batch:
            bad = [tuple(x.shape) for x in optree.tree_leaves(batch)
                   if not isinstance(x, Tensor) or x.dim() == 0 or x.shape[0] != n]
            if bad:
                raise ValueError(
                    f"batch: with split_batch=True every leaf needs a leading member dim of "
                    f"size {n}, got shapes {bad}"
                )
        # non-tensor leaves (None, Python numbers in a user's state) are not mapped
        state_dims = _tensor_dims(states)
        batch_dims = _tensor_dims(batch) if split_batch else None
        static: list[Any] = []  # the output's non-tensor leaves and structure

        def tensors_only(s: Any, b: Any) -> list[Tensor]:
            leaves, spec = torch_pytree.tree_flatten(step(s, b))
            static[:] = [spec, [_MAPPED if isinstance(x, Tensor) else x for x in leaves]]
            return [x for x in leaves if isinstance(x, Tensor)]

        mapped = iter(vmap(tensors_only, in_dims=(state_dims, batch_dims))(states, batch))
        spec, fixed = static
        leaves = [next(mapped) if x is _MAPPED else x for x in fixed]
        return torch_pytree.tree_unflatten(leaves, spec)

    return stacked_step
