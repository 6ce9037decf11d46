"""``jax.custom_vjp`` for PyTorch: a function with its own reverse-mode rule.

PyTorch's answer is an ``autograd.Function``; to work under ``torch.func`` it
needs a ``setup_context``, a vmap rule and, for ``jvp``, a second rule by hand.
``custom_vjp`` takes JAX's two functions instead and builds that Function:

- ``fwd(*args) -> (out, residuals)`` runs in the forward pass;
- ``bwd(residuals, g) -> cotangents`` (one entry per argument) in the backward.

How each transform sees it (JAX's semantics, plus forward mode):

- ``grad`` / ``vjp`` / ``jacrev`` / ``loss.backward()`` call ``bwd``.
- ``vmap`` runs ``fwd`` and ``bwd`` batched (``generate_vmap_rule``), so
  per-example gradients need nothing more.
- Higher order differentiates ``bwd``'s ops and, through the residuals, ``fwd``'s:
  the residuals are the Function's outputs, and a cotangent reaching them is
  pulled back through ``fwd`` (recomputed only then).
- ``jvp`` / ``jacfwd`` / ``hessian``: JAX refuses forward mode here. ``bwd`` is
  linear in ``g``, so its transpose is the Jacobian-vector product; torchfn
  transposes it with ``torch.func.vjp`` and gets forward mode from the same rule.
- ``torch.compile`` (``fullgraph=True`` too) traces ``fwd`` and ``bwd``. ``fwd`` is
  traced twice there, once to learn its output structure outside the Function (dynamo
  refuses a Function that changes an outside object); the unused copy is dropped. A
  ``fwd`` that dynamo cannot trace (a solver loop that reads values) would then run
  twice: give ``traceable_fwd=False`` and it runs once, eagerly (not ``fullgraph``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from torchfn.core._captures import no_captured_grads
from torchfn.core._custom_args import (
    EAGER,
    Outputs,
    _Args,
    choose_function,
    eager_call,
    fresh,
    is_float,
    nondiff_positions,
    signature,
)

__all__ = ["custom_vjp"]


# the static residual leaves mark a tensor's slot by where it comes from:
_RES = object()  # an extra Function output (after the primal outputs)
_ARG = object()  # (_ARG, i): the i-th tensor argument
_OUTPUT = object()  # (_OUTPUT, j): the j-th primal output leaf


class _Call:
    """One call of a ``custom_vjp`` function: its arguments and its rules."""

    def __init__(self, f: custom_vjp, args: _Args):
        self.f, self.args = f, args
        self.who = f"custom_vjp({f.__name__})"
        self.out = Outputs(self.who, "fwd's first output")
        self.res_treedef = None
        self.res_static: list[Any] = []  # static leaves; _RES, (_ARG, i), (_OUTPUT, j) for tensors
        self.saved_outputs: list[int] = []  # primal output leaves that are also residuals
        self.res_float: list[bool] = []  # which tensor residuals carry derivatives

    def run_fwd(self, tensors) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """fwd's output leaves, and the tensor residuals that are not arguments."""
        result = self.f.fwd(*self.args.call_args(tensors))
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(f"{self.who}: fwd must return a pair (out, residuals), got "
                            f"{type(result).__name__}")
        out, res = result
        if self.res_treedef is not None:  # the structure is known: change nothing (dynamo
            # refuses a Function's forward that mutates an object from outside it)
            res_leaves = pytree.tree_flatten(res)[0]
            return (pytree.tree_flatten(out)[0],
                    [r for r, s in zip(res_leaves, self.res_static) if s is _RES])
        out_leaves = self.out.flatten(out)
        res_leaves, self.res_treedef = pytree.tree_flatten(res)
        # A residual that is an argument is saved as that argument, and one that is an
        # output as that output (so a cotangent reaching it at second order goes
        # through bwd, not through fwd's ops); the others are returned as extra outputs.
        arg_at = {id(t): i for i, t in enumerate(tensors)}
        out_at = {id(o): j for j, o in enumerate(out_leaves)}
        self.res_static = [
            r if not isinstance(r, torch.Tensor)
            else (_ARG, arg_at[id(r)]) if id(r) in arg_at
            else (_OUTPUT, out_at[id(r)]) if id(r) in out_at
            else _RES
            for r in res_leaves
        ]
        self.saved_outputs = sorted({s[1] for s in self.res_static if _slot(s) is _OUTPUT})
        res_out = [r for r, s in zip(res_leaves, self.res_static) if s is _RES]
        self.res_float = [is_float(r) for r in res_out]
        return out_leaves, res_out

    def residuals(self, tensors, res_out, outputs) -> Any:
        """fwd's residuals, from the saved arguments, extra outputs and primal outputs."""
        it = iter(res_out)
        out_of = dict(zip(self.saved_outputs, outputs))
        leaves = [next(it) if s is _RES else tensors[s[1]] if _slot(s) is _ARG
                  else out_of[s[1]] if _slot(s) is _OUTPUT else s
                  for s in self.res_static]
        return pytree.tree_unflatten(leaves, self.res_treedef)

    def cotangents(self, tensors, res_out, outputs, g_out) -> list[Any]:
        """``bwd``'s cotangents, flat and aligned with the tensor arguments."""
        g = self.out.unflatten(g_out)
        res = self.residuals(tensors, res_out, outputs)
        cts = self.f.bwd(*self.args.nondiff_args, res, g)
        return self.args.per_arg(cts, tensors, "bwd")

    def split_saved(self, saved) -> tuple[Any, Any, Any]:
        """(arguments, extra residual outputs, saved primal outputs)."""
        n_in, n_res = len(self.args.tensors), len(self.res_float)
        return saved[:n_in], saved[n_in:n_in + n_res], saved[n_in + n_res:]

    def float_residuals(self, tensors) -> tuple[torch.Tensor, ...]:
        """fwd's returned float residuals as a function of the arguments."""
        _, res = self.run_fwd(tensors)
        return tuple(r for r, f in zip(res, self.res_float) if f)


