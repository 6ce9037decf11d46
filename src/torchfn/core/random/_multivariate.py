"""Multivariate samplers on ``normal``'s bits: ``multivariate_normal`` and ``orthogonal``
(the same draws and the same linear algebra as ``jax.random``'s, so they agree with
JAX to the rounding of the factorisations)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from torchfn.core.random._checks import (
    _check_broadcast,
    _check_float_dtype,
    _check_key,
    _check_shape,
)
from torchfn.core.random._floats import normal

Shape = int | Sequence[int]
_METHODS = ("cholesky", "eigh", "svd")


def multivariate_normal(
    key: Tensor,
    mean: Tensor,
    cov: Tensor,
    shape: Shape | None = None,
    dtype: torch.dtype | None = None,
    method: str = "cholesky",
) -> Tensor:
    """Samples of N(mean, cov): ``mean + F z`` with ``F F^T = cov`` and z standard
    normal (``jax.random.multivariate_normal``).

    Args:
      key: ``(2,)`` int32 key.
      mean: ``(..., n)``.
      cov: ``(..., n, n)`` symmetric positive (semi-)definite.
      shape: batch shape of the samples; default the broadcast of ``mean.shape[:-1]``
        and ``cov.shape[:-2]``.
      dtype: default ``mean``'s.
      method: ``"cholesky"`` (F lower triangular; cov must be positive definite),
        ``"eigh"`` or ``"svd"`` (``F = U sqrt(S)``; semi-definite allowed).

    Returns:
      ``shape + (n,)``.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> cov = torch.tensor([[2.0, 0.8], [0.8, 1.0]])
        >>> x = random.multivariate_normal(random.key(0), torch.zeros(2), cov, (20_000,))
        >>> bool(torch.allclose(torch.cov(x.T), cov, atol=0.06))
        True
    """
    k = _check_key(key, "multivariate_normal")
    if not isinstance(mean, Tensor) or mean.ndim < 1:
        raise ValueError(f"multivariate_normal: mean must be a tensor (..., n), got {mean!r}")
    if not isinstance(cov, Tensor) or cov.ndim < 2:
        raise ValueError(f"multivariate_normal: cov must be a tensor (..., n, n), got {cov!r}")
    n = mean.shape[-1]
    if tuple(cov.shape[-2:]) != (n, n):
        raise ValueError(f"multivariate_normal: cov must have shape (..., {n}, {n}) for mean "
                         f"of shape {tuple(mean.shape)}, got {tuple(cov.shape)}")
    if method not in _METHODS:
        raise ValueError(f"multivariate_normal: method must be one of {_METHODS}, got {method!r}")
    dtype = _check_float_dtype(mean.dtype if dtype is None else dtype, "multivariate_normal")
    mean, cov = mean.to(dtype=dtype, device=k.device), cov.to(dtype=dtype, device=k.device)
    batch = torch.broadcast_shapes(mean.shape[:-1], cov.shape[:-2])
    if shape is None:
        shape = tuple(batch)
    shape = _check_shape(shape, "multivariate_normal")
    _check_broadcast(shape, "multivariate_normal", **{"mean.shape[:-1]": mean[..., 0],
                                                      "cov.shape[:-2]": cov[..., 0, 0]})
    if method == "svd":
        u, s, _ = torch.linalg.svd(cov)
        factor = u * torch.sqrt(s[..., None, :])
    elif method == "eigh":
        w, v = torch.linalg.eigh(cov)
        factor = v * torch.sqrt(w[..., None, :])
    else:
        factor = torch.linalg.cholesky(cov)
    z = normal(k, (*shape, n), dtype)  # (*shape, n)
    return mean + torch.einsum("...ij,...j->...i", factor, z)


def orthogonal(key: Tensor, n: int, shape: Shape = (), dtype: torch.dtype = torch.float32,
               m: int | None = None) -> Tensor:
    """Haar-random matrices with orthonormal columns or rows (``jax.random.orthogonal``):
    the Q of a Gaussian matrix's QR, with the signs of R's diagonal taken out.

    Returns ``shape + (n, m)`` (``m`` defaults to ``n``): orthonormal columns when
    ``n >= m``, orthonormal rows otherwise.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> q = random.orthogonal(random.key(0), 4)
        >>> bool(torch.allclose(q.T @ q, torch.eye(4), atol=1e-5))
        True
    """
    k = _check_key(key, "orthogonal")
    shape = _check_shape(shape, "orthogonal")
    dtype = _check_float_dtype(dtype, "orthogonal")
    m = n if m is None else m
    for name, v in (("n", n), ("m", m)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"orthogonal: {name} must be an int >= 1, got {v!r}")
    z = normal(k, (*shape, max(n, m), min(n, m)), dtype)
    q, r = torch.linalg.qr(z)
    d = torch.diagonal(r, dim1=-2, dim2=-1)
    x = q * torch.sign(d).unsqueeze(-2)
    return x.mT if n < m else x
