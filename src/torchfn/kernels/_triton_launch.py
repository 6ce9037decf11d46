"""How a Triton attention kernel is launched: which block config, tuned how, and which
variants may join the tuning (no kernels here; ``_triton_ops`` builds the arguments).

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
config's by more than rounding. A whole variant of an op (split-KV, the ordered dQ) is
kept only where ``checked_and_faster`` found it both right and faster.

Example (GPU; ``kernel`` is a ``@triton.jit`` function, ``grid(BLOCK_M, BLOCK_N)`` its
launch grid)::

    launch("fwd", kernel, grid, args, consts, key, config=None, outputs=(o, lse))
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
import triton.language as tl

from torchfn.kernels import _triton_bwd, _triton_configs, _triton_fwd, _triton_jvp, _tune_cache
from torchfn.kernels._triton_configs import (
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

_TUNED: dict[tuple, Config] = {}


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


def ensure_mode(device: torch.device) -> None:
    """Match the kernels to ``TRITON_INTERPRET`` now (re-defining them if it changed since import).

    Triton decides interpreted vs compiled when ``@triton.jit`` runs, so a test module that
    sets the variable after another module imported these kernels still gets the interpreter.
    """
    want = _env_interpret()
    if want != is_interpreted():
        for module in (_triton_fwd, _triton_bwd, _triton_jvp):  # in place
            importlib.reload(module)
    if device.type == "cpu" and not want:
        raise RuntimeError(
            "Triton attention kernels got CPU tensors but TRITON_INTERPRET is not '1': "
            "set TRITON_INTERPRET=1 to run them in the Triton interpreter, or use the torch "
            "backend"
        )


def autotune_enabled() -> bool:
    return os.environ.get("TORCHFN_TRITON_AUTOTUNE", "1") != "0"


def kernel_args(consts: dict[str, Any]) -> dict[str, Any]:
    """``consts`` without the host-side entries (leading underscore)."""
    return {n: v for n, v in consts.items() if not n.startswith("_")}


def launch(kind: str, kernel: Any, grid: Callable[[int, int], tuple[int, ...]],
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
    results on (``tune``). ``extra(config, compile)``: more keyword arguments per
    config; ``compile(**kwargs)`` gives the compiled kernel they would launch (GPU only).
    """
    mode = _tma_mode() if tma is not None else "0"
    kargs = kernel_args(consts)

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
        run(Config(*_triton_configs._INTERP_CONFIGS[kind], tma=mode == "1"))
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
    tuning = autotune_enabled() and len(cands) > 1
    if cfg is None and tuning:  # picked by an earlier process on this GPU and software
        cfg = _tune_cache.lookup(args[0].device, full_key, cands)
        if cfg is not None:
            _TUNED[full_key] = cfg
    if cfg is not None:
        run(cfg)
    elif tuning:
        _TUNED[full_key] = cfg = tune(run, cands, outputs, kind)
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


def rel_err(got: Tensor, ref: Tensor) -> float:
    """``|got - ref| / |ref|`` in float64 (inf when ``got`` is non-finite where ``ref`` is not)."""
    got, ref = got.double(), ref.double()
    fin = torch.isfinite(ref)
    if not torch.isfinite(got[fin]).all():
        return math.inf
    return float((got - ref)[fin].norm() / ref[fin].norm().clamp_min(1e-30))


def tune(run: Callable, cands: list[Config], outputs: tuple[Tensor, ...] = (),
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

    Every kernel here overwrites all of its outputs or is reset first (``launch``'s
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
            err = max((rel_err(t, r) for t, r in zip(outputs, ref[1])), default=0.0)
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


def checked_and_faster(variant: Callable[[], Any], rival: Callable[[], Any], what: str,
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
    err = max(rel_err(g, r) for g, r in zip(got, ref))
    why = failed() or (f"results {err:.1e} off (relative)" if err > tol else None)
    if why:
        warnings.warn(f"torchfn: {what} failed its check ({why}); not used", RuntimeWarning,
                      stacklevel=4)
        return False
    t_variant, t_rival = (do_bench(fn, warmup=10, rep=25, return_mode="median")
                          for fn in (variant, rival))
    return t_variant < t_rival


def tma_descriptors(names_tensors: dict[str, Tensor], rows: dict[str, str], block_d: int,
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
    if not descriptors_usable(list(names_tensors.values())):
        return None

    def make(bm: int, bn: int) -> dict[str, Any]:
        kw: dict[str, Any] = {"USE_TMA": True}
        for name, t in names_tensors.items():
            r = bm if rows[name] == "m" else bn
            kw[name] = TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, r, block_d])
        return kw

    return make


def descriptors_usable(tensors: list[Tensor]) -> bool:
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


def ws_variant(tensors: list[Tensor], consts: dict[str, Any], ok: bool = True,
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
            and hasattr(tl, "make_tensor_descriptor") and descriptors_usable(tensors)):
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
