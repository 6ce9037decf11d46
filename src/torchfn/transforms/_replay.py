"""A replay buffer of sampler states (JEM / IGEBM persistent chains) as pure state.

buffer = replay_init(key, capacity, init_fn)                 # (capacity, ...)
x, idx = replay_sample(buffer, k1, batch_size, init_fn=init_fn)
x = langevin(energy, x, k2, steps=..., step_size=...)        # continue the chains
buffer = replay_push(buffer, x, idx)                         # write them back
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from torchfn import random

__all__ = ["ReplayBuffer", "replay_init", "replay_sample", "replay_push"]

InitFn = Callable[[Tensor, int], Tensor]


class ReplayBuffer(NamedTuple):
    """``data: (capacity, ...)``, the stored chain states. A pytree; never mutated.

    Example::

        >>> import torch
        >>> from torchfn.transforms import ReplayBuffer
        >>> buf = ReplayBuffer(torch.zeros(100, 2))          # 100 states of shape (2,)
        >>> buf.capacity, buf.data.shape
        (100, torch.Size([100, 2]))
    """

    data: Tensor

    @property
    def capacity(self) -> int:
        return self.data.shape[0]


def _fresh(init_fn: InitFn, key: Tensor, n: int, like: Tensor | None = None) -> Tensor:
    x = init_fn(key, n)
    if not isinstance(x, Tensor) or x.dim() < 1 or x.shape[0] != n:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(
            f"init_fn(key, n) must return a Tensor of shape (n, ...) = ({n}, ...), got {got}"
        )
    if like is not None and (x.shape[1:] != like.shape[1:] or x.dtype != like.dtype):
        raise ValueError(
            f"init_fn(key, n) must return samples like the buffer's, shape (n, "
            f"{', '.join(map(str, like.shape[1:]))}) and dtype {like.dtype}; got shape "
            f"{tuple(x.shape)} and dtype {x.dtype}"
        )
    return x


def replay_init(key: Tensor, capacity: int, init_fn: InitFn) -> ReplayBuffer:
    """A buffer of ``capacity`` fresh states ``init_fn(key, capacity)``.

    Args:
        key: PRNG key passed to ``init_fn``.
        capacity: number of stored states, ``>= 1``.
        init_fn: ``init_fn(key, n) -> (n, ...)``, e.g. uniform noise
            ``lambda k, n: random.uniform(k, (n, 2), minval=-4., maxval=4.)``.

    Example::

        >>> init = lambda k, n: random.uniform(k, (n, 2), minval=-1.0, maxval=1.0)
        >>> replay_init(random.key(0), 1000, init).data.shape
        torch.Size([1000, 2])
    """
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
    if not callable(init_fn):
        raise TypeError(f"init_fn must be callable, got {type(init_fn).__name__}")
    return ReplayBuffer(data=_fresh(init_fn, key, capacity))


def replay_sample(
    buffer: ReplayBuffer,
    key: Tensor,
    batch_size: int,
    *,
    init_fn: InitFn,
    reinit_prob: float = 0.05,
) -> tuple[Tensor, Tensor]:
    """Draw ``batch_size`` distinct stored states; replace each by a fresh one w.p. ``reinit_prob``.

    Returns:
        ``(samples, indices)``: ``samples: (batch_size, ...)`` (a new tensor) and
        ``indices: (batch_size,)`` int64, distinct, the slots to :func:`replay_push` back to.

    Example::

        >>> init = lambda k, n: random.uniform(k, (n, 2))
        >>> buf = replay_init(random.key(0), 100, init)
        >>> x, idx = replay_sample(buf, random.key(1), 16, init_fn=init)
        >>> x.shape, idx.shape
        (torch.Size([16, 2]), torch.Size([16]))
    """
    if not isinstance(buffer, ReplayBuffer):
        raise TypeError(f"buffer must be a ReplayBuffer, got {type(buffer).__name__}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int):
        raise TypeError(f"batch_size must be an int, got {type(batch_size).__name__}")
    if not 1 <= batch_size <= buffer.capacity:
        raise ValueError(
            f"batch_size must lie in [1, capacity] = [1, {buffer.capacity}], got {batch_size}"
        )
    if not 0.0 <= reinit_prob <= 1.0:
        raise ValueError(f"reinit_prob must lie in [0, 1], got {reinit_prob}")
    if not callable(init_fn):
        raise TypeError(f"init_fn must be callable, got {type(init_fn).__name__}")

    k_idx, k_mask, k_fresh = random.split(key, 3)
    data = buffer.data  # (capacity, ...)
    idx = random.permutation(k_idx, buffer.capacity)[:batch_size].to(data.device, torch.int64)
    samples = data[idx]  # (batch_size, ...)
    if reinit_prob > 0.0:
        reinit = random.uniform(k_mask, (batch_size,)).to(data.device) < reinit_prob  # (bs,)
        fresh = _fresh(init_fn, k_fresh, batch_size, like=data).to(data.device)
        mask = reinit.reshape((batch_size,) + (1,) * (data.dim() - 1))
        samples = torch.where(mask, fresh, samples)
    return samples, idx


def replay_push(buffer: ReplayBuffer, samples: Tensor, indices: Tensor) -> ReplayBuffer:
    """A new buffer with ``samples`` written at ``indices`` (the input buffer is unchanged).

    Args:
        samples: ``(n, ...)`` states, stored detached in the buffer's dtype.
        indices: ``(n,)`` distinct int64 slots, e.g. those :func:`replay_sample` returned.

    Example::

        >>> buf = ReplayBuffer(torch.zeros(4, 2))
        >>> replay_push(buf, torch.ones(2, 2), torch.tensor([0, 3])).data[:, 0].tolist()
        [1.0, 0.0, 0.0, 1.0]
    """
    if not isinstance(buffer, ReplayBuffer):
        raise TypeError(f"buffer must be a ReplayBuffer, got {type(buffer).__name__}")
    data = buffer.data
    if not isinstance(indices, Tensor) or indices.dtype.is_floating_point or indices.dim() != 1:
        raise TypeError(f"indices must be a 1-D integer Tensor, got {indices!r:.80}")
    if (
        not isinstance(samples, Tensor)
        or samples.shape[1:] != data.shape[1:]
        or (samples.shape[0] != indices.shape[0])
    ):
        got = tuple(samples.shape) if isinstance(samples, Tensor) else type(samples).__name__
        raise ValueError(
            f"samples must have shape (len(indices), *buffer item shape) = "
            f"{(indices.shape[0],) + tuple(data.shape[1:])}, got {got}"
        )
    if indices.numel():
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= buffer.capacity:
            raise ValueError(
                f"indices must lie in [0, capacity-1] = [0, {buffer.capacity - 1}], "
                f"got values in [{lo}, {hi}]"
            )
    idx = indices.to(data.device, torch.int64)
    if torch.unique(idx).numel() != idx.numel():
        raise ValueError("indices must be distinct (a slot written twice is ambiguous)")
    new = data.index_copy(0, idx, samples.detach().to(data.dtype))
    return ReplayBuffer(data=new)
