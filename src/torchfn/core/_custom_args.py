"""The arguments of one ``custom_vjp`` / ``custom_jvp`` call, flattened for autograd.

An ``autograd.Function`` takes tensors; the user's function takes pytrees of
tensors and Python values, some of them static (``nondiff_argnums``). ``_Args``
splits one call into the tensor leaves that go through the Function and
everything else, rebuilds the arguments from (possibly transformed) tensors, and
checks the cotangents or tangents a user's rule returns against the primals,
naming the argument and the leaf when they disagree.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree


def is_float(x: Any) -> bool:
    """True for the tensors that carry derivatives (floating point or complex)."""
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


def _none_is_leaf(x: Any) -> bool:
    return x is None


def signature(fun: Callable) -> inspect.Signature | None:
    """``fun``'s signature, or None where Python cannot tell it."""
    try:
        return inspect.signature(fun)
    except (TypeError, ValueError):
        return None


def nondiff_positions(nondiff_argnums: Any, who: str) -> tuple[int, ...]:
    """Validate ``nondiff_argnums``: an int or a sequence of non-negative ints."""
    given = (nondiff_argnums,) if isinstance(nondiff_argnums, int) else nondiff_argnums
    if (isinstance(given, (str, bytes)) or not isinstance(given, Sequence)
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in given)):
        raise TypeError(f"{who}: nondiff_argnums must be an int or a sequence of ints, got "
                        f"{nondiff_argnums!r}")
    positions = tuple(sorted(set(given)))
    if any(i < 0 for i in positions):
        raise ValueError(f"{who}: nondiff_argnums must be non-negative, got {positions}")
    return positions


