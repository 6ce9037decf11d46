"""XLA's float32 ``erf_inv``, the polynomial behind ``jax.random.normal``."""

from __future__ import annotations

import torch
from torch import Tensor

from torchfn.core import _threefry as _tf
from torchfn.core._eager import plain as _plain

# XLA's ErfInv32 (M. Giles, "Approximating the erfinv function", 2010), the
# float32 erf_inv behind jax.random.normal; torch.erfinv differs from it by up to
# ~60 ulp in the tails (and is ~4x slower compiled). Evaluated with FMAs as XLA.
_ERFINV_CENTRAL = (
    2.81022636e-08,
    3.43273939e-07,
    -3.5233877e-06,
    -4.39150654e-06,
    0.00021858087,
    -0.00125372503,
    -0.00417768164,
    0.246640727,
    1.50140941,
)
_ERFINV_TAIL = (
    -0.000200214257,
    0.000100950558,
    0.00134934322,
    -0.00367342844,
    0.00573950773,
    -0.0076224613,
    0.00943887047,
    1.00167406,
    2.83297682,
)


# Up to this many values the CPU path computes both polynomials and selects, rather
# than index the tail: normal() at 512-4096 values takes 0.91-0.96x the time (the
# indexing ops cost more than the extra polynomial); above, indexing wins.
_SELECT_MAX = 1 << 13

_CONSTANTS: dict[tuple, tuple[Tensor, ...]] = {}  # eager: (coeffs, dtype, device) -> 0-d


def _horner_(coeffs: tuple[float, ...], w: Tensor) -> Tensor:
    """``c0 * w**8 + ... + c8`` in float32, each step ``c + p * w`` a fused
    multiply-add (``addcmul``) like XLA's, computed in a new tensor ``p``."""
    if _plain(w):  # 0-d coefficients made once: indexing one tensor costs an op each
        at = (coeffs, w.dtype, w.device)
        if at not in _CONSTANTS:
            _CONSTANTS[at] = tuple(torch.tensor(c, dtype=w.dtype, device=w.device)
                                   for c in coeffs)
        cs = _CONSTANTS[at]
        p = torch.addcmul(cs[1], w, cs[0])
        for i in range(2, len(coeffs)):
            torch.addcmul(cs[i], p, w, out=p)
        return p
    cs = torch.tensor(coeffs, dtype=w.dtype, device=w.device)  # traced / batched / GPU
    p = torch.addcmul(cs[1], w, cs[0])
    for i in range(2, len(coeffs)):
        p = torch.addcmul(cs[i], p, w)
    return p


def _sqrt(x: Tensor) -> Tensor:
    """Correctly rounded float32 sqrt, as XLA's. torch.sqrt on CPU goes through MKL
    VML, which is not correctly rounded (~15% of inputs off by an ulp) and whose
    threading can stall for milliseconds per call; rsqrt plus a Newton step in
    float64 is exact. Compiled and GPU code have an exact sqrt already."""
    if torch.compiler.is_compiling() or x.device.type != "cpu":
        return torch.sqrt(x)
    xd = x.double().clamp_min_(1e-300)
    s = xd * torch.rsqrt(xd)
    return s.add_(xd / s).mul_(0.5).float()


def _erfinv_xla(x: Tensor) -> Tensor:
    """erfinv of float32 ``x`` in (-1, 1) as XLA computes it (new tensor; ``x`` is kept)."""
    w = (x * x).neg_()
    if _plain(x) and x.device.type == "cpu":
        if _tf.serial_chunks():  # keep log1p on this thread too (see _threefry)
            for part in w.split(_tf.VML_GRAIN - 1):
                part.log1p_()
        else:
            w.log1p_()
        w.neg_()  # -log(1 - x^2) >= 0
        tail = w >= 5.0  # |x| > 0.9966: ~0.3% of normal samples
        if not bool(tail.any()):  # most small draws: one polynomial, no indexing
            p = _horner_(_ERFINV_CENTRAL, w.sub_(2.5))
        elif w.numel() <= _SELECT_MAX:  # both polynomials everywhere beat boolean indexing
            p_tail = _horner_(_ERFINV_TAIL, _sqrt(w).sub_(3.0))
            p = torch.where(tail, p_tail, _horner_(_ERFINV_CENTRAL, w.sub_(2.5)))
        else:
            w_tail = w[tail]
            p = _horner_(_ERFINV_CENTRAL, w.sub_(2.5))
            p[tail] = _horner_(_ERFINV_TAIL, _sqrt(w_tail).sub_(3.0))
    else:  # traced / batched / GPU: no data-dependent shapes
        w = w.log1p().neg()
        p = torch.where(
            w < 5.0, _horner_(_ERFINV_CENTRAL, w - 2.5), _horner_(_ERFINV_TAIL, _sqrt(w) - 3.0)
        )
    return p.mul_(x)
