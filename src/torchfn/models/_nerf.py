"""NeRF's radiance field (Mildenhall et al. 2020): position and view direction to color
and density. Render rays with ``torchfn.transforms.volume_render``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchfn.models._denoiser import fourier_features

__all__ = ["NeRF"]


class NeRF(nn.Module):
    """``model(x, d) -> (rgb, sigma)``: NeRF's MLP field.

    ``x: (..., 3)`` positions and ``d: (..., 3)`` view directions are encoded as
    ``[p, sin(2^k p), cos(2^k p)]`` for ``k < pos_freqs`` (``dir_freqs``); ``depth``
    ReLU layers of width ``hidden`` read the position (its encoding is fed again after
    layer ``skip``) and give the density ``sigma = relu(.) >= 0`` (``(...)``), which
    does not depend on ``d``; a ``view_hidden`` layer adds the direction and gives
    ``rgb = sigmoid(.)`` in (0, 1) (``(..., 3)``). The paper's sizes are the defaults.

    Example::

        >>> import torch, torchfn
        >>> from torchfn import random
        >>> model = torchfn.Model(NeRF(hidden=32, depth=4, skip=2, view_hidden=16))
        >>> params = model.init(random.key(0))
        >>> x = random.normal(random.key(1), (8, 64, 3))           # 8 rays, 64 samples
        >>> d = random.normal(random.key(2), (8, 1, 3)).expand(8, 64, 3)
        >>> rgb, sigma = model.apply(params, x, d)
        >>> rgb.shape, sigma.shape
        (torch.Size([8, 64, 3]), torch.Size([8, 64]))
    """

    def __init__(self, pos_freqs: int = 10, dir_freqs: int = 4, hidden: int = 256,
                 depth: int = 8, skip: int = 4, view_hidden: int = 128) -> None:
        super().__init__()
        for name, v in (("pos_freqs", pos_freqs), ("dir_freqs", dir_freqs)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"NeRF: {name} must be an int >= 0, got {v!r}")
        for name, v in (("hidden", hidden), ("depth", depth), ("view_hidden", view_hidden)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"NeRF: {name} must be an int >= 1, got {v!r}")
        if isinstance(skip, bool) or not isinstance(skip, int) or not 0 <= skip < depth:
            raise ValueError(f"NeRF: skip must be an int in [0, depth={depth}), got {skip!r}")
        self.pos_freqs, self.dir_freqs, self.skip = pos_freqs, dir_freqs, skip
        pos_dim, dir_dim = 3 * (1 + 2 * pos_freqs), 3 * (1 + 2 * dir_freqs)
        self.layers = nn.ModuleList(
            nn.Linear(pos_dim if i == 0 else hidden + (pos_dim if i == skip + 1 else 0),
                      hidden)
            for i in range(depth)
        )
        self.sigma = nn.Linear(hidden, 1)
        self.feature = nn.Linear(hidden, hidden)
        self.view = nn.Linear(hidden + dir_dim, view_hidden)
        self.rgb = nn.Linear(view_hidden, 3)

    def _encode(self, p: Tensor, freqs: int) -> Tensor:
        return fourier_features(p, freqs, float(2 ** max(freqs - 1, 0)))  # 2^0 .. 2^(L-1)

    def forward(self, x: Tensor, d: Tensor) -> tuple[Tensor, Tensor]:
        for name, a in (("x", x), ("d", d)):
            if not isinstance(a, Tensor) or not a.is_floating_point() or a.shape[-1:] != (3,):
                got = tuple(a.shape) if isinstance(a, Tensor) else type(a).__name__
                raise ValueError(f"NeRF: {name} must be a float tensor (..., 3), got {got}")
        if x.shape != d.shape:
            raise ValueError(f"NeRF: x and d must have one shape, got {tuple(x.shape)} and "
                             f"{tuple(d.shape)} (expand d along the samples of a ray)")
        enc = self._encode(x, self.pos_freqs)  # (..., 3 (1 + 2 L))
        h = enc
        for i, layer in enumerate(self.layers):
            if i == self.skip + 1:
                h = torch.cat([h, enc], dim=-1)  # the position again, after layer `skip`
            h = F.relu(layer(h))  # (..., hidden)
        sigma = F.relu(self.sigma(h)).squeeze(-1)  # (...)
        v = F.normalize(d, dim=-1)
        h = F.relu(self.view(torch.cat([self.feature(h), self._encode(v, self.dir_freqs)], -1)))
        return torch.sigmoid(self.rgb(h)), sigma  # (..., 3), (...)
