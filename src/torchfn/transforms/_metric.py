"""The kinetic energy ``K(p) = pᵀ M⁻¹ p / 2`` of :func:`hmc` and :func:`nuts`, for a
diagonal or a dense inverse mass matrix ``M⁻¹`` on flat vectors, with any leading
chain dims: ``(..., n)`` diagonal, ``(..., n, n)`` dense."""

from __future__ import annotations

import torch
from torch import Tensor


class Metric:
    """``M⁻¹`` and what the integrators need of it.

    Example::

        >>> import torch
        >>> m = Metric(torch.tensor([[4.0, 1.0], [1.0, 2.0]]), dense=True)
        >>> p = torch.tensor([1.0, -1.0])
        >>> m.velocity(p), m.kinetic(p)
        (tensor([ 3., -1.]), tensor(2.))
    """

    def __init__(self, inv_mass: Tensor, dense: bool):
        self.inv, self.dense = inv_mass, dense
        # M⁻¹ = L Lᵀ; a momentum p = L⁻ᵀ z has covariance L⁻ᵀ L⁻¹ = M
        self.chol = torch.linalg.cholesky(inv_mass) if dense else None

    @staticmethod
    def identity(x: Tensor, dense: bool) -> Metric:
        """The unit mass for positions ``x (..., n)``."""
        if not dense:
            return Metric(torch.ones_like(x), False)
        eye = torch.eye(x.shape[-1], dtype=x.dtype, device=x.device)
        return Metric(eye.expand(*x.shape, x.shape[-1]).clone(), True)

    def velocity(self, p: Tensor) -> Tensor:
        """``dx/dt = M⁻¹ p``, ``(..., n)``."""
        if self.dense:
            return (self.inv @ p[..., None])[..., 0]
        return self.inv * p

    def kinetic(self, p: Tensor) -> Tensor:
        """``pᵀ M⁻¹ p / 2``, ``(...)``."""
        return 0.5 * (p * self.velocity(p)).sum(-1)

    def momentum(self, z: Tensor) -> Tensor:
        """A momentum ``~ N(0, M)`` from a standard normal ``z (..., n)``."""
        if self.dense:
            return torch.linalg.solve_triangular(self.chol.mT, z[..., None], upper=True)[..., 0]
        return z * self.inv.rsqrt()


def dense_inverse_mass(value: object, n: int, lead: tuple[int, ...], dtype: torch.dtype,
                       who: str) -> Tensor:
    """A user's dense ``M⁻¹``: a float tensor ``(*lead, n, n)`` over the flat position
    (leaves in ``optree`` order), symmetric positive definite."""
    want = (*lead, n, n)
    if not isinstance(value, Tensor) or not value.dtype.is_floating_point or \
            tuple(value.shape) != want:
        got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(f"{who}: with dense_mass=True, inverse_mass must be a float tensor "
                         f"of shape {want} (the flat position's covariance), got {got}")
    value = value.to(dtype)
    if not torch.allclose(value, value.mT) or \
            bool((torch.linalg.cholesky_ex(value).info != 0).any()):
        raise ValueError(f"{who}: inverse_mass must be symmetric positive definite")
    return value
