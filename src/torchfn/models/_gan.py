"""A DCGAN pair for small images: ``ConvGenerator`` and ``ConvCritic``.

The generator maps noise ``z: (..., latent_dim)`` to images ``(..., C, S, S)`` in
``[-1, 1]`` with two stride-2 transposed convolutions (Radford et al. 2016); the critic
scores images with two stride-2 convolutions and a linear read-out. Neither uses
BatchNorm: every example is computed on its own, so the WGAN-GP penalty (taken per
example with ``vmap(grad)``, ``torchfn.losses.gradient_penalty``) and per-example
gradients are exact, and no running statistics need threading through ``train=True``.
The generator normalises with GroupNorm instead.

With ``num_classes`` both are class-conditional: the generator embeds the label and
concatenates it to the noise, the critic is a projection discriminator (Miyato &
Koyama 2018): ``score = w . phi(x) + embed(y) . phi(x)``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["ConvGenerator", "ConvCritic"]


def _check_sizes(name: str, image_size: int, channels: int, width: int,
                 num_classes: int | None) -> None:
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 4 or (
        image_size % 4
    ):
        raise ValueError(f"{name}: image_size must be an int >= 4 divisible by 4 (two "
                         f"stride-2 stages), got {image_size!r}")
    for arg, v in (("channels", channels), ("width", width)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: {arg} must be an int >= 1, got {v!r}")
    if num_classes is not None and (isinstance(num_classes, bool)
                                    or not isinstance(num_classes, int) or num_classes < 2):
        raise ValueError(f"{name}: num_classes must be None or an int >= 2, got {num_classes!r}")


def _check_labels(name: str, y: object, lead: torch.Size, num_classes: int | None) -> None:
    if num_classes is None:
        if y is not None:
            raise ValueError(f"{name}: got labels y, but it was built without num_classes")
        return
    if not isinstance(y, Tensor) or y.dtype not in (torch.int64, torch.int32) or y.shape != lead:
        got = (f"{y.dtype} tensor of shape {tuple(y.shape)}" if isinstance(y, Tensor)
               else type(y).__name__)
        raise ValueError(f"{name}: y must be an int64 tensor of class labels with shape "
                         f"{tuple(lead)} (one per example), got {got}")


def _groups(c: int) -> int:
    """GroupNorm's groups for ``c`` channels: up to 8, of at least 4 channels each."""
    return next(g for g in (8, 4, 2, 1) if c % g == 0 and (c // g >= 4 or g == 1))


class ConvGenerator(nn.Module):
    """DCGAN's generator for ``S x S`` images: ``z: (..., latent_dim)`` (and, if
    ``num_classes``, labels ``y: (...)``) -> ``(..., channels, S, S)`` in ``[-1, 1]``.

    ``z`` -> linear -> ``(2 * width, S/4, S/4)`` -> [GroupNorm, ReLU, transposed conv
    x2] -> ``(width, S/2, S/2)`` -> [GroupNorm, ReLU, transposed conv x2] -> tanh.

    Example::

        >>> import torchfn
        >>> from torchfn import random
        >>> g = torchfn.Model(ConvGenerator(16, image_size=8, channels=1, num_classes=10))
        >>> params = g.init(random.key(0))
        >>> z = random.normal(random.key(1), (5, 16))               # (B, latent_dim)
        >>> y = random.randint(random.key(2), (5,), 0, 10)          # (B,)
        >>> g.apply(params, z, y).shape                             # (B, C, S, S)
        torch.Size([5, 1, 8, 8])
        >>> g.apply(params, z[0], y[0]).shape                       # one example
        torch.Size([1, 8, 8])
    """

    def __init__(self, latent_dim: int, image_size: int = 8, channels: int = 1,
                 width: int = 64, num_classes: int | None = None):
        super().__init__()
        _check_sizes("ConvGenerator", image_size, channels, width, num_classes)
        if isinstance(latent_dim, bool) or not isinstance(latent_dim, int) or latent_dim < 1:
            raise ValueError(f"ConvGenerator: latent_dim must be an int >= 1, got {latent_dim!r}")
        self.latent_dim, self.num_classes = latent_dim, num_classes
        self.width, self.base = width, image_size // 4
        self.embed = nn.Embedding(num_classes, latent_dim) if num_classes else None
        z_in = latent_dim * (2 if num_classes else 1)
        self.project = nn.Linear(z_in, 2 * width * self.base**2)
        self.norm1 = nn.GroupNorm(_groups(2 * width), 2 * width)
        self.up1 = nn.ConvTranspose2d(2 * width, width, 4, stride=2, padding=1)
        self.norm2 = nn.GroupNorm(_groups(width), width)
        self.up2 = nn.ConvTranspose2d(width, channels, 4, stride=2, padding=1)

    def forward(self, z: Tensor, y: Tensor | None = None) -> Tensor:
        if not isinstance(z, Tensor) or not z.is_floating_point() or z.dim() < 1 or (
            z.shape[-1] != self.latent_dim
        ):
            got = tuple(z.shape) if isinstance(z, Tensor) else type(z).__name__
            raise ValueError(f"ConvGenerator: z must be a float tensor (..., {self.latent_dim}), "
                             f"got {got}")
        lead = z.shape[:-1]
        _check_labels("ConvGenerator", y, lead, self.num_classes)
        if self.embed is not None:
            z = torch.cat([z, self.embed(y)], dim=-1)  # (..., 2 * latent_dim)
        h = self.project(z.reshape(-1, z.shape[-1]))  # (B, 2w * s * s)
        h = h.reshape(-1, 2 * self.width, self.base, self.base)  # (B, 2w, s, s)
        h = self.up1(self.norm1(h).relu())  # (B, w, 2s, 2s)
        x = self.up2(self.norm2(h).relu()).tanh()  # (B, C, 4s, 4s)
        return x.reshape(*lead, *x.shape[1:])


class ConvCritic(nn.Module):
    """A WGAN critic (or GAN discriminator: its score is a logit) for ``S x S`` images:
    ``x: (..., channels, S, S)`` (and, if ``num_classes``, labels ``y: (...)``) ->
    scores ``(...)``.

    Two 4x4 stride-2 convolutions (``width``, ``2 * width`` channels) with LeakyReLU(0.2)
    give features ``phi(x)``; the score is ``w . phi(x) + b``, plus ``embed(y) . phi(x)``
    with ``num_classes`` (a projection discriminator). No normalisation layers.

    Example::

        >>> import torchfn
        >>> from torchfn import random
        >>> d = torchfn.Model(ConvCritic(image_size=8, channels=1, num_classes=10))
        >>> params = d.init(random.key(0))
        >>> x = random.normal(random.key(1), (5, 1, 8, 8))          # (B, C, S, S)
        >>> y = random.randint(random.key(2), (5,), 0, 10)          # (B,)
        >>> d.apply(params, x, y).shape, d.apply(params, x[0], y[0]).shape
        (torch.Size([5]), torch.Size([]))
    """

    def __init__(self, image_size: int = 8, channels: int = 1, width: int = 64,
                 num_classes: int | None = None):
        super().__init__()
        _check_sizes("ConvCritic", image_size, channels, width, num_classes)
        self.image_size, self.channels, self.num_classes = image_size, channels, num_classes
        self.conv1 = nn.Conv2d(channels, width, 4, stride=2, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 4, stride=2, padding=1)
        features = 2 * width * (image_size // 4) ** 2
        self.score = nn.Linear(features, 1)
        self.embed = nn.Embedding(num_classes, features) if num_classes else None

    def forward(self, x: Tensor, y: Tensor | None = None) -> Tensor:
        S, C = self.image_size, self.channels
        if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() < 3 or (
            x.shape[-3:] != (C, S, S)
        ):
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"ConvCritic: x must be a float tensor (..., {C}, {S}, {S}), "
                             f"got {got}")
        lead = x.shape[:-3]
        _check_labels("ConvCritic", y, lead, self.num_classes)
        h = nn.functional.leaky_relu(self.conv1(x.reshape(-1, C, S, S)), 0.2)  # (B, w, S/2, S/2)
        h = nn.functional.leaky_relu(self.conv2(h), 0.2).flatten(1)  # (B, features)
        out = self.score(h).squeeze(-1)  # (B,)
        if self.embed is not None:
            out = out + (self.embed(y.reshape(-1)) * h).sum(-1)
        return out.reshape(lead)
