"""Quantized checkpoints back to floating point: DeepSeek-V3's block-scaled FP8 and
gpt-oss's MXFP4 experts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["dequantize_fp8", "dequantize_mxfp4"]

# the 16 values of an FP4 (E2M1) code, by its 4 bits
_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_fp8(state_dict: Mapping[str, Tensor], config: Mapping[str, Any] | None = None,
                   dtype: torch.dtype = torch.bfloat16) -> dict[str, Tensor]:
    """A block-wise FP8 checkpoint's weights in ``dtype``: each ``name.weight`` with a
    ``name.weight_scale_inv`` ``(ceil(rows / b0), ceil(cols / b1))`` becomes ``weight *
    scale`` block by block (blocks ``config["quantization_config"]["weight_block_size"]``,
    default 128 x 128, the last ones cut at the matrix's edge), computed in float32 as
    DeepSeek's ``weight_dequant`` does; the scales are dropped and the other tensors kept.

    Example::

        >>> import torch
        >>> from torchfn.models import dequantize_fp8
        >>> w = torch.full((3, 200), 1.5).to(torch.float8_e4m3fn)
        >>> scale = torch.tensor([[2.0, 4.0]])                    # blocks of 128 columns
        >>> out = dequantize_fp8({"w.weight": w, "w.weight_scale_inv": scale})
        >>> out["w.weight"][0, 127].item(), out["w.weight"][0, 128].item(), out["w.weight"].dtype
        (3.0, 6.0, torch.bfloat16)
    """
    block = ((config or {}).get("quantization_config") or {}).get("weight_block_size",
                                                                  [128, 128])
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and b >= 1 for b in block)):
        raise ValueError(f"config['quantization_config']['weight_block_size'] must be two "
                         f"ints >= 1, got {block!r}")
    out = {}
    for name, t in state_dict.items():
        if name.endswith("_scale_inv"):
            continue
        scale = state_dict.get(name + "_scale_inv")
        if scale is None:
            out[name] = t
            continue
        if t.dim() != 2:
            raise ValueError(f"state_dict[{name!r}] has a scale, so must be a matrix; got "
                             f"shape {tuple(t.shape)}")
        rows, cols = t.shape
        want = (-(-rows // block[0]), -(-cols // block[1]))
        if tuple(scale.shape) != want:
            raise ValueError(f"state_dict[{name + '_scale_inv'!r}] must have shape {want} for "
                             f"a weight {tuple(t.shape)} in blocks {tuple(block)}, got "
                             f"{tuple(scale.shape)}")
        full = scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        out[name] = (t.float() * full[:rows, :cols]).to(dtype)  # (rows, cols)
    orphans = [n for n in state_dict if n.endswith("_scale_inv") and n[:-10] not in state_dict]
    if orphans:
        raise ValueError(f"state_dict has scales without their weights: {orphans[:3]}")
    return out


def dequantize_mxfp4(state_dict: Mapping[str, Tensor],
                     dtype: torch.dtype = torch.bfloat16) -> dict[str, Tensor]:
    """gpt-oss's MXFP4 experts in ``dtype``: each ``name_blocks`` ``(E, rows, G, 16)``
    uint8 (two FP4 codes a byte, the low nibble first) with ``name_scales`` ``(E, rows,
    G)`` uint8 (a power of two per 32 values, biased by 127) becomes ``name`` ``(E, G *
    32, rows)``: the layout of the unquantized checkpoint (``gate_up_proj`` ``(E, dim,
    2 hidden)``, ``down_proj`` ``(E, hidden, dim)``). Other tensors are kept. Equal to
    transformers' ``convert_moe_packed_tensors`` (tested).

    Example::

        >>> import torch
        >>> from torchfn.models import dequantize_mxfp4
        >>> blocks = torch.full((1, 2, 1, 16), 0x21, dtype=torch.uint8)  # codes 1 and 2
        >>> scales = torch.full((1, 2, 1), 128, dtype=torch.uint8)         # times 2
        >>> w = dequantize_mxfp4({"e.down_proj_blocks": blocks, "e.down_proj_scales": scales})
        >>> w["e.down_proj"].shape, w["e.down_proj"][0, :2, 0].tolist()  # 0.5 * 2, 1.0 * 2
        (torch.Size([1, 32, 2]), [1.0, 2.0])
    """
    out: dict[str, Tensor] = {}
    for name, t in state_dict.items():
        if name.endswith("_scales") and name[:-7] + "_blocks" in state_dict:
            continue
        if not name.endswith("_blocks"):
            out[name] = t
            continue
        base = name[:-7]
        scales = state_dict.get(base + "_scales")
        if scales is None or t.dtype != torch.uint8 or t.dim() != 4 or t.shape[-1] != 16 \
                or tuple(scales.shape) != tuple(t.shape[:-1]):
            raise ValueError(f"state_dict[{name!r}] must be uint8 (E, rows, G, 16) with "
                             f"{base + '_scales'!r} (E, rows, G); got {t.dtype} "
                             f"{tuple(t.shape)} and "
                             f"{None if scales is None else tuple(scales.shape)}")
        lut = torch.tensor(_FP4, dtype=torch.float32, device=t.device)
        codes = torch.stack((t & 0x0F, t >> 4), dim=-1).long()  # (E, rows, G, 16, 2)
        values = lut[codes].flatten(-2)  # (E, rows, G, 32)
        values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
        out[base] = values.flatten(-2).transpose(1, 2).to(dtype).contiguous()  # (E, G 32, rows)
    return out
