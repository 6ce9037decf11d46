"""Gamma and the samplers built on it: ``gamma``, ``loggamma``, ``beta``, ``dirichlet``,
``chisquare``, ``t``, ``f``, ``generalized_normal``, ``ball``, with ``jax.random``'s bits.

JAX draws each gamma variate by Marsaglia & Tsang's rejection method, with its own
key: ``split(key, n)`` gives one key per element, and each element loops (split,
draw a normal until ``v > 0``, draw a uniform, test) until it accepts. Here all
elements loop together on batches of keys. In plain eager mode the loop runs until
every element has accepted, on the ones still going, so every sample is JAX's. Under
``vmap``, ``grad`` or ``torch.compile`` a loop cannot read the tensors, so it runs a
fixed number of rounds (``_ROUNDS`` tries, each with up to ``_NORMAL_TRIES`` normal
draws), masked: with acceptance >= 0.95 per try and v <= 0 below 0.01 per normal
draw, the chance that an element is left unfinished (at its last try) is about 1e-12.
Under ``torch.compile`` the sampler is a graph break and runs eagerly (exactly).

Gradients in the shape parameter are JAX's (and ``torch.distributions.Gamma.rsample``'s)
implicit reparameterisation: the derivative of the sample at a fixed CDF value, first
order only; ``beta``, ``dirichlet``, ``chisquare`` and ``t`` differentiate through it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from torchfn.core import _threefry as _tf
from torchfn.core._eager import plain as _plain
from torchfn.core.random._bits import _unit
from torchfn.core.random._checks import (
    _check_broadcast,
    _check_float_dtype,
    _check_key,
    _check_shape,
    _eager_tensor,
    _param,
    _params_shape,
    _scalar,
)
from torchfn.core.random._floats import _normal_finish, normal
from torchfn.core.random._keys import split
from torchfn.core.random._univariate import exponential, rademacher

Shape = int | Sequence[int]

_ROUNDS = 12  # accept/reject tries under transforms
_NORMAL_TRIES = 6  # normal draws per try under transforms (v <= 0 has p < 0.01)


def _split_many(keys: Tensor, num: int) -> Tensor:
    """``split(k, num)`` for each row of ``keys`` (n, 2) at once: (n, num, 2).

    Plain elementwise threefry on the key columns, so it works the same in eager
    mode, under ``vmap`` and traced, without functorch's per-call wrapping.
    """
    lo = torch.arange(num, dtype=torch.int32, device=keys.device)
    zero = torch.zeros((), dtype=torch.int32, device=keys.device)
    k0, k1 = keys[:, :1], keys[:, 1:]  # (n, 1) each
    if _plain(keys):
        n = keys.shape[0]
        x0 = torch.zeros((n, num), dtype=torch.int32, device=keys.device)
        y0, y1 = _tf.threefry2x32_keyed_(k0, k1, x0, lo.expand(n, num).clone())
    else:
        y0, y1 = _tf.threefry2x32(k0, k1, zero, lo)  # (n, num) each
    return torch.stack([y0, y1], dim=-1)


def _first_words(keys: Tensor) -> tuple[Tensor, Tensor]:
    """The hash words of counter 0 under each key: a shape-() draw's bits, (n,) each."""
    zero = torch.zeros((), dtype=torch.int32, device=keys.device)
    if _plain(keys):
        n = keys.shape[0]
        fresh = torch.zeros(n, dtype=torch.int32, device=keys.device)
        return _tf.threefry2x32_keyed_(keys[:, 0], keys[:, 1], fresh, fresh.clone())
    return _tf.threefry2x32(keys[:, 0], keys[:, 1], zero, zero)


def _vnormal(keys: Tensor, dtype: torch.dtype) -> Tensor:
    """``normal(k, (), dtype)`` for each key row: (n,)."""
    return _normal_finish(dtype, keys.device)(*_first_words(keys))


def _vuniform(keys: Tensor, dtype: torch.dtype) -> Tensor:
    """``uniform(k, (), dtype)`` for each key row: (n,)."""
    return _unit(*_first_words(keys), dtype)


