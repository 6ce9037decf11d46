"""``jax.custom_jvp`` for PyTorch: a function with its own forward-mode rule.

One rule, ``jvp(primals, tangents) -> (out, tangent_out)``, serves both modes, as
in JAX: forward mode (``jvp``, ``jacfwd``, ``hessian``) calls it, and reverse mode
(``grad``, ``vjp``, ``jacrev``, ``loss.backward()``) uses its transpose, taken by
``torch.func.vjp`` with respect to the tangents (the rule is linear in them).
Higher order differentiates the rule's own ops; ``vmap`` runs it batched.

The usual reason to write one: a derivative that autodiff gets wrong or unstable
(``log1p(exp(x))`` at large x, ``sqrt`` at 0, a solver's output), or one cheaper
than autodiff's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

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

__all__ = ["custom_jvp"]


class _Call:
    """One call of a ``custom_jvp`` function."""

    def __init__(self, f: custom_jvp, args: _Args):
        self.f, self.args = f, args
        self.who = f"custom_jvp({f.__name__})"
        self.out = Outputs(self.who, "the function")

    def tangent_out(self, tensors, tangents) -> list[torch.Tensor]:
        """The rule's output tangent, flat; ``tangents`` holds one per float argument leaf."""
        it = iter(tangents)
        full = [next(it) if f else None for f in self.args.float_mask]
        result = self.f.jvp_rule(*self.args.nondiff_args, self.args.diff_args(tensors),
                                 self.args.tangent_args(full))
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(f"{self.who}: the jvp rule must return a pair (out, tangent_out), "
                            f"got {type(result).__name__}")
        return self.out.check(result[1], self.out.meta, "the jvp rule's tangent_out")


