"""Contrastive-divergence loss for energy-based models."""

from __future__ import annotations

from torch import Tensor

__all__ = ["ebm_loss"]


def ebm_loss(energy_pos: Tensor, energy_neg: Tensor, alpha: float = 0.1) -> Tensor:
    """Contrastive divergence with an L2 energy penalty (Du & Mordatch 2019, "IGEBM")::

        loss = mean(E(x+)) - mean(E(x-)) + alpha * (mean(E(x+)^2) + mean(E(x-)^2))

    Minimising it lowers the energy of data ``x+`` and raises that of model samples
    ``x-`` (e.g. from :func:`torchfn.transforms.langevin`, which returns them detached,
    so no gradient flows through the sampler); the penalty keeps energies near 0.

    Args:
        energy_pos: ``(B+,)`` energies of data examples (any shape; all entries are averaged).
        energy_neg: ``(B-,)`` energies of negative samples.
        alpha: weight of the L2 penalty, ``>= 0``.

    Returns:
        The scalar loss.

    Example::

        >>> import torch
        >>> ebm_loss(torch.tensor([-1.0, -2.0]), torch.tensor([1.0]), alpha=0.0)
        tensor(-2.5000)
    """
    for name, e in (("energy_pos", energy_pos), ("energy_neg", energy_neg)):
        if not isinstance(e, Tensor) or not e.dtype.is_floating_point:
            raise TypeError(
                f"{name} must be a floating-point Tensor, "
                f"got {getattr(e, 'dtype', type(e).__name__)}"
            )
        if e.numel() == 0:
            raise ValueError(f"{name} must not be empty, got shape {tuple(e.shape)}")
    if not alpha >= 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    cd = energy_pos.mean() - energy_neg.mean()
    if alpha == 0:
        return cd
    return cd + alpha * (energy_pos.pow(2).mean() + energy_neg.pow(2).mean())