def _slot(s: Any) -> Any:
    """_ARG or _OUTPUT for a residual saved as an argument or an output, else None."""
    # identity, not `in`: dynamo cannot compare plain objects with ==
    return s[0] if isinstance(s, tuple) and len(s) == 2 and (s[0] is _ARG or s[0] is _OUTPUT) \
        else None


class _CustomVJP(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(call: _Call, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with no_captured_grads(call.who, tensors):
            out, res = call.run_fwd(tensors)
        return fresh((*out, *res), tensors)

    @staticmethod
    def setup_context(ctx, inputs, output):
        call, *tensors = inputs
        n = call.out.n
        ctx.call = call
        ctx.set_materialize_grads(False)
        call.out.meta = [(o.shape, o.dtype, o.device) for o in output[:n]]
        ctx.mark_non_differentiable(*[o for o in output if not is_float(o)])
        saved = (*tensors, *output[n:], *[output[j] for j in call.saved_outputs])
        ctx.save_for_backward(*saved)
        ctx.save_for_forward(*saved)

    @staticmethod
    def backward(ctx, *grads):
        call = ctx.call
        tensors, res, outputs = call.split_saved(ctx.saved_tensors)
        g_out = call.out.zeros(grads[: call.out.n])
        cts = call.cotangents(tensors, res, outputs, g_out)
        g_res = [g for g, f in zip(grads[call.out.n:], call.res_float) if f]
        if any(g is not None for g in g_res):
            # a cotangent on the residuals (higher order): pull it back through fwd
            cts = _add(cts, _through_residuals(call, tensors, g_res))
        return (None, *cts)

    @staticmethod
    def jvp(ctx, _call_tangent, *tangents):
        call = ctx.call
        tensors, res, outputs = call.split_saved(ctx.saved_tensors)
        mask = call.args.float_mask
        floats = [t for t, f in zip(tensors, mask) if f]
        t_in = [torch.zeros_like(x) if t is None else t
                for x, t, f in zip(tensors, tangents, mask) if f]
        out_float = call.out.float_positions()
        if call.f.jvp_rule is not None:  # the user's forward-mode rule
            it = iter(t_in)
            full = [next(it) if f else None for f in mask]
            t_out = call.f.jvp_rule(*call.args.nondiff_args, call.residuals(tensors, res, outputs),
                                    call.args.tangent_args(full))
            t_all = call.out.check(t_out, call.out.meta, "the jvp rule")
            t_res = _residual_tangents(call, tensors, floats, t_in, len(res))
            return (*[t_all[i] if i in out_float else None for i in range(call.out.n)], *t_res)
        g0 = call.out.zeros([None] * call.out.n)

        def ct_map(*g):  # linear in g: out cotangent -> input cotangents
            full = list(g0)
            for i, gi in zip(out_float, g):
                full[i] = gi
            cts = call.cotangents(tensors, res, outputs, full)
            return tuple(torch.zeros_like(x) if c is None else c
                         for x, c, f in zip(tensors, cts, mask) if f)

        _, pull = torch.func.vjp(ct_map, *[g0[i] for i in out_float])
        t_out_float = pull(tuple(t_in))  # the transpose of bwd: J @ t
        t_out: list[Any] = [None] * call.out.n
        for i, t in zip(out_float, t_out_float):
            t_out[i] = t
        return (*t_out, *_residual_tangents(call, tensors, floats, t_in, len(res)))


def _residual_tangents(call: _Call, tensors, floats, t_in, n_res: int) -> list[Any]:
    """Tangents of fwd's extra residual outputs, by forward mode through fwd."""
    if not any(call.res_float):
        return [None] * n_res
    mask = call.args.float_mask

    def res_map(*x):
        it = iter(x)
        return call.float_residuals([next(it) if f else t for t, f in zip(tensors, mask)])

    _, t_res_float = torch.func.jvp(res_map, tuple(floats), tuple(t_in))
    it = iter(t_res_float)
    return [next(it) if f else None for f in call.res_float]


class _CustomVJPCompiled(torch.autograd.Function):
    """``_CustomVJP`` without ``jvp``, for ``torch.compile``: dynamo refuses a Function with one."""

    generate_vmap_rule = True
    forward = staticmethod(_CustomVJP.forward)
    setup_context = staticmethod(_CustomVJP.setup_context)
    backward = staticmethod(_CustomVJP.backward)


def _through_residuals(call: _Call, tensors, g_res) -> list[Any]:
    mask = call.args.float_mask
    floats = [t for t, f in zip(tensors, mask) if f]

    def res_map(*x):
        it = iter(x)
        return call.float_residuals([next(it) if f else t for t, f in zip(tensors, mask)])

    res, pull = torch.func.vjp(res_map, *floats)
    cts = iter(pull(tuple(torch.zeros_like(r) if g is None else g for g, r in zip(g_res, res))))
    return [next(cts) if f else None for f in mask]


def _add(a: list[Any], b: list[Any]) -> list[Any]:
    return [y if x is None else x if y is None else x + y for x, y in zip(a, b)]


class custom_vjp:
    """Give ``fun`` its own reverse-mode rule, as ``jax.custom_vjp``.

    Decorate ``fun``, then call ``fun.defvjp(fwd, bwd)``:

    - ``fwd(*args)`` returns ``(out, residuals)``: ``fun``'s output and any pytree
      of values the backward needs.
    - ``bwd(*nondiff_args, residuals, g)`` gets the cotangent ``g`` of ``out`` (same
      structure) and returns a tuple with one entry per differentiable argument,
      each with that argument's structure; ``None`` (for a whole argument or one
      leaf) means zero. Leaves that are not floating-point tensors get no gradient
      whatever ``bwd`` returns for them.

    Arguments may be any pytrees of tensors and Python values. ``nondiff_argnums``
    names static arguments (functions, flags) that hold no tensors; they are passed
    to ``fwd`` in place and to ``bwd`` first. In plain eager code, where nothing
    differentiates, ``fun`` itself runs; otherwise ``fwd``'s output is the result.
    Under ``vmap``, ``fwd`` and ``bwd`` see one example. Forward mode (``jvp``,
    ``jacfwd``, ``hessian``) uses the transpose of ``bwd``, so ``bwd`` must be linear
    in ``g`` (it always is when it is a derivative). Every tensor ``fwd`` uses that
    is being differentiated must be an argument: a closure over such a tensor
    raises ``ValueError``, since it would get no gradient.

    Example (clip the gradient, not the value)::

        >>> import torch, torchfn
        >>> @torchfn.custom_vjp
        ... def clip_gradient(x, bound):           # x: any shape; bound: float
        ...     return x
        >>> def fwd(x, bound):
        ...     return x, bound
        >>> def bwd(bound, g):
        ...     return (g.clamp(-bound, bound), None)
        >>> clip_gradient.defvjp(fwd, bwd)
        >>> x = torch.tensor([1.0, 2.0])
        >>> torch.func.grad(lambda x: (10 * clip_gradient(x, 3.0)).sum())(x)
        tensor([3., 3.])
    """

    def __init__(self, fun: Callable, nondiff_argnums: int | tuple[int, ...] = (), *,
                 traceable_fwd: bool = True):
        if not callable(fun):
            raise TypeError(f"custom_vjp: fun must be callable, got {type(fun).__name__}")
        if not isinstance(traceable_fwd, bool):
            raise TypeError(f"custom_vjp: traceable_fwd must be a bool, got {traceable_fwd!r}")
        self.traceable_fwd = traceable_fwd
        functools.update_wrapper(self, fun)
        self.fun = fun
        self.__name__ = getattr(fun, "__name__", type(fun).__name__)
        self.nondiff_argnums = nondiff_positions(nondiff_argnums, f"custom_vjp({self.__name__})")
        self._sig = signature(fun)
        self.fwd: Callable | None = None
        self.bwd: Callable | None = None
        self.jvp_rule: Callable | None = None

    def defvjp(self, fwd: Callable, bwd: Callable, *, jvp: Callable | None = None) -> None:
        """Set ``fwd(*args) -> (out, residuals)`` and ``bwd(residuals, g)``.

        ``jvp(*nondiff_args, residuals, tangents) -> tangent_out`` optionally gives
        forward mode its own rule instead of ``bwd``'s transpose, for a ``bwd`` that
        is not linear in ``g`` as written (an iterative solve that stops on a
        tolerance) or a cheaper forward rule. ``tangents`` holds one entry per
        differentiable argument (``None`` for leaves that are not floating point);
        ``tangent_out`` has the output's structure.
        """
        for name, rule in (("fwd", fwd), ("bwd", bwd), ("jvp", jvp)):
            if not callable(rule) and not (name == "jvp" and rule is None):
                raise TypeError(f"custom_vjp({self.__name__}).defvjp: {name} must be callable, "
                                f"got {type(rule).__name__}")
        self.fwd, self.bwd, self.jvp_rule = fwd, bwd, jvp

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.fwd is None:
            raise TypeError(f"custom_vjp({self.__name__}): call {self.__name__}.defvjp(fwd, bwd) "
                            "before calling it")
        bound = _Args(f"custom_vjp({self.__name__})", self._sig, self.nondiff_argnums, args, kwargs)
        fn = choose_function(bound.tensors, _CustomVJP, _CustomVJPCompiled)
        if fn is EAGER:
            return eager_call(self, args, kwargs)
        if fn is None:
            return self.fun(*bound.full)
        call = _Call(self, bound)
        if fn is _CustomVJPCompiled and self.traceable_fwd:  # learn fwd's structure outside
            # the traced Function (an untraceable fwd would run twice, for real)
            with torch.no_grad():  # (its ops are unused there, and inductor drops them)
                call.run_fwd(bound.tensors)
        out = fn.apply(call, *bound.tensors)
        return call.out.unflatten(out[: call.out.n])
