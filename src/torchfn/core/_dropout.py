"""Keyed dropout inside ``Model.apply``: masks from ``torchfn.random``, not the global RNG.

:class:`KeyedRandomness` is a ``TorchFunctionMode`` active while a module runs
in ``Model.apply`` with ``train=True`` or a ``key``. It replaces the
``F.dropout`` family and ``F.scaled_dot_product_attention`` with
``dropout_p > 0`` (the ``nn.MultiheadAttention`` / ``nn.Transformer*`` path)
by versions whose masks come from ``fold_in(key, i)`` for the ``i``-th
stochastic call, so the same key gives the same output and ``vmap`` over keys
gives a different mask per example. Under forward-mode AD (``jvp``) it also
runs SDPA in plain ops, since torch's fused CPU kernel has no forward AD.
Other global-RNG draws in a forward (``torch.rand``, ``Tensor.bernoulli_``,
...) raise: they could not be keyed.
"""

from __future__ import annotations

import contextvars
import math
import types

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from torchfn.core import random

_SELU_ALPHA = 1.7580993408473766  # -scale * alpha of SELU, as ATen's alpha_dropout

# Draws from torch's global RNG that we cannot key: an error inside apply.
_GLOBAL_RNG = {
    torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like,
    torch.randint_like, torch.randperm, torch.bernoulli, torch.multinomial, torch.normal,
    torch.poisson, torch.native_dropout, torch.Tensor.bernoulli_, torch.Tensor.bernoulli,
    torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.random_,
    torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.log_normal_,
    torch.Tensor.cauchy_, torch.Tensor.multinomial,
}  # fmt: skip


def forward_ad_active() -> bool:
    """True inside ``torch.func.jvp`` or a forward-AD dual level (eager only):
    torch's fused CPU attention has no forward-mode derivative."""
    if torch.compiler.is_compiling():
        return False
    try:
        from torch._C._functorch import TransformType
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

        if any(i.key() == TransformType.Jvp for i in retrieve_all_functorch_interpreters()):
            return True
        from torch.autograd import forward_ad

        return forward_ad._current_level >= 0
    except (ImportError, AttributeError):  # private API moved: assume no forward AD
        return False


def next_key(what: str) -> torch.Tensor:
    """The next key of the running ``Model.apply`` (its ``i``-th stochastic call gets
    ``fold_in(key, i)``), for a module that passes a key on itself, e.g. to
    ``torchfn.kernels.attention(..., dropout=p, key=k)``. Outside ``apply``: an error."""
    mode = _ACTIVE.get()
    if mode is None:
        raise ValueError(
            f"{what} needs randomness: run the module through torchfn.Model.apply(..., "
            "key=k, train=True), or put it in eval mode"
        )
    return mode.next_key(what)


def _check_p(p: float) -> None:
    if p < 0.0 or p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")


# the innermost active KeyedRandomness, for modules that draw keys themselves
_ACTIVE: contextvars.ContextVar[KeyedRandomness | None] = contextvars.ContextVar(
    "torchfn_keyed_randomness", default=None)


class KeyedRandomness(TorchFunctionMode):
    """Function mode that keys dropout on ``key`` (``None``: active dropout is an error)."""

    def __init__(self, key: torch.Tensor | None, *, math_attention: bool = False):
        super().__init__()
        self.key = key
        self.count = 0
        self.math_attention = math_attention  # SDPA in plain ops (forward-mode AD)
        self._tokens: list[contextvars.Token] = []

    def __enter__(self):
        self._tokens.append(_ACTIVE.set(self))
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.reset(self._tokens.pop())
        return super().__exit__(*exc)

    def next_key(self, what: str) -> torch.Tensor:
        if self.key is None:
            raise ValueError(
                f"key: the module runs {what}, which needs randomness, but key is None; "
                "pass apply(..., key=k) with a torchfn.random key, or train=False"
            )
        k = random.fold_in(self.key, self.count)
        self.count += 1
        return k

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(self, *args, **kwargs)
        if func in _GLOBAL_RNG:
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
            raise ValueError(
                f"Model.apply: the module's forward calls {name}, which draws from torch's "
                "global RNG; inside apply randomness must come from the key (use the "
                "F.dropout family, or torchfn.random with a key passed to forward)"
            )
        return func(*args, **kwargs)


def _mask(mode: KeyedRandomness, what: str, keep: float, shape, like: torch.Tensor):
    k = mode.next_key(what).to(like.device)  # same bits on any device; draw where the data is
    m = random.bernoulli(k, keep, shape=tuple(shape))
    return m.to(device=like.device, dtype=like.dtype)