def _draw_v(keys: Tensor, c: Tensor, eager: bool) -> tuple[Tensor, Tensor]:
    """JAX's inner loop per element: ``key, sub = split(key); x = normal(sub);
    v = 1 + x c`` until ``v > 0``. Returns (x, v), each (n,)."""
    n = keys.shape[0]
    x = torch.zeros(n, dtype=c.dtype, device=c.device)
    v = torch.full((n,), -1.0, dtype=c.dtype, device=c.device)
    if eager:
        todo = torch.arange(n, device=c.device)
        while todo.numel():
            ks = _split_many(keys[todo], 2)  # (m, 2, 2)
            keys = keys.index_copy(0, todo, ks[:, 0])
            x_new = _vnormal(ks[:, 1], c.dtype)
            v_new = 1 + x_new * c[todo]
            x, v = x.index_copy(0, todo, x_new), v.index_copy(0, todo, v_new)
            todo = todo[v_new <= 0]
        return x, v
    for _ in range(_NORMAL_TRIES):
        again = v <= 0
        ks = _split_many(keys, 2)
        keys = torch.where(again[:, None], ks[:, 0], keys)
        x_new = _vnormal(ks[:, 1], c.dtype)
        x = torch.where(again, x_new, x)
        v = torch.where(again, 1 + x_new * c, v)
    return x, v


def _reject(x2: Tensor, v3: Tensor, u: Tensor, d: Tensor) -> Tensor:
    """JAX's ``_cond_fn``: True where the try is rejected (loop again)."""
    one = torch.ones((), dtype=d.dtype, device=d.device)
    squeeze = torch.full((), 0.0331, dtype=d.dtype, device=d.device)
    half = torch.full((), 0.5, dtype=d.dtype, device=d.device)
    return (u >= one - squeeze * (x2 * x2)) & (
        torch.log(u) >= x2 * half + d * ((one - v3) + torch.log(v3)))


@torch._disable_dynamo  # (lazy: importing dynamo here would import triton) run eagerly
def _gamma_flat(keys: Tensor, alpha: Tensor, log_space: bool) -> Tensor:
    """One Marsaglia-Tsang variate per (key, alpha) pair: keys (n, 2), alpha (n,)."""
    dtype = alpha.dtype
    one = torch.ones((), dtype=dtype, device=alpha.device)
    third = torch.full((), 1.0 / 3.0, dtype=dtype, device=alpha.device)
    boost = alpha >= one
    a = torch.where(boost, alpha, alpha + one)
    d = a - third
    c = third / torch.sqrt(d)
    ks = _split_many(keys, 2)
    keys, boost_keys = ks[:, 0], ks[:, 1]
    n = alpha.shape[0]
    v3 = torch.ones(n, dtype=dtype, device=alpha.device)
    eager = _plain(keys) and _plain(alpha)
    if eager:
        todo = torch.arange(n, device=alpha.device)  # all reject the initial state
        while todo.numel():
            k3 = _split_many(keys[todo], 3)  # (m, 3, 2): next key, normal key, uniform key
            keys = keys.index_copy(0, todo, k3[:, 0])
            x, v = _draw_v(k3[:, 1], c[todo], eager=True)
            x2, v3_new = x * x, v * v * v
            u = _vuniform(k3[:, 2], dtype)
            v3 = v3.index_copy(0, todo, v3_new)
            todo = todo[_reject(x2, v3_new, u, d[todo])]
    else:
        going = torch.ones(n, dtype=torch.bool, device=alpha.device)
        for _ in range(_ROUNDS):
            k3 = _split_many(keys, 3)
            keys = torch.where(going[:, None], k3[:, 0], keys)
            x, v = _draw_v(k3[:, 1], c, eager=False)
            x2, v3_new = x * x, v * v * v
            u = _vuniform(k3[:, 2], dtype)
            v3 = torch.where(going, v3_new, v3)
            going = going & _reject(x2, v3_new, u, d)
    u = _vuniform(boost_keys, dtype)
    if log_space:
        log_u = torch.log1p(-u)  # -exponential(boost_key)
        log_boost = torch.where(boost | (log_u == 0), torch.zeros_like(log_u),
                                log_u * (one / alpha))
        return torch.log(d) + torch.log(v3) + log_boost
    boosted = torch.where(boost, torch.ones_like(u), torch.pow(one - u, one / alpha))
    return d * v3 * boosted


