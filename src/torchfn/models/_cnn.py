"""Small image classifiers: a plain ConvNet and a tiny ResNet with BatchNorm."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from torchfn.models._mlp import _check_dims

__all__ = ["ConvNet", "ResNet", "BasicBlock"]


def _widths(name: str, widths: Sequence[int]) -> tuple[int, ...]:
    if isinstance(widths, int) or len(tuple(widths)) == 0:
        raise ValueError(f"{name} must be a non-empty sequence of widths, got {widths!r}")
    widths = tuple(widths)
    _check_dims(**{f"{name}[{i}]": w for i, w in enumerate(widths)})
    return widths


class ConvNet(nn.Module):
    """``[Conv3x3 -> ReLU -> MaxPool2]`` per width, global average pool, Linear.

    ``(B, C, H, W) -> (B, num_classes)``; one example ``(C, H, W) -> (num_classes,)``
    also works (for per-example ``vmap``). ``H`` and ``W`` must be at least
    ``2 ** len(channels)``.

    Example::

        >>> from torchfn import random
        >>> import torch
        >>> import torchfn
        >>> model = torchfn.Model(ConvNet(1, 10, channels=(8, 16)))
        >>> params = model.init(torchfn.random.key(0))
        >>> model.apply(params, random.normal(random.key(1), (4, 1, 8, 8))).shape
        torch.Size([4, 10])
    """

    def __init__(
        self, in_channels: int = 1, num_classes: int = 10, channels: Sequence[int] = (16, 32)
    ) -> None:
        super().__init__()
        _check_dims(in_channels=in_channels, num_classes=num_classes)
        channels = _widths("channels", channels)
        layers: list[nn.Module] = []
        c = in_channels
        for w in channels:
            layers += [nn.Conv2d(c, w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
            c = w
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.features(x)  # (B, C', H', W') or (C', H', W')
        return self.head(h.mean(dim=(-2, -1)))  # (B, num_classes)


class BasicBlock(nn.Module):
    """``relu(bn(conv(relu(bn(conv(x))))) + shortcut(x))`` (He et al. 2016); the
    shortcut is a strided 1x1 conv + BatchNorm when the shape changes.

    ``(B, c_in, H, W) -> (B, c_out, H / stride, W / stride)`` (rounded up). BatchNorm
    buffers are ``torchfn.Model`` state.

    Example::

        >>> from torchfn import random
        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import BasicBlock
        >>> model = torchfn.Model(BasicBlock(8, 16, stride=2))
        >>> params, state = model.init(torchfn.random.key(0)), model.init_state()
        >>> x = random.normal(random.key(2), (2, 8, 8, 8))  # (B, C, H, W)
        >>> y, state = model.apply(params, x, state=state, train=True)
        >>> y.shape                                                      # (B, c_out, H/2, W/2)
        torch.Size([2, 16, 4, 4])
    """

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.act = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(self.bn1(self.conv1(x)))
        return self.act(self.bn2(self.conv2(h)) + self.shortcut(x))


class ResNet(nn.Module):
    """A tiny ResNet: Conv3x3-BN-ReLU stem, one stage of :class:`BasicBlock` per width
    (stride 2 from the second stage on), global average pool, Linear.

    ``(B, C, H, W) -> (B, num_classes)``; one example ``(C, H, W)`` is run as a batch of
    one (BatchNorm needs a batch dim) -- use it so in eval mode only: in train mode a
    batch of one has no batch statistics. BatchNorm buffers are ``torchfn.Model`` state::

        >>> from torchfn import random
        >>> import torch
        >>> import torchfn
        >>> model = torchfn.Model(ResNet(3, 10, widths=(8, 16), blocks_per_stage=1))
        >>> params, state = model.init(torchfn.random.key(0)), model.init_state()
        >>> x = random.normal(random.key(3), (4, 3, 8, 8))  # (B, C, H, W)
        >>> logits, state = model.apply(params, x, state=state, train=True)
        >>> logits.shape
        torch.Size([4, 10])
    """

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        widths: Sequence[int] = (16, 32),
        blocks_per_stage: int = 1,
    ) -> None:
        super().__init__()
        _check_dims(
            in_channels=in_channels, num_classes=num_classes, blocks_per_stage=blocks_per_stage
        )
        widths = _widths("widths", widths)
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(),
        )
        blocks: list[nn.Module] = []
        c = widths[0]
        for i, w in enumerate(widths):
            for j in range(blocks_per_stage):
                blocks.append(BasicBlock(c, w, stride=2 if (i > 0 and j == 0) else 1))
                c = w
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(c, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 3:  # one example (C, H, W): BatchNorm2d needs (B, C, H, W)
            return self.forward(x.unsqueeze(0)).squeeze(0)
        h = self.blocks(self.stem(x))  # (B, C', H', W')
        return self.head(h.mean(dim=(-2, -1)))  # (B, num_classes)
