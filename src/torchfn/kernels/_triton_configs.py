"""Launch configs of the Triton attention kernels: the measured tables and the candidate
lists the GPU autotuner tries, in order (no Triton import; ``_triton_launch`` launches them).

A config is ``Config(BLOCK_M, BLOCK_N, warps, stages, tma, overlap, ws)``. Per kernel
and class (dtype and padded head dim, ``_class``), the tuner tries, on sm_90+ with TMA
usable: the TMA list, then the pointer-load list, then the untimed overlap variants
and (opt-in, ``TORCHFN_TRITON_WS=1``) the warp-specialized ones. The first candidate
is the untuned default (``TORCHFN_TRITON_AUTOTUNE=0``).

Example::

    >>> import torch
    >>> _candidates("dq", torch.bfloat16, 128)[0]
    (128, 64, 8, 3)
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch


class Config(NamedTuple):
    """One launch of a kernel: block shape, warps, pipeline stages and variant flags.

    ``tma``: streamed tiles through host tensor descriptors (sm_90+). ``overlap``: the
    kernel's variant that lets the softmax run beside a matmul in flight (``_OVERLAP``).
    ``ws``: the warp-specialized variant (``WARP_SPEC``, kernels in ``_WARP_SPEC``): one
    loop that Triton splits into a TMA producer warpgroup and two consumer warpgroups,
    reading through descriptors it makes itself (so ``tma`` and ``overlap`` are off).
    Compares equal to the plain tuple.
    """

    block_m: int
    block_n: int
    warps: int
    stages: int
    tma: bool = False
    overlap: bool = False
    ws: bool = False


# the constexpr flag that ``Config.overlap`` sets, per kernel
_OVERLAP = {"fwd": "PIPELINE", "dkdv": "EARLY_DP", "dkdv_atomic": "EARLY_DP",
            "dkdv_ordered": "EARLY_DP", "dkdv_reduce": "EARLY_DP"}
# the kernels with a warp-specialized variant (``Config.ws`` sets ``WARP_SPEC``)
_WARP_SPEC = ("fwd", "dkdv", "dq")


# (BLOCK_M, BLOCK_N, num_warps, num_stages). Forward / JVP: query block x key block.
# Backward follows the FA2 Triton tutorial: dK/dV with narrow query blocks and wide key
# blocks, dQ the other way round. Every entry is compiled ahead of time for sm_90 by
# bench/aot_sm90.py (Triton's AOT compiler with the JIT's divisibility-16
# specialisation, then cuobjdump): none spills registers or needs more than the 227 KiB
# of shared memory an H100 / H200 block gets, except where a comment says otherwise
# (fp32 "tf32x3" dots take three MMAs and more registers: some spill with every config).
# That is with Triton 3.9; with 3.6, the H200's, four atomic / TMA dK/dV entries spill
# 8-24 bytes (bench/RESULTS.md) and stay where the sweep, run with 3.6, put them.
# The bf16/fp16 D=64 and D=128 fwd, dK/dV and dQ lists are ordered by the H200 sweep
# (bench/RESULTS.md, `gpu_attention.py --sweep`, N=8192): fastest first. The GPU
# autotuner times the candidates on first use and keeps the fastest; the first entry
# is the untuned default.
_GPU_CONFIGS: dict[str, dict[str, list[tuple[int, int, int, int]]]] = {
    "fwd": {
        "d64": [(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3), (128, 64, 4, 3)],
        # (128, 128, 8, 3) was the fastest pointer config in the sweep; since the scale
        # moved into exp2's FMA (FOLD_SCALE) it spills 16 bytes on sm_90 (255 registers).
        # Kept for the tuner to judge: on sm_90 the TMA configs usually win anyway.
        "d128": [(128, 128, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3), (128, 64, 8, 3)],
        "d256": [(32, 32, 4, 2), (64, 32, 4, 2)],
        "fp32": [(32, 32, 8, 2), (64, 32, 8, 2)],
        "fp32_d128": [(32, 32, 8, 2), (16, 64, 8, 2), (16, 32, 4, 2)],
        "fp32_d256": [(16, 16, 8, 2), (16, 16, 8, 1)],
    },
    "jvp": {
        "d64": [(64, 64, 8, 2), (64, 32, 4, 2)],
        "d128": [(64, 32, 4, 2), (32, 64, 8, 2), (128, 32, 8, 2)],
        "d256": [(16, 32, 8, 2), (16, 16, 4, 2)],
        "fp32": [(16, 32, 4, 2)],
        "fp32_d128": [(16, 32, 4, 2)],  # spills (all tried do): three fp32 accumulators
        "fp32_d256": [(16, 16, 4, 1)],  # spills, as every config tried
    },
    "dkdv": {
        "d64": [(32, 64, 4, 3), (64, 64, 4, 3), (16, 128, 4, 3), (64, 128, 8, 3)],
        "d128": [(32, 64, 4, 3), (32, 128, 8, 3), (16, 64, 4, 3)],
        "d256": [(16, 32, 4, 2), (32, 32, 8, 2), (16, 64, 8, 2)],
        "fp32": [(32, 32, 8, 2), (16, 32, 4, 2)],
        "fp32_d128": [(32, 16, 8, 2), (16, 16, 8, 2)],
        "fp32_d256": [(16, 16, 4, 1)],  # spills, as every config tried
    },
    # dK/dV with the atomic dQ (deterministic=False): one more dot, so other tiles fit.
    "dkdv_atomic": {
        "d64": [(64, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 3)],
        "d128": [(32, 128, 8, 3), (32, 64, 4, 3)],
        "d256": [(16, 32, 8, 2), (32, 32, 8, 2)],
        "fp32": [(32, 32, 8, 2), (16, 32, 4, 2)],
        "fp32_d128": [(32, 16, 8, 2), (16, 16, 8, 2)],
        "fp32_d256": [(16, 16, 4, 1)],  # spills, as every config tried
    },
    # dK/dV with the ordered dQ (deterministic, sm_90+; ``_ordered_dq``): the atomic
    # one's dots, plus a float32 (BLOCK_M, D) tile in shared memory for the bulk reduce.
    # Not timed yet. BLOCK_M <= BLOCK_N everywhere: the causal order then never waits
    # in lockstep. Chosen from sm_90 AOT builds, causal and not, with and without TMA:
    # (64, 128) spills at D=128, and (64, 64) there spills without TMA.
    "dkdv_ordered": {
        "d64": [(64, 128, 8, 3), (32, 64, 4, 3)],
        "d128": [(32, 128, 8, 3), (32, 64, 8, 3)],
        "d256": [(16, 32, 8, 2), (32, 32, 8, 2)],
        "fp32": [(32, 32, 8, 2), (16, 32, 4, 2)],
        "fp32_d128": [(16, 16, 8, 2)],
        "fp32_d256": [(16, 16, 4, 1)],
    },
    "dq": {
        "d64": [(128, 64, 8, 3), (64, 64, 4, 3), (128, 64, 4, 4)],
        "d128": [(128, 64, 8, 3), (64, 32, 4, 3), (64, 64, 4, 3)],
        "d256": [(32, 32, 4, 2), (64, 16, 4, 2)],
        "fp32": [(32, 32, 8, 2)],
        "fp32_d128": [(16, 32, 8, 2), (16, 64, 8, 2), (16, 16, 8, 2)],
        "fp32_d256": [(16, 16, 4, 1)],  # spills, as every config tried
    },
}
# The same kernels with their streamed tiles read through tensor descriptors (TMA,
# sm_90+). Listed only where the H200 sweep measured TMA faster than the best pointer
# config: the forward (D=128: 1.99 ms against 2.23 at N=8192), dK/dV at D=128 (6.87
# against 7.22 ms for the whole backward) and the atomic dK/dV. With TMA usable, these
# come before the pointer configs, so the untuned default is the first TMA entry.
_GPU_TMA_CONFIGS: dict[str, dict[str, list[tuple[int, int, int, int]]]] = {
    "fwd": {
        "d64": [(128, 128, 4, 3), (128, 64, 8, 4), (128, 64, 8, 3)],
        "d128": [(128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 64, 8, 4)],
    },
    "dkdv": {"d128": [(64, 128, 8, 3), (64, 128, 8, 2), (32, 128, 8, 3)]},
    "dkdv_atomic": {
        "d64": [(64, 128, 8, 3), (32, 128, 4, 3)],
        "d128": [(32, 128, 8, 3), (32, 64, 4, 3)],
    },
    "dkdv_ordered": {  # (not timed yet; as above)
        "d64": [(64, 128, 8, 3)],
        "d128": [(32, 128, 8, 3), (64, 64, 8, 3)],
    },
}
for _table in (_GPU_CONFIGS, _GPU_TMA_CONFIGS):  # the bulk reduces without the locks
    _table["dkdv_reduce"] = _table["dkdv_ordered"]  # (deterministic=False): the same tiles
# The overlap variants (forward: PIPELINE, dK/dV: EARLY_DP), as (BLOCK_M, BLOCK_N, warps,
# stages, tma): not timed yet (no GPU since they were written), so the tuner tries them
# last and the untuned default stays a measured config. Chosen around the sweep's
# fastest configs from sm_90 AOT builds with Triton 3.6 (the H200's version) and 3.9:
# no spills, and the SASS issues the exp while a wgmma is in flight
# (`bench/aot_sm90.py --sass`, column `ovl`).
_GPU_OVERLAP_CONFIGS: dict[str, dict[str, list[tuple[int, int, int, int, bool]]]] = {
    "fwd": {
        "d64": [(128, 128, 8, 3, True), (128, 64, 8, 3, True)],
        "d128": [(128, 128, 8, 2, True), (128, 64, 8, 3, True), (128, 64, 8, 4, True)],
    },
    "dkdv": {
        "d64": [(32, 64, 4, 3, False), (64, 64, 4, 3, False), (64, 128, 8, 3, False)],
        "d128": [(32, 64, 4, 3, False), (32, 128, 8, 3, True), (32, 64, 4, 3, True)],
    },
}
# The warp-specialized variants (WARP_SPEC), bf16/fp16, as (BLOCK_M, BLOCK_N, warps,
# stages): not timed yet; tried after everything else, with TORCHFN_TRITON_WS=1 only.
# Triton's Hopper pass turns the 4 warps into 12 (a producer and two consumer
# warpgroups, `setmaxnreg`), and only for these block shapes (e.g. dQ with
# BLOCK_M = 128 fails to compile). Each entry compiles for sm_90 with Triton 3.6 and
# 3.9 without spills, causal or not (`bench/aot_sm90.py --kinds fwd_ws dkdv_ws dq_ws`);
# the dK/dV (64, 128) and (64, 64) tiles spill 16-88 bytes at D=128: left out there.
_GPU_WS_CONFIGS: dict[str, dict[str, list[tuple[int, int, int, int]]]] = {
    "fwd": {
        "d64": [(128, 128, 4, 2), (128, 64, 4, 3)],
        "d128": [(128, 128, 4, 2), (128, 64, 4, 3), (128, 64, 4, 2)],
    },
    "dkdv": {
        "d64": [(64, 128, 4, 2), (64, 128, 4, 3), (32, 128, 4, 3)],
        "d128": [(32, 128, 4, 2), (32, 128, 4, 3)],
    },
    "dq": {
        "d64": [(64, 64, 4, 3), (64, 128, 4, 2)],
        "d128": [(64, 64, 4, 3), (64, 128, 4, 2)],
    },
}
# Interpreter (CPU): few, wide-ish blocks keep the ~5 ms/step interpreter cost down.
_INTERP_CONFIGS: dict[str, tuple[int, int, int, int]] = {
    "fwd": (64, 64, 4, 1),
    "jvp": (64, 64, 4, 1),
    "dkdv": (32, 64, 4, 1),
    "dkdv_atomic": (32, 64, 4, 1),
    "dkdv_ordered": (32, 64, 4, 1),
    "dkdv_reduce": (32, 64, 4, 1),
    "dq": (64, 32, 4, 1),
}
def _class(dtype: torch.dtype, block_d: int) -> str:
    if dtype == torch.float32:
        return "fp32" if block_d <= 64 else ("fp32_d128" if block_d <= 128 else "fp32_d256")
    return "d64" if block_d <= 64 else ("d128" if block_d <= 128 else "d256")


def _candidates(kind: str, dtype: torch.dtype, block_d: int) -> list[tuple[int, int, int, int]]:
    """The pointer-load configs of ``kind`` for this dtype and padded head dim."""
    return _GPU_CONFIGS[kind][_class(dtype, block_d)]


def _tma_candidates(kind: str, dtype: torch.dtype, block_d: int,
                    ) -> list[tuple[int, int, int, int]]:
    """The TMA configs of ``kind`` (empty where TMA was not measured faster)."""
    return _GPU_TMA_CONFIGS.get(kind, {}).get(_class(dtype, block_d), [])


def _overlap_on() -> bool:
    """``TORCHFN_TRITON_OVERLAP``: "1" (default: the tuner also tries the overlap
    variants) or "0" (never: e.g. to time the plain kernels, or to rule a variant out)."""
    value = os.environ.get("TORCHFN_TRITON_OVERLAP", "1").strip() or "1"
    if value not in ("0", "1"):
        raise ValueError(f"TORCHFN_TRITON_OVERLAP must be '0' or '1', got {value!r}")
    return value == "1"


def _overlap_candidates(kind: str, dtype: torch.dtype, block_d: int, mode: str,
                        ) -> list[Config]:
    """The overlap variants to try under TMA ``mode`` ("0": only the pointer-load ones;
    "1": every one reads through descriptors); none with ``TORCHFN_TRITON_OVERLAP=0``."""
    if not _overlap_on():
        return []
    listed = _GPU_OVERLAP_CONFIGS.get(kind, {}).get(_class(dtype, block_d), [])
    out: list[Config] = []
    for *blocks, tma in listed:
        if mode == "0" and tma:
            continue
        cfg = Config(*blocks, tma=tma or mode == "1", overlap=True)
        if cfg not in out:
            out.append(cfg)
    return out


def _ws_on() -> bool:
    """``TORCHFN_TRITON_WS``: "0" (default) or "1" (the tuner also tries the
    warp-specialized variants). Opt-in until a GPU run has timed them: they rest on a
    young Triton pass, and where the tuner can catch a wrong result (it checks each
    candidate's), it cannot catch a hang."""
    value = os.environ.get("TORCHFN_TRITON_WS", "0").strip() or "0"
    if value not in ("0", "1"):
        raise ValueError(f"TORCHFN_TRITON_WS must be '0' or '1', got {value!r}")
    return value == "1"


def _ws_candidates(kind: str, dtype: torch.dtype, block_d: int) -> list[Config]:
    """The warp-specialized variants to try: bf16/fp16 at D <= 128, and only with
    ``TORCHFN_TRITON_WS=1``."""
    if not _ws_on() or dtype == torch.float32:
        return []
    listed = _GPU_WS_CONFIGS.get(kind, {}).get(_class(dtype, block_d), [])
    return [Config(*c, ws=True) for c in listed]


def _as_config(kind: str, config: tuple, mode: str) -> Config:
    """An explicit ``config=`` (4 to 7 entries) as a ``Config``; a 4-tuple uses TMA only
    under ``TORCHFN_TRITON_TMA=1``."""
    if not 4 <= len(config) <= 7:
        raise ValueError("config must be (BLOCK_M, BLOCK_N, num_warps, num_stages[, tma"
                         f"[, overlap[, ws]]]), got {tuple(config)!r}")
    ws = bool(config[6]) if len(config) > 6 else False
    cfg = Config(*config[:4], tma=bool(config[4]) if len(config) > 4 else mode == "1" and not ws,
                 overlap=bool(config[5]) if len(config) > 5 else False, ws=ws)
    if cfg.overlap and kind not in _OVERLAP:
        raise ValueError(f"config: the {kind!r} kernel has no overlap variant (only "
                         f"{', '.join(_OVERLAP)})")
    if cfg.ws and kind not in _WARP_SPEC:
        raise ValueError(f"config: the {kind!r} kernel has no warp-specialized variant "
                         f"(only {', '.join(_WARP_SPEC)})")
    if cfg.ws and (cfg.tma or cfg.overlap):
        raise ValueError("config: ws (warp specialization) makes its own descriptors and "
                         f"excludes tma and overlap, got {tuple(config)!r}")
    return cfg


def _tma_mode() -> str:
    """``TORCHFN_TRITON_TMA``: "auto" (default: tune over TMA and pointer configs), "1"
    (TMA wherever usable, e.g. to test it) or "0" (pointer loads only)."""
    mode = os.environ.get("TORCHFN_TRITON_TMA", "auto").strip().lower() or "auto"
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"TORCHFN_TRITON_TMA must be 'auto', '0' or '1', got {mode!r}")
    return mode
