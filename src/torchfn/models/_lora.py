"""LoRA (Hu et al. 2021): low-rank adapters on a module's Linear, Conv and Embedding layers.

``with_lora(module)`` returns a copy whose targeted ``nn.Linear`` layers compute

    y = x W^T + b + s (x A^T) B^T        A: (r, in), B: (out, r), s = alpha / r

and, with ``layers=(nn.Linear, nn.Conv2d, nn.Embedding)`` (or ``nn.Conv1d`` /
``nn.Conv3d``), convolutions and embeddings too, as PEFT adapts them: a conv's A is a
convolution with the layer's own kernel, stride, padding, dilation and groups into r
channels, its B a 1x1 convolution in the same groups (B A is then a weight of W's
shape); an Embedding's A (r, num) is looked up per token and B (dim, r) maps it (A
starts at zero, B normal).

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

__all__ = ["LoRALinear", "LoRAConv1d", "LoRAConv2d", "LoRAConv3d", "LoRAEmbedding",
           "with_lora", "split_lora", "merge_lora"]

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


class _LoRAConv(nn.Module):
    """An ``nn.Conv{1,2,3}d`` plus a rank-``rank`` adapter (see ``LoRAConv2d``)."""

    _base: type[nn.Module] = nn.Conv2d
    _conv: Callable[..., Tensor] = staticmethod(F.conv2d)

    def __init__(self, base: nn.Module, rank: int, alpha: float | None = None,
                 rslora: bool = False) -> None:
        super().__init__()
        kind = self._base.__name__
        if not isinstance(base, self._base):
            raise TypeError(f"base must be an nn.{kind}, got {type(base).__name__}")
        self.rank, self.scale = rank, _scale(rank, alpha, rslora)
        if rank % base.groups:
            raise ValueError(f"rank must be divisible by the {kind}'s groups (each group "
                             f"gets rank / groups), got rank={rank}, groups={base.groups}")
        self.groups, self.padding_mode = base.groups, base.padding_mode
        self._pad = base._reversed_padding_repeated_twice  # for a non-zero padding mode
        padding = base.padding if base.padding_mode == "zeros" else 0
        self.conv = dict(stride=base.stride, padding=padding, dilation=base.dilation,
                         groups=base.groups)
        self.weight = nn.Parameter(base.weight.detach().clone())  # (out, in / g, *k)
        self.bias = None if base.bias is None else nn.Parameter(base.bias.detach().clone())
        out_ch, in_per_group, *kernel = base.weight.shape
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Parameter(torch.empty(rank, in_per_group, *kernel, **factory))
        self.lora_B = nn.Parameter(torch.empty(out_ch, rank // base.groups, **factory))
        self._reset_adapter()

    def _reset_adapter(self) -> None:
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # as the conv's weights
        nn.init.zeros_(self.lora_B)

    def reset_parameters(self) -> None:
        """The conv's init for W and b (what ``Model.init`` draws), then the adapter's."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in = self.weight[0].numel()
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)
        self._reset_adapter()

    def forward(self, x: Tensor) -> Tensor:  # (N, in, *spatial) -> (N, out, *spatial')
        if self.padding_mode != "zeros":
            x = F.pad(x, self._pad, mode=self.padding_mode)
        ones = (1,) * (self.weight.dim() - 2)
        low = self._conv(x, self.lora_A, None, **self.conv)  # (N, r, *spatial')
        low = self._conv(low, self.lora_B.reshape(*self.lora_B.shape, *ones),
                         groups=self.groups)  # (N, out, *spatial')
        return self._conv(x, self.weight, self.bias, **self.conv) + self.scale * low

    def delta(self, a: Tensor, b: Tensor) -> Tensor:
        """B A as a weight of W's shape, group by group: (out, r / g) x (r, in / g, *k)
        -> (out, in / g, *k)."""
        g, out_ch = self.groups, b.shape[0]
        per_group = b.reshape(g, out_ch // g, -1) @ a.reshape(g, a.shape[0] // g, -1)
        return per_group.reshape(out_ch, *a.shape[1:])

    def extra_repr(self) -> str:
        groups = f", groups={self.groups}" if self.groups > 1 else ""
        return (f"weight={tuple(self.weight.shape)}, rank={self.rank}, "
                f"scale={self.scale:g}{groups}")


class LoRAConv2d(_LoRAConv):
    """An ``nn.Conv2d`` plus a rank-``rank`` adapter: (N, in, H, W) -> (N, out, H', W').

    ``y = conv(x, W) + b + s conv(conv(x, A), B)`` with A (r, in / g, kh, kw) convolving
    as W does (stride, padding, dilation, padding mode, groups g) and B (out, r / g) a
    1x1 convolution in the same groups, so that merged, ``W + s B A`` (group by group,
    per kernel offset) is a weight of W's shape. For ``groups=1`` this is PEFT's layout;
    PEFT's grouped adapter mixes all input channels in A and cannot be merged. The rank
    must be divisible by the groups.

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

    _base = nn.Conv2d
    _conv = staticmethod(F.conv2d)


class LoRAConv1d(_LoRAConv):
    """An ``nn.Conv1d`` plus a rank-``rank`` adapter: (N, in, L) -> (N, out, L'); as
    ``LoRAConv2d`` with one spatial dim (A: (r, in / g, k), B: (out, r / g)).

    Example:
        >>> from torch import nn
        >>> from torchfn import random
        >>> layer = LoRAConv1d(nn.Conv1d(4, 6, 5, groups=2), rank=2)
        >>> layer.lora_A.shape, layer.lora_B.shape
        (torch.Size([2, 2, 5]), torch.Size([6, 1]))
        >>> layer(random.normal(random.key(1), (3, 4, 9))).shape
        torch.Size([3, 6, 5])
    """

    _base = nn.Conv1d
    _conv = staticmethod(F.conv1d)


class LoRAConv3d(_LoRAConv):
    """An ``nn.Conv3d`` plus a rank-``rank`` adapter: (N, in, D, H, W) -> (N, out, D', H',
    W'); as ``LoRAConv2d`` with three spatial dims (A: (r, in / g, kd, kh, kw)).

    Example:
        >>> from torch import nn
        >>> from torchfn import random
        >>> layer = LoRAConv3d(nn.Conv3d(2, 4, 3, padding=1), rank=3)
        >>> layer(random.normal(random.key(1), (1, 2, 4, 4, 4))).shape
        torch.Size([1, 4, 4, 4, 4])
    """

    _base = nn.Conv3d
    _conv = staticmethod(F.conv3d)


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


_WRAPPERS = {nn.Linear: LoRALinear, nn.Conv1d: LoRAConv1d, nn.Conv2d: LoRAConv2d,
             nn.Conv3d: LoRAConv3d, nn.Embedding: LoRAEmbedding}
_LORA_LAYERS = (LoRALinear, _LoRAConv, LoRAEmbedding)


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
            ``nn.Conv1d`` / ``nn.Conv2d`` / ``nn.Conv3d`` (``LoRAConv1d`` / ``2d`` /
            ``3d``) and ``nn.Embedding`` (``LoRAEmbedding``).

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
