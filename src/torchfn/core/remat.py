"""Rematerialisation (gradient checkpointing) that composes with ``torch.func``.

``torch.utils.checkpoint`` relies on saved-tensor hooks, which ``torch.func``
transforms reject ("don't yet support saved tensor hooks"). ``remat`` is an
``autograd.Function`` instead: its forward runs ``fn`` without recording a graph
and saves only the inputs; its backward recomputes ``fn`` under
``torch.func.vjp`` and pulls the cotangents back. Because the backward is made
of ordinary differentiable ops it works under ``grad``, ``vmap(grad)``,
grad-of-grad and ``jacrev``; under ``torch.compile`` the compiler's own
rematerialisation takes over.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.utils._pytree as pytree

from torchfn.core._captures import no_captured_grads

__all__ = ["remat"]

F = TypeVar("F", bound=Callable[..., Any])


def _is_diff(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


class _Call:
    """Everything about one call that is not a tensor input."""

    def __init__(self, fn, treedef, leaves, tensor_idx, diff_mask):
        self.fn = fn
        self.treedef = treedef  # structure of (args, kwargs)
        self.leaves = leaves  # non-tensor leaves; tensor slots hold None
        self.tensor_idx = tensor_idx  # positions of the tensor leaves
        self.diff_mask = diff_mask  # which tensor leaves are differentiated
        self.out_treedef = None  # filled by the first forward

    def run(self, *tensors):
        leaves = list(self.leaves)
        for i, t in zip(self.tensor_idx, tensors):
            leaves[i] = t
        args, kwargs = pytree.tree_unflatten(leaves, self.treedef)
        out = self.fn(*args, **kwargs)
        out_leaves, out_treedef = pytree.tree_flatten(out)
        if self.out_treedef is None:
            self.out_treedef = out_treedef
        for leaf in out_leaves:
            if not _is_diff(leaf):
                raise TypeError(
                    "remat: fn must return floating-point tensors (in any pytree), "
                    f"got a leaf of type {type(leaf).__name__}"
                    + (f" with dtype {leaf.dtype}" if isinstance(leaf, torch.Tensor) else "")
                )
        return tuple(out_leaves)


class _Remat(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(call: _Call, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with no_captured_grads("remat", tensors):
            out = call.run(*tensors)
        # an input passed through unchanged (a scan carry's parameters) goes out as a
        # view: autograd cannot save an input that is also returned as-is
        inputs = {id(t) for t in tensors}
        return tuple(o.view_as(o) if id(o) in inputs else o for o in out)

    @staticmethod
    def setup_context(ctx, inputs, output):
        call, *tensors = inputs
        ctx.call = call
        ctx.save_for_backward(*tensors)  # inputs only: activations are recomputed

    @staticmethod
    def backward(ctx, *cotangents):
        tensors = ctx.saved_tensors
        mask = ctx.call.diff_mask
        diff = [t for t, d in zip(tensors, mask) if d]

        def run_diff(*d):
            it = iter(d)
            return ctx.call.run(*[next(it) if m else t for t, m in zip(tensors, mask)])

        _, vjp_fn = torch.func.vjp(run_diff, *diff)
        grads = iter(vjp_fn(tuple(cotangents)))
        return (None, *[next(grads) if m else None for m in mask])


def remat(fn: F) -> F:
    """Wrap ``fn`` so its activations are recomputed in the backward pass.

    The wrapped function returns the same values and the same gradients as
    ``fn``, but autograd keeps only its inputs alive between forward and
    backward, trading one extra forward for memory. Wrap the repeated blocks
    of a deep model (a per-block checkpoint), not the whole loss: checkpointing
    the whole loss recomputes everything and saves nothing.

    ``fn`` takes any pytree of arguments (tensors, keys, Python values) and
    returns a pytree of floating-point tensors. Floating-point tensor leaves of
    the arguments are differentiated; other leaves (integer PRNG keys, ints,
    flags) pass through, so random ops keyed by an explicit key recompute
    identically. ``fn`` must be pure (no mutation, no global RNG), and every
    tensor it differentiates must be an argument: a closure over parameters
    (or an ``nn.Module``'s own weights) would get no gradient, so ``remat``
    raises ``ValueError`` when it sees one.

    Works under ``torch.func.grad``, ``vmap(grad)``, grad-of-grad, ``jacrev``,
    ``torch.autograd.grad`` and ``torch.compile`` (``fullgraph=True`` too).
    Inside ``torch.compile`` it calls ``fn`` directly: the compiler's
    partitioner decides what to save and what to recompute (trade memory for
    compute there with ``torch._functorch.config.activation_memory_budget``).

    Example::

        >>> import torch, torchfn
        >>> def block(w, x):                      # x: (B, D), w: (D, D)
        ...     return torch.tanh(x @ w)
        >>> block = torchfn.remat(block)
        >>> def loss(ws, x):
        ...     for w in ws:
        ...         x = block(w, x)
        ...     return x.square().mean()
        >>> ws = [torch.eye(4) * 0.5 for _ in range(3)]
        >>> g = torch.func.grad(loss)(ws, torch.ones(2, 4))
        >>> len(g), g[0].shape
        (3, torch.Size([4, 4]))
    """
    if not callable(fn):
        raise TypeError(f"remat: fn must be callable, got {type(fn).__name__}")

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            # Dynamo inlines a varargs autograd.Function's forward anyway; the
            # compiler's partitioner chooses what to recompute.
            return fn(*args, **kwargs)
        leaves, treedef = pytree.tree_flatten((args, kwargs))
        tensor_idx = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        tensors = [leaves[i] for i in tensor_idx]
        rest = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        call = _Call(fn, treedef, rest, tensor_idx, [_is_diff(t) for t in tensors])
        out = _Remat.apply(call, *tensors)
        return pytree.tree_unflatten(list(out), call.out_treedef)

    return wrapped  # type: ignore[return-value]
