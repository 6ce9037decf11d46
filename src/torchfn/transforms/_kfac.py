"""Kronecker-factored curvature (K-FAC) of a network's generalised Gauss-Newton matrix
(Martens & Grosse, 2015; Grosse & Martens, 2016 for convolutions; Eschenhagen et al.,
2023, "K-FAC expand", for layers applied at many positions).

For a ``Linear`` layer ``s = W a + b`` write ``ā = [a, 1]`` (the input with a one for the
bias) and ``Θ = [W | b]`` ``(out, in + 1)``. Example ``n``'s GGN block of ``vec(Θ)``
(row-major) is ``Σ_c (g_nc ⊗ ā_n)(g_nc ⊗ ā_n)ᵀ``, ``g_nc = ∂(f_n · L_n[:, c]) / ∂s_n``
the output gradient along a column of ``Λ_n = L_n L_nᵀ`` (the likelihood's Hessian in
the output). K-FAC replaces the sum over examples of Kronecker products by the
Kronecker product of sums::

    Σ_n GGN_n  ≈  G ⊗ A,    G = Σ_{n,c} g gᵀ  (out, out),    A = Σ_n ā āᵀ / N  (in+1, in+1)

exact for one example, and for a regression network's last layer (``g`` is the same
``I / σ`` for every example). A layer applied at ``T`` positions per example (tokens; a
convolution's output pixels, with ``ā`` the unfolded input patch) counts each position
as an example ("expand": ``N T`` rows in both sums). ``fisher="mc"`` replaces the
``L`` columns by the gradient of the loss at sampled targets (``y ~ p(y | f)``): an
unbiased estimate of ``G`` for any number of classes in one backward pass;
``fisher="empirical"`` by the gradient at the observed targets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from torchfn.core import random
from torchfn.core.module import Model
from torchfn.transforms import _layer_probes as lp

__all__ = ["KronFactor", "kfac"]


class KronFactor(NamedTuple):
    """One layer's K-FAC block ``G ⊗ A`` over ``vec([W | b])`` (row-major; ``W`` viewed
    as ``(out, fan_in)``, a ``Conv2d``'s ``(out, in·kh·kw)``).

    ``weight`` / ``bias``: the param names (``bias`` None for a layer without one).
    ``A``: ``(fan_in + 1, fan_in + 1)`` (``fan_in`` without a bias), the mean of ``ā āᵀ``
    over the ``N T`` rows; ``G``: ``(out, out)``, the sum of ``g gᵀ``."""

    weight: str
    bias: str | None
    A: Tensor
    G: Tensor


def kfac(
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
    separate_bias: bool = False,
    layers: Sequence[str] | None = None,
    y: Tensor | None = None,
    state: dict[str, Tensor] | None = None,
) -> dict[str, KronFactor]:
    """K-FAC factors of the GGN ``Σ_n J_nᵀ Λ_n J_n`` of ``x``'s likelihood, for every
    ``nn.Linear`` and ``nn.Conv2d`` layer of ``model`` that the forward pass uses.

    Args:
        model: a :class:`torchfn.Model`; ``model.apply(params, x)`` maps a batch
            ``(n, ...)`` to outputs ``(n, O)`` (logits, or the regression mean).
        params: its params (the MAP, for a Laplace approximation).
        x: ``(N, ...)`` the inputs (the GGN does not need the targets).
        likelihood: ``"classification"`` (softmax cross entropy) or ``"regression"``
            (Gaussian with noise ``sigma``).
        fisher: ``"exact"`` (the GGN: ``O`` output directions per example, one per
            column of ``Λ^½``, in one vmapped backward pass), ``"mc"`` (the Fisher by
            ``mc_samples`` sampled targets; needs ``key``) or ``"empirical"`` (the
            empirical Fisher, at the targets ``y``; Kunstner et al., 2019, on why it is
            a poor curvature estimate, but kronfluence and others offer it).
        y: ``(N, ...)`` the targets, for ``fisher="empirical"`` (class indices, or the
            regression targets).
        state: the model's buffers (BatchNorm statistics, from ``model.init_state()``
            or training), for a model that has them; the model runs in eval mode.
        batch_size: examples per forward pass (None: all of them at once).
        separate_bias: give each bias its own block ``G ⊗ [1]`` (key ``"<layer>.bias"``)
            and the weight ``G ⊗ A`` without the bias row, dropping the weight-bias
            cross terms, as laplace-torch and curvlinops' default do. The default keeps
            ``[W | b]`` as one block (Martens & Grosse's homogeneous coordinates).
        layers: the names of the layers to factor (e.g. only the last); None: every
            ``nn.Linear`` and ``nn.Conv2d``.

    Returns:
        ``{layer name: KronFactor}`` (``named_modules`` names; ``""`` for a bare
        layer), in the order the layers were first called. Parameters of other layers
        (norms, embeddings) have no factor.

    Example (a one-layer regression: K-FAC is exact, ``G ⊗ A = Σ_n J_nᵀ J_n / σ²``)::

        >>> import torch
        >>> from torch import nn
        >>> import torchfn
        >>> from torchfn import random
        >>> model = torchfn.Model(nn.Sequential(nn.Linear(3, 2)))
        >>> params = model.init(random.key(0))
        >>> x = random.normal(random.key(1), (10, 3))
        >>> f = kfac(model, params, x, likelihood="regression")["0"]    # layer "0"
        >>> f.A.shape, f.G.shape                    # (in + 1, in + 1), (out, out)
        (torch.Size([4, 4]), torch.Size([2, 2]))
        >>> xb = torch.cat([x, torch.ones(10, 1)], 1)
        >>> torch.allclose(torch.kron(f.G, f.A), torch.kron(torch.eye(2), xb.T @ xb), atol=1e-5)
        True
    """
    if not isinstance(separate_bias, bool):
        raise TypeError(f"kfac: separate_bias must be a bool, got {separate_bias!r}")
    params, layers = lp.check_setup(
        "kfac", model, params, x, likelihood=likelihood, sigma=sigma, fisher=fisher, key=key,
        mc_samples=mc_samples, batch_size=batch_size, y=y, layers=layers)
    sums: dict[str, list] = {}  # name -> [Σ ā āᵀ, Σ g gᵀ, rows]
    size = len(x) if batch_size is None else batch_size
    with lp.probed(layers) as records:
        for i, start in enumerate(range(0, len(x), size)):
            out = lp.forward("kfac", model, params, x[start:start + size], records, state)
            for name, calls in records.items():
                a = torch.cat([lp.rows(layers[name], a) for a, _ in calls])
                s = sums.setdefault(name, [0.0, 0.0, 0])
                s[0] = s[0] + a.T @ a
                s[2] += len(a)
            V, weight = lp.output_directions(
                out.detach(), likelihood, sigma, fisher,
                None if key is None else random.fold_in(key, i), mc_samples,
                None if y is None else y[start:start + size])  # (k, n, O)
            for chunk in V.split(lp.DIRECTIONS_PER_PASS):
                gs = lp.grads(out, lp.probes_of(records), chunk)
                for name, calls in lp.by_layer(records, gs).items():
                    for _, g in calls:  # (k, *output.shape)
                        g = lp.output_rows(layers[name], g.flatten(0, 1))
                        sums[name][1] = sums[name][1] + weight * (g.T @ g)

    factors = {}
    for name, (aa, gg, rows) in sums.items():
        mod = layers[name]
        out_features = mod.weight.shape[0]
        if not isinstance(gg, Tensor):  # the layer does not reach the output
            gg = aa.new_zeros(out_features, out_features)
        weight, bias = lp.param_names(name, mod)
        A = aa / rows
        if bias is not None and separate_bias:  # the bias's A is the mean of 1 · 1
            factors[name] = KronFactor(weight, None, A[:-1, :-1], gg)
            factors[bias] = KronFactor(bias, None, A[-1:, -1:], gg)
        else:
            factors[name] = KronFactor(weight, bias, A, gg)
    return factors
