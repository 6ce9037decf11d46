"""Univariate samplers built on ``uniform`` / ``normal`` / ``bernoulli``, each the
same transform of the same bits as its ``jax.random`` namesake: ``exponential``,
``laplace``, ``logistic``, ``cauchy``, ``rademacher``, ``lognormal``, ``pareto``,
``weibull_min``, ``rayleigh``, ``maxwell``, ``geometric``, ``triangular``, ``poisson``.

They agree with JAX to a few ulp (torch's ``log``/``log1p``/``tan`` are not XLA's).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from torchfn.core._eager import plain as _plain
from torchfn.core.random._checks import (
    _check_float_dtype,
    _check_key,
    _check_shape,
    _eager_tensor,
    _param,
    _params_shape,
    _scalar,
)
from torchfn.core.random._discrete import bernoulli
from torchfn.core.random._floats import normal, uniform
from torchfn.core.random._keys import split

Shape = int | Sequence[int]


def _epsneg(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2  # numpy's finfo.epsneg for binary floats


def _check_positive(fn: str, **params) -> None:
    for name, v in params.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not v > 0:
            raise ValueError(f"{fn}: {name} must be > 0, got {v}")
        if _eager_tensor(v) and not bool((v > 0).all()):
            raise ValueError(f"{fn}: {name} must be > 0, got {v}")


def exponential(key: Tensor, shape: Shape = (), dtype: torch.dtype = torch.float32) -> Tensor:
    """Standard exponential samples ``-log1p(-u)`` (``jax.random.exponential``).

    Example::

        >>> from torchfn import random
        >>> e = random.exponential(random.key(0), (10_000,))
        >>> bool((e >= 0).all()) and abs(float(e.mean()) - 1) < 0.05
        True
    """
    u = uniform(_check_key(key, "exponential"), _check_shape(shape, "exponential"),
                _check_float_dtype(dtype, "exponential"))
    return torch.log1p(-u).neg_()


def laplace(key: Tensor, shape: Shape = (), dtype: torch.dtype = torch.float32) -> Tensor:
    """Standard Laplace samples ``sign(u) log1p(-|u|)``, u in (-1, 1) (``jax.random.laplace``).

    Example::

        >>> from torchfn import random
        >>> x = random.laplace(random.key(0), (10_000,))
        >>> abs(float(x.abs().mean()) - 1) < 0.05  # E|X| = 1
        True
    """
    dtype = _check_float_dtype(dtype, "laplace")
    u = uniform(_check_key(key, "laplace"), _check_shape(shape, "laplace"), dtype,
                minval=-1.0 + _epsneg(dtype), maxval=1.0)
    return torch.sign(u) * torch.log1p(-u.abs())


def logistic(key: Tensor, shape: Shape = (), dtype: torch.dtype = torch.float32) -> Tensor:
    """Standard logistic samples ``log(u) - log1p(-u)`` (``jax.random.logistic``).

    Example::

        >>> from torchfn import random
        >>> x = random.logistic(random.key(0), (10_000,))
        >>> abs(float(x.mean())) < 0.1
        True
    """
    dtype = _check_float_dtype(dtype, "logistic")
    x = uniform(_check_key(key, "logistic"), _check_shape(shape, "logistic"), dtype,
                minval=torch.finfo(dtype).tiny, maxval=1.0)
    return torch.log(x) - torch.log1p(-x)


def cauchy(key: Tensor, shape: Shape = (), dtype: torch.dtype = torch.float32) -> Tensor:
    """Standard Cauchy samples ``tan(pi (u - 1/2))`` (``jax.random.cauchy``).

    Example::

        >>> from torchfn import random
        >>> x = random.cauchy(random.key(0), (10_001,))
        >>> abs(float(x.median())) < 0.05
        True
    """
    dtype = _check_float_dtype(dtype, "cauchy")
    k = _check_key(key, "cauchy")
    u = uniform(k, _check_shape(shape, "cauchy"), dtype, minval=torch.finfo(dtype).eps,
                maxval=1.0)
    return torch.tan(_scalar(math.pi, dtype, k.device) * (u - 0.5))


def rademacher(key: Tensor, shape: Shape = (), dtype: torch.dtype = torch.int32) -> Tensor:
    """-1 or +1 with equal probability (``jax.random.rademacher``): ``2 b - 1`` for
    ``b = bernoulli(key, 0.5, shape)``.

    Example::

        >>> from torchfn import random
        >>> random.rademacher(random.key(0), (6,)).abs().tolist()
        [1, 1, 1, 1, 1, 1]
    """
    if not isinstance(dtype, torch.dtype) or dtype in (torch.bool, torch.uint8):
        raise TypeError(f"rademacher: dtype must be a signed integer or float dtype, got {dtype}")
    b = bernoulli(_check_key(key, "rademacher"), 0.5, _check_shape(shape, "rademacher"))
    return (2 * b.to(dtype) - 1).to(dtype)


def lognormal(key: Tensor, sigma: float | Tensor = 1.0, shape: Shape | None = None,
              dtype: torch.dtype = torch.float32) -> Tensor:
    """``exp(sigma z)``, z standard normal (``jax.random.lognormal``).

    Example::

        >>> from torchfn import random
        >>> x = random.lognormal(random.key(0), 0.5, (10_000,))
        >>> abs(float(x.log().std()) - 0.5) < 0.02
        True
    """
    k = _check_key(key, "lognormal")
    dtype = _check_float_dtype(dtype, "lognormal")
    shape, p = _params_shape("lognormal", shape, dtype, k.device, sigma=sigma)
    return torch.exp(normal(k, shape, dtype) * p["sigma"])


def pareto(key: Tensor, b: float | Tensor, shape: Shape | None = None,
           dtype: torch.dtype = torch.float32) -> Tensor:
    """Pareto samples with shape ``b`` > 0 and scale 1: ``exp(e / b)``, e exponential
    (``jax.random.pareto``).

    Example::

        >>> from torchfn import random
        >>> x = random.pareto(random.key(0), 3.0, (10_000,))
        >>> bool((x >= 1).all()) and abs(float(x.mean()) - 1.5) < 0.05  # b / (b - 1)
        True
    """
    k = _check_key(key, "pareto")
    dtype = _check_float_dtype(dtype, "pareto")
    _check_positive("pareto", b=b)
    shape, p = _params_shape("pareto", shape, dtype, k.device, b=b)
    return torch.exp(exponential(k, shape, dtype) / p["b"])


def weibull_min(key: Tensor, scale: float | Tensor, concentration: float | Tensor,
                shape: Shape = (), dtype: torch.dtype = torch.float32) -> Tensor:
    """Weibull samples ``scale * (-log1p(-u))^(1 / concentration)``
    (``jax.random.weibull_min``).

    Example::

        >>> from torchfn import random
        >>> x = random.weibull_min(random.key(0), 2.0, 1.0, (10_000,))  # exponential, mean 2
        >>> abs(float(x.mean()) - 2) < 0.1
        True
    """
    k = _check_key(key, "weibull_min")
    dtype = _check_float_dtype(dtype, "weibull_min")
    _check_positive("weibull_min", scale=scale, concentration=concentration)
    inv = 1.0 / concentration if not isinstance(concentration, Tensor) else None
    shape, p = _params_shape("weibull_min", shape, dtype, k.device, scale=scale,
                             concentration=concentration)
    power = _scalar(inv, dtype, k.device) if inv is not None else 1.0 / p["concentration"]
    u = uniform(k, shape, dtype)
    return torch.pow(-torch.log1p(-u), power) * p["scale"]


def rayleigh(key: Tensor, scale: float | Tensor, shape: Shape | None = None,
             dtype: torch.dtype = torch.float32) -> Tensor:
    """Rayleigh samples ``scale * sqrt(-2 log u)`` (``jax.random.rayleigh``).

    Example::

        >>> import math
        >>> from torchfn import random
        >>> x = random.rayleigh(random.key(0), 1.0, (10_000,))
        >>> abs(float(x.mean()) - math.sqrt(math.pi / 2)) < 0.05
        True
    """
    k = _check_key(key, "rayleigh")
    dtype = _check_float_dtype(dtype, "rayleigh")
    _check_positive("rayleigh", scale=scale)
    shape, p = _params_shape("rayleigh", shape, dtype, k.device, scale=scale)
    u = uniform(k, shape, dtype)
    return p["scale"] * torch.sqrt(torch.log(u) * -2.0)


def maxwell(key: Tensor, shape: Shape = (), dtype: torch.dtype = torch.float32) -> Tensor:
    """Maxwell samples: the norm of a standard normal 3-vector (``jax.random.maxwell``).

    Example::

        >>> import math
        >>> from torchfn import random
        >>> x = random.maxwell(random.key(0), (10_000,))
        >>> abs(float(x.mean()) - 2 * math.sqrt(2 / math.pi)) < 0.05
        True
    """
    shape = _check_shape(shape, "maxwell")
    z = normal(_check_key(key, "maxwell"), (*shape, 3), _check_float_dtype(dtype, "maxwell"))
    return torch.sqrt((z * z).sum(-1))  # (*shape,)


def geometric(key: Tensor, p: float | Tensor, shape: Shape | None = None,
              dtype: torch.dtype = torch.int32) -> Tensor:
    """Trials up to the first success, success probability ``p`` in (0, 1]:
    ``floor(log u / log1p(-p)) + 1`` (``jax.random.geometric``).

    Example::

        >>> from torchfn import random
        >>> n = random.geometric(random.key(0), 0.25, (10_000,))
        >>> bool((n >= 1).all()) and abs(float(n.float().mean()) - 4) < 0.2
        True
    """
    k = _check_key(key, "geometric")
    if isinstance(p, (int, float)) and not isinstance(p, bool) and not 0 < p <= 1:
        raise ValueError(f"geometric: p must be in (0, 1], got {p}")
    if _eager_tensor(p) and not bool(((p > 0) & (p <= 1)).all()):
        raise ValueError(f"geometric: p must be in (0, 1], got {p}")
    fdtype = p.dtype if isinstance(p, Tensor) and p.is_floating_point() else torch.float32
    shape, ps = _params_shape("geometric", shape, fdtype, k.device, p=p)
    u = uniform(k, shape, fdtype)
    u = torch.where(u == 0, torch.ones_like(u), u)
    return (torch.floor(torch.log(u) / torch.log1p(-ps["p"])) + 1).to(dtype)


def triangular(key: Tensor, left: float | Tensor, mode: float | Tensor, right: float | Tensor,
               shape: Shape | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
    """Triangular samples on ``[left, right]`` peaking at ``mode``, by the inverse CDF
    (``jax.random.triangular``).

    Example::

        >>> from torchfn import random
        >>> x = random.triangular(random.key(0), 0.0, 0.25, 1.0, (10_000,))
        >>> bool(((x >= 0) & (x <= 1)).all()) and abs(float(x.mean()) - 1.25 / 3) < 0.02
        True
    """
    k = _check_key(key, "triangular")
    dtype = _check_float_dtype(dtype, "triangular")
    shape, p = _params_shape("triangular", shape, dtype, k.device, left=left, mode=mode,
                             right=right)
    lo, md, hi = p["left"], p["mode"], p["right"]
    fc = (md - lo) / (hi - lo)
    u = uniform(k, shape, dtype)
    out1 = lo + torch.sqrt(u * (hi - lo) * (md - lo))
    out2 = hi - torch.sqrt((1 - u) * (hi - lo) * (hi - md))
    return torch.where(u < fc, out1, out2)


_KNUTH_ROUNDS = 64  # under transforms: P(Poisson(10) >= 64) is about 1e-28
_REJECTION_ROUNDS = 32  # under transforms: each round accepts with probability > 0.9


def _poisson_knuth(k: Tensor, lam: Tensor, eager: bool) -> Tensor:
    """JAX's Knuth loop: count uniforms until their product falls below exp(-lam); one
    key for all elements, split once per round (rounds past an element's end keep it)."""
    count = torch.zeros(lam.shape, dtype=torch.int64, device=lam.device)
    log_prod = torch.zeros(lam.shape, dtype=torch.float32, device=lam.device)
    rng, rounds = k, 0
    while (bool((log_prod > -lam).any()) if eager else rounds < _KNUTH_ROUNDS):
        rng, sub = split(rng)
        count = torch.where(log_prod > -lam, count + 1, count)
        log_prod = log_prod + torch.log(uniform(sub, tuple(lam.shape), torch.float32))
        rounds += 1
    return count - 1


def _poisson_rejection(k: Tensor, lam: Tensor, eager: bool) -> Tensor:
    """JAX's transformed rejection (Hormann's PTRS) for lam >= 10."""
    log_lam = torch.log(lam)
    b = 0.931 + 2.53 * torch.sqrt(lam)
    a = -0.059 + 0.02483 * b
    inv_alpha = 1.1239 + 1.1328 / (b - 3.4)
    v_r = 0.9277 - 3.6224 / (b - 2)
    k_out = torch.full(lam.shape, -1.0, dtype=lam.dtype, device=lam.device)
    accepted = torch.zeros(lam.shape, dtype=torch.bool, device=lam.device)
    rng, rounds = k, 0
    while (not bool(accepted.all()) if eager else rounds < _REJECTION_ROUNDS):
        rng, k0, k1 = split(rng, 3)
        u = uniform(k0, tuple(lam.shape), lam.dtype) - 0.5
        v = uniform(k1, tuple(lam.shape), lam.dtype)
        u_shifted = 0.5 - u.abs()
        kk = torch.floor((2 * a / u_shifted + b) * u + lam + 0.43)
        s = torch.log(v * inv_alpha / (a / (u_shifted * u_shifted) + b))
        t = -lam + kk * log_lam - torch.lgamma(kk + 1)
        accept1 = (u_shifted >= 0.07) & (v <= v_r)
        reject = (kk < 0) | ((u_shifted < 0.013) & (v > u_shifted))
        # JAX's loop condition, as a mask: no round runs once every element accepted
        # (a later accept would overwrite the count; the eager loop has stopped there)
        running = ~accepted.all()
        accept = (accept1 | (~reject & (s <= t))) & running
        k_out = torch.where(accept, kk, k_out)
        accepted = accepted | accept
        rounds += 1
    return k_out


def poisson(key: Tensor, lam: float | Tensor, shape: Shape | None = None,
            dtype: torch.dtype = torch.int32) -> Tensor:
    """Poisson(lam) counts, lam >= 0 (``jax.random.poisson``): Knuth's product of
    uniforms where lam < 10, transformed rejection elsewhere, each on one key for all
    elements as JAX does. Where lam < 10 the counts are JAX's. Where lam >= 10 the law
    is, and most counts: JAX's rejection loop keeps the last accepted proposal of every
    round until all elements have accepted, and its float32 acceptance test cancels
    terms of size lam log(lam), so an ulp of ``lgamma`` can add a round, and change
    the counts (as between JAX on two backends).

    In plain eager mode the loops run until every element is done; under ``vmap``,
    ``grad`` or ``torch.compile`` they run a fixed number of rounds (64 and 32), past
    which an element is left unfinished with probability below 1e-28.

    Example::

        >>> from torchfn import random
        >>> n = random.poisson(random.key(0), 3.5, (10_000,))
        >>> n.dtype, abs(float(n.float().mean()) - 3.5) < 0.1
        (torch.int32, True)
    """
    k = _check_key(key, "poisson")
    if isinstance(lam, (int, float)) and not isinstance(lam, bool) and not lam >= 0:
        raise ValueError(f"poisson: lam must be >= 0, got {lam}")
    if _eager_tensor(lam) and not bool((lam >= 0).all()):
        raise ValueError(f"poisson: lam must be >= 0, got {lam}")
    fdtype = lam.dtype if isinstance(lam, Tensor) and lam.is_floating_point() else torch.float32
    shape, p = _params_shape("poisson", shape, fdtype, k.device, lam=lam)
    lam_t = p["lam"].broadcast_to(shape)
    eager = _plain(k) and _plain(lam_t)
    use_knuth = torch.isnan(lam_t) | (lam_t < 10)
    knuth = _poisson_knuth(k, torch.where(use_knuth, lam_t, torch.zeros_like(lam_t)), eager)
    rejection = _poisson_rejection(
        k, torch.where(use_knuth, torch.full_like(lam_t, 1e5), lam_t), eager)
    out = torch.where(use_knuth, knuth.to(fdtype), rejection)
    return torch.where(lam_t == 0, torch.zeros_like(out), out).to(dtype)


def wald(key: Tensor, mean: float | Tensor, shape: Shape | None = None,
         dtype: torch.dtype = torch.float32) -> Tensor:
    """Wald (inverse Gaussian, unit shape) samples with the given ``mean`` > 0, by
    Michael, Schucany and Haas's transformation (``jax.random.wald``).

    Example::

        >>> from torchfn import random
        >>> x = random.wald(random.key(0), 2.0, (10_000,))
        >>> bool((x > 0).all()) and abs(float(x.mean()) - 2) < 0.15
        True
    """
    k = _check_key(key, "wald")
    dtype = _check_float_dtype(dtype, "wald")
    _check_positive("wald", mean=mean)
    shape, p = _params_shape("wald", shape, dtype, k.device, mean=mean)
    mu = p["mean"].broadcast_to(shape)
    k1, k2 = split(k)
    v = normal(k1, shape, dtype)
    z = uniform(k2, shape, dtype)
    y = v * v
    mu2 = mu * mu
    root = torch.sqrt(4 * mu * y + mu2 * (y * y))
    x = mu + mu2 * y / 2 - mu / 2 * root
    return torch.where(z <= mu / (mu + x), x, mu2 / x)


def double_sided_maxwell(key: Tensor, loc: float | Tensor, scale: float | Tensor,
                         shape: Shape = (), dtype: torch.dtype = torch.float32) -> Tensor:
    """Maxwell samples with a random sign, shifted and scaled: ``s * m * scale + loc``
    (``jax.random.double_sided_maxwell``). As JAX, the result has shape
    ``shape + broadcast(loc, scale).shape``.

    Example::

        >>> from torchfn import random
        >>> x = random.double_sided_maxwell(random.key(0), 1.0, 2.0, (10_000,))
        >>> abs(float(x.mean()) - 1) < 0.1 and abs(float(x.var()) - 12) < 1  # 3 scale^2
        True
    """
    k = _check_key(key, "double_sided_maxwell")
    dtype = _check_float_dtype(dtype, "double_sided_maxwell")
    _check_positive("double_sided_maxwell", scale=scale)
    lo = _param(loc, "double_sided_maxwell", "loc", dtype, k.device)
    sc = _param(scale, "double_sided_maxwell", "scale", dtype, k.device)
    lo = lo if isinstance(lo, Tensor) else _scalar(lo, dtype, k.device)
    sc = sc if isinstance(sc, Tensor) else _scalar(sc, dtype, k.device)
    params = tuple(torch.broadcast_shapes(lo.shape, sc.shape))
    shape = _check_shape(shape, "double_sided_maxwell")
    shape = (shape or params) + params
    k_maxwell, k_sign = split(k)
    m = maxwell(k_maxwell, shape, dtype)
    sign = rademacher(k_sign, shape, dtype)
    return sign * m * sc + lo
