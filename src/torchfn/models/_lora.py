"""LoRA (Hu et al. 2021): low-rank adapters on a module's Linear, Conv2d and Embedding layers.

``with_lora(module)`` returns a copy whose targeted ``nn.Linear`` layers compute

    y = x W^T + b + s (x A^T) B^T        A: (r, in), B: (out, r), s = alpha / r

and, with ``layers=(nn.Linear, nn.Conv2d, nn.Embedding)``, convolutions and embeddings
too, as PEFT adapts them: a Conv2d's A is a convolution with the layer's own kernel,
stride, padding and dilation into r channels, its B a 1x1 convolution (B A is then a
weight of W's shape); an Embedding's A (r, num) is looked up per token and B (dim, r)
maps it (A starts at zero, B normal).

with ``W``, ``b`` under their original names (so pretrained params load unchanged)
and the adapters as ``<layer>.lora_A`` / ``<layer>.lora_B``. A is initialised as
nn.Linear's weights are and B to zeros, as PEFT does, so a fresh adapter changes
nothing. The adapters never form an (out, in) matrix, so ``vmap(grad)`` over
examples gives per-example adapter gradients at the adapters' size (DP fine-tuning).
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["LoRALinear", "LoRAConv2d", "LoRAEmbedding", "with_lora", "split_lora",
           "merge_lora"]

_ADAPTER = re.compile(r"(^|\.)lora_[AB]$")


class LoRALinear(nn.Module):
    """An ``nn.Linear`` plus a rank-``rank`` adapter: (..., in) -> (..., out).

    Args:
        base: the Linear whose weight and bias this copies.
        rank: r >= 1.
        alpha: the adapter's scale is ``alpha / rank`` (``alpha / sqrt(rank)`` with
            ``rslora=True``, rank-stabilised LoRA). None: ``alpha = rank`` (scale 1).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from torchfn import random
        >>> layer = LoRALinear(nn.Linear(4, 3), rank=2)
        >>> layer.lora_A.shape, layer.lora_B.shape
        (torch.Size([2, 4]), torch.Size([3, 2]))
        >>> x = random.normal(random.key(1), (5, 4))
        >>> torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        True
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float | None = None,
                 rslora: bool = False) -> None:
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"base must be an nn.Linear, got {type(base).__name__}")
        self.scale = _scale(rank, alpha, rslora)
        self.in_features, self.out_features, self.rank = base.in_features, base.out_features, rank
        self.weight = nn.Parameter(base.weight.detach().clone())
        self.bias = None if base.bias is None else nn.Parameter(base.bias.detach().clone())
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **factory))
        self.lora_B = nn.Parameter(torch.empty(self.out_features, rank, **factory))
        self._reset_adapter()  # the base weights stay the ones given

    def _reset_adapter(self) -> None:
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # as nn.Linear's weights
        nn.init.zeros_(self.lora_B)  # PEFT's default: a fresh adapter changes nothing

    def reset_parameters(self) -> None:
        """nn.Linear's init for W and b (what ``Model.init`` draws), then the adapter's."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)
        self._reset_adapter()

    def forward(self, x: Tensor) -> Tensor:  # (..., in) -> (..., out)
        low = F.linear(F.linear(x, self.lora_A), self.lora_B)  # (..., r) -> (..., out)
        return F.linear(x, self.weight, self.bias) + self.scale * low

    def delta(self, a: Tensor, b: Tensor) -> Tensor:
        """B A, a weight of W's shape (out, in)."""
        return b @ a

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"rank={self.rank}, scale={self.scale:g}")