class _StandardGammaGrad(torch.autograd.Function):
    """``d sample / d alpha`` of Gamma(alpha, 1) samples at fixed CDF value (implicit
    reparameterisation; torch's ``_standard_gamma_grad``, XLA's ``random_gamma_grad``),
    with the ``vmap`` rule that the aten op lacks. Not differentiated itself."""

    @staticmethod
    def forward(alpha: Tensor, sample: Tensor) -> Tensor:
        return torch._standard_gamma_grad(alpha, sample)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass

    @staticmethod
    def backward(ctx, grad: Tensor):
        return None, None

    @staticmethod
    def vmap(info, in_dims, alpha: Tensor, sample: Tensor):
        def batched(x: Tensor, dim: int | None) -> Tensor:
            return x.movedim(dim, 0) if dim is not None else x.expand(info.batch_size, *x.shape)

        alpha, sample = torch.broadcast_tensors(batched(alpha, in_dims[0]),
                                                batched(sample, in_dims[1]))
        return torch._standard_gamma_grad(alpha.contiguous(), sample.contiguous()), 0


def _attach_grad(sample: Tensor, a: Tensor, alpha: Tensor, log_space: bool) -> Tensor:
    """``sample`` whose derivative in ``a`` is the implicit-reparameterisation one, as
    JAX's: ``sample + dsample/da * (a - stop_grad(a))`` (first order)."""
    if log_space:  # d log g = dg / g; g may underflow to 0: JAX floors it at tiny
        g = torch.exp(sample.detach())
        g = torch.where(g == 0, torch.full_like(g, torch.finfo(g.dtype).tiny), g)
        slope = _StandardGammaGrad.apply(alpha, g) / g
    else:
        slope = _StandardGammaGrad.apply(alpha, sample.detach())
    return sample + slope * (a - a.detach())


def _shape_param(fn: str, value, shape, dtype, device):
    """(the parameter as given, broadcast; the same detached; the output shape)."""
    p = _param(value, fn, "a", dtype, device)
    p = p if isinstance(p, Tensor) else _scalar(p, dtype, device)
    if _eager_tensor(p) and not bool((p > 0).all()):
        raise ValueError(f"{fn}: the shape parameter must be > 0, got {value}")
    shape = tuple(p.shape) if shape is None else _check_shape(shape, fn)
    _check_broadcast(shape, fn, a=p)
    return p.broadcast_to(shape), p.detach().broadcast_to(shape), shape


def _gamma(fn: str, key: Tensor, a, shape, dtype, log_space: bool) -> Tensor:
    k = _check_key(key, fn)
    dtype = _check_float_dtype(dtype, fn)
    a_t, alpha, shape = _shape_param(fn, a, shape, dtype, k.device)
    n = alpha.numel()
    if n == 0:
        return torch.empty(shape, dtype=dtype, device=k.device)
    keys = split(k, n)  # (n, 2): one key per element, as JAX
    sample = _gamma_flat(keys, alpha.reshape(n), log_space).reshape(shape)
    if isinstance(a, Tensor) and (a.requires_grad or not _plain(a)):  # a may be differentiated
        sample = _attach_grad(sample, a_t, alpha, log_space)
    return sample


def gamma(key: Tensor, a: float | Tensor, shape: Shape | None = None,
          dtype: torch.dtype = torch.float32) -> Tensor:
    """Gamma(a, 1) samples (``jax.random.gamma``).

    Args:
      key: ``(2,)`` int32 key.
      a: shape parameter > 0, a float or a tensor broadcastable to ``shape``.
      shape: output shape; default ``a``'s.
      dtype: float dtype.

    Example::

        >>> from torchfn import random
        >>> g = random.gamma(random.key(0), 3.0, (10_000,))
        >>> abs(float(g.mean()) - 3) < 0.1 and abs(float(g.var()) - 3) < 0.3
        True
    """
    return _gamma("gamma", key, a, shape, dtype, log_space=False)