class _Args:
    """One call's arguments: static parts kept here, tensor leaves handed to autograd."""

    def __init__(self, who: str, sig: inspect.Signature | None, nondiff: tuple[int, ...], args,
                 kwargs):
        self.who = who
        if sig is None:  # no signature to bind keywords with (a builtin): positional only
            if kwargs:
                raise TypeError(f"{who}: pass the arguments positionally")
            full, names = list(args), []
        elif kwargs or len(args) < len(sig.parameters):
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError as e:
                raise TypeError(f"{who}: {e}") from None
            bound.apply_defaults()
            if bound.kwargs:
                raise TypeError(
                    f"{who}: keyword-only arguments {sorted(bound.kwargs)} are not supported; "
                    "make them positional (or nondiff_argnums for static values)"
                )
            full, names = list(bound.args), list(sig.parameters)
        else:
            full, names = list(args), list(sig.parameters)
        if nondiff and nondiff[-1] >= len(full):
            raise ValueError(
                f"{who}: nondiff_argnums={nondiff} but the call has {len(full)} arguments"
            )
        for i in nondiff:
            if any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(full[i])):
                raise TypeError(
                    f"{who}: argument {i} ({names[i]!r}) is in nondiff_argnums but holds a "
                    "tensor; pass tensors as ordinary arguments (give them a None cotangent) "
                    "and keep nondiff_argnums for static values such as functions"
                )
        self.nondiff = nondiff
        self.nondiff_args = tuple(full[i] for i in nondiff)
        self.full = full
        self.diff_pos = [i for i in range(len(full)) if i not in nondiff]
        self.diff_names = [names[i] if i < len(names) else f"#{i}" for i in self.diff_pos]
        diff = tuple(full[i] for i in self.diff_pos)
        self.diff = diff
        leaves, self.treedef = pytree.tree_flatten(diff)
        self.tensor_idx = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        self.static = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        self.tensors = [leaves[i] for i in self.tensor_idx]
        self.float_mask = [is_float(t) for t in self.tensors]

    # -- rebuilding ------------------------------------------------------------
    def diff_args(self, tensors: Sequence[Any]) -> tuple[Any, ...]:
        """The differentiable arguments with ``tensors`` in the tensor slots."""
        leaves = list(self.static)
        for i, t in zip(self.tensor_idx, tensors):
            leaves[i] = t
        return pytree.tree_unflatten(leaves, self.treedef)

    def call_args(self, tensors: Sequence[Any]) -> list[Any]:
        """All positional arguments, static ones in place."""
        full = list(self.full)
        for pos, arg in zip(self.diff_pos, self.diff_args(tensors)):
            full[pos] = arg
        return full

    def tangent_args(self, tangents: Sequence[Any]) -> tuple[Any, ...]:
        """Differentiable arguments' structure with tangents in the float slots, None elsewhere."""
        leaves = [None] * len(self.static)
        for i, t, f in zip(self.tensor_idx, tangents, self.float_mask):
            leaves[i] = t if f else None
        return pytree.tree_unflatten(leaves, self.treedef)

    # -- checking a rule's per-argument result -----------------------------------
    def per_arg(self, result: Any, primals: Sequence[torch.Tensor], what: str) -> list[Any]:
        """Flatten a rule's tuple of per-argument values onto the tensor leaves.

        ``result`` holds one entry per differentiable argument, each with that
        argument's structure (or None for all zeros). Returns a list aligned with
        the tensor leaves: a tensor of the primal's shape and dtype for float
        leaves, None for zeros and for leaves that carry no derivative.
        """
        n = len(self.diff_pos)
        if not isinstance(result, (tuple, list)) or len(result) != n:
            got = (f"a {type(result).__name__} of length {len(result)}"
                   if isinstance(result, (tuple, list)) else type(result).__name__)
            raise TypeError(
                f"{self.who}: {what} must return a tuple with one entry per differentiable "
                f"argument ({n}: {self.diff_names}), got {got}"
            )
        flat: list[Any] = []
        for name, arg, val in zip(self.diff_names, self.diff, result):
            arg_paths, arg_spec = pytree.tree_flatten_with_path(arg, is_leaf=_none_is_leaf)
            if val is None:
                flat.extend([None] * len(arg_paths))
                continue
            vals, val_spec = pytree.tree_flatten(val, is_leaf=_none_is_leaf)
            if val_spec != arg_spec:
                raise TypeError(
                    f"{self.who}: {what}'s entry for argument {name!r} must have the "
                    f"argument's structure {arg_spec}, got {val_spec}"
                )
            flat.extend(vals)
        # keep the tensor leaves only, checking float ones against their primal
        leaf_vals = [flat[i] for i in self.tensor_idx]
        out: list[Any] = []
        paths = self._tensor_paths()
        for path, primal, f, v in zip(paths, primals, self.float_mask, leaf_vals):
            if not f or v is None:
                out.append(None)
                continue
            if not isinstance(v, torch.Tensor):
                raise TypeError(
                    f"{self.who}: {what} gave a {type(v).__name__} for {path}; expected a tensor "
                    f"of shape {tuple(primal.shape)} or None"
                )
            if v.shape != primal.shape:
                raise ValueError(
                    f"{self.who}: {what} gave shape {tuple(v.shape)} for {path}, expected the "
                    f"primal's shape {tuple(primal.shape)}"
                )
            out.append(v.to(primal.dtype))
        return out

    def _tensor_paths(self) -> list[str]:
        paths: list[str] = []
        for name, arg in zip(self.diff_names, self.diff):
            for path, leaf in pytree.tree_flatten_with_path(arg)[0]:
                if isinstance(leaf, torch.Tensor):
                    at = f" at {pytree.keystr(path)}" if path else ""
                    paths.append(f"argument {name!r}{at}")
        return paths


