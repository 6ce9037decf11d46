"""A multi-layer perceptron."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

__all__ = ["MLP", "SquaredReLU", "SwiGLU", "XIELU"]


class SquaredReLU(nn.Module):
    """``relu(x) ** 2`` (Primer, So et al. 2021; Nemotron-H's MLPs)."""

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.relu(x).square()


class XIELU(nn.Module):
    """xIELU (Huang and Schlag 2024; Apertus's MLPs): ``a_p x^2 + beta x`` for ``x > 0``,
    ``(expm1(min(x, eps)) - x) a_n + beta x`` otherwise, with learned
    ``a_p = softplus(alpha_p)`` and ``a_n = beta + softplus(alpha_n)`` (params ``(1,)``
    each) and constants ``beta``, ``eps``.

    Example::

        >>> import torch
        >>> act = XIELU()                        # a_p = a_n = 0.8 to start
        >>> act(torch.tensor([2.0, -1.0])).detach()  # 0.8 * 4 + 1; 0.8 e^-1 - 0.5
        tensor([ 4.2000, -0.2057])
    """

    def __init__(self, beta: float = 0.5, eps: float = -1e-6) -> None:
        super().__init__()
        self.beta, self.eps = float(beta), float(eps)
        self.alpha_p = nn.Parameter(torch.empty(1))
        self.alpha_n = nn.Parameter(torch.empty(1))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``a_p = a_n = 0.8`` (the paper's and transformers' start)."""
        with torch.no_grad():
            self.alpha_p.fill_(math.log(math.expm1(0.8)))
            self.alpha_n.fill_(math.log(math.expm1(0.8 - self.beta)))

    def forward(self, x: Tensor) -> Tensor:
        a_p = nn.functional.softplus(self.alpha_p)
        a_n = self.beta + nn.functional.softplus(self.alpha_n)
        negative = (torch.expm1(x.clamp(max=self.eps)) - x) * a_n
        return torch.where(x > 0, a_p * x * x, negative) + self.beta * x

    def extra_repr(self) -> str:
        return f"beta={self.beta}, eps={self.eps}"


_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "silu": nn.SiLU,
    "tanh": nn.Tanh,
    "elu": nn.ELU,
    "leaky_relu": nn.LeakyReLU,
    "relu2": SquaredReLU,
    "xielu": XIELU,
}


def make_activation(activation: str | Callable[[], nn.Module]) -> nn.Module:
    """An activation module from a name (``"relu"``, ``"gelu"``, ``"silu"``, ``"tanh"``,
    ``"elu"``, ``"leaky_relu"``, ``"relu2"``: squared ReLU) or a zero-argument module
    factory (``nn.Softplus``)."""
    if isinstance(activation, str):
        if activation not in _ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {sorted(_ACTIVATIONS)} or a module class, "
                f"got {activation!r}"
            )
        return _ACTIVATIONS[activation]()
    if callable(activation):
        module = activation()
        if not isinstance(module, nn.Module):
            raise TypeError(f"activation() must build an nn.Module, got {type(module).__name__}")
        return module
    raise TypeError(f"activation must be a name or a module class, got {type(activation).__name__}")


def _check_dims(**dims: object) -> None:
    for name, d in dims.items():
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise ValueError(f"{name} must be an int >= 1, got {d!r}")


class MLP(nn.Module):
    """``Linear -> act -> [Dropout] -> ... -> Linear``: ``(..., in_dim) -> (..., out_dim)``.

    Works on one example ``(in_dim,)`` as well as any batch ``(..., in_dim)``, so it
    composes with per-example ``vmap``.

    Args:
        in_dim: input features.
        hidden: widths of the hidden layers, e.g. ``(64, 64)``; ``()`` is a linear model.
        out_dim: output features.
        activation: a name (``"relu"``, ``"gelu"``, ``"silu"``, ``"tanh"``, ...) or an
            ``nn.Module`` class.
        dropout: dropout probability after each hidden activation (keyed by
            ``torchfn.Model.apply(..., key=k, train=True)``).

    Example::

        >>> from torchfn import random
        >>> import torch
        >>> import torchfn
        >>> model = torchfn.Model(MLP(4, (32, 32), 3, activation="gelu", dropout=0.1))
        >>> params = model.init(torchfn.random.key(0))
        >>> model.apply(params, random.normal(random.key(1), (8, 4))).shape
        torch.Size([8, 3])
    """

    def __init__(
        self,
        in_dim: int,
        hidden: Sequence[int],
        out_dim: int,
        activation: str | Callable[[], nn.Module] = "relu",
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if isinstance(hidden, int):
            raise TypeError(f"hidden must be a sequence of widths such as (64, 64), got {hidden}")
        hidden = tuple(hidden)
        _check_dims(in_dim=in_dim, out_dim=out_dim, **{f"hidden[{i}]": h for i, h in
                                                       enumerate(hidden)})
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        layers: list[nn.Module] = []
        width = in_dim
        for h in hidden:
            layers += [nn.Linear(width, h), make_activation(activation)]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = h
        layers.append(nn.Linear(width, out_dim))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)  # (..., out_dim)


class SwiGLU(nn.Module):
    """The gated feed-forward of PaLM and Llama: ``down(silu(gate(x)) * up(x))``,
    ``(..., dim) -> (..., dim)`` through ``hidden`` units (Shazeer 2020, "GLU Variants
    Improve Transformer"). It has 3 weight matrices where a GELU MLP has 2, so Llama sets
    ``hidden`` near ``8/3 dim`` to keep the parameter count of a 4x GELU MLP.
    ``activation="gelu_tanh"`` makes it GeGLU with the tanh-approximate GELU (Gemma's
    ``gelu_pytorch_tanh``); ``"gelu"`` the exact one. ``scales=(g, o)``:
    ``o * down(silu(g * gate(x)) * up(x))`` (Falcon-H1's ``mlp_multipliers``).

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import SwiGLU
        >>> model = torchfn.Model(SwiGLU(dim=8, hidden=16, bias=False))
        >>> params = model.init(torchfn.random.key(0))
        >>> sorted(params)
        ['down.weight', 'gate.weight', 'up.weight']
        >>> model.apply(params, torch.ones(2, 5, 8)).shape                 # (B, N, dim)
        torch.Size([2, 5, 8])
    """

    def __init__(self, dim: int, hidden: int, *, bias: bool = True,
                 activation: str = "silu", scales: tuple[float, float] | None = None) -> None:
        super().__init__()
        _check_dims(dim=dim, hidden=hidden)
        if activation not in _GATES:
            raise ValueError(f"activation must be one of {sorted(_GATES)}, got {activation!r}")
        if scales is not None and (not isinstance(scales, (tuple, list)) or len(scales) != 2
                                   or not all(isinstance(v, (int, float)) and not isinstance(
                                       v, bool) for v in scales)):
            raise ValueError(f"scales must be two numbers (gate, out) or None, got {scales!r}")
        self.activation = activation
        self.scales = None if scales is None else (float(scales[0]), float(scales[1]))
        self.gate = nn.Linear(dim, hidden, bias=bias)
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.scales is None:
            return self.down(_GATES[self.activation](self.gate(x)) * self.up(x))  # (..., dim)
        gate, out = self.scales
        return self.down(_GATES[self.activation](self.gate(x) * gate) * self.up(x)) * out


_GATES = {
    "silu": nn.functional.silu,
    "gelu": nn.functional.gelu,
    "gelu_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
}
