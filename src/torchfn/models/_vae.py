"""An MLP variational autoencoder: Gaussian encoder, Bernoulli/Gaussian decoder."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from torchfn.models._mlp import MLP, _check_dims

__all__ = ["MLPVAE"]


class MLPVAE(nn.Module):
    """``encoder: x (B, in_dim) -> (mean, logvar)``, each ``(B, latent_dim)``;
    ``decoder: z (B, latent_dim) -> (B, in_dim)`` (Bernoulli logits, or a Gaussian mean).

    ``forward(x)`` encodes, ``forward(z=z)`` decodes, so one ``torchfn.Model`` and one
    params dict serve both halves of ``torchfn.losses.vae_elbo``::

        >>> from torchfn import random
        >>> import torch
        >>> import torchfn
        >>> from torchfn.losses import vae_elbo
        >>> model = torchfn.Model(MLPVAE(in_dim=6, hidden=(32,), latent_dim=2))
        >>> params = model.init(torchfn.random.key(0))
        >>> encode = lambda p, x: model.apply(p, x)          # -> (mean, logvar)
        >>> decode = lambda p, z: model.apply(p, z=z)        # -> logits (B, 6)
        >>> x = random.uniform(random.key(2), (8, 6))  # (B, 6) in [0, 1)
        >>> elbo = vae_elbo(encode, decode, params, x, torchfn.random.key(1))

    Args:
        in_dim: data features; hidden: the encoder's hidden widths (the decoder
            mirrors them); latent_dim: ``Z``; activation: as in :class:`MLP`.
    """

    def __init__(self, in_dim: int, hidden: Sequence[int], latent_dim: int,
                 activation: str = "relu") -> None:
        super().__init__()
        _check_dims(in_dim=in_dim, latent_dim=latent_dim)
        hidden = tuple(hidden)
        self.latent_dim = latent_dim
        self.encoder = MLP(in_dim, hidden, 2 * latent_dim, activation)
        self.decoder = MLP(latent_dim, hidden[::-1], in_dim, activation)

    def encode(self, x: Tensor) -> tuple[Tensor, Tensor]:
        mean, logvar = self.encoder(x).chunk(2, dim=-1)  # (..., Z) each
        return mean, logvar

    def decode(self, z: Tensor) -> Tensor:
        return self.decoder(z)  # (..., in_dim)

    def forward(self, x: Tensor | None = None, *, z: Tensor | None = None):
        if (x is None) == (z is None):
            raise ValueError("MLPVAE: pass exactly one of x (to encode) or z= (to decode)")
        return self.encode(x) if x is not None else self.decode(z)
