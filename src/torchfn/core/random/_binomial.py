"""``binomial``: JAX's inversion (few expected successes) and BTRS (Hormann's
transformed rejection) samplers, each run on one key for all elements as JAX does;
``multinomial`` as JAX's sequence of binomials.

Where ``n min(p, 1-p) <= 10`` the counts are JAX's. Elsewhere the law is, and most
counts: as in ``poisson``, JAX keeps the last accepted proposal of every round until
all elements have accepted, and its float32 acceptance test cancels large terms, so
an ulp of ``log`` can add a round and change the counts.

Under ``vmap``, ``grad`` or ``torch.compile`` the loops run a fixed number of rounds
(``_INVERSION_ROUNDS``, ``_BTRS_ROUNDS``) with JAX's loop condition kept as a mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from torchfn.core._eager import plain as _plain
from torchfn.core.random._checks import (
    _check_float_dtype,
    _check_key,
    _eager_tensor,
    _params_shape,
)
from torchfn.core.random._floats import uniform
from torchfn.core.random._keys import split

Shape = int | Sequence[int]

_INVERSION_ROUNDS = 64  # geometric gaps until the sum passes n (n q <= 10)
_BTRS_ROUNDS = 32  # each round accepts with probability > 0.8

_STIRLING_TAIL = (0.0810614667953272, 0.0413406959554092, 0.0276779256849983,
                  0.02079067210376509, 0.0166446911898211, 0.0138761288230707,
                  0.0118967099458917, 0.0104112652619720, 0.00925546218271273,
                  0.00833056343336287)


def _stirling_tail(k: Tensor) -> Tensor:
    """log k! minus Stirling's approximation: tabled for k <= 9, a series above."""
    table = torch.tensor(_STIRLING_TAIL, dtype=k.dtype, device=k.device)
    small = k <= 9
    kc = k.clamp(0.0, 9.0)
    kp1sq = (kc + 1) * (kc + 1)
    approx = (1.0 / 12 - (1.0 / 360 - 1.0 / 1260 / kp1sq) / kp1sq) / (kc + 1)
    return torch.where(small, table[torch.floor(kc).to(torch.int64)], approx)


def _inversion(key: Tensor, count: Tensor, prob: Tensor, eager: bool) -> Tensor:
    """Count geometric gaps (in trials) until they pass ``count``."""
    log1mp = torch.log1p(-prob)
    num = torch.zeros_like(prob)
    total = torch.zeros_like(prob)
    rounds = 0
    while (bool((total <= count).any()) if eager else rounds < _INVERSION_ROUNDS):
        sub, key = split(key)
        num = torch.where(total <= count, num + 1, num)
        u = uniform(sub, tuple(prob.shape), prob.dtype)
        total = total + torch.ceil(torch.log(u) / log1mp)
        rounds += 1
    return num - 1


def _btrs(key: Tensor, count: Tensor, prob: Tensor, eager: bool) -> Tensor:
    stddev = torch.sqrt(count * prob * (1 - prob))
    b = 1.15 + 2.53 * stddev
    a = -0.0873 + 0.0248 * b + 0.01 * prob
    c = count * prob + 0.5
    v_r = 0.92 - 4.2 / b
    r = prob / (1 - prob)
    alpha = (2.83 + 5.1 / b) * stddev
    m = torch.floor((count + 1) * prob)
    k_out = torch.full_like(prob, -1.0)
    accepted = torch.zeros(prob.shape, dtype=torch.bool, device=prob.device)
    rounds = 0
    while (not bool(accepted.all()) if eager else rounds < _BTRS_ROUNDS):
        running = ~accepted.all()  # JAX's loop condition, as a mask under transforms
        key, k0, k1 = split(key, 3)
        u = uniform(k0, tuple(prob.shape), prob.dtype) - 0.5
        v = uniform(k1, tuple(prob.shape), prob.dtype)
        us = 0.5 - u.abs()
        accept1 = (us >= 0.07) & (v <= v_r)
        k = torch.floor((2 * a / us + b) * u + c)
        reject = (k < 0) | (k > count)
        v = torch.log(v * alpha / (a / (us * us) + b))
        ub = ((m + 0.5) * torch.log((m + 1) / (r * (count - m + 1)))
              + (count + 1) * torch.log((count - m + 1) / (count - k + 1))
              + (k + 0.5) * torch.log(r * (count - k + 1) / (k + 1))
              + _stirling_tail(m) + _stirling_tail(count - m)
              - _stirling_tail(k) - _stirling_tail(count - k))
        accept = (accept1 | (~reject & (v <= ub))) & running
        k_out = torch.where(accept, k, k_out)
        accepted = accepted | accept
        rounds += 1
    return k_out