class LoRAConv2d(nn.Module):
    """An ``nn.Conv2d`` plus a rank-``rank`` adapter: (N, in, H, W) -> (N, out, H', W').

    ``y = conv(x, W) + b + s conv(conv(x, A), B)`` with A (r, in, kh, kw) convolving as W
    does (stride, padding, dilation) and B (out, r) a 1x1 convolution, as PEFT's. Merged,
    ``W + s B A`` (over the channel dims, per kernel offset). Needs ``groups=1`` and zero
    padding.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from torchfn import random
        >>> layer = LoRAConv2d(nn.Conv2d(3, 8, 3, padding=1), rank=2)
        >>> layer.lora_A.shape, layer.lora_B.shape
        (torch.Size([2, 3, 3, 3]), torch.Size([8, 2]))
        >>> x = random.normal(random.key(1), (2, 3, 5, 5))
        >>> layer(x).shape
        torch.Size([2, 8, 5, 5])
    """

    def __init__(self, base: nn.Conv2d, rank: int, alpha: float | None = None,
                 rslora: bool = False) -> None:
        super().__init__()
        if not isinstance(base, nn.Conv2d):
            raise TypeError(f"base must be an nn.Conv2d, got {type(base).__name__}")
        if base.groups != 1 or base.padding_mode != "zeros":
            raise ValueError(f"LoRAConv2d needs groups=1 and padding_mode='zeros', got "
                             f"groups={base.groups}, padding_mode={base.padding_mode!r}")
        self.rank, self.scale = rank, _scale(rank, alpha, rslora)
        self.conv = dict(stride=base.stride, padding=base.padding, dilation=base.dilation)
        self.weight = nn.Parameter(base.weight.detach().clone())  # (out, in, kh, kw)
        self.bias = None if base.bias is None else nn.Parameter(base.bias.detach().clone())
        out_ch, in_ch, kh, kw = base.weight.shape
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Parameter(torch.empty(rank, in_ch, kh, kw, **factory))
        self.lora_B = nn.Parameter(torch.empty(out_ch, rank, **factory))
        self._reset_adapter()

    def _reset_adapter(self) -> None:
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # as nn.Conv2d's weights
        nn.init.zeros_(self.lora_B)

    def reset_parameters(self) -> None:
        """nn.Conv2d's init for W and b (what ``Model.init`` draws), then the adapter's."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in = self.weight[0].numel()
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)
        self._reset_adapter()

    def forward(self, x: Tensor) -> Tensor:  # (N, in, H, W) -> (N, out, H', W')
        low = F.conv2d(x, self.lora_A, None, **self.conv)  # (N, r, H', W')
        low = F.conv2d(low, self.lora_B[:, :, None, None])  # (N, out, H', W')
        return F.conv2d(x, self.weight, self.bias, **self.conv) + self.scale * low

    def delta(self, a: Tensor, b: Tensor) -> Tensor:
        """B A as a weight of W's shape: (out, r) x (r, in, kh, kw) -> (out, in, kh, kw)."""
        return torch.einsum("or,rikl->oikl", b, a)

    def extra_repr(self) -> str:
        return f"weight={tuple(self.weight.shape)}, rank={self.rank}, scale={self.scale:g}"


