"""The plumbing K-FAC, EK-FAC and influence share: a Model's ``nn.Linear`` / ``nn.Conv2d``
layers, their inputs (read by forward hooks) and the gradients at their outputs (a zero
``probe`` added to each output: ``∂/∂probe = ∂/∂output``), for a batch at a time.

For a layer ``s = W a + b`` with ``ā = [a, 1]``, the gradient of ``[W | b]`` is
``Σ_t g_t ā_tᵀ`` over the positions ``t`` where the layer ran (tokens; a convolution's
output pixels, ``ā`` the unfolded patch), so the inputs and the output gradients are all
that per-example gradients and Kronecker factors need.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchfn.core import random
from torchfn.core.module import Model

LIKELIHOODS = ("classification", "regression")
FISHERS = ("exact", "mc", "empirical")
DIRECTIONS_PER_PASS = 32  # output directions per (vmapped) backward pass

Records = dict[str, list[tuple[Tensor, Tensor]]]  # layer -> [(input, probe)] per call


def factorable(model: Model) -> dict[str, nn.Module]:
    """The ``nn.Linear`` and ``nn.Conv2d`` layers of the module ``model.apply`` runs."""
    skeleton = model._eval_skeleton  # eval mode, as model.apply(params, x)
    return {n: m for n, m in skeleton.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}


def param_names(name: str, mod: nn.Module) -> tuple[str, str | None]:
    """``(weight, bias)``: the layer's param names (``bias`` None without one)."""
    prefix = "" if name == "" else name + "."
    return prefix + "weight", None if mod.bias is None else prefix + "bias"


