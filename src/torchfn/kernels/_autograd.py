"""How the raw attention kernels compose with autograd, ``torch.func`` and ``torch.compile``.

1. Raw launches are ``torch.library`` custom ops ``torchfn::attention_{fwd,bwd,jvp}``
   (one implementation per backend, chosen by a ``backend`` string), each with a
   fake (meta) implementation for ``torch.compile`` and a vmap rule that folds the
   vmapped dim into the batch dim. No autograd is registered on them: a custom op's
   ``register_autograd`` breaks ``torch.func.grad``, and ``jvp`` through a custom op
   silently returns zero.
2. ``_Attention`` (``autograd.Function``, setup_context style) differentiates:
   forward -> fwd op, backward -> ``_AttentionBackward``, jvp -> the fused jvp op.
   Its vmap rule folds the vmapped dim into the batch dim and applies ``_Attention``
   again, one level down: the generated rule (``generate_vmap_rule=True``) gives the same
   result, but its per-call wrapping cost ~1 ms under ``vmap(grad)``. With
   ``return_lse`` its second output, lse, is differentiable too: its cotangent goes to
   the bwd op (``dlse``), its tangent is the jvp op's ``tlse``; otherwise lse is marked
   non-differentiable.
3. ``_AttentionBackward``: forward -> bwd op; its own backward / jvp (second order:
   grad-of-grad, ``hessian``) differentiate the materialised vjp formula of
   ``_reference`` with ``torch.func``, a block of query rows at a time
   (``_second_order``).
   A forward level over two levels with forward mode among them (``jacfwd(hessian)``)
   would see none of the ops the rules run with ``torch.func``: ``attention`` reads the
   transform stack and computes those calls in plain torch ops (``past_the_rules``);
   the rules refuse what reaches them anyway (``check_forward_levels``).
4. ``_AttentionCompiled``: a twin of ``_Attention`` without ``jvp`` (dynamo does not
   trace an ``autograd.Function`` that defines one) and without second order, used under
   ``torch.compile``. Inside a ``torch.func`` transform that is itself being compiled
   (``compile(grad(f))``) dynamo cannot trace the Function at all: that call runs eagerly
   (a graph break), with full transform support.
5. Plain eager shortcuts, for small attentions where Python overhead is the cost:
   with nothing to differentiate (``_needs_autograd``) the forward op runs without a
   Function, and a backward without ``create_graph`` without ``_AttentionBackward``;
   the Functions call the ops' Python bodies, not the ops, where no tracer or dispatch
   mode records them (``_call``); the Functions' signatures are made once
   (``_cache_signatures``). At B=1, H=4, N=64, D=16 on a CPU core these took a forward
   without grad from 144 to 40 us and forward+backward from 465 to 285 us.
"""

import importlib
import inspect
from functools import partial

import torch
from torch import Tensor
from torch._C._functorch import TransformType
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch.autograd import forward_ad

from torchfn.core._eager import plain

from . import _reference, _second_order

_LIB = "torchfn"


def _backend(name: str):
    return importlib.import_module(f"torchfn.kernels._{name}_ops")


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _last_contiguous(x: Tensor | None) -> Tensor | None:
    return x if x is None or x.stride(-1) == 1 else x.contiguous()


def _expand(mask: Tensor | None, q: Tensor, k: Tensor) -> Tensor | None:
    """The 4-D compact mask as a zero-copy (B, H, Nq, Nk) view, as the backends expect."""
    if mask is None:
        return None
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


# ---------------------------------------------------------------- custom ops

_BODIES: dict = {}  # custom op -> the Python function it wraps


def _op(name: str):
    """``torch.library.custom_op`` that keeps the function it wraps for :func:`_call`."""

    def wrap(fn):
        op = torch.library.custom_op(f"{_LIB}::{name}", mutates_args=())(fn)
        _BODIES[op] = fn
        return op

    return wrap


