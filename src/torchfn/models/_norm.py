"""The Transformer's norms: LayerNorm, RMSNorm, and Gemma's RMSNorm that scales by
``1 + weight``."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class UnitOffsetRMSNorm(nn.Module):
    """RMSNorm scaling by ``1 + weight`` (weights start at 0), computed in at least
    float32 and cast back, as Gemma's: ``(..., dim) -> (..., dim)``. A bf16 checkpoint's
    weights near 0 keep their precision here, where folding the 1 into them would round
    ``1 + w`` to bf16's steps of 2^-7.

    Example::

        >>> import torch
        >>> norm = UnitOffsetRMSNorm(4)
        >>> x = torch.tensor([[2.0, -2.0, 2.0, -2.0]])  # RMS 2
        >>> torch.allclose(norm(x), x / 2)  # weight 0: plain RMS scaling
        True
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        work = torch.promote_types(x.dtype, torch.float32)
        y = nn.functional.rms_norm(x.to(work), x.shape[-1:], eps=self.eps)
        return (y * (1 + self.weight.to(work))).to(x.dtype)  # (..., dim)


def make_norm(norm: str, dim: int, bias: bool = True, eps: float | None = None) -> nn.Module:
    """``"layer"``: ``nn.LayerNorm`` (its bias only if ``bias``); ``"rms"``: ``nn.RMSNorm``;
    ``"rms+1"``: :class:`UnitOffsetRMSNorm` (Gemma's); ``"rms_plain"``: RMSNorm without a
    weight (Llama 4's q/k norm). ``eps`` None: each one's default (1e-5; the dtype's
    machine epsilon; 1e-6; the dtype's machine epsilon)."""
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float))
                            or not eps > 0):
        raise ValueError(f"norm_eps must be a number > 0 or None, got {eps!r}")
    if norm == "layer":
        return nn.LayerNorm(dim, bias=bias, eps=1e-5 if eps is None else eps)
    if norm == "rms":
        return nn.RMSNorm(dim, eps=eps)
    if norm == "rms+1":
        return UnitOffsetRMSNorm(dim, eps=1e-6 if eps is None else eps)
    if norm == "rms_plain":
        return nn.RMSNorm(dim, eps=eps, elementwise_affine=False)
    raise ValueError(f"norm must be 'layer', 'rms', 'rms+1' or 'rms_plain', got {norm!r}")