def binomial(key: Tensor, n: float | Tensor, p: float | Tensor, shape: Shape | None = None,
             dtype: torch.dtype = torch.float32) -> Tensor:
    """Binomial(n, p) counts, as floats of ``dtype`` (``jax.random.binomial``).

    Args:
      key: ``(2,)`` int32 key.
      n: trials >= 0 (floored), a number or a tensor.
      p: success probability in [0, 1], a number or a tensor.
      shape: output shape; default the broadcast shape of ``n`` and ``p``.
      dtype: float dtype of the counts and of the draws.

    Example::

        >>> from torchfn import random
        >>> x = random.binomial(random.key(0), 20.0, 0.3, (10_000,))
        >>> bool(((x >= 0) & (x <= 20)).all()) and abs(float(x.mean()) - 6) < 0.1
        True
    """
    k = _check_key(key, "binomial")
    dtype = _check_float_dtype(dtype, "binomial")
    for name, v, ok in (("n", n, lambda t: t >= 0), ("p", p, lambda t: (t >= 0) & (t <= 1))):
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not ok(v):
            raise ValueError(f"binomial: {name} must be {'>= 0' if name == 'n' else 'in [0, 1]'}"
                             f", got {v}")
        if _eager_tensor(v) and not bool(ok(v).all()):
            raise ValueError(f"binomial: {name} must be {'>= 0' if name == 'n' else 'in [0, 1]'}"
                             f", got {v}")
    shape, params = _params_shape("binomial", shape, dtype, k.device, n=n, p=p)
    count, prob = params["n"].broadcast_to(shape), params["p"].broadcast_to(shape)
    eager = _plain(k) and _plain(count) and _plain(prob)
    p_lt_half = prob < 0.5
    q = torch.where(p_lt_half, prob, 1.0 - prob)
    bad_count = torch.isnan(count) | (count < 0)
    q_nan = torch.isnan(q)
    q_bad = q_nan | (q < 0)
    q = torch.where(q_bad, torch.full_like(q, 0.01), q)
    use_inversion = bad_count | (count * q <= 10.0)
    count = torch.floor(count)
    inv = _inversion(k, torch.where(use_inversion, count, torch.zeros_like(count)), q, eager)
    btrs = _btrs(k, torch.where(use_inversion, torch.full_like(count, 1e4), count),
                 torch.where(use_inversion, torch.full_like(q, 0.5), q), eager)
    samples = torch.where(use_inversion, inv, btrs)
    invalid = q_bad | bad_count
    samples = torch.where(invalid, torch.full_like(samples, float("nan")), samples)
    inf = torch.isinf(count)
    samples = torch.where(inf & ~invalid, torch.full_like(samples, float("inf")), samples)
    keep = p_lt_half | bad_count | q_nan | inf
    return torch.where(keep, samples, count - samples)


def multinomial(key: Tensor, n: float | Tensor, p: Tensor, shape: Shape | None = None,
                dtype: torch.dtype = torch.float32) -> Tensor:
    """Multinomial counts over ``p``'s last dim, by sequential binomials: category i
    takes ``Binomial(remaining, p_i / (p_i + ... + p_K))`` with its own key from
    ``split(key, K)`` (``jax.random.multinomial``). Returns ``shape`` (default
    ``p.shape``) as floats of ``dtype``.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> c = random.multinomial(random.key(0), 100.0, torch.tensor([0.2, 0.5, 0.3]))
        >>> c.shape, float(c.sum())
        (torch.Size([3]), 100.0)
    """
    k = _check_key(key, "multinomial")
    dtype = _check_float_dtype(dtype, "multinomial")
    if not isinstance(p, Tensor) or p.ndim < 1:
        raise ValueError(f"multinomial: p must be a tensor (..., K), got {p!r}")
    if _eager_tensor(p) and not bool(((p >= 0) & (p <= 1)).all()):
        raise ValueError(f"multinomial: p must be probabilities in [0, 1], got {p}")
    p = p.to(dtype=dtype, device=k.device)
    shape = tuple(p.shape) if shape is None else tuple(shape)
    if not shape:
        raise ValueError("multinomial: shape must have at least one dim (the categories)")
    _, params = _params_shape("multinomial", shape[:-1], dtype, k.device, n=n)
    remainder = params["n"].broadcast_to(shape[:-1])
    p = p.broadcast_to(shape).movedim(-1, 0)  # (K, *batch)
    remaining = p.flip(0).cumsum(0).flip(0)  # suffix sums, as JAX's reverse cumsum
    ratios = p / torch.where(remaining == 0, torch.ones_like(remaining), remaining)
    counts = []
    for ratio, sub in zip(ratios, split(k, ratios.shape[0])):
        count = binomial(sub, remainder, ratio.clamp(0, 1), dtype=dtype)
        remainder = remainder - count
        counts.append(count)
    return torch.stack(counts, -1)  # (*batch, K)
