"""RoPE's frequencies, and the ways of stretching them to contexts longer than trained:
position interpolation, NTK-aware, Llama 3.1's and YaRN's (Hugging Face's
``rope_scaling`` types, with their key names, so a checkpoint's config drops in)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["rotary_frequencies"]

_KEYS = {
    "linear": {"factor"},
    "ntk": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "attention_factor", "mscale", "mscale_all_dim", "truncate"},
    "longrope": {"short_factor", "long_factor", "original_max_position_embeddings", "factor",
                 "attention_factor", "short_mscale", "long_mscale"},
}
_REQUIRED = {"linear": {"factor"}, "ntk": {"factor"},
             "llama3": _KEYS["llama3"], "yarn": {"factor", "original_max_position_embeddings"},
             "longrope": {"short_factor", "long_factor", "original_max_position_embeddings",
                          "factor"}}


def _kind(scaling: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    if not isinstance(scaling, Mapping):
        raise TypeError(f"scaling must be a dict such as {{'rope_type': 'llama3', ...}} or "
                        f"None, got {type(scaling).__name__}")
    opts = dict(scaling)
    kind = opts.pop("rope_type", None) or opts.pop("type", None)
    opts.pop("type", None)
    if kind not in _KEYS:
        raise ValueError(f"scaling['rope_type'] must be one of {sorted(_KEYS)}, got {kind!r}")
    unknown, missing = set(opts) - _KEYS[kind], _REQUIRED[kind] - set(opts)
    if unknown or missing:
        raise ValueError(f"scaling of rope_type {kind!r} takes {sorted(_KEYS[kind])} (needs "
                         f"{sorted(_REQUIRED[kind])}); got unknown {sorted(unknown)}, "
                         f"missing {sorted(missing)}")
    factor = opts["factor"]
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1:
        raise ValueError(f"scaling['factor'] must be a number >= 1, got {factor!r}")
    return kind, opts


def rotary_frequencies(rotary_dim: int, base: float = 10000.0,
                       scaling: Mapping[str, Any] | None = None,
                       device: torch.device | str | None = None,
                       long: bool = False) -> tuple[Tensor, float]:
    """RoPE's angular frequencies ``(rotary_dim / 2,)`` float64, and a scale for cos/sin.

    Without ``scaling``: ``base ** (-2i / rotary_dim)``, scale 1. ``scaling`` stretches
    them for a context ``factor`` times the trained one:

    - ``{"rope_type": "linear", "factor": s}``: position interpolation (Chen et al.
      2023), every frequency over ``s``.
    - ``{"rope_type": "ntk", "factor": s}``: NTK-aware scaling, the base times
      ``s ** (d / (d - 2))``: the highest frequency unchanged, the lowest over ``s``.
    - ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
      "original_max_position_embeddings"}``: Llama 3.1's. Wavelengths shorter than
      ``original / high_freq_factor`` are kept, those longer than ``original /
      low_freq_factor`` divided by ``factor``, and between them the two are blended
      linearly in ``original / wavelength``.
    - ``{"rope_type": "yarn", "factor", "original_max_position_embeddings",
      "beta_fast"=32, "beta_slow"=1, "attention_factor"=None, "mscale", "mscale_all_dim",
      "truncate"=True}``: YaRN (Peng et al. 2023).
      Dimensions that turn more than ``beta_fast`` times over the original context are
      kept, fewer than ``beta_slow`` interpolated, a linear ramp between (its ends
      rounded outward unless ``truncate=False``); cos and sin are scaled by
      ``attention_factor``, by default ``m(mscale) / m(mscale_all_dim)`` where both are
      given (DeepSeek), else ``m(1)``, with ``m(s) = 0.1 s ln(factor) + 1``.
    - ``{"rope_type": "longrope", "short_factor", "long_factor",
      "original_max_position_embeddings", "factor", "attention_factor"=None}``: LongRoPE
      (Phi-3.5, Phi-4-mini): each frequency divided by its own factor, from
      ``long_factor`` for a call that reaches past ``original_max_position_embeddings``
      (``long=True``; :func:`rotary_table` decides from the positions) and from
      ``short_factor`` otherwise; cos and sin scaled by ``attention_factor``, by default
      ``sqrt(1 + ln(factor) / ln(original))`` (``factor``: the context's stretch,
      Hugging Face's ``max_position_embeddings / original_max_position_embeddings``), or
      by ``short_mscale`` / ``long_mscale`` where given, with the factors they go with
      (Phi-3.5-MoE).

    Example::

        >>> from torchfn.models import rotary_frequencies
        >>> f, scale = rotary_frequencies(8, 10000.0)
        >>> [round(x, 4) for x in f.tolist()], scale
        ([1.0, 0.1, 0.01, 0.001], 1.0)
        >>> g, _ = rotary_frequencies(8, 10000.0, {"rope_type": "linear", "factor": 4})
        >>> bool((g * 4 == f).all())
        True
    """
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or rotary_dim < 2 \
            or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be an even int >= 2, got {rotary_dim!r}")
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 0:
        raise ValueError(f"base must be a number > 0, got {base!r}")
    d = rotary_dim
    exponent = torch.arange(0, d, 2, dtype=torch.float64, device=device) / d  # 2i / d
    inv_freq = base ** -exponent  # (d/2,)
    if scaling is None:
        return inv_freq, 1.0
    kind, opts = _kind(scaling)
    factor = float(opts["factor"])
    if kind == "longrope":
        ext = opts["long_factor" if long else "short_factor"]
        if len(ext) != d // 2:
            raise ValueError(f"scaling['{'long' if long else 'short'}_factor'] must hold "
                             f"rotary_dim / 2 = {d // 2} factors, got {len(ext)}")
        original = opts["original_max_position_embeddings"]
        scale = opts.get("long_mscale" if long else "short_mscale", opts.get("attention_factor"))
        if scale is None:
            scale = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        return inv_freq / torch.tensor(ext, dtype=torch.float64, device=device), float(scale)
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "ntk":
        return (base * factor ** (d / (d - 2))) ** -exponent, 1.0
    if kind == "llama3":
        original = opts["original_max_position_embeddings"]
        low, high = opts["low_freq_factor"], opts["high_freq_factor"]
        if not 0 < low < high:
            raise ValueError(f"scaling: need 0 < low_freq_factor < high_freq_factor, got "
                             f"{low} and {high}")
        wavelen = 2 * math.pi / inv_freq
        smooth = ((original / wavelen - low) / (high - low)).clamp(0, 1)  # 0: long, 1: short
        return (1 - smooth) * inv_freq / factor + smooth * inv_freq, 1.0
    # yarn
    original = opts["original_max_position_embeddings"]
    fast, slow = opts.get("beta_fast", 32), opts.get("beta_slow", 1)

    def dim_turning(turns: float) -> float:  # the dim index that turns `turns` times
        return d * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = dim_turning(fast), dim_turning(slow)
    if opts.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    hi = hi + 0.001 if hi == lo else hi
    ramp = ((torch.arange(d // 2, dtype=torch.float64, device=device) - lo) / (hi - lo)).clamp(
        0, 1)  # 0: kept, 1: interpolated
    scale = opts.get("attention_factor")
    if scale is None:
        mscale, mscale_all = opts.get("mscale"), opts.get("mscale_all_dim")
        scale = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) \
            if mscale and mscale_all else yarn_mscale(factor)
    return inv_freq * (1 - ramp) + inv_freq / factor * ramp, float(scale)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's temperature ``0.1 mscale ln(factor) + 1`` (1 for ``factor <= 1``)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0
