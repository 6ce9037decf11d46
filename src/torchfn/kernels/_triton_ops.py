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

Block sizes (the tables and candidate lists are in ``_triton_configs``): on a GPU every
kernel is tuned once per (kernel, N bucket, head dim, causal, mask kind, dtype) over a
handful of configs (``TORCHFN_TRITON_AUTOTUNE=0`` uses the first, measured config),
and the pick is kept on disk for later processes (``_tune_cache``:
``TORCHFN_TRITON_TUNE_CACHE``, a directory, default ``~/.cache/torchfn/tuning``; ``0``: off).
Under ``TRITON_INTERPRET=1`` (CPU) one small fixed config is used. On sm_90+ the tuner
also tries the kernels with their streamed tiles read through tensor descriptors (TMA),
where the H200 sweep found that faster (``TORCHFN_TRITON_TMA``: "auto" default, "0"
never, "1" always; the interpreter uses TMA only with "1"). The overlap variants (the
forward's ``PIPELINE``, dK/dV's ``EARLY_DP``) are tried last, not yet timed
(``TORCHFN_TRITON_OVERLAP=0`` leaves them out), and after them, opt-in with
``TORCHFN_TRITON_WS=1``, the warp-specialized ones (``WARP_SPEC``: forward, dK/dV, dQ;
see their modules). The tuner skips any candidate whose results differ from the first
config's by more than rounding. A forward or dQ launch with too few query blocks to
fill the GPU (decoding) may split its keys (``SPLIT``, ``_split_kv``: FlashAttention-2's
wave rule proposes a split count, the tuner times split against unsplit once per shape
class and keeps the faster; ``TORCHFN_TRITON_SPLIT_KV``: "auto", "0" never, N forces N
splits, the only way the interpreter splits); one launch of ``_triton_merge`` merges the
forward's pieces by lse, and dQ's are summed. On sm_90+ the deterministic backward may
add dQ inside the dK/dV launch in a fixed order (the ordered dQ, ``_ordered_dq``; timed
against the 7-matmul backward once per shape class with Nq >= Nk;
``TORCHFN_TRITON_ORDERED_DQ``: "auto", "0", "1" = always, the interpreter's only way).
fp32 dots never use plain TF32: 3xTF32
("tf32x3") on the GPU, overridable with ``TORCHFN_TRITON_FP32_PRECISION=ieee``; exact
in the interpreter.

Example (GPU)::

    q = torch.randn(2, 8, 1024, 64, device="cuda", dtype=torch.bfloat16)
    o, lse = fwd(q, q, q, None, True, 64 ** -0.5)
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from torchfn.kernels import (
    _dropout,
    _ordered_dq,
    _split_kv,
    _triton_bwd,
    _triton_fwd,
    _triton_jvp,
    _triton_merge,
    _tune_cache,
)
from torchfn.kernels._triton_configs import (
    _INTERP_CONFIGS,
    _OVERLAP,
    Config,
    _as_config,
    _candidates,
    _overlap_candidates,
    _overlap_on,
    _tma_candidates,
    _tma_mode,
    _ws_candidates,
)

Tensor = torch.Tensor

__all__ = ["fwd", "bwd", "jvp", "tuned_configs", "is_interpreted"]


_PRE_BLOCK_M = 64  # preprocess kernel (delta, lse2)
_MAX_BLOCK_N = 128  # the widest key block of the GPU config tables (split-KV runs align)
_TUNED: dict[tuple, Config] = {}
_SPLIT_PICKS: dict[tuple, bool] = {}  # forward / dQ shape class -> split-KV timed faster


def tuned_configs() -> dict[tuple, Config]:
    """The configs the GPU autotuner picked so far: key -> ``Config``
    (BLOCK_M, BLOCK_N, warps, stages, tma, overlap, ws)."""
    return dict(_TUNED)


def is_interpreted() -> bool:
    """True when the kernels were defined under ``TRITON_INTERPRET=1`` (they run on CPU)."""
    return type(_triton_fwd._attn_fwd).__name__ == "InterpretedFunction"


def _env_interpret() -> bool:
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):  # older Triton: plain env var
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _ensure_mode(device: torch.device) -> None:
    """Match the kernels to ``TRITON_INTERPRET`` now (re-defining them if it changed since import).

    Triton decides interpreted vs compiled when ``@triton.jit`` runs, so a test module that
    sets the variable after another module imported these kernels still gets the interpreter.
    """
    global _triton_bwd, _triton_fwd, _triton_jvp
    want = _env_interpret()
    if want != is_interpreted():
        _triton_fwd = importlib.reload(_triton_fwd)
        _triton_bwd = importlib.reload(_triton_bwd)
        _triton_jvp = importlib.reload(_triton_jvp)
    if device.type == "cpu" and not want:
        raise RuntimeError(
            "Triton attention kernels got CPU tensors but TRITON_INTERPRET is not '1': "
            "set TRITON_INTERPRET=1 to run them in the Triton interpreter, or use the torch "
            "backend"
        )


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _bucket(n: int) -> int:
    return min(max(triton.next_power_of_2(max(n, 1)), 256), 16384)


