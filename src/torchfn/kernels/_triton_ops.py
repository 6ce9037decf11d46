"""Raw Triton attention launches: ``fwd``, ``bwd``, ``jvp`` (no autograd; validated inputs).

This is the Triton half of the backend contract (see ``_torch_ops`` for the
PyTorch half)::

    fwd(q, k, v, mask, causal, scale) -> (o, lse)
    bwd(q, k, v, o, lse, do, mask, causal, scale, deterministic=True, dlse=None)
        -> (dq, dk, dv)
    jvp(q, k, v, tq, tk, tv, mask, causal, scale) -> (o, lse, to, tlse)

q: (B, H, Nq, D); k, v: (B, Hkv, Nk, D) with Hkv dividing H; mask None or already
expanded to (B, H, Nq, Nk) (bool: True = attend; float: additive); o: (B, H, Nq, D)
in q's dtype; lse: (B, H, Nq) float32 (natural log, -inf on fully masked rows).
Each also takes ``window=(left, right)`` (normalised by ``_dispatch``, -1: unbounded) and
``segments=(q_ids, kv_ids)``, which select the band kernels (``WINDOW``, ``SEGMENTS``), and
``softcap`` (> 0: ``SOFTCAP``), ``dropout`` with ``seeds`` ((B, H, 2) int32 per-head
keys: ``DROPOUT``, see ``_triton_dropout``) and ``slopes`` ((B, H) ALiBi slopes:
``ALIBI``).

Launching and tuning (block configs, TMA, the untimed variants) is ``_triton_launch``'s.
A forward or dQ launch with too few query blocks to fill the GPU (decoding) may split its
keys (``SPLIT``, ``_split_kv``: FlashAttention-2's wave rule proposes a split count, the
tuner times split against unsplit once per shape class and keeps the faster;
``TORCHFN_TRITON_SPLIT_KV``: "auto", "0" never, N forces N splits, the only way the
interpreter splits); one launch of ``_triton_merge`` merges the forward's pieces by lse,
and dQ's are summed. On sm_90+ the deterministic backward may add dQ inside the dK/dV
launch in a fixed order (the ordered dQ, ``_triton_ordered_bwd``). fp32 dots never use
plain TF32: 3xTF32 ("tf32x3") on the GPU, overridable with
``TORCHFN_TRITON_FP32_PRECISION=ieee``; exact in the interpreter.

Example (GPU)::

    from torchfn import random
    q = random.normal(random.key(1, device="cuda"), (2, 8, 1024, 64), torch.bfloat16)
    o, lse = fwd(q, q, q, None, True, 64 ** -0.5)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import triton

from torchfn.kernels import (
    _dropout,
    _split_kv,
    _triton_bwd,
    _triton_configs,
    _triton_fwd,
    _triton_jvp,
    _triton_merge,
    _triton_ordered_bwd,
)
from torchfn.kernels._triton_launch import (
    autotune_enabled,
    checked_and_faster,
    ensure_mode,
    is_interpreted,
    launch,
    tma_descriptors,
    tuned_configs,
    ws_variant,
)

Tensor = torch.Tensor

__all__ = ["fwd", "bwd", "jvp", "tuned_configs", "is_interpreted"]


_PRE_BLOCK_M = 64  # preprocess kernel (delta, lse2)
_MAX_BLOCK_N = 128  # the widest key block of the GPU config tables (split-KV runs align)
_SPLIT_PICKS: dict[tuple, bool] = {}  # forward / dQ shape class -> split-KV timed faster


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _bucket(n: int) -> int:
    return min(max(triton.next_power_of_2(max(n, 1)), 256), 16384)


def _c(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _dot_prec(dtype: torch.dtype) -> str:
    """fp32 dots: 3xTF32 on GPU (fp32-accurate, on tensor cores; "ieee" FMA dots take 30-45 s
    to compile and spill heavily at D=128), exact in the interpreter. fp16/bf16: ignored."""
    if dtype != torch.float32:
        return "tf32"
    if is_interpreted():
        return "ieee"
    return os.environ.get("TORCHFN_TRITON_FP32_PRECISION", "tf32x3")


def _upcast(dtype: torch.dtype) -> bool:
    # the interpreter's tl.dot is wrong for bf16: run every dot in fp32 there (P and dS
    # unrounded too, as the CPU peers that set the fp16/bf16 error bound do)
    return is_interpreted() and dtype != torch.float32


def _buf_dtype(dtype: torch.dtype) -> torch.dtype:
    # the interpreter truncates fp32 -> bf16 on store: write fp32, round on the host instead
    return torch.float32 if dtype == torch.bfloat16 and is_interpreted() else dtype


def _mask_args(mask: Tensor | None, q: Tensor) -> tuple[Tensor, int, tuple[int, int, int, int]]:
    """(pointer, MASK_KIND, strides (b, h, m, n)); bool masks are read as uint8."""
    if mask is None:
        return q, 0, (0, 0, 0, 0)
    if mask.dtype == torch.bool:
        m, kind = mask.view(torch.uint8), 1
    else:
        m, kind = mask, 2
    return m, kind, tuple(m.stride())


def _common(q: Tensor, k: Tensor, mask: Tensor | None, causal: bool, scale: float,
            window: tuple[int, int] = (-1, -1), segments: tuple[Tensor, Tensor] | None = None,
            softcap: float = 0.0, dropout: float = 0.0, seeds: Tensor | None = None,
            slopes: Tensor | None = None):
    B, H, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    mptr, mkind, ms = _mask_args(mask, q)
    consts = dict(
        HEAD_DIM=D, BLOCK_D=_block_d(D), IS_CAUSAL=bool(causal), MASK_KIND=mkind,
        DOT_PREC=_dot_prec(q.dtype), UPCAST=_upcast(q.dtype),
    )
    banded = max(window) >= 0 or segments is not None
    if banded:  # the band kernels: causal folded into the right side
        left, right = window
        consts.update(IS_CAUSAL=False, WINDOW=True, win_l=left if left >= 0 else Nq + Nk,
                      win_r=0 if causal else (right if right >= 0 else Nq + Nk))
    if segments is not None:
        consts.update(SEGMENTS=True, **_segment_labels(*segments))
    if softcap > 0:  # the cap in log2 units (the kernels' scores are)
        consts.update(SOFTCAP=True, cap2=float(softcap) * 1.4426950408889634)
    if seeds is not None:  # keyed dropout: the per-head keys and the 16-bit threshold
        consts.update(DROPOUT=True, SEED=seeds.contiguous(),
                      drop_thresh=_dropout.threshold(dropout),
                      drop_scale=_dropout.keep_scale(dropout))
    if slopes is not None:  # ALiBi: per-(batch, head) slopes, the bias made in the kernels
        consts.update(ALIBI=True, SLOPES=slopes.to(torch.float32).contiguous())
    key = (_bucket(max(Nq, Nk)), D, bool(causal), mkind, q.dtype, banded, segments is not None,
           softcap > 0, seeds is not None, slopes is not None)
    return B, H, Hkv, Nq, Nk, D, mptr, ms, consts, key


def _segment_labels(q_ids: Tensor, kv_ids: Tensor) -> dict[str, Any]:
    """The kernels' view of segment ids (no device sync): int32 labels in key space, a
    key's = the first key of its segment, a query's = the first key of its segment (Nk when
    no key shares it), so equal labels <=> equal ids; and the ranges that bound the loops:
    each query's keys (``_kv``) and each key's queries (``_q``)."""
    from torchfn.kernels._reference import segment_ranges

    kv_lo, kv_hi = segment_ranges(q_ids, kv_ids)  # (B, Nq); kv_lo is also the label
    q_lo, q_hi = segment_ranges(kv_ids, q_ids)  # (B, Nk)
    return {"QSEG": kv_lo, "KSEG": segment_ranges(kv_ids, kv_ids)[0],
            "_kv": (kv_lo, kv_hi), "_q": (q_lo, q_hi)}


def _seg_ranges(consts: dict[str, Any], by_key: bool = False) -> dict[str, Any]:
    """With segments: each query's key range (or, ``by_key``, each key's query range) as
    ``RLO`` / ``RHI`` kwargs; else nothing."""
    if not consts.get("SEGMENTS"):
        return {}
    lo, hi = consts["_q" if by_key else "_kv"]
    return {"RLO": lo, "RHI": hi}


def _empty_fwd(q: Tensor) -> tuple[Tensor, Tensor]:
    B, H, Nq, _ = q.shape
    o = torch.zeros_like(q, memory_format=torch.contiguous_format)
    lse = torch.full((B, H, Nq), float("-inf"), dtype=torch.float32, device=q.device)
    return o, lse


def fwd(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float,
        *, window: tuple[int, int] = (-1, -1), segments: tuple[Tensor, Tensor] | None = None,
        softcap: float = 0.0, dropout: float = 0.0, seeds: Tensor | None = None,
        slopes: Tensor | None = None, config: tuple[int, ...] | None = None,
        ) -> tuple[Tensor, Tensor]:
    """Forward: ``o = softmax(scale q k^T + mask) v`` and its row logsumexp ``lse`` (float32).

    q: (B, H, Nq, D); k, v: (B, Hkv, Nk, D) -> o: (B, H, Nq, D), lse: (B, H, Nq).
    ``config`` = (BLOCK_M, BLOCK_N, num_warps, num_stages[, tma[, overlap[, ws]]]) overrides
    the tuned choice.
    """
    ensure_mode(q.device)
    q, k, v = _c(q), _c(k), _c(v)
    B, H, Hkv, Nq, Nk, D, mptr, ms, consts, key = _common(q, k, mask, causal, scale, window,
                                                          segments, softcap, dropout, seeds,
                                                          slopes)
    if B * H * Nq == 0 or Nk == 0:
        return _empty_fwd(q)
    # scale > 0 and no additive mask: the kernel takes the row max of the raw scores
    consts = dict(consts, FOLD_SCALE=float(scale) > 0 and consts["MASK_KIND"] != 2
                  and softcap <= 0 and slopes is None, **_seg_ranges(consts))
    tma = tma_descriptors({"desc_q": q, "desc_k": k, "desc_v": v},
                          {"desc_q": "m", "desc_k": "n", "desc_v": "n"}, consts["BLOCK_D"])

    def launch_fwd(splits: int, split_n: int) -> tuple[Tensor, Tensor]:
        if splits > 1:  # partial results per key split, merged after
            o = torch.empty((B, H, splits, Nq, D), dtype=torch.float32, device=q.device)
            lse = torch.empty((B, H, splits, Nq), dtype=torch.float32, device=q.device)
            kw = dict(consts, SPLIT=True, split_len=split_n, sos=o.stride(2))
        else:
            o = torch.empty((B, H, Nq, D), dtype=_buf_dtype(q.dtype), device=q.device)
            lse = torch.empty((B, H, Nq), dtype=torch.float32, device=q.device)
            kw = consts
        args = (q, k, v, mptr, o, lse,
                q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2), *ms,
                o.stride(0), o.stride(1), o.stride(-2),
                H, H // Hkv, Nq, Nk, float(scale) * 1.4426950408889634)
        grid = lambda bm, bn: (triton.cdiv(Nq, bm), B * H, splits)
        ws = ws_variant([q, k, v], kw, ok=kw["FOLD_SCALE"] and splits == 1,
                        ragged=lambda bm, bn: Nk % bn != 0)
        launch("fwd", _triton_fwd._attn_fwd, grid, args, kw,
               (*key, tma is not None, splits), config, tma=tma, ws=ws, outputs=(o, lse))
        if splits > 1:
            return _merge(o, lse, q.dtype)
        return o.to(q.dtype), lse

    return _with_splits(launch_fwd, ("fwd", *key, tma is not None), B * H, Nq, Nk, q.device,
                        config)


def _with_splits(run: Callable[[int, int], Any], key: tuple, programs: int, Nq: int,
                 Nk: int, device: torch.device, config: tuple[int, ...] | None) -> Any:
    """``run(splits, keys per split)`` (a forward or dQ) at the split count ``_splits``
    proposes, or unsplit where the tuner timed the split slower (``_split_wins``)."""
    splits, split_n = _splits(programs, Nq, Nk, device, config)
    if splits > 1 and not _split_wins((*key, splits), device, config,
                                      lambda: run(splits, split_n), lambda: run(1, Nk)):
        splits, split_n = 1, Nk
    return run(splits, split_n)


def _split_wins(key: tuple, device: torch.device, config: tuple[int, ...] | None,
                split: Callable[[], Any], whole: Callable[[], Any]) -> bool:
    """Whether the split-KV kernel (forward or dQ) runs for this shape class: once per
    process on a GPU with the tuner on, the split and unsplit launches are timed (each
    after its own config tuning) and the faster kept, as for any untimed variant; the
    split one must first give the same outputs (o and lse, or dq) to rounding. Without
    the tuner (or with a forced split count, or an explicit config), the heuristic's
    split stands."""
    if (not autotune_enabled() or device.type != "cuda" or config is not None
            or _split_kv.mode() != "auto"):
        return True
    if key not in _SPLIT_PICKS:
        _SPLIT_PICKS[key] = checked_and_faster(split, whole, "a split-KV Triton kernel")
    return _SPLIT_PICKS[key]


def _merge(o_part: Tensor, lse_part: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The split forward's (B, H, S, Nq, D) / (B, H, S, Nq) partial results -> (o, lse),
    in one launch (``_triton_merge``; ``_split_kv.merge`` is the same in torch ops)."""
    B, H, S, Nq, D = o_part.shape
    o = torch.empty((B, H, Nq, D), dtype=_buf_dtype(dtype), device=o_part.device)
    lse = torch.empty((B, H, Nq), dtype=torch.float32, device=o_part.device)
    _triton_merge._merge_splits[(B * H * Nq,)](
        o_part, lse_part, o, lse, S, Nq, H, o.stride(0), o.stride(1), o.stride(2),
        HEAD_DIM=D, BLOCK_D=_block_d(D), BLOCK_S=max(2, triton.next_power_of_2(S)))
    return o.to(dtype), lse