def _dropout_like(mode, name, input, p, training, *, feature: bool, alpha: bool):
    _check_p(p)
    if not training or p == 0.0:
        return input
    if p == 1.0:
        return input * torch.zeros_like(input)
    if feature:  # one draw per (sample, channel): (N, C, 1, ...)
        shape = (*input.shape[:2], *([1] * (input.dim() - 2)))
    else:
        shape = input.shape
    keep = _mask(mode, name, 1.0 - p, shape, input)
    if not alpha:
        return input * keep / (1.0 - p)
    a = 1.0 / math.sqrt((_SELU_ALPHA**2 * p + 1.0) * (1.0 - p))
    b = (keep - 1.0) * (_SELU_ALPHA * a) + _SELU_ALPHA * a * p
    return input * (keep * a) + b


def _dropout(mode, input, p=0.5, training=True, inplace=False):
    return _dropout_like(mode, "F.dropout", input, p, training, feature=False, alpha=False)


def _alpha_dropout(mode, input, p=0.5, training=False, inplace=False):
    return _dropout_like(mode, "F.alpha_dropout", input, p, training, feature=False, alpha=True)


def _feature_alpha_dropout(mode, input, p=0.5, training=False, inplace=False):
    return _dropout_like(
        mode, "F.feature_alpha_dropout", input, p, training, feature=True, alpha=True
    )


def _feature_nd(name: str, batched_dim: int | None):
    """dropout1d/2d/3d: channel-wise masks; unbatched inputs get a batch dim first."""

    def handler(mode, input, p=0.5, training=True, inplace=False):
        _check_p(p)
        if not training or p == 0.0:
            return input
        unbatched = batched_dim is not None and input.dim() == batched_dim - 1
        x = input.unsqueeze(0) if unbatched else input  # (N, C, ...)
        out = _dropout_like(mode, name, x, p, training, feature=True, alpha=False)
        return out.squeeze(0) if unbatched else out

    return handler


def _sdpa(
    mode,
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
):
    """SDPA whose attention dropout is keyed; the math of torch's reference."""
    if dropout_p == 0.0 and not mode.math_attention:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal,
            scale=scale, enable_gqa=enable_gqa,
        )  # fmt: skip
    _check_p(dropout_p)
    L, S = query.size(-2), key.size(-2)
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    if enable_gqa:
        key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
        value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
    scores = (query @ key.transpose(-2, -1)) * scale  # (..., L, S)
    if is_causal:
        causal = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    attn = torch.softmax(scores, dim=-1)
    # fully masked rows give 0, as torch's math backend (instead of NaN)
    attn = torch.where(torch.isneginf(scores).all(-1, keepdim=True), 0.0, attn)
    if dropout_p == 1.0:
        attn = attn * 0.0
    elif dropout_p > 0.0:
        what = "F.scaled_dot_product_attention(dropout_p>0)"
        keep = _mask(mode, what, 1.0 - dropout_p, attn.shape, attn)
        attn = attn * keep / (1.0 - dropout_p)
    return attn @ value  # (..., L, Ev)


def _mha(mode, *args, **kwargs):
    """``F.multi_head_attention_forward`` with keyed attention dropout.

    A function mode is off while it handles a call, so the ``dropout`` / SDPA
    calls inside torch's MHA would escape it. We run torch's own code object
    with those two names bound to the keyed versions instead (a copy of the
    function with its own globals; torch itself is not patched).
    """
    f = F.multi_head_attention_forward
    scope = dict(vars(F))
    scope["has_torch_function"] = lambda *a, **k: False
    scope["dropout"] = lambda *a, **k: _dropout(mode, *a, **k)
    scope["scaled_dot_product_attention"] = lambda *a, **k: _sdpa(mode, *a, **k)
    keyed = types.FunctionType(f.__code__, scope, f.__name__, f.__defaults__, f.__closure__)
    keyed.__kwdefaults__ = f.__kwdefaults__
    return keyed(*args, **kwargs)


def _torch_feature_dropout(mode, input, p, train):
    return _feature_nd("torch.feature_dropout", None)(mode, input, p, train)


_HANDLERS = {
    F.dropout: _dropout,
    F.alpha_dropout: _alpha_dropout,
    F.feature_alpha_dropout: _feature_alpha_dropout,
    F.dropout1d: _feature_nd("F.dropout1d", 3),
    F.dropout2d: _feature_nd("F.dropout2d", None),
    F.dropout3d: _feature_nd("F.dropout3d", 5),
    F.scaled_dot_product_attention: _sdpa,
    F.multi_head_attention_forward: _mha,
    torch.dropout: lambda mode, input, p, train: _dropout(mode, input, p, train),
    torch.feature_dropout: _torch_feature_dropout,
    torch.alpha_dropout: lambda mode, input, p, train: _alpha_dropout(mode, input, p, train),
    torch.feature_alpha_dropout: (
        lambda mode, input, p, train: _feature_alpha_dropout(mode, input, p, train)
    ),
}