def _call(op, *args):
    """``op(*args)``, or in plain eager mode the op's own Python function: the same code
    without the dispatcher's Python layers (~23 us a call on a CPU core, which a small
    attention does not amortise). The op itself runs wherever it is a node of something:
    under ``torch.compile``, ``make_fx`` and other dispatch modes, for meta / fake
    tensors, and for a ``torch.func`` wrapper (its vmap rule)."""
    q = args[0]
    if q.device.type != "meta" and all(plain(x) for x in args if isinstance(x, Tensor)):
        return _BODIES[op](*args)
    return op(*args)  # (any wrapped argument: a tangent may be batched where q is not)


@_op("attention_fwd")
def attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    causal: bool,
    scale: float,
    backend: str,
    window_left: int = -1,
    window_right: int = -1,
    q_ids: Tensor | None = None,
    kv_ids: Tensor | None = None,
    softcap: float = 0.0,
    dropout: float = 0.0,
    seeds: Tensor | None = None,
    slopes: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(o, lse): o (B, H, Nq, D), lse (B, H, Nq) fp32 (fp64 for fp64 inputs).
    ``window_left`` / ``window_right``: the normalised window (-1: unbounded);
    ``q_ids`` (B, Nq) / ``kv_ids`` (B, Nk): int64 segment ids, or None;
    ``seeds`` (B, H, 2) int32: the per-head dropout keys of rate ``dropout``, or None;
    ``slopes`` (B, H): ALiBi slopes, or None."""
    q, k, v = (_last_contiguous(x) for x in (q, k, v))
    return _backend(backend).fwd(q, k, v, _expand(mask, q, k), causal, scale,
                                 window=(window_left, window_right),
                                 segments=_segments(q_ids, kv_ids), softcap=softcap,
                                 dropout=dropout, seeds=seeds, slopes=slopes)


@attention_fwd.register_fake
def _(q, k, v, mask, causal, scale, backend, window_left=-1, window_right=-1, q_ids=None,
      kv_ids=None, softcap=0.0, dropout=0.0, seeds=None, slopes=None):
    B, H, Nq, D = q.shape
    return q.new_empty(B, H, Nq, D), q.new_empty(B, H, Nq, dtype=_lse_dtype(q.dtype))


@_op("attention_bwd")
def attention_bwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    do: Tensor,
    mask: Tensor | None,
    causal: bool,
    scale: float,
    backend: str,
    deterministic: bool = True,
    window_left: int = -1,
    window_right: int = -1,
    q_ids: Tensor | None = None,
    kv_ids: Tensor | None = None,
    softcap: float = 0.0,
    dropout: float = 0.0,
    seeds: Tensor | None = None,
    dlse: Tensor | None = None,
    slopes: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) for the cotangents ``do`` (of o) and ``dlse`` (of lse, (B, H, Nq);
    None: zero); dk / dv summed over GQA query heads."""
    q, k, v, o, do = (_last_contiguous(x) for x in (q, k, v, o, do))
    return _backend(backend).bwd(q, k, v, o, lse, do, _expand(mask, q, k), causal, scale,
                                 deterministic, window=(window_left, window_right),
                                 segments=_segments(q_ids, kv_ids), softcap=softcap,
                                 dropout=dropout, seeds=seeds, dlse=dlse, slopes=slopes)