def loggamma(key: Tensor, a: float | Tensor, shape: Shape | None = None,
             dtype: torch.dtype = torch.float32) -> Tensor:
    """``log`` of Gamma(a, 1) samples, computed in log space so that small ``a`` does
    not underflow to 0 (``jax.random.loggamma``).

    Example::

        >>> from torchfn import random
        >>> lg = random.loggamma(random.key(0), 1e-3, (5,))
        >>> bool((lg < -90).all()), bool((lg.exp() == 0).any())  # gamma underflows
        (True, True)
    """
    return _gamma("loggamma", key, a, shape, dtype, log_space=True)


def beta(key: Tensor, a: float | Tensor, b: float | Tensor, shape: Shape | None = None,
         dtype: torch.dtype = torch.float32) -> Tensor:
    """Beta(a, b) samples, from two log-gamma draws (``jax.random.beta``).

    Example::

        >>> from torchfn import random
        >>> lam = random.beta(random.key(0), 0.4, 0.4, (10_000,))  # mixup's weights
        >>> bool(((lam >= 0) & (lam <= 1)).all()) and abs(float(lam.mean()) - 0.5) < 0.02
        True
    """
    k = _check_key(key, "beta")
    dtype = _check_float_dtype(dtype, "beta")
    shape, p = _params_shape("beta", shape, dtype, k.device, a=a, b=b)
    key_a, key_b = split(k)
    log_a = loggamma(key_a, p["a"].broadcast_to(shape), shape, dtype)
    log_b = loggamma(key_b, p["b"].broadcast_to(shape), shape, dtype)
    log_max = torch.maximum(log_a, log_b)
    ga, gb = torch.exp(log_a - log_max), torch.exp(log_b - log_max)
    return ga / (ga + gb)


def dirichlet(key: Tensor, alpha: Tensor, shape: Shape | None = None,
              dtype: torch.dtype = torch.float32) -> Tensor:
    """Dirichlet(alpha) samples on the simplex of alpha's last dim: a softmax of
    log-gamma draws (``jax.random.dirichlet``). Returns ``shape + alpha.shape[-1:]``.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> p = random.dirichlet(random.key(0), torch.tensor([1.0, 2.0, 3.0]), (1000,))
        >>> p.shape, bool(torch.allclose(p.sum(-1), torch.ones(1000)))
        (torch.Size([1000, 3]), True)
    """
    k = _check_key(key, "dirichlet")
    dtype = _check_float_dtype(dtype, "dirichlet")
    if not isinstance(alpha, Tensor) or alpha.ndim < 1:
        raise ValueError("dirichlet: alpha must be a tensor with at least 1 dim (..., K), "
                         f"got {alpha!r}")
    alpha = alpha.to(dtype=dtype, device=k.device)
    batch = tuple(alpha.shape[:-1]) if shape is None else _check_shape(shape, "dirichlet")
    _check_broadcast(batch, "dirichlet", **{"alpha.shape[:-1]": alpha[..., 0]})
    return torch.softmax(loggamma(k, alpha, (*batch, alpha.shape[-1]), dtype), dim=-1)


def chisquare(key: Tensor, df: float | Tensor, shape: Shape | None = None,
              dtype: torch.dtype = torch.float32) -> Tensor:
    """Chi-square samples with ``df`` > 0 degrees of freedom: ``2 Gamma(df / 2)``
    (``jax.random.chisquare``).

    Example::

        >>> from torchfn import random
        >>> x = random.chisquare(random.key(0), 4.0, (10_000,))
        >>> abs(float(x.mean()) - 4) < 0.15
        True
    """
    k = _check_key(key, "chisquare")
    dtype = _check_float_dtype(dtype, "chisquare")
    p = _param(df, "chisquare", "df", dtype, k.device)
    p = p if isinstance(p, Tensor) else _scalar(p, dtype, k.device)
    return torch.exp(loggamma(k, p / 2, shape, dtype)) * 2