def _autotune_enabled() -> bool:
    return os.environ.get("TORCHFN_TRITON_AUTOTUNE", "1") != "0"


def _launch(kind: str, kernel: Any, grid: Callable[[int, int], tuple[int, ...]],
            args: tuple, consts: dict[str, Any], key: tuple,
            config: tuple[int, ...] | None,
            reset: Callable[[], None] | None = None,
            tma: Callable[[int, int], dict[str, Any]] | None = None,
            ws: Callable[[int, int], dict[str, Any]] | None = None,
            outputs: tuple[Tensor, ...] = (),
            extra: Callable[[Config, Callable[..., Any]], dict[str, Any]] | None = None,
            ) -> None:
    """Launch ``kernel`` with a block config: given, interpreter-fixed, tuned or default.

    A config is (BLOCK_M, BLOCK_N, num_warps, num_stages[, tma[, overlap[, ws]]]) (see
    ``Config``); a given 4-tuple uses TMA only under ``TORCHFN_TRITON_TMA=1``. ``reset``
    runs before every launch, for kernels that accumulate into an output (atomics): the
    tuner launches a kernel many times. ``tma(BLOCK_M, BLOCK_N)`` gives the
    tensor-descriptor keyword arguments (None: TMA off or unusable for these tensors);
    ``ws(BLOCK_M, BLOCK_N)`` those of the warp-specialized variant (None: unusable).
    ``outputs``: what the kernel writes, which the tuner checks each candidate's
    results on (``_tune``). ``extra(config, compile)``: more keyword arguments per
    config; ``compile(**kwargs)`` gives the compiled kernel they would launch (GPU only).
    """
    mode = _tma_mode() if tma is not None else "0"
    kargs = _kernel_args(consts)

    def run(cfg: Config) -> None:
        if reset is not None:
            reset()
        bm, bn, warps, stages, use_tma, overlap, use_ws = cfg
        kw = tma(bm, bn) if use_tma and tma is not None else {}
        if overlap:
            kw = dict(kw, **{_OVERLAP[kind]: True})
        if use_ws:
            if ws is None:
                raise ValueError(
                    f"config: the warp-specialized {kind} kernel needs fp16/bf16 on sm_90+ "
                    "(or the interpreter), no mask, window, softcap or dropout, 16-byte aligned "
                    "heads "
                    "and rows"
                    + (", scale > 0" if kind == "fwd" else "")
                    + (", and with GQA each head's rows right after the previous head's"
                       if kind == "dkdv" else "")
                    + f"; got {cfg!r} for inputs that do not qualify")
            kw = dict(kw, **ws(bm, bn))
        if extra is not None:
            kw = dict(kw, **extra(cfg, lambda **more: kernel.warmup(
                *args, **kargs, **kw, **more, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
                num_stages=stages, grid=grid(bm, bn))))
        with _scratch_allocator(args[0].device) if use_ws else contextlib.nullcontext():
            if is_interpreted():
                kernel[grid(bm, bn)](*args, **kargs, **kw, BLOCK_M=bm, BLOCK_N=bn)
            else:
                kernel[grid(bm, bn)](*args, **kargs, **kw, BLOCK_M=bm, BLOCK_N=bn,
                                     num_warps=warps, num_stages=stages)

    if config is not None:
        run(_as_config(kind, config, mode))
        return
    if is_interpreted():
        run(Config(*_INTERP_CONFIGS[kind], tma=mode == "1"))
        return
    dtype, bd = args[0].dtype, consts["BLOCK_D"]
    ptr, tmas = _candidates(kind, dtype, bd), _tma_candidates(kind, dtype, bd)
    if mode == "0":
        cands = [Config(*c) for c in ptr]
    elif mode == "1":  # TMA only: its own list, else the pointer configs with TMA loads
        cands = [Config(*c, tma=True) for c in (tmas or ptr)]
    else:
        cands = [Config(*c, tma=True) for c in tmas] + [Config(*c) for c in ptr]
    cands += _overlap_candidates(kind, dtype, bd, mode)  # untimed variants: last
    ws_cands = _ws_candidates(kind, dtype, bd) if ws is not None else []
    cands += ws_cands
    full_key = (kind, *key, bool(ws_cands), _overlap_on(), mode)
    cfg = _TUNED.get(full_key)
    tune = _autotune_enabled() and len(cands) > 1
    if cfg is None and tune:  # picked by an earlier process on this GPU and software
        cfg = _tune_cache.lookup(args[0].device, full_key, cands)
        if cfg is not None:
            _TUNED[full_key] = cfg
    if cfg is not None:
        run(cfg)
    elif tune:
        _TUNED[full_key] = cfg = _tune(run, cands, outputs, kind)
        _tune_cache.record(args[0].device, full_key, cfg)
        run(cfg)
    else:  # untuned: the first config this GPU can hold (less shared memory than an H100's)
        from triton.runtime.errors import OutOfResources

        for i, cfg in enumerate(cands):
            try:
                run(cfg)
            except OutOfResources:
                if i == len(cands) - 1:
                    raise
                continue
            _TUNED[full_key] = cfg
            break