@attention_bwd.register_fake
def _(q, k, v, o, lse, do, mask, causal, scale, backend, deterministic=True, window_left=-1,
      window_right=-1, q_ids=None, kv_ids=None, softcap=0.0, dropout=0.0, seeds=None,
      dlse=None, slopes=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@_op("attention_jvp")
def attention_jvp(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    tq: Tensor | None,
    tk: Tensor | None,
    tv: Tensor | None,
    mask: Tensor | None,
    causal: bool,
    scale: float,
    backend: str,
    window_left: int = -1,
    window_right: int = -1,
    q_ids: Tensor | None = None,
    kv_ids: Tensor | None = None,
    softcap: float = 0.0,
    dropout: float = 0.0,
    seeds: Tensor | None = None,
    slopes: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(o, lse, to, tlse): the forward-mode tangents of o (B, H, Nq, D) and of lse
    (B, H, Nq); a None input tangent is zero."""
    q, k, v, tq, tk, tv = (_last_contiguous(x) for x in (q, k, v, tq, tk, tv))
    return _backend(backend).jvp(q, k, v, tq, tk, tv, _expand(mask, q, k), causal, scale,
                                 window=(window_left, window_right),
                                 segments=_segments(q_ids, kv_ids), softcap=softcap,
                                 dropout=dropout, seeds=seeds, slopes=slopes)


@attention_jvp.register_fake
def _(q, k, v, tq, tk, tv, mask, causal, scale, backend, window_left=-1, window_right=-1,
      q_ids=None, kv_ids=None, softcap=0.0, dropout=0.0, seeds=None, slopes=None):
    B, H, Nq, D = q.shape
    lse = q.new_empty(B, H, Nq, dtype=_lse_dtype(q.dtype))
    return q.new_empty(B, H, Nq, D), lse, q.new_empty(B, H, Nq, D), torch.empty_like(lse)


# ---------------------------------------------------------------- vmap rules


def _fold(x: Tensor | None, bdim: int | None, size: int) -> Tensor | None:
    """(..V at bdim..) -> (V * B, ...): the vmapped dim becomes part of the batch dim."""
    if x is None:
        return None
    x = x.movedim(bdim, 0) if bdim is not None else x.expand(size, *x.shape)
    return x.reshape(size * x.shape[1], *x.shape[2:])


def _fold_mask(mask: Tensor | None, bdim: int | None, size: int, batch: int):
    """Fold a compact (b, h, nq, nk) mask, b in {1, B}; an unbatched b == 1 stays shared."""
    if mask is None:
        return None
    if bdim is None:
        if mask.shape[0] == 1:
            return mask
        mask = mask.expand(size, *mask.shape)
    else:
        mask = mask.movedim(bdim, 0)
    mask = mask.expand(size, batch, *mask.shape[2:])
    return mask.reshape(size * batch, *mask.shape[2:])


def _segments(q_ids: Tensor | None, kv_ids: Tensor | None):
    return None if q_ids is None else (q_ids.contiguous(), kv_ids.contiguous())


def _unfold(x: Tensor, size: int) -> Tensor:
    return x.reshape(size, x.shape[0] // size, *x.shape[1:])


def _fold_args(info, in_dims: tuple, args: tuple, mask_at: int) -> list:
    """An op's or Function's arguments with each tensor's vmapped dim folded into the
    batch dim (argument 0 is q, ``mask_at`` the compact mask); others as they are."""
    n = info.batch_size
    out = [_fold(x, d, n) if isinstance(x, Tensor) else x for x, d in zip(args, in_dims)]
    out[mask_at] = _fold_mask(args[mask_at], in_dims[mask_at], n, out[0].shape[0] // n)
    return out


# Each op's rule folds every tensor argument's vmapped dim into the batch (``_fold_args``;
# trailing arguments left at their defaults have no in_dims entry) and unfolds the outputs.


@torch.library.register_vmap(f"{_LIB}::attention_fwd")
def _(info, in_dims, *args):
    outs = attention_fwd(*_fold_args(info, in_dims, args, mask_at=3))
    return tuple(_unfold(x, info.batch_size) for x in outs), (0, 0)


@torch.library.register_vmap(f"{_LIB}::attention_bwd")
def _(info, in_dims, *args):
    grads = attention_bwd(*_fold_args(info, in_dims, args, mask_at=6))
    return tuple(_unfold(g, info.batch_size) for g in grads), (0, 0, 0)


@torch.library.register_vmap(f"{_LIB}::attention_jvp")
def _(info, in_dims, *args):
    outs = attention_jvp(*_fold_args(info, in_dims, args, mask_at=6))
    return tuple(_unfold(x, info.batch_size) for x in outs), (0, 0, 0, 0)


# ---------------------------------------------------------------- autograd


def _save(ctx, inputs, output) -> None:
    q, k, v, mask, causal, scale, backend, deterministic, win_l, win_r, q_ids, kv_ids = inputs[:12]
    o, lse = output
    ctx.lse_grad = inputs[15]  # return_lse: lse is an output with a derivative
    if not ctx.lse_grad:
        ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, o, lse, mask, q_ids, kv_ids, inputs[14], inputs[16])
    ctx.causal, ctx.scale, ctx.backend = causal, scale, backend
    ctx.deterministic, ctx.window, ctx.softcap = deterministic, (win_l, win_r), inputs[12]
    ctx.dropout = inputs[13]


# mask, causal, scale, backend, deterministic, window (2), segment ids (2), softcap, dropout,
# seeds, lse_grad, slopes
_NO_GRADS = (None,) * 14


class _Attention(torch.autograd.Function):
    @staticmethod
    def vmap(info, in_dims, *args):
        o, lse = _Attention.apply(*_fold_args(info, in_dims, args, mask_at=3))
        return (_unfold(o, info.batch_size), _unfold(lse, info.batch_size)), (0, 0)

    @staticmethod
    def forward(q, k, v, mask, causal, scale, backend, deterministic, win_l, win_r, q_ids,
                kv_ids, softcap, dropout, seeds, lse_grad, slopes):
        return _call(attention_fwd, q, k, v, mask, causal, scale, backend, win_l, win_r, q_ids,
                     kv_ids, softcap, dropout, seeds, slopes)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _save(ctx, inputs, output)
        ctx.save_for_forward(*inputs[:4], *inputs[10:12], inputs[14], inputs[16])

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse, mask, q_ids, kv_ids, seeds, slopes = ctx.saved_tensors
        # a differentiable backward only where its result may be differentiated again
        # (create_graph, a torch.func transform, forward-mode AD): not for loss.backward()
        fn = _AttentionBackward.apply if _needs_autograd(q, k, v, do) else partial(
            _call, attention_bwd)
        dq, dk, dv = fn(
            q, k, v, o, lse, do, mask, ctx.causal, ctx.scale, ctx.backend, ctx.deterministic,
            *ctx.window, q_ids, kv_ids, ctx.softcap, ctx.dropout, seeds,
            dlse if ctx.lse_grad else None, slopes,
        )
        return dq, dk, dv, *_NO_GRADS

    @staticmethod
    def jvp(ctx, tq, tk, tv, *_):
        q, k, v, mask, q_ids, kv_ids, seeds, slopes = ctx.saved_tensors
        # forward AD's efficient zeros have no storage for a kernel to read: None is zero
        tq, tk, tv = (None if t is None or t._is_zerotensor() else t for t in (tq, tk, tv))
        tangents = [t for t in (tq, tk, tv) if t is not None]
        if _needs_autograd(q, k, v, *tangents):  # the tangent itself is differentiated
            _, _, to, tlse = _AttentionJvp.apply(
                q, k, v, tq, tk, tv, mask, ctx.causal, ctx.scale, ctx.backend,
                ctx.deterministic, *ctx.window, q_ids, kv_ids, ctx.softcap, ctx.dropout, seeds,
                ctx.lse_grad, slopes)
        else:
            _, _, to, tlse = _call(attention_jvp, q, k, v, tq, tk, tv, mask, ctx.causal,
                                   ctx.scale, ctx.backend, *ctx.window, q_ids, kv_ids,
                                   ctx.softcap, ctx.dropout, seeds, slopes)
        return to, tlse if ctx.lse_grad else None


class _AttentionCompiled(torch.autograd.Function):
    """``_Attention`` without ``jvp`` and without second order, for ``torch.compile``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, mask, causal, scale, backend, deterministic, win_l, win_r, q_ids,
                kv_ids, softcap, dropout, seeds, lse_grad, slopes):
        return attention_fwd(q, k, v, mask, causal, scale, backend, win_l, win_r, q_ids, kv_ids,
                             softcap, dropout, seeds, slopes)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _save(ctx, inputs, output)

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse, mask, q_ids, kv_ids, seeds, slopes = ctx.saved_tensors
        dq, dk, dv = attention_bwd(q, k, v, o, lse, do, mask, ctx.causal, ctx.scale, ctx.backend,
                                   ctx.deterministic, *ctx.window, q_ids, kv_ids, ctx.softcap,
                                   ctx.dropout, seeds, dlse if ctx.lse_grad else None, slopes)
        return dq, dk, dv, *_NO_GRADS


def check_forward_levels(allowed: int, what: str) -> None:
    """Refuse a forward-mode level outside a rule that differentiates with ``torch.func``
    inside: such a level sees none of the rule's ops, so its derivative came out as
    zeros (measured, torch 2.13): an error, not a silently wrong third derivative.
    ``allowed``: the forward-mode levels the rule itself may be running for."""
    levels = sum(i.key() == TransformType.Jvp for i in retrieve_all_functorch_interpreters())
    if levels > allowed:
        raise NotImplementedError(
            f"attention: forward mode (jvp / jacfwd) around {what} is not supported (a "
            "third derivative with its outer levels in forward mode); take the outer "
            "derivative in reverse mode (grad / jacrev), which is")


class _AttentionJvp(torch.autograd.Function):
    """(q, k, v, tq, tk, tv) -> (o, lse, to, tlse) with the fused forward-mode kernel;
    differentiable, so reverse mode runs over forward mode (``grad`` of a loss that
    takes a ``jvp`` through attention: MeanFlow's target, tangent regularisers).

    ``to`` is linear in the tangents: its pullback to them is attention's own vjp at
    the cotangent, and to (q, k, v) it is the Hessian of ``<g, attention>`` applied to
    the tangents, the jvp of the vjp formula (``_second_order.jvp``). o and lse are
    returned for that vjp and carry no derivative.
    """

    @staticmethod
    def vmap(info, in_dims, *args):
        outs = _AttentionJvp.apply(*_fold_args(info, in_dims, args, mask_at=6))
        return tuple(_unfold(x, info.batch_size) for x in outs), (0, 0, 0, 0)

    @staticmethod
    def forward(q, k, v, tq, tk, tv, mask, causal, scale, backend, deterministic, win_l, win_r,
                q_ids, kv_ids, softcap, dropout, seeds, lse_grad, slopes):
        # forward AD's efficient zeros have no storage: a zero tangent is None here
        tq, tk, tv = (None if t is None or t._is_zerotensor() else t for t in (tq, tk, tv))
        return _call(attention_jvp, q, k, v, tq, tk, tv, mask, causal, scale, backend, win_l,
                     win_r, q_ids, kv_ids, softcap, dropout, seeds, slopes)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, tq, tk, tv, mask, causal, scale, backend, deterministic, win_l, win_r = \
            inputs[:13]
        q_ids, kv_ids, softcap, dropout, seeds, lse_grad, slopes = inputs[13:]
        o, lse = output[:2]
        ctx.mark_non_differentiable(o, lse)
        ctx.has_tangent = (tq is not None, tk is not None, tv is not None)
        ctx.save_for_backward(q, k, v, tq, tk, tv, o, lse, mask, q_ids, kv_ids, seeds, slopes)
        ctx.save_for_forward(q, k, v, tq, tk, tv, mask, q_ids, kv_ids, seeds, slopes)
        ctx.causal, ctx.scale, ctx.backend, ctx.deterministic = causal, scale, backend, \
            deterministic
        ctx.window, ctx.softcap, ctx.dropout, ctx.lse_grad = (win_l, win_r), softcap, \
            dropout, lse_grad

    @staticmethod
    def jvp(ctx, sq, sk, sv, stq, stk, stv, *_):
        """Forward over forward: the tangent ``to`` moves by the jvp along the tangents'
        own tangents plus the second directional derivative along (s, t), materialised
        in blocks of query rows (o and lse are returned without derivatives)."""
        check_forward_levels(1, "a jvp / jacfwd around a jvp of attention")
        q, k, v, tq, tk, tv, mask, q_ids, kv_ids, seeds, slopes = ctx.saved_tensors
        opts = (mask, ctx.causal, ctx.scale, ctx.backend, ctx.deterministic, *ctx.window,
                q_ids, kv_ids, ctx.softcap, ctx.dropout, seeds, ctx.lse_grad, slopes)

        def first(a, b, c):  # attention's (o, lse) tangents along (a, b, c); None if all None
            if a is None and b is None and c is None:
                return None, None
            return _AttentionJvp.apply(q, k, v, a, b, c, *opts)[2:]

        a, alse = first(stq, stk, stv)
        to, tlse = a, alse
        if any(x is not None for x in (sq, sk, sv)) and any(
                x is not None for x in (tq, tk, tv)):
            args = dict(mask=mask, causal=ctx.causal, scale=ctx.scale, window=ctx.window,
                        segments=None if q_ids is None else (q_ids, kv_ids),
                        softcap=ctx.softcap, dropout=ctx.dropout, seeds=seeds, slopes=slopes)
            d2o, d2lse = _second_order.second_jvp((q, k, v), (tq, tk, tv), (sq, sk, sv),
                                                  **args)
            to = d2o if to is None else to + d2o
            tlse = d2lse.to(_lse_dtype(q.dtype)) if tlse is None else tlse + d2lse.to(tlse.dtype)
        if to is None:
            to = q.new_zeros(*q.shape[:3], v.shape[-1])
        if tlse is None:
            tlse = q.new_zeros(q.shape[:3], dtype=_lse_dtype(q.dtype))
        return None, None, to, tlse  # o and lse carry no derivative here

    @staticmethod
    def backward(ctx, _go, _glse, gto, gtlse):
        check_forward_levels(0, "a reverse pass over a jvp of attention")
        q, k, v, tq, tk, tv, o, lse, mask, q_ids, kv_ids, seeds, slopes = ctx.saved_tensors
        # contiguous: a cotangent is often expanded (that of a sum), and torch.func.jvp's
        # dual tensors cannot be made from an expanded primal
        gto = torch.zeros_like(o) if gto is None else gto.contiguous()
        dlse = ((torch.zeros_like(lse) if gtlse is None else gtlse.contiguous())
                if ctx.lse_grad else None)
        # to the tangents: attention's vjp at the cotangent (differentiable when needed)
        fn = _AttentionBackward.apply if _needs_autograd(q, k, v, gto) else partial(
            _call, attention_bwd)
        dtq, dtk, dtv = fn(q, k, v, o, lse, gto, mask, ctx.causal, ctx.scale, ctx.backend,
                           ctx.deterministic, *ctx.window, q_ids, kv_ids, ctx.softcap,
                           ctx.dropout, seeds, dlse, slopes)
        # to the primals: the jvp of that vjp along the tangents
        primals = (q, k, v, gto) if dlse is None else (q, k, v, gto, dlse)
        primals = tuple(x.contiguous() for x in primals)
        tq, tk, tv = (None if x is None else x.contiguous() for x in (tq, tk, tv))
        args = dict(mask=mask, causal=ctx.causal, scale=ctx.scale, window=ctx.window,
                    segments=None if q_ids is None else (q_ids, kv_ids), softcap=ctx.softcap,
                    dropout=ctx.dropout, seeds=seeds, slopes=slopes)
        dq, dk, dv = _second_order.jvp(primals, (tq, tk, tv, None, None)[:len(primals)],
                                       **args)
        keep = ctx.has_tangent
        return (dq, dk, dv, dtq if keep[0] else None, dtk if keep[1] else None,
                dtv if keep[2] else None, *(None,) * 14)


def _second_order_args(ctx) -> tuple[tuple, dict]:
    """The backward's saved primals (q, k, v, do[, dlse]) and attention options."""
    q, k, v, do, mask, q_ids, kv_ids, seeds, dlse, slopes = ctx.saved_tensors
    args = dict(mask=mask, causal=ctx.causal, scale=ctx.scale, window=ctx.window,
                segments=None if q_ids is None else (q_ids, kv_ids), softcap=ctx.softcap,
                dropout=ctx.dropout, seeds=seeds, slopes=slopes)
    return ((q, k, v, do) if dlse is None else (q, k, v, do, dlse)), args


class _AttentionBackward(torch.autograd.Function):
    """(q, k, v, o, lse, do) -> (dq, dk, dv) with the fused backward; differentiable.

    o and lse are functions of (q, k, v) cached by the forward: the derivatives
    below are total derivatives through (q, k, v, do), so o and lse get none.
    """

    @staticmethod
    def vmap(info, in_dims, *args):
        grads = _AttentionBackward.apply(*_fold_args(info, in_dims, args, mask_at=6))
        return tuple(_unfold(g, info.batch_size) for g in grads), (0, 0, 0)

    @staticmethod
    def forward(q, k, v, o, lse, do, mask, causal, scale, backend, deterministic, win_l, win_r,
                q_ids, kv_ids, softcap, dropout, seeds, dlse, slopes):
        return _call(attention_bwd, q, k, v, o, lse, do, mask, causal, scale, backend,
                     deterministic, win_l, win_r, q_ids, kv_ids, softcap, dropout, seeds, dlse,
                     slopes)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, _o, _lse, do, mask, causal, scale, _backend, _det, win_l, win_r = inputs[:13]
        q_ids, kv_ids, softcap, dropout, seeds, dlse, slopes = inputs[13:]
        ctx.save_for_backward(q, k, v, do, mask, q_ids, kv_ids, seeds, dlse, slopes)
        ctx.save_for_forward(q, k, v, do, mask, q_ids, kv_ids, seeds, dlse, slopes)
        ctx.causal, ctx.scale, ctx.window, ctx.softcap = causal, scale, (win_l, win_r), softcap
        ctx.dropout = dropout

    @staticmethod
    def backward(ctx, gq, gk, gv):
        primals, args = _second_order_args(ctx)
        rq, rk, rv, rdo, *rdlse = _second_order.vjp(primals, (gq, gk, gv), **args)
        return rq, rk, rv, None, None, rdo, *(None,) * 12, (rdlse or [None])[0], None

    @staticmethod
    def jvp(ctx, *t):  # t: the tangents of the inputs (q, k, v, o, lse, do, ..., dlse, slopes)
        check_forward_levels(1, "a jvp of attention's backward (hessian)")
        primals, args = _second_order_args(ctx)
        tangents = (t[0], t[1], t[2], t[5], t[18])[: len(primals)]
        return _second_order.jvp(primals, tangents, **args)


def _cache_signatures(*functions: type[torch.autograd.Function]) -> None:
    """torch's ``Function.apply`` binds its arguments to ``inspect.signature(forward)`` on
    every call, and builds that signature anew each time: ~25 us for these forwards'
    17-20 parameters on a CPU core, per call. A ``__signature__`` made once (Python's own
    hook for ``inspect.signature``) turns it into a lookup."""
    for fn in functions:
        fn.forward.__signature__ = inspect.signature(fn.forward)


_cache_signatures(_Attention, _AttentionCompiled, _AttentionBackward)


def _needs_autograd(*xs: Tensor) -> bool:
    """Whether a call on ``xs`` must be differentiable, through a Function: a
    ``torch.func`` transform is active, forward-mode AD (``torch.autograd.forward_ad``)
    is on, an input requires grad under grad mode, or an input is not a plain tensor (a
    subclass, a transform's wrapper). Otherwise (inference; a backward without
    ``create_graph``) the op alone gives the same outputs, ~80 us sooner on a CPU."""
    if torch._C._are_functorch_transforms_active() or forward_ad._current_level >= 0:
        return True
    if any(type(x) is not Tensor for x in xs):
        return True
    return torch.is_grad_enabled() and any(x.requires_grad for x in xs)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    causal: bool,
    scale: float,
    backend: str,
    deterministic: bool = True,
    window: tuple[int, int] = _reference.NO_WINDOW,
    segments: tuple[Tensor, Tensor] | None = None,
    softcap: float = 0.0,
    dropout: float = 0.0,
    seeds: Tensor | None = None,
    return_lse: bool = False,
    slopes: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Differentiable attention on validated inputs (mask: compact 4-D; window: normalised
    (left, right), -1 = unbounded; segments: int64 (q ids (B, Nq), kv ids (B, Nk));
    softcap: 0.0 for none; seeds: (B, H, 2) int32 dropout keys of rate ``dropout``, or
    None); ``return_lse``: (o, lse), both differentiable; ``slopes``: (B, H) ALiBi slopes,
    or None."""
    if not _needs_autograd(q, k, v):
        q_ids, kv_ids = segments if segments is not None else (None, None)
        o, lse = _call(attention_fwd, q, k, v, mask, causal, scale, backend, *window, q_ids,
                       kv_ids, softcap, dropout, seeds, slopes)
        return (o, lse) if return_lse else o
    # two ints and two tensors, not tuples: a tuple would be a pytree input to the Functions
    args = (deterministic, *window, *(segments if segments is not None else (None, None)),
            softcap, dropout, seeds, return_lse, slopes)
    if torch.compiler.is_compiling():
        if torch._C._functorch.maybe_current_level() is not None:
            # dynamo cannot trace an autograd.Function inside a torch.func transform
            # (grad, vmap, ...) with custom ops in it: run this call eagerly
            return _eager()(q, k, v, mask, causal, scale, backend, *args)
        o, lse = _AttentionCompiled.apply(q, k, v, mask, causal, scale, backend, *args)
        return (o, lse) if return_lse else o
    return _eager_attention(q, k, v, mask, causal, scale, backend, *args)


def past_the_rules() -> bool:
    """Whether the ``torch.func`` derivative levels active now (outermost first) ask the
    Functions' rules for what they cannot give: a forward-mode level with two or more
    derivative levels inside it, one of them forward mode (``jacfwd(hessian)``,
    ``jacfwd(jacfwd(jacfwd))``, ``jacfwd(jacrev(jacfwd))``). Such a level would see none
    of the ops that the inner rules run with ``torch.func`` (see
    :func:`check_forward_levels`). ``vmap`` levels do not count, and
    ``torch.autograd.forward_ad`` cannot hold a ``torch.func`` forward level (torch
    refuses nested forward mode), so it adds no case."""
    if not torch._C._are_functorch_transforms_active():
        return False
    kinds = [i.key() for i in retrieve_all_functorch_interpreters()
             if i.key() in (TransformType.Grad, TransformType.Jvp)]
    return any(kind == TransformType.Jvp and len(kinds) - i > 2
               and TransformType.Jvp in kinds[i + 1:] for i, kind in enumerate(kinds))


def _materialised(q, k, v, mask, causal, scale, win_l, win_r, q_ids, kv_ids, softcap,
                  dropout, seeds, slopes) -> tuple[Tensor, Tensor]:
    """(o, lse) in plain torch ops (``_reference``), which every transform differentiates
    to any order: O(B * H * Nq * Nk) memory, for what :func:`past_the_rules` picks out.
    fp16 / bf16 are computed in fp32, as the kernels accumulate."""
    acc = _lse_dtype(q.dtype)
    o, lse = _reference._attention(
        q.to(acc), k.to(acc), v.to(acc), mask, causal, scale, (win_l, win_r),
        None if q_ids is None else (q_ids, kv_ids), softcap, dropout, seeds,
        None if slopes is None else slopes.to(acc))
    return o.to(q.dtype), lse


def _eager_attention(q, k, v, mask, causal, scale, backend, *args):
    if past_the_rules():  # third order with forward mode outside: plain ops
        _det, win_l, win_r, q_ids, kv_ids, softcap, dropout, seeds, _lse, slopes = args
        o, lse = _materialised(q, k, v, mask, causal, scale, win_l, win_r, q_ids, kv_ids,
                               softcap, dropout, seeds, slopes)
    else:
        o, lse = _Attention.apply(q, k, v, mask, causal, scale, backend, *args)
    return (o, lse) if args[-2] else o


_EAGER: list = []


def _eager():
    """``_eager_attention`` hidden from dynamo. Made on first use: ``torch.compiler.disable``
    imports dynamo and with it ``triton.language``, which must not load before
    ``TRITON_INTERPRET`` is decided."""
    if not _EAGER:
        _EAGER.append(torch.compiler.disable(_eager_attention))
    return _EAGER[0]
