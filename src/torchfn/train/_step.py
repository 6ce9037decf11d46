"""``make_train_step``: a pure ``(train_state, batch) -> (train_state, metrics)``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import optree
import torch

from torchfn import optim
from torchfn.train._state import TrainState

__all__ = ["make_train_step", "NonFiniteLossError"]

_RESERVED = ("loss", "grad_norm", "lr", "loss_scale", "skipped", "nonfinite")


class NonFiniteLossError(FloatingPointError, ValueError):
    """A train step met a non-finite loss or gradient and has no loss scale."""


def _transform_active() -> bool:
    """True inside ``torch.func`` transforms (vmap, grad, ...) or ``torch.compile``."""
    return torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()


def _add(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> list[torch.Tensor]:
    if torch._C._are_functorch_transforms_active():  # _foreach_* has no vmap rule
        return [x + y for x, y in zip(xs, ys)]
    return list(torch._foreach_add(xs, ys))


def _mul(xs: list[torch.Tensor], s: Any) -> list[torch.Tensor]:
    if torch._C._are_functorch_transforms_active():
        return [x * s for x in xs]
    return list(torch._foreach_mul(xs, s))


def _scaling(loss_scale: Any) -> bool:
    return not isinstance(loss_scale, optim.NoOpLossScale)


def _find_lr(opt_state: Any) -> torch.Tensor | None:
    """The learning rate in an optimizer state, if it holds one (inject_hyperparams)."""
    found: list[Any] = []

    def visit(node: Any) -> None:
        if found:
            return
        hyper = getattr(node, "hyperparams", None)
        if isinstance(hyper, dict):
            for name in ("lr", "learning_rate"):
                if name in hyper:
                    found.append(hyper[name])
                    return
        for name in ("lr", "learning_rate"):
            if isinstance(node, tuple) and name in getattr(node, "_fields", ()):
                found.append(getattr(node, name))
                return
        if isinstance(node, (tuple, list)):
            for child in node:
                visit(child)
        elif isinstance(node, dict):
            for child in node.values():
                visit(child)

    visit(opt_state)
    if found and isinstance(found[0], (torch.Tensor, float, int)):
        return torch.as_tensor(found[0])
    return None


def _lead(x: Any) -> Any:
    return tuple(x.shape[:1]) if isinstance(x, torch.Tensor) else type(x).__name__


def _split(batch: Any, k: int) -> list[Any]:
    """``k`` micro-batches of a batch pytree, split along dim 0."""
    leaves, treedef = optree.tree_flatten(batch)
    if not leaves:
        raise ValueError("batch must contain at least one tensor, got an empty pytree")
    sizes = {leaf.shape[0] if isinstance(leaf, torch.Tensor) and leaf.ndim else None
             for leaf in leaves}
    if None in sizes or len(sizes) != 1:
        raise ValueError(
            "batch leaves must be tensors sharing the leading (batch) dimension to split "
            f"into accumulate={k} micro-batches, got leading sizes "
            f"{[_lead(x) for x in leaves]}"
        )
    (b,) = sizes
    if b % k:
        raise ValueError(f"batch size {b} is not divisible by accumulate={k}")
    m = b // k
    return [optree.tree_unflatten(treedef, [x.narrow(0, i * m, m) for x in leaves])
            for i in range(k)]


def _apply_donated(params: Any, updates: Any) -> Any:
    """``params + updates`` written into the donated params, or None when that
    is not safe (dtype change, autograd, an update aliasing a param)."""
    p_leaves, spec = optree.tree_flatten(params)
    u_leaves = optree.tree_leaves(updates)
    if len(u_leaves) != len(p_leaves) or not p_leaves:
        return None
    ptrs = {p.untyped_storage().data_ptr() for p in p_leaves}
    if len(ptrs) != len(p_leaves):  # two leaves share memory: not safe to add twice
        return None
    for p, u in zip(p_leaves, u_leaves):
        if (p.dtype != u.dtype or p.shape != u.shape or p.requires_grad
                or u.untyped_storage().data_ptr() in ptrs):
            return None
    torch._foreach_add_(p_leaves, u_leaves)
    return optree.tree_unflatten(spec, p_leaves)


def make_train_step(
    loss_fn: Callable[..., Any],
    optimizer: Any,
    *,
    accumulate: int = 1,
    clip_norm: float | None = None,
    policy: Any = None,
    has_aux: bool = False,
    donate: bool = False,
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, torch.Tensor]]]:
    """A pure train step ``step(state, batch) -> (state, metrics)``.

    ``loss_fn(params, model_state, batch, key)`` returns a 0-d loss, or with
    ``has_aux=True`` a pair ``(loss, (model_state, aux))`` where ``model_state``
    is the updated model state (BatchNorm statistics; return the input one if
    nothing changed) and ``aux`` a dict of metric tensors (or ``None``). With
    a ``torchfn.Model``::

        def loss_fn(params, model_state, batch, key):
            x, y = batch                                   # x: (B, D), y: (B,)
            logits, model_state = model.apply(params, x, state=model_state,
                                              key=key, train=True)
            loss = F.cross_entropy(logits, y)
            return loss, (model_state, {"acc": (logits.argmax(-1) == y).float().mean()})

    One step:

    * ``key = fold_in(state.key, state.step)`` (``fold_in(key, i)`` for
      micro-batch ``i`` when ``accumulate > 1``); ``state.key`` never changes,
      so any step can be recomputed from a checkpoint.
    * ``accumulate=K`` splits every batch leaf along dim 0 into ``K`` equal
      micro-batches (the batch size must divide) and averages their losses and
      gradients: for a mean loss this equals one step on the full batch while
      holding only one micro-batch of activations. Model state threads through
      the micro-batches in order.
    * ``policy`` (``torchfn.optim.Policy``) casts params and floating batch
      leaves to its compute dtype for the forward; the loss is taken in float32
      and gradients arrive in the params' dtype.
    * A loss scale in ``state.loss_scale`` scales the loss, unscales the
      gradients, skips the update (params, optimizer state) when a gradient is
      non-finite and adjusts the scale, as ``torch.amp.GradScaler``.
    * ``clip_norm`` rescales gradients to global norm ``<= clip_norm`` with
      ``torch.nn.utils.clip_grad_norm_``'s formula.
    * Without a loss scale a non-finite loss or gradient norm raises
      :class:`NonFiniteLossError` naming the step (one host sync per step). Inside
      ``vmap`` or ``torch.compile`` a step cannot raise on data: it skips the
      update instead and reports ``metrics["nonfinite"]``; :func:`torchfn.fit`
      raises on it, naming the step.

    ``metrics``: ``loss`` and ``grad_norm`` (before clipping), ``lr`` when the
    optimizer state holds one (wrap the optimizer in
    ``torchfn.optim.inject_hyperparams``), ``loss_scale`` and ``skipped`` with a loss scale,
    plus the ``aux`` entries (averaged over micro-batches).

    Gradients: at top level the step takes them with ``torch.autograd.grad``
    (peak memory as ``loss.backward()``); inside a ``torch.func`` transform
    (``vmap`` over stacked states for an ensemble, ``grad`` through a step) or
    ``torch.compile`` it uses ``torch.func.grad_and_value``. For memory, wrap
    the repeated blocks of the model in :func:`torchfn.remat`.

    ``donate=True`` (JAX's ``donate_argnums``) lets an eager step reuse the
    buffers of the state it is given: params are updated in place and an
    optimizer whose ``update`` takes ``donate`` (``adam``, ``adamw``) overwrites
    its moments, so peak memory matches ``loss.backward()`` + ``torch.optim``.
    The state passed in must not be used afterwards (``state, m = step(state,
    batch)``). It is ignored (the step stays pure) inside transforms, under
    ``torch.compile`` and with a loss scale, where a skipped step needs the old state.

    Example::

        >>> import torch, torchfn
        >>> def loss_fn(params, model_state, batch, key):
        ...     x, y = batch
        ...     return ((x @ params["w"] - y) ** 2).mean()
        >>> opt = torchfn.optim.sgd(0.1)
        >>> state = torchfn.TrainState.create({"w": torch.zeros(3)}, opt,
        ...                                   key=torchfn.random.key(0))
        >>> step = torchfn.make_train_step(loss_fn, opt)
        >>> state, metrics = step(state, (torch.ones(8, 3), torch.ones(8)))
        >>> int(state.step), sorted(metrics)
        (1, ['grad_norm', 'loss'])
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(
            "optimizer must be a gradient transformation with init/update, got "
            f"{type(optimizer).__name__}"
        )
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"accumulate must be an int >= 1, got {accumulate!r}")
    if clip_norm is not None and not (isinstance(clip_norm, (int, float)) and clip_norm > 0):
        raise ValueError(f"clip_norm must be a number > 0 or None, got {clip_norm!r}")
    if not isinstance(has_aux, bool):
        raise TypeError(f"has_aux must be a bool, got {type(has_aux).__name__}")
    try:
        pure_update = "inplace" in inspect.signature(optimizer.update).parameters
    except (TypeError, ValueError):
        pure_update = False
    update_kwargs = {"inplace": False} if pure_update else {}
    if not isinstance(donate, bool):
        raise TypeError(f"donate must be a bool, got {type(donate).__name__}")
    try:
        donate_kw = donate and "donate" in inspect.signature(optimizer.update).parameters
    except (TypeError, ValueError):
        donate_kw = False

    from torchfn import random

    def objective(params, model_state, batch, key, loss_scale):
        if policy is not None:
            params = policy.cast_to_compute(params)
            batch = policy.cast_to_compute(batch)
        out = loss_fn(params, model_state, batch, key)
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2
                    and isinstance(out[1], tuple) and len(out[1]) == 2):
                raise TypeError(
                    "loss_fn with has_aux=True must return (loss, (model_state, aux)), got "
                    f"{type(out).__name__}"
                )
            loss, (model_state, aux) = out
        else:
            loss, aux = out, None
        if not (isinstance(loss, torch.Tensor) and loss.ndim == 0 and loss.is_floating_point()):
            raise TypeError(
                "loss_fn must return a 0-d floating-point loss tensor"
                + (" (first of the pair)" if has_aux else "")
                + ", got "
                + (f"shape {tuple(loss.shape)} dtype {loss.dtype}"
                   if isinstance(loss, torch.Tensor) else type(loss).__name__)
            )
        aux = {} if aux is None else aux
        if not isinstance(aux, dict):
            raise TypeError(f"aux must be a dict of metrics or None, got {type(aux).__name__}")
        clash = [k for k in aux if k in _RESERVED]
        if clash:
            raise ValueError(f"aux metric names {clash} clash with the step's own {_RESERVED}")
        loss = loss.float()
        scaled = loss_scale.scale(loss) if _scaling(loss_scale) else loss
        return scaled, (loss.detach(), model_state, aux)

    def grads_and_loss(params, model_state, batch, key, loss_scale):
        if _transform_active():
            grad_fn = torch.func.grad_and_value(objective, has_aux=True)
            grads, (_, extra) = grad_fn(params, model_state, batch, key, loss_scale)
            return grads, extra
        leaves, treedef = optree.tree_flatten(params)
        inputs = [p.detach().requires_grad_() for p in leaves]
        with torch.enable_grad():
            scaled, extra = objective(
                optree.tree_unflatten(treedef, inputs), model_state, batch, key, loss_scale
            )
            grads = torch.autograd.grad(scaled, inputs, allow_unused=True)
        del scaled
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(leaves, grads)]
        extra = optree.tree_map(
            lambda x: x.detach() if isinstance(x, torch.Tensor) else x, extra
        )
        return optree.tree_unflatten(treedef, grads), extra

    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
        if not isinstance(state, TrainState):
            raise TypeError(f"state must be a TrainState, got {type(state).__name__}")
        step_key = random.fold_in(state.key, state.step)
        micro = [batch] if accumulate == 1 else _split(batch, accumulate)
        params, model_state, loss_scale = state.params, state.model_state, state.loss_scale

        total = loss = aux = None
        for i, mb in enumerate(micro):
            key = step_key if accumulate == 1 else random.fold_in(step_key, i)
            grads, (mb_loss, model_state, mb_aux) = grads_and_loss(
                params, model_state, mb, key, loss_scale
            )
            leaves, p_def = optree.tree_flatten(grads)
            if total is None:
                total, loss, aux = leaves, mb_loss, mb_aux
            else:
                total = _add(total, leaves)
                loss = loss + mb_loss
                aux = optree.tree_map(torch.add, aux, mb_aux)
        if accumulate > 1:
            total = _mul(total, 1.0 / accumulate)
            loss = loss / accumulate
            aux = optree.tree_map(lambda a: a / accumulate, aux)
        grads = optree.tree_unflatten(p_def, total)

        scaling = _scaling(loss_scale)
        if scaling:
            grads = loss_scale.unscale(grads)
        grad_norm = optim.global_norm(grads)
        finite = torch.isfinite(grad_norm) & torch.isfinite(loss)
        skip = scaling or _transform_active()
        if not skip and not bool(finite):  # one host sync per eager step
            raise NonFiniteLossError(
                f"non-finite loss or gradient at step {int(state.step)}: loss={float(loss)}, "
                f"grad_norm={float(grad_norm)}; lower the learning rate, clip gradients "
                "(clip_norm=...) or use a loss scale"
            )
        if clip_norm is not None:  # torch.nn.utils.clip_grad_norm_'s arithmetic
            coef = torch.clamp(clip_norm / (grad_norm + 1e-6), max=1.0)
            leaves, g_def = optree.tree_flatten(grads)
            grads = optree.tree_unflatten(g_def, _mul(leaves, coef))

        donating = donate and not skip and not torch.compiler.is_compiling()
        kwargs = dict(update_kwargs, donate=True) if donating and donate_kw else update_kwargs
        updates, opt_state = optimizer.update(grads, state.opt_state, params=params, **kwargs)
        del grads, total, leaves  # free the gradients before the new params exist
        new_params = _apply_donated(params, updates) if donating else None
        if new_params is None:
            new_params = optim.apply_updates(params, updates)
        del updates

        metrics: dict[str, torch.Tensor] = {"loss": loss, "grad_norm": grad_norm}
        lr = _find_lr(opt_state)
        if lr is not None:
            metrics["lr"] = lr
        if skip:  # keep params and optimizer state on a non-finite step
            new_params = optim.select_tree(finite, new_params, params)
            opt_state = optim.select_tree(finite, opt_state, state.opt_state)
        if scaling:
            metrics["loss_scale"] = loss_scale.loss_scale
            metrics["skipped"] = (~finite).float()
            loss_scale = loss_scale.adjust(finite)
        elif skip:
            metrics["nonfinite"] = ~finite
        metrics.update(aux)
        new_state = TrainState(
            params=new_params,
            model_state=model_state,
            opt_state=opt_state,
            loss_scale=loss_scale,
            step=state.step + 1,
            key=state.key,
        )
        return new_state, metrics

    return step