class Outputs:
    """The structure of a function's output, filled by the Function's forward."""

    def __init__(self, who: str, what: str):
        self.who, self.what = who, what
        self.treedef = None
        self.n = 0
        self.meta: list[tuple[torch.Size, torch.dtype, torch.device]] = []

    def flatten(self, out: Any) -> list[torch.Tensor]:
        leaves, treedef = pytree.tree_flatten(out)
        for path, leaf in pytree.tree_flatten_with_path(out)[0]:
            if not isinstance(leaf, torch.Tensor):
                where = f" at {pytree.keystr(path)}" if path else ""
                raise TypeError(
                    f"{self.who}: {self.what} must return tensors (in any pytree), got a "
                    f"{type(leaf).__name__}{where}"
                )
        self.treedef, self.n = treedef, len(leaves)
        return leaves

    def float_positions(self) -> list[int]:
        """Which output leaves carry derivatives."""
        return [i for i, (_, dtype, _) in enumerate(self.meta)
                if dtype.is_floating_point or dtype.is_complex]

    def unflatten(self, leaves: Sequence[Any]) -> Any:
        return pytree.tree_unflatten(list(leaves), self.treedef)

    def zeros(self, grads: Sequence[Any], like: Sequence[Any] | None = None) -> list[Any]:
        """Fill None (unused) output gradients with zeros of the output's shape."""
        out = []
        for g, (shape, dtype, device) in zip(grads, self.meta):
            if g is None and (dtype.is_floating_point or dtype.is_complex):
                g = torch.zeros(shape, dtype=dtype, device=device)
            out.append(g)
        return out

    def check(self, tangent: Any, primal_meta, what: str) -> list[Any]:
        """A rule's output-structured value as a flat list (None leaves as zeros)."""
        vals, spec = pytree.tree_flatten(tangent, is_leaf=_none_is_leaf)
        if spec != self.treedef:
            raise TypeError(
                f"{self.who}: {what} must have the output's structure {self.treedef}, got {spec}"
            )
        out = []
        for i, (v, (shape, dtype, device)) in enumerate(zip(vals, primal_meta)):
            if v is None:
                v = torch.zeros(shape, dtype=dtype, device=device)
            elif not isinstance(v, torch.Tensor):
                raise TypeError(f"{self.who}: {what} gave a {type(v).__name__} for output leaf {i}")
            elif v.shape != shape:
                raise ValueError(
                    f"{self.who}: {what} gave shape {tuple(v.shape)} for output leaf {i}, "
                    f"expected the output's shape {tuple(shape)}"
                )
            out.append(v.to(dtype))
        return out


EAGER = object()  # from choose_function: run the call eagerly, hidden from dynamo


def choose_function(tensors: Sequence[torch.Tensor], eager_fn, compiled_fn):
    """Which way to run a custom-rule call: a Function class, ``None`` (call ``fun``
    itself: nothing differentiates) or ``EAGER`` (rerun the call via ``eager_call``)."""
    if torch.compiler.is_compiling():
        if torch._C._functorch.maybe_current_level() is not None:
            # inside a torch.func transform dynamo drops a Function's own backward and jvp
            # (pytorch#193279, #192985): run the call eagerly (a graph break)
            return EAGER
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
            return None
        return compiled_fn
    return None if nothing_differentiates(tensors) else eager_fn


@torch._disable_dynamo
def eager_call(f: Callable, args, kwargs) -> Any:
    """``f(*args, **kwargs)`` hidden from dynamo (``torch.compiler.disable`` would import it)."""
    return f(*args, **kwargs)


def nothing_differentiates(tensors: Sequence[torch.Tensor]) -> bool:
    """True in plain eager code where no transform and no autograd can see the call."""
    if torch.compiler.is_compiling():
        return False
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    import torch.autograd.forward_ad as fwAD

    if fwAD._current_level >= 0:
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def fresh(outs: Sequence[Any], inputs: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    """Copy the outputs that are inputs or views.

    An output that aliases an input gets that input's tangent added by forward-mode
    view tracking under ``vmap`` (so ``jacfwd`` would be off by the identity), and
    autograd cannot save an input returned as-is.
    """
    ids = {id(t) for t in inputs}
    views = not torch.compiler.is_compiling()  # no forward mode under compile
    return tuple(
        o.clone() if isinstance(o, torch.Tensor) and (id(o) in ids or views and o._is_view())
        else o
        for o in outs
    )
