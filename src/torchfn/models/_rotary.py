"""Rotary position embeddings (RoPE, Su et al. 2021): rotate query/key pairs by position."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from torchfn.models._rotary_scaling import rotary_frequencies

__all__ = ["rotary_embedding"]


def _check(x: Tensor, positions: Tensor, base: float, rotary_dim: int | None) -> int:
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() < 2:
        got = f"shape {tuple(x.shape)}, {x.dtype}" if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"x must be a float tensor (..., N, D), got {got}")
    n, d = x.shape[-2:]
    rot = d if rotary_dim is None else rotary_dim
    if isinstance(rot, bool) or not isinstance(rot, int) or rot < 2 or rot % 2 or rot > d:
        raise ValueError(f"rotary_dim must be an even int in 2..D = {d}, got {rotary_dim!r}"
                         + (" (the head dim D is odd: give an even rotary_dim)" if d % 2 else ""))
    if not isinstance(base, (int, float)) or isinstance(base, bool) or not base > 0:
        raise ValueError(f"base must be a number > 0, got {base!r}")
    if not isinstance(positions, Tensor) or positions.is_complex() or positions.dtype == torch.bool:
        raise TypeError(f"positions must be an int or float tensor (N,) or (B, N), got "
                        f"{positions.dtype if isinstance(positions, Tensor) else type(positions)}")
    lead = tuple(x.shape[:-3]) if x.dim() >= 3 else ()
    if positions.dim() == 1:
        ok = positions.shape[0] == n
    else:
        ok = tuple(positions.shape) == (*lead, n)
    if not ok:
        want = f"({n},)" + (f" or {(*lead, n)}" if lead else "")
        raise ValueError(f"positions must have shape {want} for x of shape {tuple(x.shape)} "
                         f"(..., H, N, D), got {tuple(positions.shape)}")
    return rot


def rotary_embedding(
    x: Tensor,
    positions: Tensor,
    *,
    base: float = 10000.0,
    rotary_dim: int | None = None,
    interleaved: bool = False,
    scaling: Mapping[str, Any] | None = None,
) -> Tensor:
    """Rotate each pair of features of ``x`` by ``position * base^(-2i / rotary_dim)``.

    Applied to queries and keys before attention, the score ``<R(q, m), R(k, n)>``
    depends on the positions only through ``m - n`` (RoPE). Pure tensor ops: it composes
    with ``grad``, ``vmap``, ``jvp`` and ``torch.compile``.

    Args:
        x: ``(B, H, N, D)`` (or ``(H, N, D)``, ``(N, D)``: any ``(..., N, D)``).
        positions: ``(N,)`` shared by the batch, or ``(B, N)`` per row (``x.shape[:-3] +
            (N,)``). Ints, or floats for position interpolation (``positions / factor``).
        base: the wavelength base, 10000 in RoPE and Llama 2; Llama 3 uses 500000.
        rotary_dim: rotate only the first ``rotary_dim`` features (GPT-J, GPT-NeoX's
            partial rotary); the rest pass unchanged. Default: all ``D``.
        interleaved: pairs ``(2i, 2i + 1)`` (GPT-J, Meta's Llama code, the paper) instead
            of ``(i, i + rotary_dim / 2)`` (GPT-NeoX, Hugging Face's Llama). The two give the
            same scores when q and k use the same convention; checkpoints do not mix.
        scaling: stretch the frequencies for a longer context than trained, as a
            Hugging Face ``rope_scaling`` dict (``"linear"``, ``"ntk"``, ``"llama3"``,
            ``"yarn"``): see :func:`rotary_frequencies`.

    Returns:
        ``x``'s shape and dtype. The angles are computed in float64 (a table of ``N x
        rotary_dim / 2``, small next to attention) and the rotation in float32 (float64
        for float64 ``x``). Hugging Face computes the angles in float32, which at
        position 4096 are off by up to 2.4e-4 rad.

    Example::

        >>> import torch
        >>> from torchfn import random
        >>> from torchfn.models import rotary_embedding
        >>> q = random.normal(random.key(0), (1, 2, 8, 16))   # (B, H, N, D)
        >>> k = random.normal(random.key(1), (1, 2, 8, 16))
        >>> pos = torch.arange(8)
        >>> s = rotary_embedding(q, pos) @ rotary_embedding(k, pos).mT           # (B, H, N, N)
        >>> s5 = rotary_embedding(q, pos + 5) @ rotary_embedding(k, pos + 5).mT  # shifted
        >>> torch.allclose(s, s5, atol=1e-4)
        True
    """
    rot = _check(x, positions, base, rotary_dim)
    table = rotary_table(positions, rot, base=base, scaling=scaling, dtype=x.dtype,
                         device=x.device)
    return apply_rotary(x, table, interleaved=interleaved)


class RotaryTable(NamedTuple):
    """The cos and sin of RoPE's angles ``(N, rot/2)`` or ``(B, 1, N, rot/2)``, in the
    dtype the rotation runs in (scaled by YaRN's attention factor where it has one)."""

    cos: Tensor
    sin: Tensor


def rotary_table(positions: Tensor, rotary_dim: int, *, base: float = 10000.0,
                 scaling: Mapping[str, Any] | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None) -> RotaryTable:
    """The table :func:`rotary_embedding` rotates by, for ``x`` of ``dtype``: made once,
    it serves the queries and keys of every layer (``apply_rotary``). Angles in float64,
    cos and sin in float32 (float64 for float64 ``x``)."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    # float64 angles: in float32, position 4096 would be off by up to 2.4e-4 rad
    inv_freq, scale = _frequencies(rotary_dim, base, scaling, device)  # (rot/2,)
    pos = positions.to(device=device, dtype=torch.float64)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "longrope":
        # LongRoPE: the long factors for a call that reaches past the original context
        # (decided on the tensor, as Hugging Face does: no sync, traceable, vmap-able)
        long_freq, long_scale = _frequencies(rotary_dim, base, scaling, device, long=True)
        past = pos.max() + 1 > scaling["original_max_position_embeddings"]
        inv_freq = torch.where(past, long_freq, inv_freq)
        if long_scale != scale:  # (Phi-3.5-MoE's short_mscale / long_mscale)
            scale = torch.where(past, torch.tensor(long_scale, dtype=torch.float64, device=device),
                                torch.tensor(scale, dtype=torch.float64, device=device))
    if pos.dim() > 1:
        pos = pos.unsqueeze(-2)  # (B, 1, N): shared by the heads
    angles = pos[..., None] * inv_freq  # (..., N, rot/2)
    cos, sin = angles.cos(), angles.sin()
    if isinstance(scale, Tensor) or scale != 1.0:  # YaRN's attention factor
        cos, sin = cos * scale, sin * scale
    return RotaryTable(cos.to(work), sin.to(work))


def apply_rotary(x: Tensor, table: RotaryTable, interleaved: bool = False) -> Tensor:
    """``x`` ``(..., N, D)`` rotated by ``table`` (its first ``2 * table.cos.shape[-1]``
    features; the rest pass unchanged)."""
    cos, sin = table
    rot, half = 2 * cos.shape[-1], cos.shape[-1]
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    if cos.dtype != work:
        cos, sin = cos.to(work), sin.to(work)
    if x.dtype == work and _eager_no_grad(x):
        return _rotate_into_buffer(x, cos, sin, rot, interleaved)
    xr, rest = x[..., :rot].to(work), x[..., rot:]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]  # (..., N, rot/2) each
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((out.to(x.dtype), rest), dim=-1) if rot < x.shape[-1] else out.to(x.dtype)


def _frequencies(rotary_dim: int, base: float, scaling: Mapping[str, Any] | None,
                 device: torch.device | None, long: bool = False) -> tuple[Tensor, float]:
    """``rotary_frequencies``, remembered in plain eager mode: a decoding step would
    otherwise rebuild the same (rot/2,) tensor in every layer (~25 us each here)."""
    if torch.compiler.is_compiling():
        return rotary_frequencies(rotary_dim, base, scaling, device=device, long=long)
    try:
        key = (rotary_dim, float(base), None if scaling is None else tuple(sorted(
            (k, tuple(v) if isinstance(v, list) else v) for k, v in scaling.items())),
            str(torch.device(device or "cpu")), long)
        hash(key)
    except (TypeError, AttributeError):  # an unhashable scaling: no memo
        return rotary_frequencies(rotary_dim, base, scaling, device=device, long=long)
    found = _FREQUENCIES.get(key)
    if found is None:
        found = rotary_frequencies(rotary_dim, base, scaling, device=device, long=long)
        if len(_FREQUENCIES) < 256:  # a few models' worth; never grows without bound
            _FREQUENCIES[key] = found
    return found


_FREQUENCIES: dict[tuple, tuple[Tensor, float]] = {}  # only read back, never written into


def _eager_no_grad(x: Tensor) -> bool:
    """Plain eager mode with nothing to differentiate: ``out=`` buffers are safe."""
    from torchfn.core._dropout import forward_ad_active
    from torchfn.core._eager import plain

    return plain(x) and not (x.requires_grad and torch.is_grad_enabled()) \
        and not forward_ad_active()


def _rotate_into_buffer(x: Tensor, cos: Tensor, sin: Tensor, rot: int,
                        interleaved: bool) -> Tensor:
    """The same rotation written into one output buffer: 2x faster on the CPU than the
    functional form, whose four fresh (..., N, rot/2) products cost a page fault each."""
    out = torch.empty_like(x)
    if interleaved:
        x1, x2, o1, o2 = x[..., 0:rot:2], x[..., 1:rot:2], out[..., 0:rot:2], out[..., 1:rot:2]
    else:
        h = rot // 2
        x1, x2, o1, o2 = x[..., :h], x[..., h:rot], out[..., :h], out[..., h:rot]
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-1)  # x1 cos - x2 sin
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin)  # x2 cos + x1 sin
    if rot < x.shape[-1]:
        out[..., rot:] = x[..., rot:]
    return out
