"""DDPM's noise-prediction U-Net for small images, with torchfn attention."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchfn.models._denoiser import timestep_embedding

__all__ = ["UNet"]


def _norm(channels: int, groups: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(groups, channels), channels)


class _ResBlock(nn.Module):
    """``norm -> silu -> conv3x3 -> + time -> norm -> silu -> dropout -> conv3x3``, plus
    a skip (a 1x1 conv when the width changes): ``(B, c_in, h, w) -> (B, c_out, h, w)``."""

    def __init__(self, c_in: int, c_out: int, time_dim: int, dropout: float, groups: int):
        super().__init__()
        self.norm1, self.conv1 = _norm(c_in, groups), nn.Conv2d(c_in, c_out, 3, padding=1)
        self.time = nn.Linear(time_dim, c_out)
        self.norm2, self.conv2 = _norm(c_out, groups), nn.Conv2d(c_out, c_out, 3, padding=1)
        self.drop = nn.Dropout(dropout)
        self.skip = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x: Tensor, temb: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x)))  # (B, c_out, h, w)
        h = h + self.time(temb)[:, :, None, None]
        h = self.conv2(self.drop(F.silu(self.norm2(h))))
        return self.skip(x) + h


class _AttnBlock(nn.Module):
    """Self-attention over the ``h * w`` positions, residual: ``(B, c, h, w)`` to itself."""

    def __init__(self, channels: int, heads: int, groups: int):
        super().__init__()
        self.heads = heads
        self.norm = _norm(channels, groups)
        self.qkv = nn.Conv2d(channels, 3 * channels, 1)
        self.out = nn.Conv2d(channels, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        from torchfn.kernels import attention

        B, C, H, W = x.shape
        qkv = self.qkv(self.norm(x)).reshape(B, 3, self.heads, C // self.heads, H * W)
        q, k, v = qkv.transpose(-1, -2).unbind(1)  # (B, heads, HW, C / heads) each
        o = attention(q, k, v)  # (B, heads, HW, C / heads)
        return x + self.out(o.transpose(-1, -2).reshape(B, C, H, W))


class UNet(nn.Module):
    """``model(x, t) -> (B, C, H, W)``: the noise in images ``x: (B, C, H, W)`` at ``t: (B,)``.

    The U-Net of DDPM (Ho et al. 2020), sized for small images: a 3x3 conv, then per
    level ``blocks`` residual blocks (GroupNorm, SiLU, the time embedding added between
    the convs) with self-attention at the levels in ``attention``, halving the
    resolution between levels; a middle of res-attention-res; the mirror image up,
    each block taking the matching skip. The output conv starts at zero (as DDPM), so
    an untrained model predicts 0. Attention is ``torchfn.kernels.attention``: fused on
    a GPU, and it works under ``vmap``, ``grad``, ``jvp`` and ``torch.compile``.

    One example ``(C, H, W)`` with ``t: ()`` works too, so ``vmap`` over examples and
    per-example gradients compose.

    Args:
      in_channels: image channels ``C`` (also the output's).
      channels: width of the first level.
      mults: width multiplier of each level; ``H`` and ``W`` must be divisible by
        ``2 ** (len(mults) - 1)``.
      blocks: residual blocks per level (DDPM: 2).
      attention: levels (0 = full resolution) with self-attention; default the lowest.
      heads: attention heads (each level's width must be divisible by it).
      dropout: dropout in the residual blocks, keyed by ``torchfn.Model.apply``.
      groups: GroupNorm groups (each width must be divisible by ``min(groups, width)``).
      num_classes: if set, ``model(x, t, y)`` adds a learned embedding of the class
        ``y: (B,)`` (ints in ``[0, num_classes)``) to the time embedding.

    Example::

        >>> from torchfn import random
        >>> import torch, torchfn
        >>> model = torchfn.Model(UNet(1, channels=16, mults=(1, 2)))
        >>> params = model.init(torchfn.random.key(0))
        >>> x, t = random.normal(random.key(1), (4, 1, 8, 8)), torch.tensor([0, 10, 100, 999])
        >>> model.apply(params, x, t).shape
        torch.Size([4, 1, 8, 8])
    """

    def __init__(
        self,
        in_channels: int,
        channels: int = 32,
        mults: Sequence[int] = (1, 2),
        blocks: int = 1,
        attention: Sequence[int] | None = None,
        heads: int = 1,
        dropout: float = 0.0,
        groups: int = 8,
        num_classes: int | None = None,
    ) -> None:
        super().__init__()
        for name, v in (("in_channels", in_channels), ("channels", channels),
                        ("blocks", blocks), ("heads", heads), ("groups", groups)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"UNet: {name} must be an int >= 1, got {v!r}")
        mults = tuple(mults)
        if not mults or any(isinstance(m, bool) or not isinstance(m, int) or m < 1
                            for m in mults):
            raise ValueError(f"UNet: mults must be ints >= 1, one per level, got {mults!r}")
        levels = len(mults)
        attention = (levels - 1,) if attention is None else tuple(attention)
        if any(not isinstance(a, int) or not 0 <= a < levels for a in attention):
            raise ValueError(f"UNet: attention must list levels in [0, {levels}), "
                             f"got {attention!r}")
        widths = [channels * m for m in mults]
        for w in widths:
            if w % min(groups, w):
                raise ValueError(f"UNet: width {w} is not divisible by groups={groups}")
            if w % heads:
                raise ValueError(f"UNet: width {w} is not divisible by heads={heads}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"UNet: dropout must be in [0, 1), got {dropout!r}")
        if num_classes is not None and (isinstance(num_classes, bool)
                                        or not isinstance(num_classes, int) or num_classes < 1):
            raise ValueError(f"UNet: num_classes must be None or an int >= 1, got {num_classes!r}")
        self.in_channels, self.channels, self.levels = in_channels, channels, levels
        self.num_classes = num_classes
        tdim = 4 * channels
        self.time_mlp = nn.Sequential(nn.Linear(channels, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
        self.label = nn.Embedding(num_classes, tdim) if num_classes else None
        self.conv_in = nn.Conv2d(in_channels, channels, 3, padding=1)

        res = lambda a, b: _ResBlock(a, b, tdim, dropout, groups)  # noqa: E731
        attn = lambda c: _AttnBlock(c, heads, groups)  # noqa: E731
        self.down = nn.ModuleList()
        skips, width = [channels], channels  # widths of the skips, in order
        for level, w in enumerate(widths):
            stage = nn.ModuleList()
            for _ in range(blocks):
                stage.append(nn.ModuleList([res(width, w)] + ([attn(w)] if level in attention
                                                              else [])))
                width = w
                skips.append(width)
            if level < levels - 1:
                stage.append(nn.Conv2d(width, width, 3, stride=2, padding=1))  # downsample
                skips.append(width)
            self.down.append(stage)
        self.mid = nn.ModuleList([res(width, width), attn(width), res(width, width)])
        self.up = nn.ModuleList()
        for level in reversed(range(levels)):
            w = widths[level]
            stage = nn.ModuleList()
            for _ in range(blocks + 1):
                stage.append(nn.ModuleList([res(width + skips.pop(), w)]
                                           + ([attn(w)] if level in attention else [])))
                width = w
            if level > 0:
                stage.append(nn.Conv2d(width, width, 3, padding=1))  # after a 2x upsample
            self.up.append(stage)
        self.norm_out = _norm(width, groups)
        self.conv_out = nn.Conv2d(width, in_channels, 3, padding=1)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The output conv starts at zero (DDPM); the rest keeps torch's init."""
        nn.init.zeros_(self.conv_out.weight)
        nn.init.zeros_(self.conv_out.bias)

    def _check(self, x: object, t: object, y: object) -> tuple[Tensor, Tensor, Tensor | None]:
        if not isinstance(x, Tensor) or not x.is_floating_point():
            got = x.dtype if isinstance(x, Tensor) else type(x).__name__
            raise TypeError(f"UNet: x must be a float tensor, got {got}")
        f = 2 ** (self.levels - 1)
        if x.dim() not in (3, 4) or x.shape[-3] != self.in_channels or x.shape[-1] % f or (
            x.shape[-2] % f
        ):
            raise ValueError(
                f"UNet: x must be (B, {self.in_channels}, H, W) or ({self.in_channels}, H, W) "
                f"with H and W divisible by {f}, got shape {tuple(x.shape)}"
            )
        batch = () if x.dim() == 3 else (x.shape[0],)
        if not isinstance(t, Tensor):
            t = torch.as_tensor(t, device=x.device)
        if tuple(t.shape) != batch:
            raise ValueError(f"UNet: t must have shape {batch} (one step per image), "
                             f"got {tuple(t.shape)}")
        if (y is None) != (self.num_classes is None):
            raise ValueError("UNet: pass the class y exactly when num_classes is set "
                             f"(num_classes={self.num_classes})")
        if y is not None and (not isinstance(y, Tensor) or tuple(y.shape) != batch
                              or y.is_floating_point()):
            got = f"{tuple(y.shape)} {y.dtype}" if isinstance(y, Tensor) else type(y).__name__
            raise ValueError(f"UNet: y must be an integer tensor of shape {batch}, got {got}")
        return x, t, y

    def forward(self, x: Tensor, t: Tensor, y: Tensor | None = None) -> Tensor:
        x, t, y = self._check(x, t, y)
        one = x.dim() == 3
        if one:  # one example: a batch of one inside
            x, t = x[None], t[None]
            y = None if y is None else y[None]
        temb = self.time_mlp(timestep_embedding(t, self.channels).to(x.dtype))  # (B, 4c)
        if self.label is not None:
            temb = temb + self.label(y)
        temb = F.silu(temb)
        h = self.conv_in(x)  # (B, c, H, W)
        skips = [h]
        for stage in self.down:
            for block in stage:
                if isinstance(block, nn.Conv2d):
                    h = block(h)  # (B, w, H/2, W/2)
                else:
                    h = self._block(block, h, temb)
                skips.append(h)
        h = self.mid[2](self.mid[1](self.mid[0](h, temb)), temb)
        for stage in self.up:
            for block in stage:
                if isinstance(block, nn.Conv2d):
                    h = block(F.interpolate(h, scale_factor=2.0, mode="nearest"))
                else:
                    h = self._block(block, torch.cat([h, skips.pop()], dim=1), temb)
        out = self.conv_out(F.silu(self.norm_out(h)))  # (B, C, H, W)
        return out[0] if one else out

    @staticmethod
    def _block(block: nn.ModuleList, h: Tensor, temb: Tensor) -> Tensor:
        h = block[0](h, temb)
        return block[1](h) if len(block) > 1 else h
