"""Griffin's recurrent block (De et al. 2024; Hawk, RecurrentGemma): a causal convolution
and the Real-Gated Linear Recurrent Unit (RG-LRU), a diagonal recurrence whose decay
each token gates, beside a GELU-gated branch."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from torchfn.models._kv_cache import KVCache, StaticKVCache
from torchfn.models._mlp import _check_dims
from torchfn.models._recurrent import causal_conv, recurrent_cache, recurrent_inputs

__all__ = ["RGLRU"]

_C = 8.0  # Griffin's fixed scale of the log decay: a = sigmoid(.)^(8 softplus(Lambda))


def _sqrt(x: Tensor, bound: float | None) -> Tensor:
    """``sqrt(x)``; with ``bound``, its derivative capped at ``bound`` (Griffin's, so
    ``a -> 1`` does not blow the gradient up), the cap's own derivative taken as 0."""
    if bound is None:
        return torch.sqrt(x)
    slope = (0.5 * torch.rsqrt(x.clamp(min=1 / (4 * bound ** 2)))).detach()
    return torch.sqrt(x).detach() + (x - x.detach()) * slope


class RGLRU(nn.Module):
    """Griffin's recurrent block ``(B, N, dim) -> (B, N, dim)``, as Hawk and
    RecurrentGemma (``RecurrentGemmaRecurrentBlock``) have it: a state of ``width``
    numbers per sequence, so a token costs the same however long the context.

    One branch is ``gelu_tanh(x W_y)``; the other ``x W_x`` through a causal depthwise
    convolution of ``conv_kernel`` taps, then the RG-LRU: per channel,
    ``h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t * u_t)`` with an input gate
    ``i_t = sigmoid(u_t W_i + b_i)``, a decay ``a_t = exp(-8 r_t softplus(Lambda))`` and a
    recurrence gate ``r_t = sigmoid(u_t W_a + b_a)`` (``W_i``, ``W_a``: block-diagonal,
    ``heads`` blocks). A sequence's first token starts from a zero state and skips the
    ``sqrt`` factor: position 0 (the encoder passes ``positions``), a call's first real
    token when nothing came before it, and each document's first. The branches' product
    goes through ``out``. The recurrence runs in float32 (or float64) as an associative scan:
    plain torch ops, so ``grad``, ``vmap`` and ``jvp`` compose with it. The ``sqrt``'s
    derivative is capped at ``sqrt_grad_bound`` (Griffin's 1000, as transformers'; its
    own derivative then taken as 0), or exact with None.

    With a cache (``KVCache()`` to start, or a :class:`StaticKVCache`), the forward
    returns ``(out, cache)``; the entry holds the convolution's last ``conv_kernel - 1``
    inputs ``(B, width, K - 1)`` as its "keys" and the state ``(B, 1, width, 1)`` as its
    "values". ``key_padding_mask`` keeps padded tokens out of the window and the state
    (left padding: the first real token starts the sequence);
    ``segment_ids`` packs documents, each as if it ran alone.

    Example::

        >>> import torch
        >>> import torchfn
        >>> from torchfn.models import KVCache, RGLRU
        >>> model = torchfn.Model(RGLRU(dim=16, heads=2))
        >>> params = model.init(torchfn.random.key(0))
        >>> x = torchfn.random.normal(torchfn.random.key(1), (2, 10, 16))  # (B, N, dim)
        >>> first, cache = model.apply(params, x[:, :6], cache=KVCache())
        >>> rest, cache = model.apply(params, x[:, 6:], cache=cache)
        >>> torch.allclose(torch.cat((first, rest), 1), model.apply(params, x), atol=1e-6)
        True
        >>> cache.keys[0].shape, cache.values[0].shape  # conv window, state
        (torch.Size([2, 16, 3]), torch.Size([2, 1, 16, 1]))
    """

    needs_positions = True  # the encoder hands each block's positions (resets at 0)

    def __init__(self, dim: int, heads: int, *, width: int | None = None,
                 conv_kernel: int = 4, sqrt_grad_bound: float | None = 1000.0) -> None:
        super().__init__()
        width = dim if width is None else width
        _check_dims(dim=dim, heads=heads, width=width, conv_kernel=conv_kernel)
        if width % heads:
            raise ValueError(f"heads must divide width = {width}, got heads={heads}")
        if sqrt_grad_bound is not None and (isinstance(sqrt_grad_bound, bool) or not isinstance(
                sqrt_grad_bound, (int, float)) or not sqrt_grad_bound > 0):
            raise ValueError(f"sqrt_grad_bound must be a number > 0 or None, got "
                             f"{sqrt_grad_bound!r}")
        self.dim, self.heads, self.width, self.conv_kernel = dim, heads, width, conv_kernel
        self.sqrt_grad_bound = sqrt_grad_bound
        block = width // heads
        self.gate = nn.Linear(dim, width)  # the GELU branch (linear_y)
        self.in_proj = nn.Linear(dim, width)  # the recurrent branch (linear_x)
        self.conv = nn.Conv1d(width, width, conv_kernel, groups=width)  # causal here
        self.input_gate_weight = nn.Parameter(torch.empty(heads, block, block))
        self.input_gate_bias = nn.Parameter(torch.empty(heads, block))
        self.recurrent_gate_weight = nn.Parameter(torch.empty(heads, block, block))
        self.recurrent_gate_bias = nn.Parameter(torch.empty(heads, block))
        self.recurrent_param = nn.Parameter(torch.empty(width))  # Lambda
        self.out = nn.Linear(width, dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Griffin's (transformers'): gate weights N(0, 0.01 / block), zero biases, and
        ``Lambda = softplus^-1(-log a0)`` with ``a0^2`` uniform in [0.9^2, 0.999^2], so a
        token's decay is ``a0^(8 r)``."""
        std = math.sqrt(0.01 / (self.width // self.heads))
        for w in (self.input_gate_weight, self.recurrent_gate_weight):
            nn.init.normal_(w, std=std)
        nn.init.zeros_(self.input_gate_bias)
        nn.init.zeros_(self.recurrent_gate_bias)
        with torch.no_grad():
            a2 = torch.empty_like(self.recurrent_param).uniform_(0.9 ** 2 + 1e-8, 0.999 ** 2 + 1e-8)
            self.recurrent_param.copy_(a2.log().mul(-0.5).exp().sub(1).log())

    def cache_shapes(self, batch_size: int, capacity: int) -> tuple[tuple, tuple]:
        """This layer's cache entry: the convolution's window ``(B, width, K - 1)`` and the
        state ``(B, 1, width, 1)`` (4-D, as every recurrent layer's), whatever the
        capacity."""
        return (batch_size, self.width, self.conv_kernel - 1), (batch_size, 1, self.width, 1)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None,
                segment_ids: Tensor | None = None, positions: Tensor | None = None,
                cache: KVCache | StaticKVCache | None = None) -> Tensor | tuple:
        x, keep, runs, cache, window, state = recurrent_inputs(
            "RGLRU", x, key_padding_mask, segment_ids, cache)  # x: padding zeroed
        b, n, _ = x.shape
        state = None if state is None else state.reshape(b, self.width)  # (B, W)
        y = nn.functional.gelu(self.gate(x), approximate="tanh")  # (B, N, W)
        u = self.in_proj(x)
        if keep is not None:  # a biased projection of 0 is not 0: keep padding out
            u = u * keep
        u, window = causal_conv(u.transpose(1, 2), self.conv.weight, self.conv.bias, window,
                                runs)
        u = u.transpose(1, 2)  # (B, N, W)
        blocks = u.unflatten(-1, (self.heads, -1))  # (B, N, heads, W / heads)
        i_gate = torch.sigmoid(torch.einsum("bnhi,hij->bnhj", blocks, self.input_gate_weight)
                               + self.input_gate_bias).flatten(2)
        r_gate = torch.sigmoid(torch.einsum("bnhi,hij->bnhj", blocks,
                                            self.recurrent_gate_weight)
                               + self.recurrent_gate_bias).flatten(2)
        work = torch.promote_types(x.dtype, torch.float32)
        log_a = -_C * r_gate.to(work) * nn.functional.softplus(
            self.recurrent_param.to(work))  # (B, N, W), <= 0
        fresh = state is None or (cache.length == 0 if isinstance(cache, StaticKVCache)
                                  else False)  # nothing before this call
        reset = self._resets(b, n, x.device, positions, keep, runs, fresh)  # (B, N, 1)
        scale = torch.where(reset, 1.0, _sqrt(-torch.expm1(2 * log_a), self.sqrt_grad_bound))
        write = (u * i_gate) * scale.to(u.dtype)
        if keep is not None:  # the state stays 0 through left padding
            write = write * keep
        decay = torch.where(reset, 0.0, torch.exp(log_a))
        if n == 1 and state is not None:  # decoding: one step
            h = decay * state[:, None].to(work) + write.to(work)
        else:  # Mamba's linear recurrence h -> a h + u, as an associative scan
            from torchfn.kernels._selective_scan import _scan

            carried, h = _scan(decay, write.to(work))
            if state is not None:
                h = h + carried * state[:, None].to(work)  # (B, N, W)
        out = self.out(h.to(x.dtype) * y)  # (B, N, dim)
        if cache is None:
            return out
        return out, recurrent_cache(cache, window, h[:, -1].reshape(b, 1, -1, 1), n)

    @staticmethod
    def _resets(b: int, n: int, device: torch.device, positions: Tensor | None,
                keep: Tensor | None, runs: Tensor | None, fresh: bool | Tensor) -> Tensor:
        """Where a sequence starts, ``(B, N, 1)`` bool: position 0, a call's first real
        token when nothing came before it (left padding: as if the row ran alone), and
        each document's first token."""
        if keep is None:
            first = torch.zeros(b, n, dtype=torch.bool, device=device)
            first[:, 0] = True
        else:
            real = keep[..., 0] > 0
            first = real & (real.long().cumsum(1) == 1)  # (B, N)
        reset = first & fresh
        if positions is not None:
            reset = reset | (positions == 0)
        if runs is not None:
            reset = reset | torch.cat((torch.ones_like(runs[:, :1], dtype=torch.bool),
                                       runs[:, 1:] != runs[:, :-1]), 1)
        return reset[..., None]

    def extra_repr(self) -> str:
        return f"dim={self.dim}, heads={self.heads}, width={self.width}"