def _splits(programs: int, Nq: int, Nk: int, device: torch.device,
            config: tuple[int, ...] | None) -> tuple[int, int]:
    """(key splits, keys per split) of a forward or dQ (``_split_kv``); (1, Nk): no split.

    ``programs`` = batch x heads; the query blocks are counted at the forward's widest
    tile (64 rows; all of Nq when it is one block anyway). The keys per split are a
    multiple of every BLOCK_N the launch may use (the explicit config's, the
    interpreter's, or the widest of the GPU tables).
    """
    mode = _split_kv.mode()
    align = (config[1] if config is not None
             else _triton_configs._INTERP_CONFIGS["fwd"][1] if is_interpreted() else _MAX_BLOCK_N)
    if mode == "auto":
        if is_interpreted() or device.type != "cuda":
            return 1, Nk
        n_sms = torch.cuda.get_device_properties(device).multi_processor_count
        mode = _split_kv.num_splits(programs * triton.cdiv(Nq, 64), n_sms,
                                    triton.cdiv(Nk, align))
    if mode <= 1:
        return 1, Nk
    split_n, splits = _split_kv.split_len(Nk, mode, align)
    return (splits, split_n) if splits > 1 else (1, Nk)


def bwd(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor,
        mask: Tensor | None, causal: bool, scale: float, deterministic: bool = True,
        *, window: tuple[int, int] = (-1, -1), segments: tuple[Tensor, Tensor] | None = None,
        softcap: float = 0.0, dropout: float = 0.0, seeds: Tensor | None = None,
        dlse: Tensor | None = None, slopes: Tensor | None = None,
        config: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
        ) -> tuple[Tensor, Tensor, Tensor]:
    """Backward from ``do`` (and ``dlse``, the cotangent of lse, or None): (dq, dk, dv) in
    the input dtype; dk/dv summed over GQA groups.

    ``deterministic=True``: bitwise reproducible. Either a separate dQ launch (7 matmuls
    per tile pair, no atomics), or, on sm_90+ where the tuner timed it faster (or with
    ``TORCHFN_TRITON_ORDERED_DQ=1``), the ordered dQ: the dK/dV launch adds each ``dS K``
    into dQ by a TMA bulk reduce, one key block after another in a fixed order
    (``_ordered_dq``; 5 matmuls). ``False``: dQ is accumulated inside the dK/dV launch
    in any order (5 matmuls), at the cost of run-to-run rounding differences in dq: by
    float32 atomics (on an H200 slower than the deterministic backward: the atomics cost
    more than the two matmuls), or on sm_90+ where the tuner timed it faster by the
    ordered dQ's bulk reduces without its locks. ``config`` = (dkdv config, dq config)
    overrides tuning (the dq one is unused when ``deterministic=False`` or the ordered
    dQ runs); each may have the flags ``tma``, ``overlap`` (dK/dV) and ``ws`` (dQ; dK/dV
    when deterministic, and with GQA only for heads stored one after another).
    """
    ensure_mode(q.device)
    q, k, v, o, do = _c(q), _c(k), _c(v), _c(o), _c(do)
    B, H, Hkv, Nq, Nk, D, mptr, ms, consts, key = _common(q, k, mask, causal, scale, window,
                                                          segments, softcap, dropout, seeds,
                                                          slopes)
    buf = _buf_dtype(q.dtype)
    dq = torch.zeros((B, H, Nq, D), dtype=buf, device=q.device)
    dk = torch.zeros((B, Hkv, Nk, D), dtype=buf, device=q.device)
    dv = torch.zeros((B, Hkv, Nk, D), dtype=buf, device=q.device)
    if B * H * Nq == 0 or Nk == 0:
        return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)
    lse = lse.contiguous()
    delta = torch.empty((B, H, Nq), dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(delta)
    pre_grid = (triton.cdiv(Nq, _PRE_BLOCK_M), B * H)
    _triton_bwd._bwd_preprocess[pre_grid](
        o, do, lse, delta, lse2,
        o.stride(0), o.stride(1), o.stride(2), do.stride(0), do.stride(1), do.stride(2),
        H, Nq, HEAD_DIM=D, BLOCK_D=consts["BLOCK_D"], BLOCK_M=_PRE_BLOCK_M,
    )
    if dlse is not None:  # d lse_i / d s_ij = P_ij: dS = P (dP - (delta - dlse))
        delta = delta - dlse.to(torch.float32)
    qk_scale = float(scale) * 1.4426950408889634
    common = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
              v.stride(0), v.stride(1), v.stride(2), *ms,
              do.stride(0), do.stride(1), do.stride(2))
    atomic = not deterministic
    # atomic dQ: a float32 (B, H, Nq, D) accumulator, unscaled (zeroed before each launch);
    # else an unused pointer
    dq_acc = torch.empty((B, H, Nq, D), dtype=torch.float32, device=q.device) if atomic else dq
    args_kv = (q, k, v, mptr, do, lse2, delta, dk, dv, dq_acc, *common,
               dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
               H, Hkv, H // Hkv, Nq, Nk, qk_scale, float(scale))
    grid_kv = lambda bm, bn: (triton.cdiv(Nk, bn), B * Hkv)
    bd = consts["BLOCK_D"]
    tma_kv = tma_descriptors({"desc_q": q, "desc_do": do}, {"desc_q": "m", "desc_do": "m"}, bd)
    consts_kv = dict(consts, **_seg_ranges(consts, by_key=True))
    key_kv = (*key, tma_kv is not None)
    cfg_kv = None if config is None else config[0]

    def in_dkdv() -> tuple[Tensor, Tensor, Tensor]:  # dQ by bulk reduce, ordered or not
        return _triton_ordered_bwd.backward(args_kv, grid_kv, consts_kv, key_kv, cfg_kv,
                                            tma_kv, q.dtype, scale, ordered=deterministic)

    def element_atomics() -> tuple[Tensor, Tensor, Tensor]:  # FlashAttention-2's
        launch("dkdv_atomic", _triton_bwd._attn_bwd_dkdv, grid_kv, args_kv,
               dict(consts_kv, DQ_ATOMIC=True), key_kv, cfg_kv, reset=dq_acc.zero_,
               tma=tma_kv, outputs=(dk, dv, dq_acc))
        return (dq_acc * scale).to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)

    def two_kernels() -> tuple[Tensor, Tensor, Tensor]:
        return _bwd_plain(args_kv, grid_kv, consts_kv, key_kv, config, tma_kv, q, k, v, do,
                          mptr, lse2, delta, dq, common, consts, key, scale)

    rival = two_kernels if deterministic else element_atomics
    if _triton_ordered_bwd.applies(consts, q.device, Nq, Nk) and _triton_ordered_bwd.wins(
            (deterministic, *key_kv), q.device, config, in_dkdv, rival):
        return in_dkdv()
    return rival()