def t(key: Tensor, df: float | Tensor, shape: Shape | None = None,
      dtype: torch.dtype = torch.float32) -> Tensor:
    """Student's t samples with ``df`` > 0 degrees of freedom: ``z sqrt((df/2) / g)``,
    g ~ Gamma(df / 2) (``jax.random.t``).

    Example::

        >>> from torchfn import random
        >>> x = random.t(random.key(0), 5.0, (10_000,))
        >>> abs(float(x.var()) - 5 / 3) < 0.2
        True
    """
    k = _check_key(key, "t")
    dtype = _check_float_dtype(dtype, "t")
    p = _param(df, "t", "df", dtype, k.device)
    p = p if isinstance(p, Tensor) else _scalar(p, dtype, k.device)
    shape = tuple(p.shape) if shape is None else _check_shape(shape, "t")
    key_n, key_g = split(k)
    z = normal(key_n, shape, dtype)
    half_df = p / 2
    g = gamma(key_g, half_df, shape, dtype)
    return z * torch.sqrt(half_df / g)


def f(key: Tensor, dfnum: float | Tensor, dfden: float | Tensor, shape: Shape | None = None,
      dtype: torch.dtype = torch.float32) -> Tensor:
    """F-distribution samples: a ratio of chi-squares over their degrees of freedom
    (``jax.random.f``).

    Example::

        >>> from torchfn import random
        >>> x = random.f(random.key(0), 5.0, 10.0, (10_000,))
        >>> abs(float(x.mean()) - 10 / 8) < 0.05  # dfden / (dfden - 2)
        True
    """
    k = _check_key(key, "f")
    dtype = _check_float_dtype(dtype, "f")
    shape, p = _params_shape("f", shape, dtype, k.device, dfnum=dfnum, dfden=dfden)
    num, den = p["dfnum"], p["dfden"]
    key_den, key_num = split(k)
    chi_num = chisquare(key_num, num.broadcast_to(shape), shape, dtype)
    chi_den = chisquare(key_den, den.broadcast_to(shape), shape, dtype)
    return (chi_num / num) / (chi_den / den)


def generalized_normal(key: Tensor, p: float, shape: Shape = (),
                       dtype: torch.dtype = torch.float32) -> Tensor:
    """Samples with density proportional to ``exp(-|x|^p)``, p > 0: a random sign
    times ``Gamma(1/p)^(1/p)`` (``jax.random.generalized_normal``; p = 2 is a normal
    with variance 1/2, p = 1 a Laplace).

    Example::

        >>> from torchfn import random
        >>> x = random.generalized_normal(random.key(0), 2.0, (10_000,))
        >>> abs(float(x.var()) - 0.5) < 0.03
        True
    """
    k = _check_key(key, "generalized_normal")
    dtype = _check_float_dtype(dtype, "generalized_normal")
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not p > 0:
        raise ValueError(f"generalized_normal: p must be a number > 0, got {p!r}")
    shape = _check_shape(shape, "generalized_normal")
    k_gamma, k_sign = split(k)
    g = gamma(k_gamma, 1 / p, shape, dtype)
    r = rademacher(k_sign, shape, dtype)
    return r * g ** (1 / p)


def ball(key: Tensor, d: int, p: float = 2, shape: Shape = (),
         dtype: torch.dtype = torch.float32) -> Tensor:
    """Points uniform in the unit ``p``-norm ball of dimension ``d``
    (``jax.random.ball``): ``shape + (d,)``.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> x = random.ball(random.key(0), 3, shape=(1000,))
        >>> x.shape, bool((torch.linalg.vector_norm(x, dim=-1) <= 1).all())
        (torch.Size([1000, 3]), True)
    """
    k = _check_key(key, "ball")
    dtype = _check_float_dtype(dtype, "ball")
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        raise ValueError(f"ball: d must be an int >= 1, got {d!r}")
    shape = _check_shape(shape, "ball")
    k1, k2 = split(k)
    g = generalized_normal(k1, p, (*shape, d), dtype)  # (*shape, d)
    e = exponential(k2, shape, dtype)  # (*shape,)
    return g / (((g.abs() ** p).sum(-1) + e) ** (1 / p))[..., None]
