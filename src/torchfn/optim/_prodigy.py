"""Prodigy (Mishchenko & Defazio 2024): Adam whose step size D is estimated as it
trains, from how far the params have moved against the gradients. Equal to the
``prodigyopt`` package's ``Prodigy``.

    dlr = D lr c_t                                 (c_t = Adam's bias correction, or 1)
    m = b1 m + (1 - b1) D g        v = b2 v + (1 - b2) D^2 g^2
    s = b3 s + (D / D0) dlr g      r = b3 r + (D / D0) dlr <g, p0 - p>
    D <- min(D_max, D growth),  D_max = max(D_max, d_coef r / ||s||_1)
    update = -dlr m / (sqrt(v) + D eps)  - dlr wd p

Where ``prodigyopt`` reads four numbers back to the host per leaf per step, this
keeps D and its sums in 0-d tensors: no syncs, and the update compiles and vmaps.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from torchfn.optim import _checks, _ops
from torchfn.optim._base import GradientTransformation, check_state, lr_at, new_count
from torchfn.optim._tree import check_params, check_structure

__all__ = ["ProdigyState", "prodigy"]


class ProdigyState(NamedTuple):
    count: Tensor  # () int32, steps taken
    d: Tensor  # () float64, the step-size estimate D
    d_max: Tensor  # () float64
    d_numerator: Tensor  # () float64, r
    p0: Any  # the initial params, flattened and sliced: (numel // slice_p,) per leaf
    s: Any  # the weighted gradient sum, like p0
    mu: Any  # first moments, params' structure (() leaves when b1 = 0)
    nu: Any  # second moments, params' structure


def _per_dtype(**values: Tensor):
    """``dtype -> {name: value cast to dtype}``, each dtype cast once per step."""
    cache: dict[torch.dtype, dict[str, Tensor]] = {}

    def get(dtype: torch.dtype) -> dict[str, Tensor]:
        if dtype not in cache:
            cache[dtype] = {k: v.to(dtype) for k, v in values.items()}
        return cache[dtype]

    return get


def prodigy(
    lr: Any = 1.0,
    betas: tuple[Any, Any] = (0.9, 0.999),
    beta3: float | None = None,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    decouple: bool = True,
    use_bias_correction: bool = False,
    safeguard_warmup: bool = False,
    d0: float = 1e-6,
    d_coef: float = 1.0,
    growth_rate: float = math.inf,
    slice_p: int = 1,
) -> GradientTransformation:
    """Prodigy, equal to ``prodigyopt.Prodigy`` (the same arguments and defaults).

    Args:
        lr: a multiplier on the estimated step (keep 1.0; a schedule may decay it).
        betas: Adam's (b1, b2); b1 = 0 drops the first moment.
        beta3: decay of the estimate's sums (None: sqrt(b2)).
        eps: added to the denominator (scaled by D).
        weight_decay: decoupled (AdamW) by default, else L2 (``decouple=False``).
        use_bias_correction: Adam's bias correction in the step.
        safeguard_warmup: weight ``s`` by D instead of D lr (for warm-up schedules).
        d0: the initial estimate (> 0). d_coef: a multiplier on the estimate.
        growth_rate: the most D may grow per step.
        slice_p: estimate D from every ``slice_p``-th element only (saves memory).

    Example:
        >>> import torch
        >>> from torchfn import optim
        >>> tx = optim.prodigy()
        >>> params = {"w": torch.tensor([5.0, -3.0])}
        >>> state = tx.init(params)
        >>> for _ in range(300):
        ...     grads = {"w": 2 * params["w"]}  # minimise |w|^2, no lr tuned
        ...     updates, state = tx.update(grads, state, params)
        ...     params = optim.apply_updates(params, updates)
        >>> bool(state.d > 1e-3), bool(params["w"].abs().max() < 0.5)
        (True, True)
    """
    _checks.lr(lr)
    b1, b2 = _checks.betas(betas)
    if beta3 is not None:
        _checks.unit_interval("beta3", beta3)
    b3 = math.sqrt(b2) if beta3 is None else beta3
    _checks.positive("eps", eps)
    _checks.nonneg("weight_decay", weight_decay)
    _checks.positive("d0", d0)
    _checks.positive("d_coef", d_coef)
    _checks.positive("growth_rate", growth_rate)
    _checks.positive_int("slice_p", slice_p)
    has_wd = weight_decay != 0

    def _sliced(x: Tensor) -> Tensor:
        return x.reshape(-1)[::slice_p]

    def init(params: Any) -> ProdigyState:
        leaves, spec = optree.tree_flatten(params)
        count = new_count(leaves)
        scalar = lambda v: torch.full((), v, dtype=torch.float64, device=count.device)  # noqa: E731
        return ProdigyState(
            count, scalar(d0), scalar(d0), scalar(0.0),
            optree.tree_unflatten(spec, [_sliced(x).detach().clone() for x in leaves]),
            optree.tree_unflatten(spec, [torch.zeros_like(_sliced(x)) for x in leaves]),
            optree.tree_unflatten(spec, _ops.zeros_like(leaves) if b1 > 0 else
                                  [x.new_zeros(()) for x in leaves]),
            optree.tree_unflatten(spec, _ops.zeros_like(leaves)),
        )

    def update(grads: Any, state: ProdigyState, params: Any = None, *, inplace: Any = None):
        check_state(state, ProdigyState, "prodigy")
        g, spec = optree.tree_flatten(grads)
        if not g:
            return grads, state
        nu = check_structure(state.nu, "optimizer state", grads, "grads")
        mu, p0, s = (optree.tree_leaves(x) for x in (state.mu, state.p0, state.s))
        p = check_params(params, spec, "prodigy")
        lr_t = lr_at(lr, state.count)
        d, d_max = state.d, state.d_max
        if use_bias_correction:
            t = (state.count + 1).to(torch.float64)
            dlr = d * lr_t * torch.sqrt(1 - b2**t) / (1 - b1**t)
        else:
            dlr = d * lr_t
        if has_wd and not decouple:
            g = _ops.add(g, p, alpha=weight_decay)

        # In place on the fresh per-leaf temporaries where no transform or autograd
        # looks: on a CPU every new parameter-sized tensor costs page faults.
        fresh = _ops.can_mutate(g)
        ratio = d / d0
        s_weight = ratio * (d if safeguard_warmup else dlr)
        c_mu, c_nu = d * (1 - b1), d * d * (1 - b2)
        scalars = _per_dtype(s_weight=s_weight, nu_in=b2 / c_nu, c_nu=c_nu, c_mu=c_mu)
        dots, l1s, new_s, new_mu, new_nu = [], [], [], [], []
        for gi, pi, a, si, mi, vi in zip(g, p, p0, s, mu, nu):
            g_sl = _sliced(gi)
            dots.append(torch.dot(g_sl, a - _sliced(pi)).to(torch.float64))
            if fresh:
                c = scalars(gi.dtype)
                si = (si * b3).addcmul_(g_sl, c["s_weight"])
                # b2 v + c g^2 == c (v b2 / c + g^2); c = D^2 (1 - b2) > 0: one buffer
                vi = (vi * c["nu_in"]).addcmul_(gi, gi).mul_(c["c_nu"])
                if b1 > 0:
                    mi = (mi * b1).addcmul_(gi, c["c_mu"])
            else:
                si = si * b3 + g_sl * s_weight
                vi = vi * b2 + gi * gi * c_nu
                if b1 > 0:
                    mi = mi * b1 + gi * c_mu
            l1s.append(torch.linalg.vector_norm(si, ord=1).to(torch.float64))
            new_s.append(si)
            new_mu.append(mi)
            new_nu.append(vi)
        numerator = state.d_numerator * b3 + ratio * dlr * torch.stack(dots).sum()
        denom_sum = torch.stack(l1s).sum()

        # no progress yet (all-zero gradients so far): prodigyopt skips the step and
        # keeps D, its numerator and the step count
        live = denom_sum > 0
        d_hat = d_coef * numerator / torch.where(live, denom_sum, 1.0)
        d_new = torch.where(d == d0, torch.maximum(d, d_hat), d)
        d_max_new = torch.maximum(d_max, d_hat)
        d_new = torch.minimum(d_max_new, d_new * growth_rate)
        d_new = torch.where(live, d_new, d)
        d_max_new = torch.where(live, d_max_new, d_max)
        numerator = torch.where(live, numerator, state.d_numerator)

        step = -torch.where(live, dlr, 0.0)
        scalars = _per_dtype(eps=d_new * eps, scale=step if b1 > 0 else step * d_new,
                             decay=step * weight_decay)
        updates = []
        for gi, pi, mi, vi in zip(g, p, new_mu, new_nu):
            num, scale = (mi, step) if b1 > 0 else (gi, step * d_new)
            if fresh:  # num / (sqrt(v) + D eps) * scale, in the denominator's buffer
                c = scalars(gi.dtype)
                u = vi.sqrt().add_(c["eps"]).reciprocal_().mul_(num).mul_(c["scale"])
                if has_wd and decouple:
                    u.addcmul_(pi, c["decay"])
            else:
                u = num / (torch.sqrt(vi) + d_new * eps) * scale
                if has_wd and decouple:
                    u = u + pi * (step * weight_decay)
            updates.append(u)
        mu, nu, s = new_mu, new_nu, new_s
        new_state = ProdigyState(
            state.count + live.to(state.count.dtype), d_new, d_max_new, numerator,
            state.p0, optree.tree_unflatten(spec, s),
            optree.tree_unflatten(spec, mu), optree.tree_unflatten(spec, nu),
        )
        return optree.tree_unflatten(spec, updates), new_state

    return GradientTransformation(init, update)
