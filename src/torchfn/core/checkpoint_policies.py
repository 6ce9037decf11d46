"""What ``remat(fn, policy=...)`` keeps from the forward (``jax.checkpoint_policies``).

A policy is a function ``policy(op, *args, **kwargs) -> bool`` asked about each
op ``fn`` runs in the forward: ``True`` keeps the op's outputs, so the backward's
recomputation reuses them instead of running the op again. ``op`` is an aten
``OpOverload`` (``torch.ops.aten.mm.default``) and ``args`` are the tensors it
ran on, as they are physically: under ``vmap`` they carry the batch dim, and a
per-example matrix product may run as one ``mm`` or ``bmm``. Values marked with
``checkpoint_name(x, name)`` are asked about too, as ``policy(checkpoint_name,
x, name=name)``; keeping one keeps the op that made it.

Saving matrix products (``dots_saveable``) is the usual choice: the backward
then recomputes only the cheap elementwise ops and normalisations between them,
while the large activations those ops make are not kept.

A policy has a fixed cost per op: the forward is recorded under ``vjp`` and both it
and the recomputation pass every op through a Python dispatch mode (about 10 µs an
op on a CPU). On a 2-core CPU, on eight MLP blocks of width 256 and hidden 1024
``dots_saveable`` took 0.85x the time of plain remat; on a Transformer of width 32 it
took 1.4x, since the ops it skips are tiny there (``bench/RESULTS.md``).

Example::

    >>> import torch, torchfn
    >>> from torchfn import checkpoint_policies as cp
    >>> def block(w, x):                              # x: (B, D), w: (D, D)
    ...     return torch.tanh(x @ w) @ w
    >>> fast = torchfn.remat(block, policy=cp.dots_saveable)
    >>> w, x = torch.eye(3), torch.ones(2, 3)
    >>> g = torch.func.grad(lambda w: fast(w, x).sum())(w)
    >>> torch.allclose(g, torch.func.grad(lambda w: block(w, x).sum())(w))
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = [
    "checkpoint_dots",
    "checkpoint_dots_with_no_batch_dims",
    "checkpoint_name",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "everything_saveable",
    "nothing_saveable",
    "save_any_names_but_these",
    "save_anything_except_these_names",
    "save_from_both_policies",
    "save_only_these_names",
    "save_these_ops",
]

Policy = Callable[..., bool]

_aten = torch.ops.aten
# matrix products that contract without a batch dim (JAX's dot_general without batch dims)
_DOTS_NO_BATCH = frozenset({
    _aten.mm.default, _aten.addmm.default, _aten.mv.default, _aten.addmv.default,
    _aten.dot.default, _aten.vdot.default,
})
_DOTS = _DOTS_NO_BATCH | {
    _aten.bmm.default, _aten.baddbmm.default, _aten.addbmm.default,
    _aten.convolution.default, _aten._convolution.default,
}


def checkpoint_name(x: Any, name: str) -> Any:
    """Mark ``x`` (a tensor or pytree of tensors) as ``name`` for a remat policy.

    Returns ``x`` unchanged. Inside ``remat(fn, policy=...)`` the policy is asked
    ``policy(checkpoint_name, x, name=name)``; if it says yes, the op that made
    ``x`` is not recomputed in the backward. Outside ``remat`` (or under
    ``torch.compile``) it does nothing.

    Example::

        >>> import torch, torchfn
        >>> from torchfn import checkpoint_policies as cp
        >>> def block(w, x):                          # x: (B, D), w: (D, D)
        ...     h = cp.checkpoint_name(x @ w, "proj")
        ...     return torch.tanh(h)
        >>> f = torchfn.remat(block, policy=cp.save_only_these_names("proj"))
        >>> f(torch.eye(2), torch.ones(1, 2))
        tensor([[0.7616, 0.7616]])
    """
    if not isinstance(name, str):
        raise TypeError(f"checkpoint_name: name must be a str, got {type(name).__name__}")
    if torch.compiler.is_compiling():
        return x
    from torchfn.core._remat_tape import active_record

    record = active_record()
    if record is not None:
        for leaf in pytree.tree_leaves(x):
            if isinstance(leaf, torch.Tensor):
                record.name(leaf, name)
    return x


def _policy(fn: Policy, *, uses_names: bool, unsaved: frozenset[str] = frozenset()) -> Policy:
    fn.uses_names = uses_names  # type: ignore[attr-defined]  # Record skips name bookkeeping
    fn.unsaved_names = unsaved  # type: ignore[attr-defined]  # names that undo an op's save
    return fn


def everything_saveable(op: Any, *args: Any, **kwargs: Any) -> bool:
    """Keep everything: ``remat`` then runs ``fn`` as it is (no recomputation)."""
    return True


def nothing_saveable(op: Any, *args: Any, **kwargs: Any) -> bool:
    """Keep only the inputs and recompute everything (``remat``'s default)."""
    return False


def dots_saveable(op: Any, *args: Any, **kwargs: Any) -> bool:
    """Keep the outputs of matrix products and convolutions (mm, bmm, addmm, conv, ...)."""
    return op in _DOTS


def dots_with_no_batch_dims_saveable(op: Any, *args: Any, **kwargs: Any) -> bool:
    """Keep the outputs of matrix products without a batch dim (mm, addmm, mv, dot).

    ``x @ w`` with ``x`` of shape (B, N, D) and ``w`` of (D, E) runs as one ``mm`` and
    is kept; an attention's ``q @ k.T`` per head runs as ``bmm`` and is recomputed.
    """
    return op in _DOTS_NO_BATCH


checkpoint_dots = dots_saveable
checkpoint_dots_with_no_batch_dims = dots_with_no_batch_dims_saveable
for _p in (everything_saveable, nothing_saveable, dots_saveable, dots_with_no_batch_dims_saveable):
    _policy(_p, uses_names=False)


def _names(fn_name: str, names: tuple) -> frozenset[str]:
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"{fn_name}: names must be str, got {type(n).__name__} {n!r}")
    return frozenset(names)


