"""Rematerialisation (gradient checkpointing) that composes with ``torch.func``.

``torch.utils.checkpoint`` relies on saved-tensor hooks, which ``torch.func``
transforms reject ("don't yet support saved tensor hooks"). ``remat`` is an
``autograd.Function`` instead: its forward runs ``fn`` without recording a graph
and saves only the inputs; its backward recomputes ``fn`` at a ``torch.func``
grad level of its own and pulls the cotangents back there (``_pullback``).
Because the backward is made of ordinary differentiable ops it works under
``grad``, ``vmap(grad)``, grad-of-grad, ``jacrev``, ``jvp`` and ``hessian``, and
remats nest; under ``torch.compile`` the compiler's own rematerialisation takes
over.

With a ``policy`` (``torchfn.checkpoint_policies``) the forward also keeps the
outputs of the ops the policy names, and the recomputation reuses them instead of
running those ops again (``_remat_tape``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.utils._pytree as pytree

from torchfn.core import checkpoint_policies
from torchfn.core._captures import no_captured_grads
from torchfn.core._dropout import forward_ad_active
from torchfn.core._remat_tape import Record, Replay

__all__ = ["remat"]

F = TypeVar("F", bound=Callable[..., Any])


def _is_diff(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


def _pullback(f, primals, cotangents) -> tuple[torch.Tensor, ...]:
    """``torch.func.vjp(f, *primals)[1](cotangents)``, pulled back inside the level
    ``f`` ran at: ``vjp``'s ``vjp_fn`` runs after the level is gone, where the
    backward of a remat nested in ``f`` finds its saved tensors dead ("escaped?").
    As ``vjp_fn``, it records a graph only when the caller's backward does
    (``create_graph``, or an outer ``torch.func`` transform)."""
    from torch._functorch import eager_transforms as et

    create_graph = torch.is_grad_enabled()
    with et.grad_increment_nesting() as level, torch.enable_grad():
        primals = [et._create_differentiable(et._wrap_all_tensors(p, level), level)
                   for p in primals]
        outs = f(*primals)
        grads = et._autograd_grad(outs, primals, cotangents, create_graph=create_graph)
        return et._undo_create_differentiable(grads, level)


class _Call:
    """Everything about one call that is not a tensor input."""

    def __init__(self, fn, treedef, leaves, tensor_idx, diff_mask, policy):
        self.fn = fn
        self.policy = policy  # None: save nothing but the inputs
        self.record: Record | None = None  # what the forward kept, for the policy
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

    def forward(self, *tensors):
        """Run ``fn``; with a policy, keep what it asks for."""
        if self.policy is None:
            return self.run(*tensors)
        # under vjp, as the recomputation will be: code that branches on whether
        # grad is needed (SDPA's backend choice, fast no-grad paths) then runs the
        # same ops both times
        f, diff = self.differentiable(tensors, replay=False)
        record = Record(self.policy)
        with record:
            out = torch.func.vjp(f, *diff)[0] if diff else self.run(*tensors)
        record.finish()
        self.record = record
        return out

    def recompute(self, *tensors):
        """Run ``fn`` again, reusing what the forward kept, once: the kept values are
        let go as the backward moves on, as autograd frees saved tensors (a second
        backward through a retained graph recomputes everything). Not under
        forward-mode AD: its tangent ops would run between the recorded ones."""
        record, self.record = self.record, None
        if record is None or forward_ad_active():
            return self.run(*tensors)
        with Replay(record):
            return self.run(*tensors)

    def differentiable(self, tensors, *, replay=True):
        """``fn`` as a function of the differentiated tensors alone, and those tensors."""
        mask = self.diff_mask
        run = self.recompute if replay else self.run

        def f(*d):
            it = iter(d)
            return run(*[next(it) if m else t for t, m in zip(tensors, mask)])

        return f, [t for t, m in zip(tensors, mask) if m]


class _Remat(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(call: _Call, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with no_captured_grads("remat", tensors):
            out = call.forward(*tensors)
        # an input passed through unchanged (a scan carry's parameters) goes out as a
        # view: autograd cannot save an input that is also returned as-is
        inputs = {id(t) for t in tensors}
        return tuple(o.view_as(o) if id(o) in inputs else o for o in out)

    @staticmethod
    def setup_context(ctx, inputs, output):
        call, *tensors = inputs
        ctx.call = call
        ctx.save_for_backward(*tensors)  # inputs only: activations are recomputed
        ctx.save_for_forward(*tensors)

    @staticmethod
    def backward(ctx, *cotangents):
        f, diff = ctx.call.differentiable(ctx.saved_tensors)
        grads = iter(_pullback(f, diff, cotangents))
        return (None, *[next(grads) if m else None for m in ctx.call.diff_mask])

    @staticmethod
    def jvp(ctx, _call, *tangents):
        # forward mode recomputes fn under jvp (the forward kept no activations)
        f, diff = ctx.call.differentiable(ctx.saved_tensors, replay=False)
        tangents = [
            torch.zeros_like(t) if dt is None else dt
            for t, dt, m in zip(ctx.saved_tensors, tangents, ctx.call.diff_mask) if m
        ]
        return torch.func.jvp(f, tuple(diff), tuple(tangents))[1]


def remat(fn: F | None = None, *, policy: Callable[..., bool] | None = None) -> F:
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

    ``policy`` (``jax.checkpoint``'s) chooses what else the forward keeps, from
    ``torchfn.checkpoint_policies``: with ``dots_saveable`` the outputs of matrix
    products and convolutions are kept, so the backward recomputes only the
    elementwise ops between them; ``save_only_these_names`` keeps the values
    marked with ``torchfn.checkpoint_name``. The default, ``nothing_saveable``,
    keeps the inputs alone; ``everything_saveable`` is no remat at all. Used as
    a decorator with a policy: ``@torchfn.remat(policy=...)``.

    Works under ``torch.func.grad``, ``vmap(grad)``, grad-of-grad, ``jacrev``,
    ``jvp``, ``jacfwd``, ``hessian``, ``torch.autograd.grad`` and
    ``torch.compile`` (``fullgraph=True`` too). Inside ``torch.compile`` it
    calls ``fn`` directly and ignores ``policy``: the compiler's partitioner
    decides what to save and what to recompute (trade memory for compute there
    with ``torch._functorch.config.activation_memory_budget``).

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
    if policy is not None and not callable(policy):
        raise TypeError(
            "remat: policy must be a function (op, *args, **kwargs) -> bool, such as "
            f"torchfn.checkpoint_policies.dots_saveable, got {type(policy).__name__}"
        )
    if fn is None:
        return functools.partial(remat, policy=policy)  # type: ignore[return-value]
    if not callable(fn):
        raise TypeError(f"remat: fn must be callable, got {type(fn).__name__}")
    if policy is checkpoint_policies.everything_saveable:
        return fn  # keep every activation: plain autograd
    if policy is checkpoint_policies.nothing_saveable:
        policy = None

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
        call = _Call(fn, treedef, rest, tensor_idx, [_is_diff(t) for t in tensors], policy)
        out = _Remat.apply(call, *tensors)
        return pytree.tree_unflatten(list(out), call.out_treedef)

    return wrapped  # type: ignore[return-value]
