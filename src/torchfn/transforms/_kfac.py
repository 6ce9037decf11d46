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
unbiased estimate of ``G`` for any number of classes in one backward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchfn.core import random
from torchfn.core.module import Model

__all__ = ["KronFactor", "kfac"]

_LIKELIHOODS = ("classification", "regression")
_FISHERS = ("exact", "mc")
_DIRECTIONS_PER_PASS = 32  # output directions per (vmapped) backward pass


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


def factorable(model: Model) -> dict[str, nn.Module]:
    """The ``nn.Linear`` and ``nn.Conv2d`` layers of the module ``model.apply`` runs."""
    skeleton = model._eval_skeleton  # eval mode, as model.apply(params, x)
    return {n: m for n, m in skeleton.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}


def output_hessian(likelihood: str, out: Tensor, sigma: float) -> Tensor:
    """``Λ`` of one example's output ``(O,)``: ``(O, O)``; ``I / σ²`` (regression) or
    ``diag(p) - p pᵀ`` (softmax)."""
    if likelihood == "regression":
        return torch.eye(out.shape[-1], dtype=out.dtype, device=out.device) / sigma ** 2
    p = out.softmax(-1)
    return torch.diag(p) - torch.outer(p, p)


def _output_sqrt(likelihood: str, out: Tensor, sigma: float) -> Tensor:
    """``L (n, O, O)`` with ``L Lᵀ = Λ`` for each row of ``out (n, O)``:
    ``I / σ`` (regression), ``√p_c (e_c - p)`` in column ``c`` (softmax)."""
    n, o = out.shape
    eye = torch.eye(o, dtype=out.dtype, device=out.device)
    if likelihood == "regression":
        return (eye / sigma).expand(n, o, o)
    p = out.softmax(-1)  # (n, O)
    return (eye[None] - p[:, :, None]) * p.sqrt()[:, None, :]


def _check_layer(name: str, mod: nn.Module) -> None:
    if isinstance(mod, nn.Conv2d) and (
            mod.groups != 1 or mod.padding_mode != "zeros" or isinstance(mod.padding, str)
            and mod.padding != "valid"):
        raise ValueError(
            f"kfac: Conv2d {name!r} has groups={mod.groups}, padding={mod.padding!r}, "
            f"padding_mode={mod.padding_mode!r}; K-FAC here supports groups=1 with numeric "
            "(or 'valid') zero padding")


def _rows(mod: nn.Module, a: Tensor) -> Tensor:
    """The layer's input as rows ``ā`` ``(rows, fan_in (+1))``."""
    if isinstance(mod, nn.Conv2d):
        padding = 0 if mod.padding == "valid" else mod.padding
        a = a if a.dim() == 4 else a[None]  # (n, C, H, W)
        a = F.unfold(a, mod.kernel_size, mod.dilation, padding, mod.stride)  # (n, C kh kw, L)
        a = a.transpose(1, 2).reshape(-1, a.shape[1])
    else:
        a = a.reshape(-1, a.shape[-1])
    if mod.bias is not None:
        a = torch.cat([a, a.new_ones(a.shape[0], 1)], 1)
    return a