@contextlib.contextmanager
def _scratch_allocator(device: torch.device):
    """Descriptors made inside a kernel (the warp-specialized variants) live in a small
    global scratch buffer that Triton asks ``triton.set_allocator``'s allocator for.
    When the caller set none, lend torch's caching allocator for this launch only."""
    try:
        from triton.runtime import _allocation

        var = _allocation._allocator
        unset = isinstance(var.get(), _allocation.NullAllocator)
    except (ImportError, AttributeError):  # another Triton: its own error if it needs one
        unset = False
    if not unset or device.type != "cuda":
        yield
        return
    token = var.set(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8,
                                                                device=device))
    try:
        yield
    finally:
        var.reset(token)


def _rel_err(got: Tensor, ref: Tensor) -> float:
    """``|got - ref| / |ref|`` in float64 (inf when ``got`` is non-finite where ``ref`` is not)."""
    got, ref = got.double(), ref.double()
    fin = torch.isfinite(ref)
    if not torch.isfinite(got[fin]).all():
        return math.inf
    return float((got - ref)[fin].norm() / ref[fin].norm().clamp_min(1e-30))


def _tune(run: Callable, cands: list[Config], outputs: tuple[Tensor, ...] = (),
          kind: str = "") -> Config:
    """Time each config (compiling it first); configs that fail to compile/launch are skipped.

    Configs whose results differ from the first config's (the measured default) by more
    than rounding (``|d| / |ref|`` > 2e-2 for fp16/bf16, 1e-4 for fp32, in any of
    ``outputs``) are skipped with a warning: the untimed variants rely on Triton passes
    (warp specialization on Hopper) that are young, and a miscompiled kernel must never
    win on speed.

    An idle GPU starts at a low clock (the H200 idled at 345 MHz) and ramps up under
    load, which can favour the configs timed last; on the H200 the tuner kept configs up
    to 5% slower than the sweep's best at the same shape. So the first config runs a
    warm-up, and the candidates are timed in two rounds, in list order and then
    reversed, keeping each config's faster median.

    Every kernel here overwrites all of its outputs or is reset first (``_launch``'s
    ``reset``), so re-running it is harmless.
    """
    from triton.testing import do_bench

    def timed(cfg) -> float:
        return do_bench(lambda: run(cfg), warmup=10, rep=25, return_mode="median")

    ok, last_err, ref = [], None, None
    for cfg in cands:
        try:
            run(cfg)  # compiles it
        except Exception as err:  # noqa: BLE001 - out of shared memory / registers, ...
            last_err = err
            continue
        if ref is None:
            ref = (cfg, [t.clone() for t in outputs])
        else:
            tol = 1e-4 if outputs and outputs[0].dtype == torch.float32 else 2e-2
            err = max((_rel_err(t, r) for t, r in zip(outputs, ref[1])), default=0.0)
            if err > tol:
                warnings.warn(f"torchfn: Triton attention {kind} config {tuple(cfg)} gave "
                              f"results {err:.1e} off those of {tuple(ref[0])} (relative); "
                              "skipped", RuntimeWarning, stacklevel=2)
                continue
        ok.append(cfg)
    if not ok:
        raise RuntimeError(f"no Triton attention config could run: {last_err}") from last_err
    if len(ok) == 1:
        return ok[0]
    do_bench(lambda: run(ok[0]), warmup=50, rep=1)  # bring the clocks up first
    times = {cfg: timed(cfg) for cfg in ok}
    for cfg in reversed(ok):
        times[cfg] = min(times[cfg], timed(cfg))
    return min(ok, key=times.get)


