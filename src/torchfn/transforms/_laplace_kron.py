"""The ``"kron"`` structure of :func:`laplace`: K-FAC blocks ``G ⊗ A + δ I`` for the
``Linear`` / ``Conv2d`` layers, the exact GGN diagonal plus ``δ`` for the other params.

Each block is kept as its factors' eigendecompositions, ``A = Q_A diag(α) Q_Aᵀ`` and
``G = Q_G diag(γ) Q_Gᵀ``; the block then has eigenvectors ``Q_G ⊗ Q_A`` and eigenvalues
``γ_i α_j + δ``, so any power of it (the solve, the inverse square root that sampling
needs) and its log-determinant cost two small matrix products per block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.func import jacrev, vmap

from torchfn.core.module import Model
from torchfn.transforms._kfac import KronFactor, kfac
from torchfn.transforms._laplace_prior import block_delta, offsets, prior_of
from torchfn.transforms._layer_probes import factorable, output_hessian


class KronPrecision(NamedTuple):
    """The GGN of a ``"kron"`` posterior: ``factors`` ``{layer: KronFactor}`` from
    :func:`kfac`, their eigendecompositions ``eigh`` ``{layer: (α, Q_A, γ, Q_G)}``
    (``A = Q_A diag(α) Q_Aᵀ``, ``G = Q_G diag(γ) Q_Gᵀ``; the block's precision has
    eigenvalues ``γ_i α_j + δ``), and ``diag`` ``{param: GGN diagonal}`` for the params
    outside those layers."""

    factors: dict[str, KronFactor]
    eigh: dict[str, tuple[Tensor, Tensor, Tensor, Tensor]]
    diag: dict[str, Tensor]


def kron_precision(model: Any, params: dict[str, Tensor], all_params: dict[str, Tensor],
                   x: Tensor, out_of: Callable[[Tensor, Tensor], Tensor], theta: Tensor, *,
                   likelihood: str, sigma: float, fisher: str, key: Tensor | None,
                   batch_size: int | None, separate_bias: bool,
                   state: dict[str, Tensor] | None) -> KronPrecision:
    """K-FAC blocks for the layers whose params are all in ``params`` (the posterior's,
    a subset of the network's ``all_params``), the exact GGN diagonal for the rest.
    ``out_of(θ (P,), x_one) -> (O,)`` is one example's output at the flat ``params``."""
    if not isinstance(model, Model):
        raise TypeError(f"laplace: structure='kron' needs apply_fn to be a torchfn.Model "
                        f"(K-FAC reads its layers' inputs), got {type(model).__name__}")
    where = offsets(params)
    owners = {n.rpartition(".")[0] for n in where}  # the layers the subset touches
    layers = [n for n in factorable(model) if n in owners]
    factors = kfac(model, all_params, x, likelihood=likelihood, sigma=sigma, fisher=fisher,
                   key=key, batch_size=batch_size, separate_bias=separate_bias,
                   layers=layers, state=state) if layers else {}
    kept = {}
    for layer, f in factors.items():
        names = [n for n in (f.weight, f.bias) if n is not None]
        inside = [n for n in names if n in where]
        if inside and len(inside) < len(names):
            raise ValueError(f"laplace: subset holds {inside} but not "
                             f"{[n for n in names if n not in where]} of layer {layer!r}; "
                             "take the whole layer, or separate_bias=True")
        if inside:
            kept[layer] = f
    eigh = {}
    for layer, f in kept.items():  # in float64: A's spectrum spans decades
        alpha, QA = (t.to(f.A.dtype) for t in torch.linalg.eigh(f.A.double()))
        gamma, QG = (t.to(f.G.dtype) for t in torch.linalg.eigh(f.G.double()))
        eigh[layer] = (alpha.clamp(min=0), QA, gamma.clamp(min=0), QG)
    covered = {n for f in kept.values() for n in (f.weight, f.bias) if n is not None}
    rest = [n for n in where if n not in covered]
    diag: dict[str, Tensor] = {}
    if rest:  # the exact GGN diagonal of the params outside Linear/Conv2d layers
        index = torch.cat([torch.arange(where[n][0], sum(where[n]), device=theta.device)
                           for n in rest])

        def sub_out(sub: Tensor, x_one: Tensor) -> Tensor:
            return out_of(theta.index_put((index,), sub), x_one)

        size = len(x) if batch_size is None else batch_size
        d = theta.new_zeros(len(index))
        for start in range(0, len(x), size):
            xb = x[start:start + size]
            J = vmap(jacrev(sub_out), in_dims=(None, 0))(theta[index], xb)  # (n, O, p)
            out = vmap(out_of, in_dims=(None, 0))(theta, xb)  # (n, O)
            lam = vmap(lambda o: output_hessian(likelihood, o, sigma))(out)  # (n, O, O)
            d = d + torch.einsum("nop,noq,nqp->p", J, lam, J)
        diag = dict(zip(rest, d.split([where[n][1] for n in rest])))
    return KronPrecision(kept, eigh, diag)


def kron_power_times(prec: KronPrecision, prior: Any, params: Any, M: Tensor,
                     power: float) -> Tensor:
    """``H^power M`` for ``M (P, m)``, ``H`` the block-diagonal precision (GGN plus the
    prior's ``δ``, one per block or param): ``power = -1`` solves, ``-1/2`` maps standard
    normals to posterior draws."""
    where = offsets(params)
    out = torch.empty_like(M)
    m = M.shape[1]
    for layer, (alpha, QA, gamma, QG) in prec.eigh.items():
        f = prec.factors[layer]
        delta = block_delta(prior, f.weight, f.bias, "laplace")
        w0, wn = where[f.weight]
        rows = len(gamma)
        X = M[w0:w0 + wn].reshape(rows, -1, m)  # (out, fan_in, m)
        if f.bias is not None:
            b0, bn = where[f.bias]
            X = torch.cat([X, M[b0:b0 + bn].reshape(rows, 1, m)], 1)  # (out, fan_in + 1, m)
        Z = torch.einsum("po,pqm,qr->orm", QG, X, QA)  # Q_Gᵀ X Q_A
        Z = Z * (gamma[:, None] * alpha[None, :] + delta).pow(power)[:, :, None]
        Y = torch.einsum("po,orm,qr->pqm", QG, Z, QA)  # Q_G Z Q_Aᵀ
        if f.bias is not None:
            out[b0:b0 + bn] = Y[:, -1]
            Y = Y[:, :-1]
        out[w0:w0 + wn] = Y.reshape(wn, m)
    for name, d in prec.diag.items():
        start, n = where[name]
        delta = prior_of(prior, name)
        out[start:start + n] = M[start:start + n] * (d + delta).pow(power)[:, None]
    return out


def kron_eigenvalues(prec: KronPrecision) -> dict[tuple[str, ...], Tensor]:
    """The GGN's eigenvalues by group of params that share one ``δ``: a block's
    ``γ_i α_j`` under its params' names, each other param's diagonal under its own."""
    out = {}
    for layer, (alpha, _, gamma, _) in prec.eigh.items():
        f = prec.factors[layer]
        names = (f.weight,) if f.bias is None else (f.weight, f.bias)
        out[names] = (gamma[:, None] * alpha[None, :]).reshape(-1)
    out.update({(name,): d.reshape(-1) for name, d in prec.diag.items()})
    return out


def kron_logdet(prec: KronPrecision, prior: Any) -> Tensor:
    """``log det(GGN + δ)`` from the eigenvalues: ``Σ log(γ_i α_j + δ)`` per block."""
    return sum((lam + block_delta(prior, names[0], names[-1] if len(names) > 1 else None,
                                  "laplace_log_marginal")).log().sum()
               for names, lam in kron_eigenvalues(prec).items())