class LoRAEmbedding(nn.Module):
    """An ``nn.Embedding`` plus a rank-``rank`` adapter: (...) int -> (..., dim).

    ``y = W[x] + s A[:, x]^T B^T`` with A (r, num) and B (dim, r); A starts at zero and
    B normal, as PEFT's (the lookup is into A, so zeros there keep a fresh adapter
    inert). Merged, ``W + s (B A)^T``. Needs no ``max_norm`` (it renormalises W in
    place).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> layer = LoRAEmbedding(nn.Embedding(10, 4), rank=2)
        >>> layer.lora_A.shape, layer.lora_B.shape
        (torch.Size([2, 10]), torch.Size([4, 2]))
        >>> layer(torch.tensor([[1, 2, 3]])).shape
        torch.Size([1, 3, 4])
    """

    def __init__(self, base: nn.Embedding, rank: int, alpha: float | None = None,
                 rslora: bool = False) -> None:
        super().__init__()
        if not isinstance(base, nn.Embedding):
            raise TypeError(f"base must be an nn.Embedding, got {type(base).__name__}")
        if base.max_norm is not None:
            raise ValueError("LoRAEmbedding needs max_norm=None (it renormalises W in place)")
        self.rank, self.scale = rank, _scale(rank, alpha, rslora)
        self.padding_idx = base.padding_idx
        self.weight = nn.Parameter(base.weight.detach().clone())  # (num, dim)
        num, dim = base.weight.shape
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Parameter(torch.empty(rank, num, **factory))
        self.lora_B = nn.Parameter(torch.empty(dim, rank, **factory))
        self._reset_adapter()

    def _reset_adapter(self) -> None:
        nn.init.zeros_(self.lora_A)  # PEFT's: A zero, B normal
        nn.init.normal_(self.lora_B)

    def reset_parameters(self) -> None:
        """nn.Embedding's init for W (what ``Model.init`` draws), then the adapter's."""
        nn.init.normal_(self.weight)
        if self.padding_idx is not None:
            with torch.no_grad():
                self.weight[self.padding_idx].fill_(0)
        self._reset_adapter()

    def forward(self, x: Tensor) -> Tensor:  # (...) -> (..., dim)
        low = F.embedding(x, self.lora_A.T)  # (..., r)
        return F.embedding(x, self.weight, self.padding_idx) + self.scale * (low @ self.lora_B.T)

    def delta(self, a: Tensor, b: Tensor) -> Tensor:
        """(B A)^T, a weight of W's shape (num, dim)."""
        return (b @ a).T

    def extra_repr(self) -> str:
        return f"weight={tuple(self.weight.shape)}, rank={self.rank}, scale={self.scale:g}"


def _scale(rank: Any, alpha: Any, rslora: bool) -> float:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be an int >= 1, got {rank!r}")
    alpha = float(rank) if alpha is None else alpha
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ValueError(f"alpha must be a number > 0, got {alpha!r}")
    return alpha / (math.sqrt(rank) if rslora else rank)


_WRAPPERS = {nn.Linear: LoRALinear, nn.Conv2d: LoRAConv2d, nn.Embedding: LoRAEmbedding}
_LORA_LAYERS = (LoRALinear, LoRAConv2d, LoRAEmbedding)


def _matches(targets: Any) -> Callable[[str, nn.Module], bool]:
    if targets is None:
        return lambda name, m: True
    if callable(targets):
        return targets
    if isinstance(targets, str) or not isinstance(targets, Sequence):
        raise TypeError(
            "targets must be None (every nn.Linear), a sequence of layer-name suffixes "
            f"or a callable (name, module) -> bool, got {targets!r}"
        )

    def match(name: str, m: nn.Module) -> bool:
        return any(name == t or name.endswith("." + t) for t in targets)

    return match


