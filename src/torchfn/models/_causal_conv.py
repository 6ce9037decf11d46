"""The causal depthwise convolution in front of linear-attention and state-space layers
(Gated DeltaNet, Mamba-2), continued from a cached window of past inputs."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["causal_conv"]


def causal_conv(x: Tensor, weight: Tensor, bias: Tensor | None = None,
                window: Tensor | None = None, runs: Tensor | None = None
                ) -> tuple[Tensor, Tensor]:
    """``x`` ``(B, C, N)`` convolved per channel by ``weight`` ``(C, 1, K)`` (an
    ``nn.Conv1d(C, C, K, groups=C)``'s), each output reading its own and the ``K - 1``
    inputs before it: those of ``window`` ``(B, C, K - 1)`` (a cache's; default zeros) for
    the first. With ``runs`` ``(B, N)`` (ascending document numbers) an input of an earlier
    document counts as 0. Returns ``(y (B, C, N), window)``, the new window being the last
    ``K - 1`` inputs.

    A few tokens (decoding) or documents take the taps as multiply-adds, which is cheaper
    than a ``conv1d`` call there and maskable; longer inputs ``conv1d``.

    Example::

        >>> import torch
        >>> x = torch.arange(1.0, 6.0).reshape(1, 1, 5)             # (B, C, N)
        >>> y, window = causal_conv(x, torch.ones(1, 1, 3))           # sums of 3
        >>> y, window
        (tensor([[[ 1.,  3.,  6.,  9., 12.]]]), tensor([[[4., 5.]]]))
    """
    b, c, n = x.shape
    k = weight.shape[-1]
    if window is None:
        window = x.new_zeros(b, c, k - 1)
    full = torch.cat((window.to(x.dtype), x), 2)  # (B, C, K - 1 + N)
    if n > 8 and runs is None:
        y = nn.functional.conv1d(full, weight, bias, groups=c)
    else:
        y = 0
        for j in range(k):
            tap = weight[:, 0, j, None] * full[:, :, j:j + n]  # reads d = K - 1 - j back
            d = k - 1 - j
            if runs is not None and d:
                same = runs[:, d:] == runs[:, :-d]  # (B, N - d)
                same = torch.cat((same.new_ones(b, min(d, n)), same), 1)[:, :n]
                tap = tap * same[:, None].to(tap.dtype)  # (the first d read the window)
            y = y + tap
        if bias is not None:
            y = y + bias[:, None]
    return y, full[:, :, full.shape[2] - (k - 1):]
