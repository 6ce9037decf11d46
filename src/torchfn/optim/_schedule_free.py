"""Schedule-free SGD and AdamW (Defazio et al. 2024, "The Road Less Scheduled"), equal
to the ``schedulefree`` package's ``SGDScheduleFree`` / ``AdamWScheduleFree``.

Three sequences: ``z`` takes plain steps, ``x`` is their running average (what you
evaluate), and the params you train on are ``y = (1 - beta) z + beta x``:

    d = g / (sqrt(v / (1 - b2^t)) + eps) + wd y     (AdamW; SGD: d = g + wd y)
    c = w_t / (w_1 + ... + w_t),   w_t = t^r * max_lr_so_far^weight_lr_power
    y <- lerp(y, z, c) + lr (beta (1 - c) - 1) d
    z <- z - lr d

No learning-rate schedule is needed (``warmup_steps`` ramps lr up linearly). The
state holds ``z``; ``schedule_free_eval_params(state, params)`` gives ``x``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from torchfn.optim import _checks, _ops
from torchfn.optim._base import GradientTransformation, check_state, lr_at, new_count
from torchfn.optim._tree import check_params, check_structure

__all__ = [
    "ScheduleFreeState",
    "schedule_free_adamw",
    "schedule_free_eval_params",
    "schedule_free_sgd",
]


class ScheduleFreeState(NamedTuple):
    count: Tensor  # () int32, steps taken
    z: Any  # the plain iterate, params' structure
    nu: Any  # AdamW's second moments (params' structure); SGD: ()
    weight_sum: Tensor  # () float64, sum of the averaging weights so far
    lr_max: Tensor  # () float64, the largest lr so far
    beta: Tensor  # () float64, the interpolation coefficient (b1 / momentum), for eval


def _schedule_free(lr, beta, b2, eps, weight_decay, warmup_steps, r, weight_lr_power, name):
    _checks.lr(lr)
    _checks.unit_interval("beta" if b2 is None else "betas[0]", beta)
    if not isinstance(beta, Tensor) and beta == 0:
        raise ValueError(f"{name}: the momentum (beta) must be > 0 for eval params, got 0")
    _checks.nonneg("weight_decay", weight_decay)
    _checks.positive_int("warmup_steps", warmup_steps, minimum=0)
    _checks.nonneg("r", r)
    _checks.nonneg("weight_lr_power", weight_lr_power)
    adam = b2 is not None
    has_wd = not _checks.is_zero(weight_decay)

    def init(params: Any) -> ScheduleFreeState:
        leaves, spec = optree.tree_flatten(params)
        count = new_count(leaves)
        zero = torch.zeros((), dtype=torch.float64, device=count.device)
        return ScheduleFreeState(
            count,
            optree.tree_unflatten(spec, [x.detach().clone() for x in leaves]),
            optree.tree_unflatten(spec, _ops.zeros_like(leaves)) if adam else (),
            zero,
            zero - 1.0,
            torch.as_tensor(beta, dtype=torch.float64, device=count.device),
        )

    def update(grads: Any, state: ScheduleFreeState, params: Any = None, *, inplace: Any = None):
        check_state(state, ScheduleFreeState, name)
        g, spec = optree.tree_flatten(grads)
        z = check_structure(state.z, "optimizer state", grads, "grads")
        y = check_params(params, spec, name)
        count = state.count + 1
        t = count.to(torch.float64)
        lr_t = lr_at(lr, state.count)
        if warmup_steps > 0:
            lr_t = lr_t * torch.clamp(t / warmup_steps, max=1.0)
        lr_max = torch.maximum(state.lr_max, torch.as_tensor(lr_t, dtype=torch.float64))
        weight = t**r * lr_max**weight_lr_power
        weight_sum = state.weight_sum + weight
        c = torch.where(weight_sum > 0, weight / weight_sum, 0.0)

        nu = state.nu
        if adam:
            nu = _ops.addcmul_(_ops.mul(optree.tree_leaves(state.nu), b2), g, g, 1 - b2)
            bc2_sqrt = torch.sqrt(1 - b2**t)
            # g / (sqrt(v) / c2 + eps) == c2 g / (sqrt(v) + c2 eps)
            d = _ops.mul_(_ops.div_into_(g, _ops.add_scalar_(_ops.sqrt(nu), eps * bc2_sqrt)),
                          bc2_sqrt)
            nu = optree.tree_unflatten(spec, nu)
        else:
            d = list(g)
        if has_wd:
            d = _ops.add(d, y, alpha=weight_decay)
        # y_new - y = c (z - y) + lr (beta (1 - c) - 1) d
        toward_z = _ops.mul_(_ops.add(z, y, alpha=-1.0), c)
        updates = _ops.add_(toward_z, d, alpha=lr_t * (beta * (1 - c) - 1))
        new_z = _ops.add(z, d, alpha=-lr_t)
        new_state = ScheduleFreeState(
            count, optree.tree_unflatten(spec, new_z), nu, weight_sum, lr_max, state.beta
        )
        return optree.tree_unflatten(spec, updates), new_state

    return GradientTransformation(init, update)


def schedule_free_adamw(
    lr: Any = 2.5e-3,
    betas: tuple[Any, Any] = (0.9, 0.999),
    eps: Any = 1e-8,
    weight_decay: Any = 0.0,
    *,
    warmup_steps: int = 0,
    r: float = 0.0,
    weight_lr_power: float = 2.0,
) -> GradientTransformation:
    """Schedule-free AdamW, equal to ``schedulefree.AdamWScheduleFree`` (its defaults).

    Train on the params this updates (``y``); evaluate and save
    ``schedule_free_eval_params(state, params)`` (``x``). Needs params.

    Args:
        lr: learning rate >= 0, a 0-d tensor or a schedule (usually a constant).
        betas: ``(b1, b2)``; b1 > 0 interpolates between ``z`` and ``x``, b2 decays v.
        eps: added to the denominator.
        weight_decay: decoupled, evaluated at ``y``.
        warmup_steps: linear warm-up of lr over this many steps.
        r, weight_lr_power: the averaging weights ``t^r * max_lr^weight_lr_power``.

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> params = {"w": torch.tensor([3.0])}
        >>> tx = optim.schedule_free_adamw(0.1, warmup_steps=5)
        >>> state = tx.init(params)
        >>> for _ in range(100):
        ...     grads = {"w": 2 * params["w"]}  # d/dw of w^2
        ...     updates, state = tx.update(grads, state, params)
        ...     params = optim.apply_updates(params, updates)
        >>> x = optim.schedule_free_eval_params(state, params)
        >>> bool(abs(x["w"]) < 0.1)
        True
    """
    b1, b2 = _checks.betas(betas)
    _checks.nonneg("eps", eps)
    return _schedule_free(lr, b1, b2, eps, weight_decay, warmup_steps, r, weight_lr_power,
                          "schedule_free_adamw")


def schedule_free_sgd(
    lr: Any = 1.0,
    momentum: Any = 0.9,
    weight_decay: Any = 0.0,
    *,
    warmup_steps: int = 0,
    r: float = 0.0,
    weight_lr_power: float = 2.0,
) -> GradientTransformation:
    """Schedule-free SGD, equal to ``schedulefree.SGDScheduleFree`` (its defaults).

    ``momentum`` in (0, 1) is the interpolation coefficient beta. Needs params.

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> params = {"w": torch.tensor([1.0])}
        >>> tx = optim.schedule_free_sgd(0.1)
        >>> u, state = tx.update({"w": torch.tensor([1.0])}, tx.init(params), params)
        >>> u["w"]  # c = 1 at the first step: y moves to z, then by lr (beta * 0 - 1) g
        tensor([-0.1000])
    """
    return _schedule_free(lr, momentum, None, 0.0, weight_decay, warmup_steps, r,
                          weight_lr_power, "schedule_free_sgd")


def _find_state(state: Any) -> ScheduleFreeState:
    found = []

    def visit(s: Any) -> None:
        if isinstance(s, ScheduleFreeState):
            found.append(s)
        elif isinstance(s, (tuple, list)):
            for item in s:
                visit(item)
        elif isinstance(s, dict):
            for item in s.values():
                visit(item)

    visit(state)
    if len(found) != 1:
        raise ValueError(
            "schedule_free_eval_params: state must hold exactly one ScheduleFreeState "
            f"(from schedule_free_adamw / schedule_free_sgd), found {len(found)}"
        )
    return found[0]


def schedule_free_eval_params(state: Any, params: Any) -> Any:
    """The averaged params ``x`` to evaluate and save: ``y + (1 - 1/beta) (z - y)``.

    ``state`` is a schedule-free state, or a chain's state holding one; ``params``
    are the trained ``y``. Pure: neither is changed.
    """
    sf = _find_state(state)
    y, spec = optree.tree_flatten(params)
    z = check_structure(sf.z, "schedule-free state's z", params, "params")
    x = _ops.add_(_ops.mul_(_ops.add(z, y, alpha=-1.0), 1 - 1 / sf.beta), y)
    return optree.tree_unflatten(spec, x)
