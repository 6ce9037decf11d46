"""Volume rendering along rays (NeRF's quadrature), and keyed stratified depth samples."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from torchfn import random

__all__ = ["volume_render", "Rendered", "stratified_depths"]


class Rendered(NamedTuple):
    """What :func:`volume_render` returns, per ray."""

    color: Tensor  # (..., C): sum_i w_i c_i
    depth: Tensor  # (...): sum_i w_i t_i
    opacity: Tensor  # (...): sum_i w_i = 1 - transmittance past the last sample
    weights: Tensor  # (..., S): w_i = T_i (1 - exp(-sigma_i delta_i))


def volume_render(sigma: Tensor, color: Tensor, t: Tensor, *,
                  far_delta: float = 1e10) -> Rendered:
    """Composite samples along rays: NeRF's quadrature of the volume rendering integral.

    With ``delta_i = t_{i+1} - t_i`` (``far_delta`` after the last sample; NeRF's 1e10
    makes the last sample absorb what is left, 0 stops at it), ``alpha_i = 1 -
    exp(-sigma_i delta_i)`` and the transmittance ``T_i = exp(-sum_{j<i} sigma_j
    delta_j)``, the weights are ``w_i = T_i alpha_i`` and the color ``sum_i w_i c_i``.
    For a density and color that are constant between samples the quadrature is exact.

    Args:
      sigma: ``(..., S)`` non-negative densities at the samples.
      color: ``(..., S, C)`` colors (or any features) at the samples.
      t: ``(..., S)`` increasing sample depths along each ray (broadcasts against sigma).
      far_delta: the last interval's length.

    Returns:
      :class:`Rendered` ``(color (..., C), depth (...), opacity (...), weights (..., S))``.

    Example::

        >>> import torch
        >>> sigma = torch.full((4, 64), 2.0)                   # 4 rays, 64 samples
        >>> t = torch.linspace(0.0, 1.0, 64).expand(4, 64)
        >>> out = volume_render(sigma, torch.ones(4, 64, 3), t, far_delta=0.0)
        >>> torch.allclose(out.opacity, torch.tensor(1 - torch.e ** -2.0).expand(4))
        True
    """
    if not all(isinstance(a, Tensor) and a.is_floating_point() for a in (sigma, color, t)):
        raise TypeError("volume_render: sigma, color and t must be float tensors")
    if color.dim() != sigma.dim() + 1 or color.shape[:-1] != sigma.shape:
        raise ValueError(f"volume_render: color must be sigma's shape {tuple(sigma.shape)} "
                         f"plus a channel dim, got {tuple(color.shape)}")
    try:
        t = t.expand_as(sigma)
    except RuntimeError:
        raise ValueError(f"volume_render: t of shape {tuple(t.shape)} does not broadcast to "
                         f"sigma's {tuple(sigma.shape)}") from None
    if not isinstance(far_delta, (int, float)) or isinstance(far_delta, bool) or far_delta < 0:
        raise ValueError(f"volume_render: far_delta must be a number >= 0, got {far_delta!r}")
    delta = torch.cat([t[..., 1:] - t[..., :-1], torch.full_like(t[..., :1], far_delta)], -1)
    tau = sigma * delta  # (..., S) optical depth of each interval
    alpha = -torch.expm1(-tau)  # 1 - exp(-tau), exact for small tau
    # T_i = exp(-sum_{j<i} tau_j): an exclusive cumsum. Not cumsum(tau) - tau, which
    # cancels catastrophically once the last tau is sigma * 1e10.
    before = torch.cat([torch.zeros_like(tau[..., :1]), torch.cumsum(tau[..., :-1], -1)], -1)
    trans = torch.exp(-before)
    w = trans * alpha  # (..., S)
    return Rendered(
        color=(w.unsqueeze(-1) * color).sum(-2),
        depth=(w * t).sum(-1),
        opacity=w.sum(-1),
        weights=w,
    )


def stratified_depths(key: Tensor, near: float, far: float, samples: int,
                      shape: tuple[int, ...] = ()) -> Tensor:
    """One depth drawn uniformly in each of ``samples`` equal bins of ``[near, far)``.

    NeRF's stratified sampling, keyed: ``(*shape, samples)``, increasing along the last
    dim; ``vmap`` over keys gives each ray its own jitter.

    Example::

        >>> from torchfn import random
        >>> t = stratified_depths(random.key(0), 2.0, 6.0, 8, (5,))  # 5 rays
        >>> t.shape, bool((t[:, 1:] > t[:, :-1]).all())
        (torch.Size([5, 8]), True)
    """
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"stratified_depths: samples must be an int >= 1, got {samples!r}")
    if not near < far:
        raise ValueError(f"stratified_depths: near must be < far, got {near}, {far}")
    edges = torch.linspace(near, far, samples + 1, device=key.device)[:-1]  # (S,)
    u = random.uniform(key, (*shape, samples))  # (..., S) in [0, 1)
    return edges + u * ((far - near) / samples)