def check_setup(who: str, model: Any, params: Any, x: Any, *, likelihood: str, sigma: Any,
                fisher: str, key: Any, mc_samples: Any, batch_size: Any, y: Any,
                layers: Sequence[str] | None) -> tuple[dict[str, Tensor], dict[str, nn.Module]]:
    """Checks the shared arguments; returns the detached params and the chosen layers."""
    if not isinstance(model, Model):
        raise TypeError(f"{who}: model must be a torchfn.Model (it reads the layers' "
                        f"inputs), got {type(model).__name__}")
    if likelihood not in LIKELIHOODS:
        raise ValueError(f"{who}: likelihood must be one of {LIKELIHOODS}, got {likelihood!r}")
    if fisher not in FISHERS:
        raise ValueError(f"{who}: fisher must be one of {FISHERS}, got {fisher!r}")
    if fisher == "mc" and key is None:
        raise ValueError(f"{who}: fisher='mc' needs a key (the sampled targets)")
    if not isinstance(sigma, (int, float)) or isinstance(sigma, bool) or not sigma > 0:
        raise ValueError(f"{who}: sigma must be a positive float, got {sigma!r}")
    for name, v in (("mc_samples", mc_samples), ("batch_size", batch_size)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{who}: {name} must be a positive int, got {v!r}")
    if not isinstance(x, Tensor) or x.dim() < 1 or len(x) == 0:
        raise ValueError(f"{who}: x must be a non-empty batch of inputs (N, ...), got "
                         f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
    if fisher == "empirical" and (not isinstance(y, Tensor) or len(y) != len(x)):
        got = tuple(y.shape) if isinstance(y, Tensor) else type(y).__name__
        raise ValueError(f"{who}: fisher='empirical' needs the targets y, one per example "
                         f"({len(x)}), got {got}")
    if not isinstance(params, dict):
        raise TypeError(f"{who}: params must be the model's params dict, got "
                        f"{type(params).__name__}")
    found = factorable(model)
    if not found:
        raise ValueError(f"{who}: model ({model._module_type}) has no nn.Linear or nn.Conv2d "
                         "layer to factor")
    if layers is not None:
        if isinstance(layers, str) or not layers or [n for n in layers if n not in found]:
            raise ValueError(f"{who}: layers must name some of the model's Linear/Conv2d "
                             f"layers {list(found)}, got {layers!r}")
        found = {n: m for n, m in found.items() if n in layers}
    for name, mod in found.items():
        if isinstance(mod, nn.Conv2d) and (
                mod.groups != 1 or mod.padding_mode != "zeros"
                or isinstance(mod.padding, str) and mod.padding != "valid"):
            raise ValueError(
                f"{who}: Conv2d {name!r} has groups={mod.groups}, padding={mod.padding!r}, "
                f"padding_mode={mod.padding_mode!r}; supported: groups=1 with numeric (or "
                "'valid') zero padding")
    return {k: v.detach() for k, v in params.items()}, found


@contextmanager
def probed(layers: dict[str, nn.Module]) -> Iterator[Records]:
    """Hooks on ``layers`` while the block runs: each call records ``(input, probe)``
    and returns ``output + probe`` (``probe`` zeros that require grad)."""
    records: Records = {}

    def hook(name: str) -> Callable[..., Tensor]:
        def record(mod: nn.Module, inputs: tuple, out: Tensor) -> Tensor:
            probe = torch.zeros_like(out, requires_grad=True)
            records.setdefault(name, []).append((inputs[0].detach(), probe))
            return out + probe
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in layers.items()]
    try:
        yield records
    finally:
        for h in handles:
            h.remove()
        records.clear()


def forward(who: str, model: Model, params: dict[str, Tensor], xb: Tensor,
            records: Records, state: dict[str, Tensor] | None) -> Tensor:
    """``model.apply(params, xb, state=state)`` (eval mode) with fresh records; checks
    the output is ``(n, O)``."""
    records.clear()
    with torch.enable_grad():
        out = model.apply(params, xb, state=state)
    if not isinstance(out, Tensor) or out.dim() != 2 or len(out) != len(xb):
        got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(f"{who}: model.apply(params, x) must return outputs of shape "
                         f"(n, O) for a batch of n = {len(xb)}, got {got}")
    return out


def rows(mod: nn.Module, a: Tensor) -> Tensor:
    """The layer's input as rows ``ā`` ``(rows, fan_in (+1))``, example-major."""
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


def output_rows(mod: nn.Module, g: Tensor) -> Tensor:
    """An output gradient as rows ``(rows, out)``, example-major."""
    if isinstance(mod, nn.Conv2d):
        g = g if g.dim() == 4 else g[None]  # (n, out, H', W')
        return g.permute(0, 2, 3, 1).reshape(-1, g.shape[1])
    return g.reshape(-1, g.shape[-1])


def per_example(who: str, name: str, mod: nn.Module, calls: list[tuple[Tensor, Tensor]],
                n: int) -> Tensor:
    """Per-example gradients of ``[W | b]``, ``(k, n, out, fan_in (+1))``, from the
    layer's calls ``[(input, output gradient (k, *output.shape))]``: ``Σ_t g_t ā_tᵀ``."""
    total = 0.0
    for a, g in calls:
        if a.shape[0] != n:
            raise ValueError(f"{who}: layer {name!r} ran on an input of shape "
                             f"{tuple(a.shape)}; per-example gradients need the batch "
                             f"({n}) first")
        ar = rows(mod, a)
        gr = output_rows(mod, g.flatten(0, 1))
        a = ar.reshape(n, -1, ar.shape[-1])  # (n, T, fan_in (+1))
        g = gr.reshape(g.shape[0], n, -1, gr.shape[-1])  # (k, n, T, out)
        total = total + torch.einsum("knto,nti->knoi", g, a)
    return total


def output_hessian(likelihood: str, out: Tensor, sigma: float) -> Tensor:
    """``Λ`` of one example's output ``(O,)``: ``(O, O)``; ``I / σ²`` (regression) or
    ``diag(p) - p pᵀ`` (softmax)."""
    if likelihood == "regression":
        return torch.eye(out.shape[-1], dtype=out.dtype, device=out.device) / sigma ** 2
    p = out.softmax(-1)
    return torch.diag(p) - torch.outer(p, p)


def output_sqrt(likelihood: str, out: Tensor, sigma: float) -> Tensor:
    """``L (n, O, O)`` with ``L Lᵀ = Λ`` for each row of ``out (n, O)``:
    ``I / σ`` (regression), ``√p_c (e_c - p)`` in column ``c`` (softmax)."""
    n, o = out.shape
    eye = torch.eye(o, dtype=out.dtype, device=out.device)
    if likelihood == "regression":
        return (eye / sigma).expand(n, o, o)
    p = out.softmax(-1)  # (n, O)
    return (eye[None] - p[:, :, None]) * p.sqrt()[:, None, :]


def output_directions(out: Tensor, likelihood: str, sigma: float, fisher: str,
                      key: Tensor | None, mc_samples: int,
                      y: Tensor | None) -> tuple[Tensor, float]:
    """``(V (k, n, O), weight)``: output directions whose gradients ``g`` give
    ``weight · Σ g gᵀ``: the ``O`` columns of ``Λ^½`` (exact), the loss gradients at
    ``mc_samples`` sampled targets (MC) or at the given targets (empirical)."""
    if fisher == "exact":
        return output_sqrt(likelihood, out, sigma).permute(2, 0, 1), 1.0  # (O, n, O)
    if fisher == "empirical":
        if likelihood == "regression":  # ∂/∂f of |y - f|² / 2σ²
            return ((out - y.reshape(out.shape).to(out.dtype)) / sigma ** 2)[None], 1.0
        return (out.softmax(-1) - F.one_hot(y.long(), out.shape[1]).to(out.dtype))[None], 1.0
    shape = (mc_samples, *out.shape)
    if likelihood == "regression":  # at y = f + σ ε: (f - y) / σ² = -ε / σ
        eps = random.normal(key, shape, dtype=out.dtype).to(out.device)
        return eps / sigma, 1.0 / mc_samples
    t = random.categorical(key, out, shape=shape[:-1])  # (k, n), t ~ softmax(f)
    # ∂/∂f of -log softmax(f)_t: p - e_t
    return out.softmax(-1) - F.one_hot(t, out.shape[1]).to(out.dtype), 1.0 / mc_samples


def grads(out: Tensor, probes: list[Tensor], V: Tensor) -> list[Tensor | None]:
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


def by_layer(records: Records, gs: list[Tensor | None]) -> dict[str, list[tuple[Tensor, Tensor]]]:
    """The gradients ``gs`` (in ``records``' probe order) matched to each call's input;
    calls whose output does not reach the loss are dropped."""
    it = iter(gs)
    out: dict[str, list[tuple[Tensor, Tensor]]] = {}
    for name, calls in records.items():
        for a, _ in calls:
            g = next(it)
            if g is not None:
                out.setdefault(name, []).append((a, g))
    return out


def probes_of(records: Records) -> list[Tensor]:
    return [p for calls in records.values() for _, p in calls]
