"""The VAE evidence lower bound with the reparameterisation trick, noise from a key."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from torchfn import random
from torchfn.losses._classification import _check_float, _check_reduction, _reduce

__all__ = ["vae_elbo", "gaussian_kl"]

_LIKELIHOODS = ("bernoulli", "gaussian")
_LOG_2PI = math.log(2 * math.pi)


def gaussian_kl(
    mean: Tensor,
    logvar: Tensor,
    prior_mean: Tensor | float = 0.0,
    prior_logvar: Tensor | float = 0.0,
) -> Tensor:
    """``KL(N(mean, exp(logvar)) || N(prior_mean, exp(prior_logvar)))`` for diagonal
    Gaussians, summed over the last (latent) dim.

    ``0.5 * sum(lv_p - lv + (exp(lv) + (m - m_p)^2) / exp(lv_p) - 1)``; the default prior
    is ``N(0, I)``.

    Args:
        mean, logvar: ``(..., Z)``, e.g. ``(B, Z)`` or one example ``(Z,)``.
        prior_mean, prior_logvar: numbers or tensors broadcastable to ``(..., Z)``.

    Returns:
        ``(...)``: one KL per example.

    Example::

        >>> gaussian_kl(torch.zeros(4, 2), torch.zeros(4, 2))
        tensor([0., 0., 0., 0.])
    """
    _check_float("mean", mean)
    _check_float("logvar", logvar)
    if mean.dim() < 1 or logvar.shape != mean.shape:
        raise ValueError(
            f"mean and logvar must share a shape (..., Z), got {tuple(mean.shape)} and "
            f"{tuple(logvar.shape)}"
        )
    prior_logvar = torch.as_tensor(prior_logvar, dtype=mean.dtype, device=mean.device)
    prior_mean = torch.as_tensor(prior_mean, dtype=mean.dtype, device=mean.device)
    ratio = (logvar.exp() + (mean - prior_mean).square()) * torch.exp(-prior_logvar)
    return 0.5 * (prior_logvar - logvar + ratio - 1).sum(-1)


def _log_likelihood(out: Any, x: Tensor, likelihood: str) -> Tensor:
    """``log p(x | z)`` per example, summed over all but the batch dim: ``(B,)``."""
    if likelihood == "bernoulli":
        if isinstance(out, tuple):
            raise TypeError(
                "decode_fn must return Bernoulli logits (one tensor) for "
                "likelihood='bernoulli', got a tuple"
            )
        _check_shape_like("decode_fn output (logits)", out, x)
        ll = -F.binary_cross_entropy_with_logits(out, x, reduction="none")
    else:
        mean, logvar = out if isinstance(out, tuple) else (out, None)
        _check_shape_like("decode_fn output (mean)", mean, x)
        if logvar is None:  # unit variance
            ll = -0.5 * ((x - mean).square() + _LOG_2PI)
        else:
            _check_shape_like("decode_fn output (logvar)", logvar, x)
            ll = -0.5 * ((x - mean).square() * torch.exp(-logvar) + logvar + _LOG_2PI)
    return ll.flatten(1).sum(-1)


def _check_shape_like(name: str, t: Any, x: Tensor) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if t.shape != x.shape:
        raise ValueError(f"{name} must have x's shape {tuple(x.shape)}, got {tuple(t.shape)}")


def vae_elbo(
    encode_fn: Callable[[Any, Tensor], tuple[Tensor, Tensor]],
    decode_fn: Callable[[Any, Tensor], Any],
    params: Any,
    x: Tensor,
    key: Tensor,
    *,
    likelihood: str = "bernoulli",
    beta: float = 1.0,
    reduction: str = "mean",
    return_parts: bool = False,
) -> Tensor | tuple[Tensor, tuple[Tensor, Tensor]]:
    """The (beta-)ELBO ``E_q[log p(x | z)] - beta KL(q(z | x) || N(0, I))``, one sample.

    The reparameterisation trick, with all noise from ``key``::

        mean, logvar = encode_fn(params, x)                       # (B, Z) each
        eps = random.normal(key, mean.shape, mean.dtype)          # (B, Z)
        z = mean + exp(logvar / 2) * eps
        elbo = log p(x | decode_fn(params, z)) - beta * gaussian_kl(mean, logvar)

    so gradients flow to the encoder through ``z``. Maximise it: the loss is ``-elbo``.

    Likelihoods (``log p(x | z)`` summed over all dims of one example, constants included):

    * ``"bernoulli"``: ``decode_fn`` returns logits ``(B, ...)``; ``x`` in ``[0, 1]``.
    * ``"gaussian"``: ``decode_fn`` returns the mean ``(B, ...)`` (unit variance) or a
      pair ``(mean, logvar)`` of ``x``'s shape.

    Args:
        encode_fn: ``(params, x (B, ...)) -> (mean, logvar)``, each ``(B, Z)``.
        decode_fn: ``(params, z (B, Z)) -> (B, ...)`` as above.
        params: any pytree both functions read.
        x: ``(B, ...)`` data.
        key: a ``torchfn.random`` key.
        likelihood: ``"bernoulli"`` or ``"gaussian"``.
        beta: KL weight ``>= 0`` (beta-VAE).
        reduction: ``"mean"`` or ``"sum"`` over the batch, or ``"none"`` for ``(B,)``.
        return_parts: also return ``(log_likelihood, kl)``, each ``(B,)``.

    Returns:
        The ELBO (reduced), or ``(elbo, (log_likelihood, kl))`` with ``return_parts``.

    Example::

        >>> import torchfn
        >>> from torchfn.models import MLPVAE
        >>> model = torchfn.Model(MLPVAE(in_dim=6, hidden=(16,), latent_dim=2))
        >>> params = model.init(torchfn.random.key(0))
        >>> x = random.uniform(random.key(1), (8, 6))
        >>> loss = lambda p, k: -vae_elbo(lambda p, x: model.apply(p, x),
        ...                               lambda p, z: model.apply(p, z=z), p, x, k)
        >>> grads = torch.func.grad(loss)(params, torchfn.random.key(1))
    """
    if not callable(encode_fn) or not callable(decode_fn):
        raise TypeError("encode_fn and decode_fn must be callable")
    _check_float("x", x)
    if x.dim() < 2:
        raise ValueError(f"x must be a batch (B, ...), got shape {tuple(x.shape)}")
    if likelihood not in _LIKELIHOODS:
        raise ValueError(f"likelihood must be one of {_LIKELIHOODS}, got {likelihood!r}")
    if not beta >= 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    _check_reduction(reduction)

    enc = encode_fn(params, x)
    if not (isinstance(enc, tuple) and len(enc) == 2):
        raise TypeError(f"encode_fn must return a pair (mean, logvar), got {type(enc).__name__}")
    mean, logvar = enc
    _check_float("encode_fn's mean", mean)
    if mean.dim() != 2 or mean.shape[0] != x.shape[0] or logvar.shape != mean.shape:
        raise ValueError(
            f"encode_fn must return mean and logvar of shape (B, Z) with B = {x.shape[0]}, "
            f"got {tuple(mean.shape)} and {tuple(getattr(logvar, 'shape', ()))}"
        )
    eps = random.normal(key, tuple(mean.shape), dtype=mean.dtype).to(mean.device)  # (B, Z)
    z = mean + torch.exp(0.5 * logvar) * eps  # (B, Z)
    log_lik = _log_likelihood(decode_fn(params, z), x, likelihood)  # (B,)
    kl = gaussian_kl(mean, logvar)  # (B,)
    elbo = _reduce(log_lik - beta * kl, reduction)
    if return_parts:
        return elbo, (log_lik, kl)
    return elbo
