"""The ordered dQ's host side: the 5-matmul backward that adds dQ inside the dK/dV launch
by TMA bulk reduces, in turn (deterministic) or in any order, and when it runs.

The schedule is ``_ordered_dq``'s (in Python) and ``_triton_ordered_dq``'s (in the
kernel); the kernel is ``_triton_bwd._attn_bwd_dkdv`` with ``DQ_ORDERED`` set.
``TORCHFN_TRITON_ORDERED_DQ``: "auto" (on sm_90+ with Nq >= Nk, timed against its rival
once per shape class), "0" never, "1" always where it applies (the interpreter's only way).

How ``_triton_ops.bwd`` uses it (GPU; ``ordered`` runs ``backward`` with the dK/dV
launch's arguments, ``plain`` the 7-matmul backward)::

    if applies(consts, q.device, Nq, Nk) and wins(key, q.device, None, ordered, plain):
        dq, dk, dv = ordered()
    else:
        dq, dk, dv = plain()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton

from torchfn.kernels import _ordered_dq, _triton_bwd
from torchfn.kernels._triton_configs import Config
from torchfn.kernels._triton_launch import (
    autotune_enabled,
    checked_and_faster,
    is_interpreted,
    launch,
)

Tensor = torch.Tensor

_ORDER_PICKS: dict[tuple, bool] = {}  # (deterministic, dK/dV shape class) -> the bulk
# reduces inside dK/dV timed faster than their rival
_WAVES: dict[tuple, int] = {}  # (config, query blocks, key blocks, device) -> wave size
_LAST_LOCKS: list[Tensor] = []  # the last ordered launch's counters ([1]: a wait gave up)


def applies(consts: dict[str, Any], device: torch.device, Nq: int, Nk: int) -> bool:
    """Whether dQ may be added inside dK/dV by bulk reduces here (the ordered dQ, or
    without its locks for ``deterministic=False``): ``TORCHFN_TRITON_ORDERED_DQ`` not
    "0", no window or segments (their query ranges are not whole blocks), and a bulk reduce:
    sm_90+ (the interpreter only with "1"). "auto" also needs Nq >= Nk: with more keys
    the schedule queues (causal: the key blocks before the first query all start at
    the first query block; non-causal: a few query blocks for many key blocks), where
    the split-KV dQ is the better plan."""
    mode = _ordered_dq.mode()
    if mode == "0" or consts.get("WINDOW"):
        return False
    if is_interpreted():
        return mode == "1"
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9 and (
        mode == "1" or Nq >= Nk)


def wins(key: tuple, device: torch.device, config: Any,
         ordered: Callable[[], Any], plain: Callable[[], Any]) -> bool:
    """Whether dQ is added inside dK/dV by bulk reduces for this shape class (``key[0]``:
    deterministic, so in turn; else in any order). "1": always. "auto": on a GPU with
    the tuner on, once per process that backward and its rival (``plain``: the 7-matmul
    one, or element atomics) are run (each tuned), must agree to rounding, and the
    faster is kept; without the tuner (or with an explicit config) the measured rival
    stays."""
    if _ordered_dq.mode() == "1":
        return True
    if not autotune_enabled() or device.type != "cuda" or config is not None:
        return False
    if key not in _ORDER_PICKS:
        _ORDER_PICKS[key] = checked_and_faster(
            ordered, plain, f"the {'ordered-dQ' if key[0] else 'bulk-reduce dQ'} Triton backward",
            lambda: ("a wait timed out" if _LAST_LOCKS and _LAST_LOCKS[0][1].item() else None))
    return _ORDER_PICKS[key]


def backward(args_kv: tuple, grid_kv: Callable, consts_kv: dict[str, Any], key_kv: tuple,
             config: tuple[int, ...] | None, tma_kv: Callable | None, dtype: torch.dtype,
             scale: float, ordered: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """The 5-matmul backward with dQ added by bulk reduces inside dK/dV: in turn,
    deterministic (``DQ_ORDERED`` = 1), or with ``ordered=False`` in any order (2)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    q, dk, dv = args_kv[0], args_kv[7], args_kv[8]
    B, H, Nq, D = q.shape
    Nk = args_kv[1].shape[2]
    bd, causal, interp = consts_kv["BLOCK_D"], consts_kv["IS_CAUSAL"], is_interpreted()
    # float32, scaled; rows padded to 16 bytes for the descriptor; zeroed by reset()
    acc = torch.empty((B, H, Nq, -(-D // 4) * 4), dtype=torch.float32, device=q.device)[..., :D]
    # [0]: tickets, [1]: a wait gave up, then a lock per (batch, head, query block)
    locks = torch.empty(2 + B * H * triton.cdiv(Nq, 16), dtype=torch.int32, device=q.device)

    def extra(cfg: Config, compile_: Callable[..., Any]) -> dict[str, Any]:
        kw = dict(LOCKS=locks, DQ_ORDERED=1 if ordered else 2, TMA_REDUCE=not interp,
                  spin_limit=64 if interp else 1 << 22,
                  desc_dq=TensorDescriptor(acc, list(acc.shape), list(acc.stride()),
                                           [1, 1, cfg.block_m, bd]))
        if causal or interp:  # (the interpreter runs one program after another)
            kw["wave"] = 1
        else:
            kw["wave"] = _wave(cfg, compile_, kw, q.device, Nq, Nk)
        return kw

    def reset() -> None:
        acc.zero_()
        locks.zero_()

    args = args_kv[:9] + (acc,) + args_kv[10:]
    launch("dkdv_ordered" if ordered else "dkdv_reduce", _triton_bwd._attn_bwd_dkdv, grid_kv,
           args, consts_kv, key_kv, config, reset=reset, tma=tma_kv, outputs=(dk, dv, acc),
           extra=extra)
    _LAST_LOCKS[:] = [locks]
    if interp and locks[1].item():
        raise RuntimeError("torchfn: an ordered-dQ wait timed out in the interpreter, where "
                           "every earlier turn has run: the schedule is inconsistent")
    return acc.to(dtype, memory_format=torch.contiguous_format), dk.to(dtype), dv.to(dtype)


def _wave(cfg: Config, compile_: Callable[..., Any], kw: dict[str, Any],
          device: torch.device, Nq: int, Nk: int) -> int:
    """How many tickets rotate together (non-causal): as many programs as the GPU runs
    at once (``_ordered_dq.wave_size``, from the compiled kernel; ``wave_cap`` keeps a
    head's share within its query blocks). If the kernel cannot be inspected: one
    program per SM, which the GPU always holds."""
    n_m, n_kb = triton.cdiv(Nq, cfg.block_m), triton.cdiv(Nk, cfg.block_n)
    at = (tuple(cfg), n_m, n_kb, device.index)
    if at not in _WAVES:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        try:
            kernel = compile_(**kw, wave=2)  # (not 1: the JIT would make 1 a constant)
            kernel._init_handles()
            _WAVES[at] = _ordered_dq.wave_size(device, kernel.n_regs, kernel.metadata.shared,
                                               cfg.warps, n_m, n_kb)
        except Exception:  # noqa: BLE001 - an older Triton: the safe wave
            _WAVES[at] = _ordered_dq.wave_cap(sms, n_m, n_kb)
    return _WAVES[at]