# --------------------------------------------------------------------------- helpers
def _tma_descriptors(names_tensors: dict[str, Tensor], rows: dict[str, str], block_d: int,
                     ) -> Callable[[int, int], dict[str, Any]] | None:
    """Tensor-descriptor (TMA) kwargs per block shape, or None when TMA is off or unusable.

    TMA needs sm_90+ (or the interpreter, where only ``TORCHFN_TRITON_TMA=1`` uses it),
    triton's host ``TensorDescriptor``, 16-byte aligned base pointers and strides, and a
    contiguous last dim. ``rows`` maps each descriptor name to "m" or "n": its tile has
    BLOCK_M or BLOCK_N rows.
    """
    mode = _tma_mode()
    if mode == "0" or (mode == "auto" and is_interpreted()):
        return None
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    if not _descriptors_usable(list(names_tensors.values())):
        return None

    def make(bm: int, bn: int) -> dict[str, Any]:
        kw: dict[str, Any] = {"USE_TMA": True}
        for name, t in names_tensors.items():
            r = bm if rows[name] == "m" else bn
            kw[name] = TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, r, block_d])
        return kw

    return make


def _descriptors_usable(tensors: list[Tensor]) -> bool:
    """Tensor descriptors (TMA) can read these: sm_90+ (or the interpreter), 16-byte
    aligned base pointers and strides, and a contiguous last dim."""
    dev = tensors[0].device
    if not is_interpreted() and (dev.type != "cuda"
                                 or torch.cuda.get_device_capability(dev)[0] < 9):
        return False
    for t in tensors:
        step = 16 // t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(
                st % step or st == 0 for st, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1):
            return False
    return True