def _output_rows(mod: nn.Module, g: Tensor) -> Tensor:
    """An output gradient as rows ``(rows, out)``."""
    if isinstance(mod, nn.Conv2d):
        g = g if g.dim() == 4 else g[None]  # (n, out, H', W')
        return g.permute(0, 2, 3, 1).reshape(-1, g.shape[1])
    return g.reshape(-1, g.shape[-1])


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
        fisher: ``"exact"`` (``O`` backward passes per batch, one per column of
            ``Λ^½``) or ``"mc"`` (``mc_samples`` backward passes at sampled targets;
            needs ``key``).
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
    if not isinstance(model, Model):
        raise TypeError(f"kfac: model must be a torchfn.Model (K-FAC reads its layers' "
                        f"inputs), got {type(model).__name__}")
    if likelihood not in _LIKELIHOODS:
        raise ValueError(f"kfac: likelihood must be one of {_LIKELIHOODS}, got {likelihood!r}")
    if fisher not in _FISHERS:
        raise ValueError(f"kfac: fisher must be one of {_FISHERS}, got {fisher!r}")
    if fisher == "mc" and key is None:
        raise ValueError("kfac: fisher='mc' needs a key (the sampled targets)")
    if not isinstance(sigma, (int, float)) or isinstance(sigma, bool) or not sigma > 0:
        raise ValueError(f"kfac: sigma must be a positive float, got {sigma!r}")
    for name, v in (("mc_samples", mc_samples), ("batch_size", batch_size)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"kfac: {name} must be a positive int, got {v!r}")
    if not isinstance(x, Tensor) or x.dim() < 1 or len(x) == 0:
        raise ValueError(f"kfac: x must be a non-empty batch of inputs (N, ...), got "
                         f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
    if not isinstance(separate_bias, bool):
        raise TypeError(f"kfac: separate_bias must be a bool, got {separate_bias!r}")
    if not isinstance(params, dict):
        raise TypeError(f"kfac: params must be the model's params dict, got "
                        f"{type(params).__name__}")
    params = {k: v.detach() for k, v in params.items()}
    chosen, layers = layers, factorable(model)
    if not layers:
        raise ValueError(f"kfac: model ({model._module_type}) has no nn.Linear or nn.Conv2d "
                         "layer to factor")
    if chosen is not None:
        if isinstance(chosen, str) or [n for n in chosen if n not in layers] or not chosen:
            raise ValueError(f"kfac: layers must name some of the model's Linear/Conv2d "
                             f"layers {list(layers)}, got {chosen!r}")
        layers = {n: m for n, m in layers.items() if n in chosen}
    for name, mod in layers.items():
        _check_layer(name, mod)

    sums: dict[str, list[Tensor]] = {}  # name -> [Σ ā āᵀ, Σ g gᵀ, rows]
    records: dict[str, list[tuple[Tensor, Tensor]]] = {}

    def hook(name: str) -> Callable[..., Tensor]:
        def record(mod: nn.Module, inputs: tuple, out: Tensor) -> Tensor:
            probe = torch.zeros_like(out, requires_grad=True)  # ∂/∂probe = ∂/∂out
            records.setdefault(name, []).append((inputs[0].detach(), probe))
            return out + probe
        return record

    size = len(x) if batch_size is None else batch_size
    handles = [m.register_forward_hook(hook(n)) for n, m in layers.items()]
    try:
        for i, start in enumerate(range(0, len(x), size)):
            xb = x[start:start + size]
            records.clear()
            with torch.enable_grad():
                out = model.apply(params, xb)
            if not isinstance(out, Tensor) or out.dim() != 2 or len(out) != len(xb):
                got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
                raise ValueError(f"kfac: model.apply(params, x) must return outputs of shape "
                                 f"(n, O) for a batch of n = {len(xb)}, got {got}")
            probes = [p for recs in records.values() for _, p in recs]
            for name, recs in records.items():
                a = torch.cat([_rows(layers[name], a) for a, _ in recs])
                s = sums.setdefault(name, [0.0, 0.0, 0])
                s[0] = s[0] + a.T @ a
                s[2] += len(a)
            V, weight = _output_directions(out.detach(), likelihood, sigma, fisher,
                                           None if key is None else random.fold_in(key, i),
                                           mc_samples)  # (k, n, O)
            for chunk in V.split(_DIRECTIONS_PER_PASS):
                it = iter(_grads(out, probes, chunk))
                for name, recs in records.items():
                    for _ in recs:
                        g = next(it)  # (k, *probe.shape)
                        if g is not None:
                            g = _output_rows(layers[name], g.flatten(0, 1))
                            sums[name][1] = sums[name][1] + weight * (g.T @ g)
    finally:
        for h in handles:
            h.remove()
        records.clear()

    factors = {}
    for name, (aa, gg, rows) in sums.items():
        mod = layers[name]
        out_features = mod.weight.shape[0]
        if not isinstance(gg, Tensor):  # the layer does not reach the output
            gg = aa.new_zeros(out_features, out_features)
        prefix = "" if name == "" else name + "."
        A = aa / rows
        if mod.bias is None:
            factors[name] = KronFactor(prefix + "weight", None, A, gg)
        elif separate_bias:  # the bias's A is the mean of 1 · 1
            factors[name] = KronFactor(prefix + "weight", None, A[:-1, :-1], gg)
            factors[prefix + "bias"] = KronFactor(prefix + "bias", None, A[-1:, -1:], gg)
        else:
            factors[name] = KronFactor(prefix + "weight", prefix + "bias", A, gg)
    return factors


def _grads(out: Tensor, probes: list[Tensor], V: Tensor) -> list[Tensor | None]:
    """``∂(out · V[k]) / ∂probe`` stacked over ``k``: one vmapped backward pass, or a
    loop where an op of the network has no batching rule for its backward."""
    try:
        return list(torch.autograd.grad(out, probes, V, retain_graph=True,
                                        allow_unused=True, is_grads_batched=True))
    except RuntimeError:
        per = [torch.autograd.grad(out, probes, v, retain_graph=True, allow_unused=True)
               for v in V]
        return [None if per[0][j] is None else torch.stack([p[j] for p in per])
                for j in range(len(probes))]


def _output_directions(out: Tensor, likelihood: str, sigma: float, fisher: str,
                       key: Tensor | None, mc_samples: int) -> tuple[Tensor, float]:
    """``(V (k, n, O), weight)``: the output directions whose gradients ``g`` give
    ``G = weight · Σ g gᵀ``: the ``O`` columns of ``Λ^½`` (exact), or the loss gradients
    at ``mc_samples`` sampled targets (MC)."""
    if fisher == "exact":
        return _output_sqrt(likelihood, out, sigma).permute(2, 0, 1), 1.0  # (O, n, O)
    shape = (mc_samples, *out.shape)
    if likelihood == "regression":  # ∂/∂f of |y - f|² / 2σ² at y = f + σ ε
        eps = random.normal(key, shape, dtype=out.dtype).to(out.device)
        return eps / sigma, 1.0 / mc_samples
    y = random.categorical(key, out, shape=shape[:-1])  # (k, n), y ~ softmax(f)
    # ∂/∂f of -log softmax(f)_y: p - e_y
    return out.softmax(-1) - F.one_hot(y, out.shape[1]).to(out.dtype), 1.0 / mc_samples