def _bwd_plain(args_kv, grid_kv, consts_kv, key_kv, config, tma_kv, q, k, v, do, mptr, lse2,
               delta, dq, common, consts, key, scale) -> tuple[Tensor, Tensor, Tensor]:
    """The 7-matmul deterministic backward (dK/dV, then the dQ pass), as ``bwd`` runs it
    when the ordered dQ is not used: the ordered one's rival in ``_triton_ordered_bwd.wins``."""
    B, H, Nq, D = q.shape
    Hkv = k.shape[1]
    flat = all(t.shape[1] == 1 or t.stride(1) == Nq * t.stride(2) for t in (q, do))
    ws_kv = ws_variant([q, k, v, do], consts, ok=H == Hkv or flat)
    dk, dv = args_kv[7], args_kv[8]
    launch("dkdv", _triton_bwd._attn_bwd_dkdv, grid_kv, args_kv,
           dict(consts_kv, DQ_ATOMIC=False),
           key_kv, None if config is None else config[0], tma=tma_kv, ws=ws_kv,
           outputs=(dk, dv))
    return (_dq_pass(q, k, v, do, mptr, lse2, delta, dq, common, consts, key, scale,
                     None if config is None else config[1]), dk.to(q.dtype), dv.to(q.dtype))


def _dq_pass(q, k, v, do, mptr, lse2, delta, dq, common, consts, key, scale,
             cfg_q) -> Tensor:
    """The deterministic backward's dQ launch (split-KV where few query blocks)."""
    B, H, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    bd = consts["BLOCK_D"]
    qk_scale = float(scale) * 1.4426950408889634
    tma_q = tma_descriptors({"desc_k": k, "desc_v": v}, {"desc_k": "n", "desc_v": "n"}, bd)

    def launch_dq(splits: int, split_n: int) -> Tensor:
        if splits > 1:  # partial dQ per key split (split-KV, as the forward), summed after
            out = torch.empty((B, H, splits, Nq, D), dtype=torch.float32, device=q.device)
            kw = dict(consts, SPLIT=True, split_len=split_n, sdqs=out.stride(2))
        else:
            out, kw = dq, consts
        args_q = (q, k, v, mptr, do, lse2, delta, out, *common,
                  out.stride(0), out.stride(1), out.stride(-2),
                  H, H // Hkv, Nq, Nk, qk_scale, float(scale))
        grid_q = lambda bm, bn: (triton.cdiv(Nq, bm), B * H, splits)
        ws_q = (ws_variant([q, k, v, do], kw, ragged=lambda bm, bn: Nk % bn != 0)
                if splits == 1 else None)
        launch("dq", _triton_bwd._attn_bwd_dq, grid_q, args_q,
               dict(kw, **_seg_ranges(consts)), (*key, tma_q is not None, splits), cfg_q,
               tma=tma_q, ws=ws_q, outputs=(out,))
        return out.sum(2).to(q.dtype) if splits > 1 else out.to(q.dtype)

    return _with_splits(launch_dq, ("dq", *key, tma_q is not None), B * H, Nq, Nk,
                        q.device, cfg_q)


def jvp(q: Tensor, k: Tensor, v: Tensor, tq: Tensor | None, tk: Tensor | None,
        tv: Tensor | None, mask: Tensor | None, causal: bool, scale: float,
        *, window: tuple[int, int] = (-1, -1), segments: tuple[Tensor, Tensor] | None = None,
        softcap: float = 0.0, dropout: float = 0.0, seeds: Tensor | None = None,
        slopes: Tensor | None = None, config: tuple[int, ...] | None = None,
        ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Fused forward-mode: (o, lse, to, tlse) with ``to`` / ``tlse`` the tangents of ``o`` /
    ``lse``; None tangents are 0.

    tq: (B, H, Nq, D) or None; tk, tv: (B, Hkv, Nk, D) or None -> to: (B, H, Nq, D).
    """
    ensure_mode(q.device)
    q, k, v = _c(q), _c(k), _c(v)
    tq, tk, tv = (None if t is None else _c(t) for t in (tq, tk, tv))
    B, H, Hkv, Nq, Nk, D, mptr, ms, consts, key = _common(q, k, mask, causal, scale, window,
                                                          segments, softcap, dropout, seeds,
                                                          slopes)
    if B * H * Nq == 0 or Nk == 0:
        o, lse = _empty_fwd(q)
        return o, lse, torch.zeros_like(o), torch.zeros_like(lse)
    o = torch.empty((B, H, Nq, D), dtype=_buf_dtype(q.dtype), device=q.device)
    to = torch.empty_like(o)
    lse = torch.empty((B, H, Nq), dtype=torch.float32, device=q.device)
    tlse = torch.empty_like(lse)
    tq_, tk_, tv_ = (q if tq is None else tq), (k if tk is None else tk), (v if tv is None else tv)
    args = (q, k, v, tq_, tk_, tv_, mptr, o, lse, to, tlse,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            tq_.stride(0), tq_.stride(1), tq_.stride(2), tk_.stride(0), tk_.stride(1),
            tk_.stride(2), tv_.stride(0), tv_.stride(1), tv_.stride(2),
            *ms, o.stride(0), o.stride(1), o.stride(2), to.stride(0), to.stride(1), to.stride(2),
            H, H // Hkv, Nq, Nk, float(scale) * 1.4426950408889634, float(scale))
    consts = dict(consts, HAS_TQ=tq is not None, HAS_TK=tk is not None, HAS_TV=tv is not None,
                  **_seg_ranges(consts))
    key = (*key, tq is not None, tk is not None, tv is not None)
    grid = lambda bm, bn: (triton.cdiv(Nq, bm), B * H)
    launch("jvp", _triton_jvp._attn_jvp, grid, args, consts, key, config)
    return o.to(q.dtype), lse, to.to(q.dtype), tlse