def _ws_variant(tensors: list[Tensor], consts: dict[str, Any], ok: bool = True,
                ragged: Callable[[int, int], bool] | None = None,
                ) -> Callable[[int, int], dict[str, Any]] | None:
    """The warp-specialized variant's kwargs per block shape, or None where it does not
    apply: a user mask, a window or segments, a softcap, dropout, ALiBi, ``ok`` False
    (kernel-specific conditions), tensors descriptors cannot read, fp32 on a GPU (its
    3xTF32 dots), or a Triton without in-kernel descriptors. Whether the tuner tries it
    is ``TORCHFN_TRITON_WS``'s call.
    ``ragged(BLOCK_M, BLOCK_N)``: whether a non-causal launch still needs the bounds
    mask on every block (``WS_MASKED``)."""
    if not (ok and consts["MASK_KIND"] == 0 and not consts.get("WINDOW")
            and not consts.get("SOFTCAP") and not consts.get("DROPOUT")
            and not consts.get("ALIBI")
            and hasattr(tl, "make_tensor_descriptor") and _descriptors_usable(tensors)):
        return None
    if any(t.stride(2) % (16 // t.element_size()) for t in tensors):  # even with one row:
        return None  # the per-head descriptor's row stride
    if tensors[0].dtype == torch.float32 and not is_interpreted():
        return None

    def make(bm: int, bn: int) -> dict[str, Any]:
        kw: dict[str, Any] = {"WARP_SPEC": True}
        if ragged is not None:
            kw["WS_MASKED"] = consts["IS_CAUSAL"] or ragged(bm, bn)
        return kw

    return make


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


def _kernel_args(consts: dict[str, Any]) -> dict[str, Any]:
    """``consts`` without the host-side entries (leading underscore)."""
    return {n: v for n, v in consts.items() if not n.startswith("_")}


def _empty_fwd(q: Tensor) -> tuple[Tensor, Tensor]:
    B, H, Nq, _ = q.shape
    o = torch.zeros_like(q, memory_format=torch.contiguous_format)
    lse = torch.full((B, H, Nq), float("-inf"), dtype=torch.float32, device=q.device)
    return o, lse


# --------------------------------------------------------------------------- raw ops
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
    _ensure_mode(q.device)
    q, k, v = _c(q), _c(k), _c(v)
    B, H, Hkv, Nq, Nk, D, mptr, ms, consts, key = _common(q, k, mask, causal, scale, window,
                                                          segments, softcap, dropout, seeds,
                                                          slopes)
    if B * H * Nq == 0 or Nk == 0:
        return _empty_fwd(q)
    # scale > 0 and no additive mask: the kernel takes the row max of the raw scores
    consts = dict(consts, FOLD_SCALE=float(scale) > 0 and consts["MASK_KIND"] != 2
                  and softcap <= 0 and slopes is None, **_seg_ranges(consts))
    tma = _tma_descriptors({"desc_q": q, "desc_k": k, "desc_v": v},
                           {"desc_q": "m", "desc_k": "n", "desc_v": "n"}, consts["BLOCK_D"])

    def launch(splits: int, split_n: int) -> tuple[Tensor, Tensor]:
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
        ws = _ws_variant([q, k, v], kw, ok=kw["FOLD_SCALE"] and splits == 1,
                         ragged=lambda bm, bn: Nk % bn != 0)
        _launch("fwd", _triton_fwd._attn_fwd, grid, args, kw,
                (*key, tma is not None, splits), config, tma=tma, ws=ws, outputs=(o, lse))
        if splits > 1:
            return _merge(o, lse, q.dtype)
        return o.to(q.dtype), lse

    return _with_splits(launch, ("fwd", *key, tma is not None), B * H, Nq, Nk, q.device,
                        config)


def _with_splits(launch: Callable[[int, int], Any], key: tuple, programs: int, Nq: int,
                 Nk: int, device: torch.device, config: tuple[int, ...] | None) -> Any:
    """``launch(splits, keys per split)`` (a forward or dQ) at the split count ``_splits``
    proposes, or unsplit where the tuner timed the split slower (``_split_wins``)."""
    splits, split_n = _splits(programs, Nq, Nk, device, config)
    if splits > 1 and not _split_wins((*key, splits), device, config,
                                      lambda: launch(splits, split_n), lambda: launch(1, Nk)):
        splits, split_n = 1, Nk
    return launch(splits, split_n)


def _split_wins(key: tuple, device: torch.device, config: tuple[int, ...] | None,
                split: Callable[[], Any], whole: Callable[[], Any]) -> bool:
    """Whether the split-KV kernel (forward or dQ) runs for this shape class: once per
    process on a GPU with the tuner on, the split and unsplit launches are timed (each
    after its own config tuning) and the faster kept, as for any untimed variant; the
    split one must first give the same outputs (o and lse, or dq) to rounding. Without
    the tuner (or with a forced split count, or an explicit config), the heuristic's
    split stands."""
    if (not _autotune_enabled() or device.type != "cuda" or config is not None
            or _split_kv.mode() != "auto"):
        return True
    if key not in _SPLIT_PICKS:
        _SPLIT_PICKS[key] = _checked_and_faster(split, whole, "a split-KV Triton kernel")
    return _SPLIT_PICKS[key]


def _checked_and_faster(variant: Callable[[], Any], rival: Callable[[], Any], what: str,
                        failed: Callable[[], str | None] = lambda: None) -> bool:
    """Whether ``variant`` may replace ``rival``: both run (each compiling and tuning its
    kernels), their outputs must agree to rounding (``|d| / |ref|`` <= 1e-4 for fp32,
    2e-2 for fp16 / bf16) and ``failed()`` must find nothing, else a warning names
    ``what`` and the variant is not used; then both are timed and the faster wins."""
    from triton.testing import do_bench

    def outputs(fn: Callable[[], Any]) -> tuple[Tensor, ...]:
        out = fn()
        return out if isinstance(out, tuple) else (out,)

    ref = [t.clone() for t in outputs(rival)]  # (a rival may share buffers with the variant)
    got = outputs(variant)
    tol = 1e-4 if ref[0].dtype == torch.float32 else 2e-2
    err = max(_rel_err(g, r) for g, r in zip(got, ref))
    why = failed() or (f"results {err:.1e} off (relative)" if err > tol else None)
    if why:
        warnings.warn(f"torchfn: {what} failed its check ({why}); not used", RuntimeWarning,
                      stacklevel=4)
        return False
    t_variant, t_rival = (do_bench(fn, warmup=10, rep=25, return_mode="median")
                          for fn in (variant, rival))
    return t_variant < t_rival


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
             else _INTERP_CONFIGS["fwd"][1] if is_interpreted() else _MAX_BLOCK_N)
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
    _ensure_mode(q.device)
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
    tma_kv = _tma_descriptors({"desc_q": q, "desc_do": do}, {"desc_q": "m", "desc_do": "m"}, bd)
    consts_kv = dict(consts, **_seg_ranges(consts, by_key=True))
    key_kv = (*key, tma_kv is not None)
    cfg_kv = None if config is None else config[0]

    def in_dkdv() -> tuple[Tensor, Tensor, Tensor]:  # dQ by bulk reduce, ordered or not
        return _bwd_ordered(args_kv, grid_kv, consts_kv, key_kv, cfg_kv, tma_kv, q.dtype,
                            scale, ordered=deterministic)

    def element_atomics() -> tuple[Tensor, Tensor, Tensor]:  # FlashAttention-2's
        _launch("dkdv_atomic", _triton_bwd._attn_bwd_dkdv, grid_kv, args_kv,
                dict(consts_kv, DQ_ATOMIC=True), key_kv, cfg_kv, reset=dq_acc.zero_,
                tma=tma_kv, outputs=(dk, dv, dq_acc))
        return (dq_acc * scale).to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)

    def two_kernels() -> tuple[Tensor, Tensor, Tensor]:
        return _bwd_plain(args_kv, grid_kv, consts_kv, key_kv, config, tma_kv, q, k, v, do,
                          mptr, lse2, delta, dq, common, consts, key, scale)

    rival = two_kernels if deterministic else element_atomics
    if _ordered_applies(consts, q.device, Nq, Nk) and _ordered_wins(
            (deterministic, *key_kv), q.device, config, in_dkdv, rival):
        return in_dkdv()
    return rival()