def save_only_these_names(*names: str) -> Policy:
    """Keep only the values marked ``checkpoint_name(x, n)`` with ``n`` in ``names``."""
    keep = _names("save_only_these_names", names)

    def policy(op: Any, *args: Any, name: str | None = None, **kwargs: Any) -> bool:
        return op is checkpoint_name and name in keep

    return _policy(policy, uses_names=True)


def save_any_names_but_these(*names: str) -> Policy:
    """Keep every named value except those named in ``names``; nothing unnamed."""
    skip = _names("save_any_names_but_these", names)

    def policy(op: Any, *args: Any, name: str | None = None, **kwargs: Any) -> bool:
        return op is checkpoint_name and name not in skip

    return _policy(policy, uses_names=True)


def save_anything_except_these_names(*names: str) -> Policy:
    """Keep every op's outputs except the values named in ``names``, which are
    recomputed: keep all but the large attention probabilities, say."""
    skip = _names("save_anything_except_these_names", names)

    def policy(op: Any, *args: Any, name: str | None = None, **kwargs: Any) -> bool:
        return op is not checkpoint_name or name not in skip

    return _policy(policy, uses_names=True, unsaved=skip)


def save_these_ops(*ops: Any) -> Policy:
    """Keep the outputs of the given aten ops (``torch.ops.aten.mm`` or one overload,
    ``torch.ops.aten.mm.default``). Not in JAX; PyTorch's selective checkpointing
    takes the same list."""
    overloads, packets = set(), set()
    for op in ops:
        if isinstance(op, torch._ops.OpOverload):
            overloads.add(op)
        elif isinstance(op, torch._ops.OpOverloadPacket):
            packets.add(op)
        else:
            raise TypeError(
                "save_these_ops: each op must be an aten op such as torch.ops.aten.mm or "
                f"torch.ops.aten.mm.default, got {type(op).__name__} {op!r}"
            )

    def policy(op: Any, *args: Any, **kwargs: Any) -> bool:
        return op in overloads or getattr(op, "overloadpacket", None) in packets

    return _policy(policy, uses_names=False)


def save_from_both_policies(policy_1: Policy, policy_2: Policy) -> Policy:
    """Keep what either policy keeps."""
    for arg, p in (("policy_1", policy_1), ("policy_2", policy_2)):
        if not callable(p):
            raise TypeError(f"save_from_both_policies: {arg} must be a policy "
                            f"(a callable), got {type(p).__name__}")

    def policy(op: Any, *args: Any, **kwargs: Any) -> bool:
        return bool(policy_1(op, *args, **kwargs) or policy_2(op, *args, **kwargs))

    unsaved = _unsaved(policy_1) & _unsaved(policy_2)  # undone only if both would drop it
    return _policy(policy, uses_names=_uses_names(policy_1) or _uses_names(policy_2),
                   unsaved=unsaved)


def _uses_names(policy: Policy) -> bool:
    return getattr(policy, "uses_names", True)


def _unsaved(policy: Policy) -> frozenset[str]:
    return getattr(policy, "unsaved_names", frozenset())


def policy_names(policy: Policy) -> tuple[bool, frozenset[str]]:
    """(whether ``policy`` looks at names, the names whose ops it will not keep)."""
    return _uses_names(policy), _unsaved(policy)
