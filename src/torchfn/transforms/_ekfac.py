"""Eigenvalue-corrected K-FAC (EK-FAC; George et al., 2018), the curvature behind
influence functions at scale (Grosse et al., 2023; kronfluence).

K-FAC's block ``G ⊗ A`` has the eigenbasis ``Q_G ⊗ Q_A`` and eigenvalues ``γ_i α_j``.
EK-FAC keeps the basis and replaces the eigenvalues by the curvature's own diagonal in
it, ``Λ_ij = Σ_{n,c} ((Q_Gᵀ DW_nc Q_A)_ij)²`` over the per-example gradients ``DW_nc``
of ``[W | b]`` along the output directions of the Fisher (``c``: the columns of
``Λ_n^½``, sampled targets, or the observed one). That is the best diagonal in the
basis (the GGN block's ``diag((Q_G ⊗ Q_A)ᵀ GGN (Q_G ⊗ Q_A))``), and it is exact where
the examples' contributions do not factor, which K-FAC is not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from torchfn.core import random
from torchfn.core.module import Model
from torchfn.transforms import _layer_probes as lp
from torchfn.transforms._kfac import kfac

__all__ = ["EKFACFactor", "ekfac"]


class EKFACFactor(NamedTuple):
    """One layer's EK-FAC block ``(Q_G ⊗ Q_A) diag(vec Λ) (Q_G ⊗ Q_A)ᵀ`` over
    ``vec([W | b])`` (row-major, ``W`` as ``(out, fan_in)``).

    ``weight`` / ``bias``: the param names. ``QA``: ``(fan_in + 1, fan_in + 1)`` and
    ``QG``: ``(out, out)``, the K-FAC factors' eigenvectors. ``eigenvalues``:
    ``(out, fan_in + 1)``, ``Λ``, summed over the ``num_examples`` examples (divide by
    it for the mean curvature)."""

    weight: str
    bias: str | None
    QA: Tensor
    QG: Tensor
    eigenvalues: Tensor
    num_examples: int


def ekfac(
    model: Model,
    params: dict[str, Tensor],
    x: Tensor,
    *,
    likelihood: str = "classification",
    sigma: float = 1.0,
    fisher: str = "exact",
    key: Tensor | None = None,
    mc_samples: int = 1,
    batch_size: int | None = None,
    layers: Sequence[str] | None = None,
    y: Tensor | None = None,
    state: dict[str, Tensor] | None = None,
) -> dict[str, EKFACFactor]:
    """EK-FAC for every ``nn.Linear`` and ``nn.Conv2d`` layer of ``model``: two passes
    over ``x``, the K-FAC factors (:func:`kfac`) and their eigenvectors, then the
    corrected eigenvalues from per-example gradients projected on them.

    Args:
        model, params, x, likelihood, sigma, fisher, mc_samples, batch_size, layers, y,
        state:
            as :func:`kfac` (``fisher="mc"`` draws the two passes' targets from two keys
            split from ``key``). The layers' inputs must have the batch first.

    Returns:
        ``{layer name: EKFACFactor}``.

    Example (one example: the corrected eigenvalues are the GGN block's diagonal in
    the K-FAC basis)::

        >>> import torch
        >>> from torch import nn
        >>> import torchfn
        >>> from torchfn import random
        >>> model = torchfn.Model(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
        >>> params = model.init(random.key(0))
        >>> x = random.normal(random.key(1), (16, 3))
        >>> f = ekfac(model, params, x)["2"]
        >>> f.QA.shape, f.QG.shape, f.eigenvalues.shape      # (in+1)², out², (out, in+1)
        (torch.Size([5, 5]), torch.Size([2, 2]), torch.Size([2, 5]))
    """
    params, chosen = lp.check_setup(
        "ekfac", model, params, x, likelihood=likelihood, sigma=sigma, fisher=fisher,
        key=key, mc_samples=mc_samples, batch_size=batch_size, y=y, layers=layers)
    k_factors, k_lambda = random.split(key) if key is not None else (None, None)
    factors = kfac(model, params, x, likelihood=likelihood, sigma=sigma, fisher=fisher,
                   key=k_factors, mc_samples=mc_samples, batch_size=batch_size,
                   layers=list(chosen), y=y, state=state)
    basis = {}  # eigenvectors in float64 (as kronfluence): A's spectrum spans decades
    for name, f in factors.items():
        basis[name] = tuple(torch.linalg.eigh(m.double()).eigenvectors.to(m.dtype)
                            for m in (f.A, f.G))
    lam: dict[str, Tensor] = {}
    size = len(x) if batch_size is None else batch_size
    with lp.probed({n: chosen[n] for n in factors}) as records:
        for i, start in enumerate(range(0, len(x), size)):
            xb = x[start:start + size]
            out = lp.forward("ekfac", model, params, xb, records, state)
            V, weight = lp.output_directions(
                out.detach(), likelihood, sigma, fisher,
                None if key is None else random.fold_in(k_lambda, i), mc_samples,
                None if y is None else y[start:start + size])  # (k, n, O)
            for chunk in V.split(lp.DIRECTIONS_PER_PASS):
                gs = lp.grads(out, lp.probes_of(records), chunk)
                for name, calls in lp.by_layer(records, gs).items():
                    QA, QG = basis[name]
                    DW = lp.per_example("ekfac", name, chosen[name], calls, len(xb))
                    proj = torch.einsum("po,knpq,qr->knor", QG, DW, QA)  # Q_Gᵀ DW Q_A
                    lam[name] = lam.get(name, 0.0) + weight * proj.square().sum((0, 1))
    out_factors = {}
    for name, f in factors.items():
        QA, QG = basis[name]
        eig = lam.get(name)
        if eig is None:  # the layer does not reach the output
            eig = QG.new_zeros(QG.shape[0], QA.shape[0])
        out_factors[name] = EKFACFactor(f.weight, f.bias, QA, QG, eig, len(x))
    return out_factors