def with_lora(
    module: nn.Module,
    rank: int = 8,
    alpha: float | None = None,
    *,
    targets: Any = None,
    rslora: bool = False,
    layers: Sequence[type] = (nn.Linear,),
) -> nn.Module:
    """A copy of ``module`` with its targeted layers given LoRA adapters.

    ``module`` itself is not changed. Base params keep their names, so
    ``model.extract(pretrained)`` or a pretrained state dict fills them; the new
    params are ``<layer>.lora_A`` (r, in) and ``<layer>.lora_B`` (out, r).

    Args:
        module: any nn.Module.
        rank: the adapters' rank r.
        alpha: scale numerator (``alpha / r``); None: ``alpha = r``.
        targets: which Linear layers: None (all), names or name suffixes
            (``["qkv", "out"]`` matches ``blocks.0.attn.qkv``), or a callable
            ``(name, module) -> bool``.
        rslora: scale by ``alpha / sqrt(r)`` instead.
        layers: the layer types to adapt, among ``nn.Linear`` (``LoRALinear``),
            ``nn.Conv2d`` (``LoRAConv2d``) and ``nn.Embedding`` (``LoRAEmbedding``).

    Example:
        >>> import torch, torchfn
        >>> from torch import nn
        >>> from torchfn import models, random
        >>> net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        >>> lora = torchfn.Model(models.with_lora(net, rank=4, targets=["0"]))
        >>> params = lora.init(random.key(0))
        >>> sorted(k for k in params if "lora" in k)
        ['0.lora_A', '0.lora_B']
        >>> frozen, adapters = models.split_lora(params)
        >>> def loss(adapters, x):  # only the adapters are trained
        ...     return lora.apply({**frozen, **adapters}, x).square().sum()
        >>> x = random.normal(random.key(1), (5, 8))
        >>> per_example = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(adapters, x)
        >>> per_example["0.lora_A"].shape
        torch.Size([5, 4, 8])
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    layers = tuple(layers)
    if not layers or any(t not in _WRAPPERS for t in layers):
        raise ValueError(f"layers must be some of {[t.__name__ for t in _WRAPPERS]}, got "
                         f"{[getattr(t, '__name__', t) for t in layers]}")
    match = _matches(targets)
    out = copy.deepcopy(module)

    def kind(m: nn.Module) -> type | None:
        return next((t for t in layers if isinstance(m, t)), None)

    chosen = [name for name, m in out.named_modules() if kind(m) and match(name, m)]
    if not chosen:
        found = [n for n, m in out.named_modules() if kind(m)]
        names = "/".join(f"nn.{t.__name__}" for t in layers)
        raise ValueError(f"targets={targets!r} matched no {names}; the module's {names} "
                         f"layers are {found}")
    if chosen == [""]:  # the module is itself such a layer
        return _WRAPPERS[kind(out)](out, rank, alpha, rslora)
    for name in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = out.get_submodule(parent_name) if parent_name else out
        base = getattr(parent, child)
        setattr(parent, child, _WRAPPERS[kind(base)](base, rank, alpha, rslora))
    return out


def split_lora(params: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """``(frozen, adapters)``: the ``lora_A`` / ``lora_B`` params apart from the rest.

    Example:
        >>> import torch
        >>> from torchfn import models
        >>> params = {"w.weight": torch.ones(2, 2), "w.lora_A": torch.ones(1, 2),
        ...           "w.lora_B": torch.zeros(2, 1)}
        >>> frozen, adapters = models.split_lora(params)
        >>> sorted(frozen), sorted(adapters)
        (['w.weight'], ['w.lora_A', 'w.lora_B'])
    """
    if not isinstance(params, dict):
        raise TypeError(f"params must be a dict of name -> tensor, got {type(params).__name__}")
    adapters = {k: v for k, v in params.items() if _ADAPTER.search(k)}
    if not adapters:
        raise ValueError("params hold no adapters (no '<layer>.lora_A' / '.lora_B' names): "
                         "make the model with models.with_lora")
    return {k: v for k, v in params.items() if k not in adapters}, adapters


def merge_lora(module: nn.Module, params: dict[str, Tensor]) -> dict[str, Tensor]:
    """Params for the module *without* adapters: each ``W + s B A`` folded in.

    ``module`` is the ``with_lora`` copy the params belong to (it knows each layer's
    scale). The result has the original module's names: load it into the module you
    started from, or serve it with no adapter cost.

    Example:
        >>> import torch, torchfn
        >>> from torch import nn
        >>> from torchfn import models, random
        >>> net = nn.Linear(3, 2)
        >>> lora_net = models.with_lora(net, rank=1)
        >>> params = torchfn.Model(lora_net).init(random.key(0))
        >>> sorted(models.merge_lora(lora_net, params))
        ['bias', 'weight']
    """
    layers = {n: m for n, m in module.named_modules() if isinstance(m, _LORA_LAYERS)}
    if not layers:
        raise ValueError("module has no LoRA layers: pass the models.with_lora copy")
    out = dict(params)
    for name, layer in layers.items():
        prefix = f"{name}." if name else ""
        try:
            a, b = out.pop(prefix + "lora_A"), out.pop(prefix + "lora_B")
            w = out[prefix + "weight"]
        except KeyError as missing:
            raise ValueError(f"params lack {missing.args[0]!r}, which the module's "
                             f"LoRA layer {name or '<root>'!r} needs") from None
        out[prefix + "weight"] = w + layer.scale * layer.delta(a, b)
    return out