class _CustomJVP(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(call: _Call, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with no_captured_grads(call.who, tensors):
            out = call.f.fun(*call.args.call_args(tensors))
        return fresh(call.out.flatten(out), tensors)

    @staticmethod
    def setup_context(ctx, inputs, output):
        call, *tensors = inputs
        ctx.call = call
        ctx.set_materialize_grads(False)
        call.out.meta = [(o.shape, o.dtype, o.device) for o in output]
        ctx.mark_non_differentiable(*[o for o in output if not is_float(o)])
        ctx.save_for_backward(*tensors)
        ctx.save_for_forward(*tensors)

    @staticmethod
    def jvp(ctx, _call_tangent, *tangents):
        call = ctx.call
        tensors = ctx.saved_tensors
        t_in = [torch.zeros_like(x) if t is None else t
                for x, t, f in zip(tensors, tangents, call.args.float_mask) if f]
        t_out = call.tangent_out(tensors, t_in)
        return tuple(t if is_float(t) else None for t in t_out)

    @staticmethod
    def backward(ctx, *grads):
        call = ctx.call
        tensors = ctx.saved_tensors
        mask = call.args.float_mask
        floats = [x for x, f in zip(tensors, mask) if f]
        out_float = call.out.float_positions()

        def t_map(*t):  # linear in t: input tangents -> output tangents
            t_out = call.tangent_out(tensors, t)
            return tuple(t_out[i] for i in out_float)

        _, pull = torch.func.vjp(t_map, *[torch.zeros_like(x) for x in floats])
        g = call.out.zeros(grads)
        cts = iter(pull(tuple(g[i] for i in out_float)))  # the transpose of the rule
        return (None, *[next(cts) if f else None for f in mask])


class _CustomJVPCompiled(torch.autograd.Function):
    """``_CustomJVP`` without ``jvp``, for ``torch.compile``: dynamo refuses a Function with one."""

    generate_vmap_rule = True
    forward = staticmethod(_CustomJVP.forward)
    setup_context = staticmethod(_CustomJVP.setup_context)
    backward = staticmethod(_CustomJVP.backward)


class custom_jvp:
    """Give ``fun`` its own forward-mode rule, as ``jax.custom_jvp``; reverse mode follows.

    Decorate ``fun``, then set the rule with ``@fun.defjvp``:
    ``rule(*nondiff_args, primals, tangents) -> (out, tangent_out)``, where
    ``primals`` and ``tangents`` are tuples with one entry per differentiable
    argument (tangents have the arguments' structure; leaves that are not
    floating-point tensors get ``None``) and ``tangent_out`` has the output's
    structure (``None`` leaves mean zero). The rule must be linear in
    ``tangents``: reverse mode transposes it. Its ``out`` is not used (``fun``'s
    output is the result), so it may be ``None``. A rule may call the function
    itself, as in JAX, except under ``torch.compile(fullgraph=True)``: there the
    nested call breaks the graph, so call ``f.fun`` (the undecorated function).

    For elementwise rules, ``fun.defjvps(rule_0, rule_1, ...)`` takes one
    ``rule_i(t_i, out, *primals) -> tangent_out`` per argument (``None`` for an
    argument with no derivative) and sums them, as JAX's ``defjvps``.

    Arguments may be pytrees; ``nondiff_argnums`` as in :class:`custom_vjp`.
    Works under ``grad``, ``vmap``, ``jacrev``, ``jacfwd``, ``jvp``, ``hessian``,
    grad-of-grad and ``torch.compile``.

    Example (a softplus whose gradient is exact where autodiff's overflows)::

        >>> import torch, torchfn
        >>> @torchfn.custom_jvp
        ... def softplus(x):                        # x: any shape
        ...     return torch.log1p(torch.exp(-x.abs())) + x.clamp(min=0)
        >>> @softplus.defjvp
        ... def softplus_jvp(primals, tangents):
        ...     (x,), (t,) = primals, tangents
        ...     return softplus.fun(x), torch.sigmoid(x) * t
        >>> x = torch.tensor([-200.0, 0.0, 200.0])
        >>> torch.func.grad(lambda x: softplus(x).sum())(x)
        tensor([0.0000, 0.5000, 1.0000])
    """

    def __init__(self, fun: Callable, nondiff_argnums: int | tuple[int, ...] = ()):
        if not callable(fun):
            raise TypeError(f"custom_jvp: fun must be callable, got {type(fun).__name__}")
        functools.update_wrapper(self, fun)
        self.fun = fun
        self.__name__ = getattr(fun, "__name__", type(fun).__name__)
        self.nondiff_argnums = nondiff_positions(nondiff_argnums, f"custom_jvp({self.__name__})")
        self._sig = signature(fun)
        self.jvp_rule: Callable | None = None

    def defjvp(self, rule: Callable) -> Callable:
        """Set ``rule(*nondiff_args, primals, tangents) -> (out, tangent_out)``; returns it."""
        if not callable(rule):
            raise TypeError(f"custom_jvp({self.__name__}).defjvp: rule must be callable, "
                            f"got {type(rule).__name__}")
        self.jvp_rule = rule
        return rule

    def defjvps(self, *rules: Callable | None) -> None:
        """One ``rule_i(t_i, out, *primals)`` per differentiable argument, summed."""
        for i, r in enumerate(rules):
            if r is not None and not callable(r):
                raise TypeError(f"custom_jvp({self.__name__}).defjvps: rule {i} must be callable "
                                f"or None, got {type(r).__name__}")

        def rule(*args):
            *nondiff, primals, tangents = args
            if len(rules) != len(primals):
                raise TypeError(f"custom_jvp({self.__name__}).defjvps: got {len(rules)} rules "
                                f"for {len(primals)} differentiable arguments")
            out = self.fun(*_merge(self.nondiff_argnums, nondiff, primals))
            total = None
            for r, t in zip(rules, tangents):
                if r is None or t is None:
                    continue
                term = r(t, out, *primals)
                total = term if total is None else total + term
            return out, total

        self.jvp_rule = rule

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.jvp_rule is None:
            raise TypeError(f"custom_jvp({self.__name__}): set a rule with "
                            f"@{self.__name__}.defjvp before calling it")
        bound = _Args(f"custom_jvp({self.__name__})", self._sig, self.nondiff_argnums, args, kwargs)
        fn = choose_function(bound.tensors, _CustomJVP, _CustomJVPCompiled)
        if fn is EAGER:
            return eager_call(self, args, kwargs)
        if fn is None:
            return self.fun(*bound.full)
        call = _Call(self, bound)
        out = fn.apply(call, *bound.tensors)
        return call.out.unflatten(out)


def _merge(positions: tuple[int, ...], nondiff, diff) -> list[Any]:
    """All positional arguments from the static ones and the differentiable ones."""
    nd, d = iter(nondiff), iter(diff)
    return [next(nd) if k in positions else next(d) for k in range(len(nondiff) + len(diff))]
