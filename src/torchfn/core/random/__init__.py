"""Explicit, counter-based PRNG keys: ``torchfn.random``.

A JAX-style functional random number generator on plain torch integer ops.
Randomness is a pure function of a *key*: nothing reads or advances torch's
global generator, the same key always gives the same numbers, on any device,
under ``vmap``, ``grad`` and ``torch.compile``.

The generator is Threefry-2x32 (20 rounds) with ``jax.random``'s default
*partitionable* scheme (``jax_threefry_partitionable=True``), so ``key``,
``split``, ``fold_in``, ``bits``, ``uniform``, ``bernoulli``, ``gumbel``,
``randint``, ``categorical`` and ``permutation`` give exactly JAX's bits for
the same seed; ``normal`` and ``truncated_normal`` reproduce XLA's float32
``erf_inv`` polynomial and agree with JAX to a few ulp (torch's ``log1p`` is not
XLA's); float64 follows JAX with ``jax_enable_x64`` (64 random bits per sample).
The distributions built on them (``exponential``, ``laplace``, ``logistic``,
``cauchy``, ``rademacher``, ``lognormal``, ``pareto``, ``weibull_min``, ``rayleigh``,
``maxwell``, ``double_sided_maxwell``, ``wald``, ``geometric``, ``triangular``) and
the gamma family (``gamma``, ``loggamma``, ``beta``, ``dirichlet``, ``chisquare``,
``t``, ``f``, ``generalized_normal``, ``ball``, JAX's per-element rejection loops
included) give JAX's values to float rounding; ``poisson`` does where lam < 10 and
``binomial`` where n min(p, 1 - p) <= 10;
``multivariate_normal`` and ``orthogonal`` do to the rounding of the factorisations.

**Key format.** A key is a ``torch.int32`` tensor of shape ``(2,)`` holding the
bit patterns of JAX's two ``uint32`` key words (``key.view(torch.uint32)`` shows
``jax.random.key_data``). int32 is what the hash computes in (torch has no uint32
arithmetic), every bit pattern is a valid key, so a key never needs a value
check (no device sync). A batch of keys is ``(..., 2)``, e.g. ``split(key, n)``
is ``(n, 2)``; map over it with ``torch.func.vmap``. Treat keys as opaque.

Example::

    >>> import torch
    >>> from torchfn import random
    >>> k = random.key(0)
    >>> k_init, k_drop = random.split(k)
    >>> w = random.normal(k_init, (3, 4))            # (3, 4) float32
    >>> mask = random.bernoulli(k_drop, 0.9, (3, 4))  # (3, 4) bool
    >>> keys = random.split(k, 8)                     # (8, 2)
    >>> noise = torch.func.vmap(lambda kk: random.normal(kk, (5,)))(keys)  # (8, 5)
    >>> bool((noise[0] == random.normal(keys[0], (5,))).all())
    True
"""

from torchfn.core.random._binomial import binomial, multinomial
from torchfn.core.random._bits import bits
from torchfn.core.random._checks import KEY_DTYPE
from torchfn.core.random._discrete import bernoulli, categorical, choice, permutation
from torchfn.core.random._floats import gumbel, normal, truncated_normal, uniform
from torchfn.core.random._gamma import (
    ball,
    beta,
    chisquare,
    dirichlet,
    f,
    gamma,
    generalized_normal,
    loggamma,
    t,
)
from torchfn.core.random._integers import randint
from torchfn.core.random._keys import fold_in, key, split
from torchfn.core.random._multivariate import multivariate_normal, orthogonal
from torchfn.core.random._univariate import (
    cauchy,
    double_sided_maxwell,
    exponential,
    geometric,
    laplace,
    logistic,
    lognormal,
    maxwell,
    pareto,
    poisson,
    rademacher,
    rayleigh,
    triangular,
    wald,
    weibull_min,
)

__all__ = [
    "key",
    "split",
    "fold_in",
    "bits",
    "uniform",
    "normal",
    "bernoulli",
    "randint",
    "permutation",
    "categorical",
    "truncated_normal",
    "gumbel",
    "choice",
    "exponential",
    "laplace",
    "logistic",
    "cauchy",
    "rademacher",
    "lognormal",
    "pareto",
    "weibull_min",
    "rayleigh",
    "maxwell",
    "geometric",
    "triangular",
    "poisson",
    "binomial",
    "multinomial",
    "wald",
    "double_sided_maxwell",
    "gamma",
    "loggamma",
    "beta",
    "dirichlet",
    "chisquare",
    "t",
    "f",
    "generalized_normal",
    "ball",
    "multivariate_normal",
    "orthogonal",
    "KEY_DTYPE",
]