def _bwd_plain(args_kv, grid_kv, consts_kv, key_kv, config, tma_kv, q, k, v, do, mptr, lse2,
               delta, dq, common, consts, key, scale) -> tuple[Tensor, Tensor, Tensor]:
    """The 7-matmul deterministic backward (dK/dV, then the dQ pass), as ``bwd`` runs it
    when the ordered dQ is not used: the ordered one's rival in ``_ordered_wins``."""
    B, H, Nq, D = q.shape
    Hkv = k.shape[1]
    flat = all(t.shape[1] == 1 or t.stride(1) == Nq * t.stride(2) for t in (q, do))
    ws_kv = _ws_variant([q, k, v, do], consts, ok=H == Hkv or flat)
    dk, dv = args_kv[7], args_kv[8]
    _launch("dkdv", _triton_bwd._attn_bwd_dkdv, grid_kv, args_kv, dict(consts_kv, DQ_ATOMIC=False),
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
    tma_q = _tma_descriptors({"desc_k": k, "desc_v": v}, {"desc_k": "n", "desc_v": "n"}, bd)

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
        ws_q = (_ws_variant([q, k, v, do], kw, ragged=lambda bm, bn: Nk % bn != 0)
                if splits == 1 else None)
        _launch("dq", _triton_bwd._attn_bwd_dq, grid_q, args_q,
                dict(kw, **_seg_ranges(consts)), (*key, tma_q is not None, splits), cfg_q,
                tma=tma_q, ws=ws_q, outputs=(out,))
        return out.sum(2).to(q.dtype) if splits > 1 else out.to(q.dtype)

    return _with_splits(launch_dq, ("dq", *key, tma_q is not None), B * H, Nq, Nk,
                        q.device, cfg_q)


# --------------------------------------------------------------------------- ordered dQ
_ORDER_PICKS: dict[tuple, bool] = {}  # (deterministic, dK/dV shape class) -> the bulk
# reduces inside dK/dV timed faster than their rival
_WAVES: dict[tuple, int] = {}  # (config, query blocks, key blocks, device) -> wave size
_LAST_LOCKS: list[Tensor] = []  # the last ordered launch's counters ([1]: a wait gave up)


def _ordered_applies(consts: dict[str, Any], device: torch.device, Nq: int, Nk: int) -> bool:
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


def _ordered_wins(key: tuple, device: torch.device, config: Any,
                  ordered: Callable[[], Any], plain: Callable[[], Any]) -> bool:
    """Whether dQ is added inside dK/dV by bulk reduces for this shape class (``key[0]``:
    deterministic, so in turn; else in any order). "1": always. "auto": on a GPU with
    the tuner on, once per process that backward and its rival (``plain``: the 7-matmul
    one, or element atomics) are run (each tuned), must agree to rounding, and the
    faster is kept; without the tuner (or with an explicit config) the measured rival
    stays."""
    if _ordered_dq.mode() == "1":
        return True
    if not _autotune_enabled() or device.type != "cuda" or config is not None:
        return False
    if key not in _ORDER_PICKS:
        _ORDER_PICKS[key] = _checked_and_faster(
            ordered, plain, f"the {'ordered-dQ' if key[0] else 'bulk-reduce dQ'} Triton backward",
            lambda: ("a wait timed out" if _LAST_LOCKS and _LAST_LOCKS[0][1].item() else None))
    return _ORDER_PICKS[key]


def _bwd_ordered(args_kv: tuple, grid_kv: Callable, consts_kv: dict[str, Any], key_kv: tuple,
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
    _launch("dkdv_ordered" if ordered else "dkdv_reduce", _triton_bwd._attn_bwd_dkdv, grid_kv,
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
    _ensure_mode(q.device)
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
    _launch("jvp", _triton_jvp._attn_jvp, grid, args, consts, key, config)
    return o.to(q.dtype), lse, to.to(q.dtype), tlse
