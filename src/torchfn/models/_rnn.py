"""LSTM and GRU as a ``torchfn.scan`` of plain ops, with ``nn.LSTM`` / ``nn.GRU``'s
parameters, names, shapes and numerics.

Why not ``nn.LSTM``: its fused CPU kernel has no forward-mode derivative, so ``jvp``,
``jacfwd`` and ``hessian`` through it raise. These modules are the same function
written step by step (the input projection of every step is one matmul up front),
so every ``torch.func`` transform goes through them. A state dict loads either way.
In plain eager mode (no transform, no forward AD, no tracing) a layer runs torch's own
fused kernels inside one ``autograd.Function`` instead
(``_rnn_fused``): the same numbers at ``nn.LSTM`` / ``nn.GRU``'s speed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchfn.core.scan import scan
from torchfn.models._rnn_fused import fusable, torch_layer

__all__ = ["LSTM", "GRU"]


def _lstm(x: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None, b_hh: Tensor | None,
          w_hr: Tensor | None = None):
    """The input projection of every step at once, ``(T, B, 4H)``, and one LSTM step
    (``w_hr``: the ``(P, H)`` projection of ``h`` with ``proj_size = P``)."""
    gx = F.linear(x, w_ih, None if b_ih is None else b_ih + b_hh)  # both biases folded in
    w_t = w_hh.T  # (R, 4H), R = P or H

    def step(carry, gx):  # gx: (B, 4H), this step's x W_ih^T + b_ih + b_hh
        h, c = carry  # (B, R), (B, H)
        gates = torch.addmm(gx, h, w_t)  # (B, 4H): i, f, g, o (PyTorch's order)
        i, f, _, o = torch.sigmoid(gates).chunk(4, dim=-1)  # one op for three gates
        H = c.shape[-1]
        g = torch.tanh(gates[..., 2 * H : 3 * H])
        c = torch.addcmul(f * c, i, g)
        h = o * torch.tanh(c)  # (B, H)
        if w_hr is not None:
            h = h @ w_hr.T  # (B, P)
        return (h, c), h

    return gx, step


def _gru(x: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None, b_hh: Tensor | None,
         w_hr: None = None):
    """The input projection of every step at once, ``(T, B, 3H)``, and one GRU step
    (``b_hh`` stays in the step: its n part is scaled by r)."""
    gx = F.linear(x, w_ih, b_ih)
    w_t = w_hh.T  # (H, 3H)

    def step(h, gx):  # h: (B, H), gx: (B, 3H), this step's x W_ih^T + b_ih
        gh = h @ w_t if b_hh is None else torch.addmm(b_hh, h, w_t)  # (B, 3H): r, z, n
        H = h.shape[-1]
        r, z = torch.sigmoid(gx[..., : 2 * H] + gh[..., : 2 * H]).chunk(2, dim=-1)
        n = torch.tanh(torch.addcmul(gx[..., 2 * H :], r, gh[..., 2 * H :]))
        h = torch.lerp(n, h, z)  # (1 - z) * n + z * h
        return h, h

    return gx, step


class _Recurrent(nn.Module):
    _GATES = 0
    _NAME = ""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
                 bidirectional: bool = False, proj_size: int = 0) -> None:
        super().__init__()
        for name, v in (("input_size", input_size), ("hidden_size", hidden_size),
                        ("num_layers", num_layers)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{self._NAME}: {name} must be an int >= 1, got {v!r}")
        for name, v in (("bias", bias), ("batch_first", batch_first),
                        ("bidirectional", bidirectional)):
            if not isinstance(v, bool):
                raise TypeError(f"{self._NAME}: {name} must be a bool, got {type(v).__name__}")
        if isinstance(proj_size, bool) or not isinstance(proj_size, int) or not (
            0 <= proj_size < hidden_size
        ):
            raise ValueError(f"{self._NAME}: proj_size must be an int in [0, hidden_size="
                             f"{hidden_size}), got {proj_size!r}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not (
            0.0 <= dropout < 1.0
        ):
            raise ValueError(f"{self._NAME}: dropout must be in [0, 1), got {dropout!r}")
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.bidirectional = bias, batch_first, bidirectional
        self.dropout, self.proj_size = float(dropout), proj_size
        self.num_directions = 2 if bidirectional else 1
        G, H = self._GATES * hidden_size, hidden_size
        R = proj_size or H  # width of h: what recurs and what comes out
        for layer in range(num_layers):
            width = input_size if layer == 0 else R * self.num_directions
            for suffix in ("", "_reverse")[: self.num_directions]:
                self.register_parameter(f"weight_ih_l{layer}{suffix}",
                                        nn.Parameter(torch.empty(G, width)))
                self.register_parameter(f"weight_hh_l{layer}{suffix}",
                                        nn.Parameter(torch.empty(G, R)))
                if bias:
                    self.register_parameter(f"bias_ih_l{layer}{suffix}",
                                            nn.Parameter(torch.empty(G)))
                    self.register_parameter(f"bias_hh_l{layer}{suffix}",
                                            nn.Parameter(torch.empty(G)))
                if proj_size:
                    self.register_parameter(f"weight_hr_l{layer}{suffix}",
                                            nn.Parameter(torch.empty(proj_size, H)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform in ``±1/sqrt(hidden_size)``, as ``nn.LSTM`` / ``nn.GRU``."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)

    def extra_repr(self) -> str:
        return (f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}, "
                f"bias={self.bias}, batch_first={self.batch_first}, dropout={self.dropout}, "
                f"bidirectional={self.bidirectional}"
                + (f", proj_size={self.proj_size}" if self.proj_size else ""))

    # ------------------------------------------------------------------ shapes
    def _inputs(self, x: object) -> tuple[Tensor, bool]:
        """``x`` as ``(T, B, input_size)`` and whether it came without a batch dim."""
        if not isinstance(x, Tensor) or not x.is_floating_point():
            got = x.dtype if isinstance(x, Tensor) else type(x).__name__
            raise TypeError(f"{self._NAME}: input must be a float tensor, got {got}")
        layout = "(B, T, input_size)" if self.batch_first else "(T, B, input_size)"
        if x.dim() not in (2, 3) or x.shape[-1] != self.input_size:
            raise ValueError(
                f"{self._NAME}: input must be {layout} or (T, input_size) with "
                f"input_size={self.input_size}, got shape {tuple(x.shape)}"
            )
        if x.dim() == 2:
            return x.unsqueeze(1), True  # (T, 1, F)
        return (x.transpose(0, 1) if self.batch_first else x), False  # (T, B, F)

    def _state(self, s: object, name: str, B: int, unbatched: bool, like: Tensor,
               H: int) -> Tensor:
        """An initial state as ``(num_layers * num_directions, B, H)``."""
        LD = self.num_layers * self.num_directions
        if s is None:
            return like.new_zeros(LD, B, H)
        want = (LD, H) if unbatched else (LD, B, H)
        if not isinstance(s, Tensor) or tuple(s.shape) != want:
            got = tuple(s.shape) if isinstance(s, Tensor) else type(s).__name__
            raise ValueError(f"{self._NAME}: {name} must have shape {want} "
                             f"(num_layers * num_directions, {'' if unbatched else 'B, '}"
                             f"{'proj_size' if H != self.hidden_size else 'hidden_size'}"
                             f"), got {got}")
        if s.dtype != like.dtype or s.device != like.device:
            raise ValueError(f"{self._NAME}: {name} must have the input's dtype and device "
                             f"({like.dtype}, {like.device}), got {s.dtype}, {s.device}")
        return s.unsqueeze(1) if unbatched else s

    def _weights(self, layer: int, reverse: bool) -> tuple[Tensor, ...]:
        sfx = f"l{layer}{'_reverse' if reverse else ''}"
        get = lambda n: getattr(self, f"{n}_{sfx}") if self.bias or "weight" in n else None  # noqa: E731
        w_hr = getattr(self, f"weight_hr_{sfx}") if self.proj_size else None
        return get("weight_ih"), get("weight_hh"), get("bias_ih"), get("bias_hh"), w_hr

    def _run(self, x: Tensor, init: list, cell) -> tuple[Tensor, list]:
        """All layers and directions: ``x`` ``(T, B, F)`` -> ``(T, B, D * H)``, last states."""
        finals = []
        for layer in range(self.num_layers):
            outs = []
            for d in range(self.num_directions):
                weights = self._weights(layer, reverse=d == 1)  # w_ih, w_hh, b_ih, b_hh, w_hr
                i = layer * self.num_directions + d
                state = init[i] if isinstance(init[i], tuple) else (init[i],)
                tensors = [x, *state, *(w for w in weights if w is not None)]
                if fusable(*tensors):  # plain eager: torch's kernels
                    carry, ys = torch_layer(cell, x, init[i], *weights, reverse=d == 1)
                else:
                    gx, step = cell(x, *weights)  # (T, B, G*H)
                    carry, ys = scan(step, init[i], gx, reverse=d == 1)
                outs.append(ys)  # (T, B, H)
                finals.append(carry)
            x = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
            if self.dropout > 0 and layer < self.num_layers - 1:
                x = F.dropout(x, self.dropout, self.training)  # keyed inside Model.apply
        return x, finals

    def _output(self, y: Tensor, unbatched: bool) -> Tensor:
        if unbatched:
            return y.squeeze(1)  # (T, D*H)
        return y.transpose(0, 1) if self.batch_first else y


class LSTM(_Recurrent):
    """``nn.LSTM`` as a scan of plain ops: works under ``jvp``,
    ``jacfwd`` and ``hessian`` as well as ``grad``, ``vmap`` and ``torch.compile``.

    Same constructor arguments, parameter names and shapes, initialisation and outputs
    as ``nn.LSTM``; ``load_state_dict`` takes an ``nn.LSTM``'s state dict and the other
    way round. Dropout between layers is keyed inside ``torchfn.Model.apply``.

    Shapes (``D`` = 2 if bidirectional else 1, ``L`` = num_layers):
      input: ``(T, B, input_size)`` (``(B, T, input_size)`` with ``batch_first``) or
      ``(T, input_size)``; ``hx``: optional ``(h_0, c_0)``, each ``(D * L, B, H)``
      (``(D * L, H)`` unbatched). Returns ``output`` ``(T, B, D * H)`` (batch-first or
      unbatched as the input) and ``(h_n, c_n)``, each ``(D * L, B, H)``. With
      ``proj_size = P > 0`` (LSTMP, as ``nn.LSTM``) ``h`` is projected to ``P``:
      ``output`` is ``(T, B, D * P)`` and ``h_0``, ``h_n`` are ``(D * L, B, P)``.

    Example::

        >>> from torchfn import random
        >>> import torch, torchfn
        >>> model = torchfn.Model(LSTM(3, 8, num_layers=2, batch_first=True))
        >>> params = model.init(torchfn.random.key(0))
        >>> out, (h, c) = model.apply(params, random.normal(random.key(1), (4, 10, 3)))  # (B, T, F)
        >>> out.shape, h.shape
        (torch.Size([4, 10, 8]), torch.Size([2, 4, 8]))
        >>> x, dx = random.normal(random.key(2), (10, 3)), random.normal(random.key(3), (10, 3))
        >>> _, dout = torch.func.jvp(lambda x: model.apply(params, x)[0], (x,), (dx,))
        >>> dout.shape                                                    # nn.LSTM: raises
        torch.Size([10, 8])
    """

    _GATES = 4
    _NAME = "LSTM"

    def forward(self, input: Tensor, hx: tuple[Tensor, Tensor] | None = None):
        x, unbatched = self._inputs(input)  # (T, B, F)
        if hx is not None and (not isinstance(hx, (tuple, list)) or len(hx) != 2):
            raise TypeError(f"LSTM: hx must be a pair (h_0, c_0), got {type(hx).__name__}")
        B, H = x.shape[1], self.hidden_size
        h0 = self._state(None if hx is None else hx[0], "h_0", B, unbatched, x,
                         self.proj_size or H)
        c0 = self._state(None if hx is None else hx[1], "c_0", B, unbatched, x, H)
        y, finals = self._run(x, list(zip(h0, c0)), _lstm)
        h_n = torch.stack([h for h, _ in finals])  # (D*L, B, H)
        c_n = torch.stack([c for _, c in finals])
        if unbatched:
            h_n, c_n = h_n.squeeze(1), c_n.squeeze(1)
        return self._output(y, unbatched), (h_n, c_n)


class GRU(_Recurrent):
    """``nn.GRU`` as a scan of plain ops: works under ``jvp``, ``jacfwd`` and
    ``hessian`` as well as ``grad``, ``vmap`` and ``torch.compile``.

    Same constructor arguments, parameter names and shapes, initialisation and outputs
    as ``nn.GRU`` (gates r, z, n; ``n = tanh(x W_in + b_in + r * (h W_hn + b_hn))``).

    Shapes (``D`` = 2 if bidirectional else 1, ``L`` = num_layers):
      input: ``(T, B, input_size)`` (``(B, T, input_size)`` with ``batch_first``) or
      ``(T, input_size)``; ``hx``: optional ``h_0`` ``(D * L, B, H)`` (``(D * L, H)``
      unbatched). Returns ``output`` ``(T, B, D * H)`` and ``h_n`` ``(D * L, B, H)``.

    Example::

        >>> from torchfn import random
        >>> import torch, torchfn
        >>> model = torchfn.Model(GRU(3, 8, bidirectional=True))
        >>> params = model.init(torchfn.random.key(0))
        >>> out, h = model.apply(params, random.normal(random.key(4), (10, 4, 3)))  # (T, B, F)
        >>> out.shape, h.shape
        (torch.Size([10, 4, 16]), torch.Size([2, 4, 8]))
    """

    _GATES = 3
    _NAME = "GRU"

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
                 bidirectional: bool = False) -> None:  # as nn.GRU: no proj_size
        super().__init__(input_size, hidden_size, num_layers, bias, batch_first, dropout,
                         bidirectional)

    def forward(self, input: Tensor, hx: Tensor | None = None):
        x, unbatched = self._inputs(input)  # (T, B, F)
        h0 = self._state(hx, "hx", x.shape[1], unbatched, x, self.hidden_size)
        y, finals = self._run(x, list(h0), _gru)
        h_n = torch.stack(finals)  # (D*L, B, H)
        return self._output(y, unbatched), (h_n.squeeze(1) if unbatched else h_n)
