"""A small MLP energy for energy-based models."""

from __future__ import annotations

from torch import Tensor, nn

from torchfn.models._denoiser import fourier_features

__all__ = ["MLPEnergy"]


class MLPEnergy(nn.Module):
    """``E(x) = MLP(x)``: ``(..., dim) -> (...)``, a scalar energy per example.

    SiLU activations keep the energy smooth, so Langevin gradients are too. With
    ``fourier > 0`` the input is first encoded by :func:`fourier_features` (frequencies up to
    ``max_freq``), which helps a small MLP carve sharp modes in low dimension. Works on one
    example ``x: (dim,)`` (returns shape ``()``) as well as on a batch ``(B, dim) -> (B,)``.

    Example::

        >>> import torchfn
        >>> model = torchfn.Model(MLPEnergy(2, hidden=64, depth=2))
        >>> params = model.init(torchfn.random.key(0))
        >>> energy = lambda x: model.apply(params, x)          # (2,) -> ()
    """

    def __init__(
        self, dim: int, hidden: int = 128, depth: int = 2, fourier: int = 0, max_freq: float = 10.0
    ) -> None:
        super().__init__()
        if dim < 1 or hidden < 1 or depth < 1:
            raise ValueError(
                f"dim, hidden and depth must be >= 1, got dim={dim}, hidden={hidden}, depth={depth}"
            )
        if fourier < 0 or not max_freq >= 1.0:
            raise ValueError(f"fourier must be >= 0 and max_freq >= 1, got {fourier}, {max_freq}")
        self.fourier, self.max_freq = fourier, max_freq
        layers: list[nn.Module] = []
        width = dim * (1 + 2 * fourier)
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.SiLU()]
            width = hidden
        layers.append(nn.Linear(width, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(fourier_features(x, self.fourier, self.max_freq)).squeeze(-1)  # (...,)
