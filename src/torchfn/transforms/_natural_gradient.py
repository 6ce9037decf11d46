"""K-FAC as an optimizer (Martens & Grosse, 2015): natural-gradient steps preconditioned
by running averages of the Kronecker factors, state in and state out.

Per ``Linear`` / ``Conv2d`` layer the Fisher of the MEAN loss is ``(G / n) ⊗ A`` on
``vec([W | b])`` (:func:`kfac`'s factors over a batch of ``n``). A step keeps
exponential moving averages of ``A`` and ``G / n``, inverts them damped every
``inverse_every`` curvature updates, and maps each layer's gradient ``∇ = [∇W | ∇b]`` to

    (G + (√λ / π) I)⁻¹ ∇ (A + π √λ I)⁻¹,    π = sqrt((tr A / dim A) / (tr G / dim G))

(Tikhonov damping ``λ`` split between the factors by Martens & Grosse's π). Other
params (norms, embeddings) keep their plain gradient. The preconditioned gradient goes
to any optimizer (``optim.sgd`` with momentum, as K-FAC's authors) as ``grads``.

    state = kfac_curvature(None, model, params, x, key=k)        # the first batch
    for step, (x, y) in enumerate(batches):
        g = torch.func.grad(loss)(params, x, y)
        state = kfac_curvature(state, model, params, x, key=random.fold_in(k, step))
        updates, opt = sgd.update(kfac_precondition(state, g), opt, params)
        params = optim.apply_updates(params, updates)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from torchfn.core.module import Model
from torchfn.transforms._kfac import KronFactor, kfac

__all__ = ["KFACState", "kfac_curvature", "kfac_precondition"]


class KFACState(NamedTuple):
    """``factors``: ``{layer: KronFactor}`` the running averages (``A``, and ``G`` per
    example); ``inverses``: ``{layer: (G_damped⁻¹, A_damped⁻¹)}``; ``count``: ``()``
    int64, curvature updates so far; ``damping``: ``λ``."""

    factors: dict[str, KronFactor]
    inverses: dict[str, tuple[Tensor, Tensor]]
    count: Tensor
    damping: float


def _damped_inverses(f: KronFactor, damping: float) -> tuple[Tensor, Tensor]:
    dim_a, dim_g = f.A.shape[0], f.G.shape[0]
    tr_a = f.A.diagonal().sum() / dim_a
    tr_g = f.G.diagonal().sum() / dim_g
    pi = (tr_a / tr_g).sqrt() if bool(tr_a > 0) and bool(tr_g > 0) else tr_a.new_ones(())
    root = damping ** 0.5
    eye_a = torch.eye(dim_a, dtype=f.A.dtype, device=f.A.device)
    eye_g = torch.eye(dim_g, dtype=f.G.dtype, device=f.G.device)
    return (torch.linalg.inv(f.G + root / pi * eye_g),
            torch.linalg.inv(f.A + pi * root * eye_a))


def kfac_curvature(
    state: KFACState | None,
    model: Model,
    params: dict[str, Tensor],
    x: Tensor,
    *,
    key: Tensor | None = None,
    decay: float = 0.95,
    damping: float = 1e-3,
    inverse_every: int = 1,
    likelihood: str = "classification",
    sigma: float = 1.0,
    fisher: str = "mc",
    y: Tensor | None = None,
    model_state: dict[str, Tensor] | None = None,
) -> KFACState:
    """One curvature update: the batch's K-FAC factors folded into the running
    averages, and the damped inverses refreshed when due.

    Args:
        state: the previous :class:`KFACState`, or None for the first batch (the
            averages start at its factors).
        model, params, x: as :func:`kfac`, at the current params.
        key: the sampled targets' key (``fisher="mc"``, the default, as K-FAC's
            authors); ``fisher="exact"`` takes ``O`` directions per example.
        decay: the averages' ``A ← decay A + (1 - decay) A_batch`` (and ``G``).
        damping: ``λ``, Tikhonov damping split by π between the factors.
        inverse_every: refresh the inverses on every this-many-th update (the first
            update always inverts); in between the steps use the stale ones.
        likelihood, sigma, y: as :func:`kfac`.
        model_state: the model's buffers (BatchNorm statistics), eval mode.

    Returns:
        The new :class:`KFACState` (``state`` is not modified).

    Example (linear least squares: one undamped step lands on the solution)::

        >>> import torch
        >>> from torch import nn
        >>> import torchfn
        >>> from torchfn import random
        >>> model = torchfn.Model(nn.Linear(3, 1).double())
        >>> params = model.init(random.key(0))
        >>> x = random.normal(random.key(1), (40, 3), dtype=torch.float64)
        >>> y = x @ torch.tensor([[1.0], [-2.0], [0.5]], dtype=torch.float64) + 0.3
        >>> loss = lambda p: 0.5 * ((model(p, x) - y) ** 2).sum(-1).mean()
        >>> state = kfac_curvature(None, model, params, x, likelihood="regression",
        ...                        fisher="exact", damping=1e-12)
        >>> step = kfac_precondition(state, torch.func.grad(loss)(params))
        >>> params = {k: params[k] - step[k] for k in params}
        >>> torch.allclose(params["weight"], torch.tensor([[1.0, -2.0, 0.5]],
        ...                dtype=torch.float64)) and bool(params["bias"].isclose(
        ...                torch.tensor(0.3, dtype=torch.float64)))
        True
    """
    if state is not None and not isinstance(state, KFACState):
        raise TypeError(f"kfac_curvature: state must be a KFACState or None, got "
                        f"{type(state).__name__}")
    if not _real(decay) or not 0 <= decay < 1:
        raise ValueError(f"kfac_curvature: decay must be a float in [0, 1), got {decay!r}")
    if not _real(damping) or not damping >= 0:
        raise ValueError(f"kfac_curvature: damping must be a float >= 0, got {damping!r}")
    if not isinstance(inverse_every, int) or isinstance(inverse_every, bool) or inverse_every < 1:
        raise ValueError(f"kfac_curvature: inverse_every must be a positive int, got "
                         f"{inverse_every!r}")
    batch = kfac(model, params, x, likelihood=likelihood, sigma=sigma, fisher=fisher,
                 key=key, y=y, state=model_state)
    batch = {n: f._replace(G=f.G / len(x)) for n, f in batch.items()}  # the mean loss's
    if state is None:
        factors, count = batch, torch.zeros((), dtype=torch.int64)
    else:
        if set(state.factors) != set(batch):
            raise ValueError(f"kfac_curvature: state has layers {sorted(state.factors)}, "
                             f"this batch reached {sorted(batch)}")
        factors = {n: f._replace(A=decay * f.A + (1 - decay) * batch[n].A,
                                 G=decay * f.G + (1 - decay) * batch[n].G)
                   for n, f in state.factors.items()}
        count = state.count
    due = state is None or int(count) % inverse_every == 0 or damping != state.damping
    inverses = ({n: _damped_inverses(f, float(damping)) for n, f in factors.items()}
                if due else state.inverses)
    return KFACState(factors, inverses, count + 1, float(damping))


def _real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def kfac_precondition(state: KFACState, grads: dict[str, Tensor]) -> dict[str, Tensor]:
    """``grads`` with each K-FAC layer's ``[∇W | ∇b]`` mapped to
    ``G_damped⁻¹ [∇W | ∇b] A_damped⁻¹``; the other entries unchanged.

    Args:
        state: from :func:`kfac_curvature`.
        grads: ``{name: tensor}``, the params' gradient (of the mean loss).

    Returns:
        A new dict of the same names and shapes (``grads`` is not modified).

    Example::

        >>> import torch
        >>> from torch import nn
        >>> import torchfn
        >>> from torchfn import random
        >>> model = torchfn.Model(nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8),
        ...                                     nn.Linear(8, 3)))
        >>> params = model.init(random.key(0))
        >>> x = random.normal(random.key(1), (32, 4))
        >>> state = kfac_curvature(None, model, params, x, key=random.key(2))
        >>> grads = {k: torch.ones_like(v) for k, v in params.items()}
        >>> step = kfac_precondition(state, grads)
        >>> bool(torch.equal(step["1.weight"], grads["1.weight"]))   # LayerNorm: as is
        True
        >>> step["2.weight"].shape
        torch.Size([3, 8])
    """
    if not isinstance(state, KFACState):
        raise TypeError(f"kfac_precondition: state must be a KFACState (from "
                        f"kfac_curvature), got {type(state).__name__}")
    if not isinstance(grads, dict):
        raise TypeError(f"kfac_precondition: grads must be the params' gradient dict, got "
                        f"{type(grads).__name__}")
    out = dict(grads)
    for name, f in state.factors.items():
        missing = [n for n in (f.weight, f.bias) if n is not None and n not in grads]
        if missing:
            raise ValueError(f"kfac_precondition: grads lack {missing} of layer {name!r}")
        g_inv, a_inv = state.inverses[name]
        w = grads[f.weight]
        mat = w.reshape(w.shape[0], -1)  # (out, fan_in)
        if f.bias is not None:
            mat = torch.cat([mat, grads[f.bias][:, None]], 1)  # (out, fan_in + 1)
        mat = g_inv @ mat @ a_inv
        if f.bias is not None:
            out[f.bias] = mat[:, -1]
            mat = mat[:, :-1]
        out[f.weight] = mat.reshape(w.shape)
    return out
