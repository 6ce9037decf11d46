"""EDM's denoising loss (Karras et al. 2022): log-normal noise levels, and a weight that
makes every level's loss start at unit scale."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from torchfn import random
from torchfn.losses._flow_matching import _check_x0

__all__ = ["edm_loss"]


def edm_loss(
    denoiser_fn: Callable[[Tensor, Tensor], Tensor],
    x0: Tensor,
    key: Tensor,
    *,
    p_mean: float = -1.2,
    p_std: float = 1.2,
    sigma_data: float = 0.5,
) -> Tensor:
    """``mean_b lambda(sigma_b) mean_d (D(x0 + sigma eps, sigma) - x0)^2``, with
    ``log sigma ~ N(p_mean, p_std)`` and ``lambda = (sigma^2 + sd^2) / (sigma sd)^2``.

    ``lambda`` is the inverse of the preconditioned target's scale, ``c_out^2``, so with
    :func:`torchfn.transforms.diffusion.edm_denoiser` this is the unit-variance
    regression of the raw network. For data of standard deviation ``sigma_data`` per
    coordinate (independent Gaussian), the best denoiser's loss is exactly 1 at every
    level. The paper sums over coordinates; this averages (divide the learning rate by
    the dimension to compare).

    Args:
        denoiser_fn: ``D(x, sigma) -> (B, ...)``, ``sigma: (B,)`` float.
        x0: ``(B, ...)`` data.
        key: PRNG key for the levels and the noise.
        p_mean, p_std: the log-normal levels (the paper's -1.2 and 1.2).
        sigma_data: the data's standard deviation (0.5 for images in [-1, 1]).

    Returns:
        The scalar loss, in ``x0``'s dtype.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> x0 = random.normal(random.key(1), (4096, 8), dtype=torch.float64) * 0.5
        >>> best = lambda x, s: x * (0.25 / (s * s + 0.25))[:, None]   # E[x0 | x]
        >>> round(float(edm_loss(best, x0, random.key(2))), 1)
        1.0
    """
    if not callable(denoiser_fn):
        raise TypeError(f"denoiser_fn must be callable, got {type(denoiser_fn).__name__}")
    _check_x0(x0)
    for name, value in (("p_std", p_std), ("sigma_data", sigma_data)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a float > 0, got {value!r}")
    B = x0.shape[0]
    k_sigma, k_noise = random.split(key)
    sigma = (p_mean + p_std * random.normal(k_sigma, (B,), dtype=x0.dtype)).exp().to(x0.device)
    eps = random.normal(k_noise, tuple(x0.shape), dtype=x0.dtype).to(x0.device)  # (B, ...)
    s = sigma.view((B,) + (1,) * (x0.dim() - 1))
    out = denoiser_fn(x0 + s * eps, sigma)
    if not isinstance(out, Tensor) or out.shape != x0.shape:
        got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(f"denoiser_fn(x, sigma) must return x0's shape {tuple(x0.shape)}, "
                         f"got {got}")
    weight = (sigma * sigma + sigma_data**2) / (sigma * sigma_data) ** 2  # (B,)
    return (weight * (out - x0).pow(2).reshape(B, -1).mean(dim=1)).mean()
