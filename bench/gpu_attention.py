#!/usr/bin/env python
"""GPU check and benchmark of torchfn's Triton FlashAttention-2 kernels.

Run from the repository root on a CUDA machine (needs only torch + triton)::

    PYTHONPATH=src python bench/gpu_attention.py --out bench/gpu_attention.json

Smoke test of the script itself on CPU (Triton interpreter, tiny sizes, no GPU)::

    PYTHONPATH=src python bench/gpu_attention.py --dry-run --out /tmp/gpu_attention_dry.json

Phases, each in its own process so that one crash (a CUDA fault poisons its
process) cannot take the others down; every result is written as it comes:

1. ``warm``: parallel workers compile every Triton config the benchmark may
   pick into Triton's disk cache and run the correctness cases (raw fwd / bwd /
   jvp vs a float64 reference: fp32 relative error <= 1e-5, fp16 / bf16 <= 2x
   SDPA's error in the same dtype); one more worker pre-compiles FlexAttention.
2. ``bench``: TFLOP/s with the FlashAttention convention (forward 4 B H N^2 D,
   backward 2.5x, causal half), B N = 16k tokens, H = 2048 / D, bf16 (fp16 for
   one size): torchfn raw ops, the public ``torchfn.kernels.attention`` (if it
   imports), SDPA flash and SDPA cuDNN, via ``triton.testing.do_bench``.
3. ``flex``: compiled FlexAttention at N in {4k, 16k}.

``--budget-s`` (default 240) is a global deadline: past it no new measurement
starts; the JSON (``--out``) and a markdown table (same name, ``.md``) are
always written. Results go to bench/RESULTS.md by hand.

Providers: ``torchfn`` (raw ops with the library's defaults: deterministic backward, the
autotuner choosing between tensor-descriptor (TMA) and pointer-load configs),
``torchfn_atomic`` (``deterministic=False``: dQ by atomics, FlashAttention-2's element
atomics or, on sm_90, TMA bulk reduces, whichever the tuner timed faster), ``torchfn_ordered`` (the
deterministic backward with the ordered dQ forced, ``TORCHFN_TRITON_ORDERED_DQ=1``: 5
matmuls, dQ added in turn by TMA bulk reduces; ``torchfn`` itself times it against the
7-matmul backward once per shape class and keeps the faster), ``torchfn_ptr`` (pointer
loads only, ``TORCHFN_TRITON_TMA=0``: what TMA adds), ``torchfn_api`` (the public
function), SDPA's flash and cuDNN backends, and compiled FlexAttention. ``--ws`` swaps
``torchfn_ptr`` for ``torchfn_ws``: the tuner with the opt-in warp-specialized variants
(``TORCHFN_TRITON_WS=1``), timed last at each shape; ``gpu_session.sh`` passes it only
once the GPU test of those kernels has passed.

``--sweep`` is a separate run (about 5 minutes with ``--budget-s 280``): it compiles a
grid of block configs for every kernel, with and without TMA, in parallel, then times
each kernel config at N = 8192 (checking that it gives the first config's result), and
the best combination against SDPA cuDNN. Its table says which configs to put first in
``_triton_configs._GPU_CONFIGS`` and ``_GPU_TMA_CONFIGS`` (TMA lists only where TMA won), and
whether the overlap variants (``fwd_ovl`` / ``dkdv_ovl`` rows: the forward's
``PIPELINE``, dK/dV's ``EARLY_DP``; ``_GPU_OVERLAP_CONFIGS``) and the warp-specialized
ones (``fwd_ws`` / ``dkdv_ws`` / ``dq_ws``; ``_GPU_WS_CONFIGS``) beat the plain kernels.
``sweep_best_any`` runs, per kernel, the fastest config of any variant.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.abspath(__file__)
FP32_TOL = 1e-5
N_LIST = [4096, 16384, 8192, 2048, 1024]  # most important first: the budget may run out
FLEX_N = [4096, 16384]
TOKENS = 16384
WIDTH = 2048  # H * D


# ============================================================================ utilities
def _err_str(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:600]


def _append(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")


def _read_rows(path: str) -> list[dict]:
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a line cut off by a kill
    return rows


def _dtype(name: str):
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def _device(dry: bool) -> str:
    return "cpu" if dry else "cuda"


def _sync(dry: bool) -> None:
    if not dry:
        import torch

        torch.cuda.synchronize()


def _flops(B: int, H: int, N: int, D: int, causal: bool, mode: str) -> float:
    f = 4.0 * B * H * N * N * D * (0.5 if causal else 1.0)
    return f * (3.5 if mode == "fwd_bwd" else 1.0)


# ============================================================================ env info
def env_info(dry: bool) -> dict:
    info: dict = {"python": sys.version.split()[0], "platform": platform.platform()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda_runtime"] = torch.version.cuda
        info["cudnn"] = torch.backends.cudnn.version() if torch.cuda.is_available() else None
        if torch.cuda.is_available() and not dry:
            p = torch.cuda.get_device_properties(0)
            info.update(gpu=p.name, capability=f"{p.major}.{p.minor}",
                        sm_count=p.multi_processor_count,
                        gpu_mem_gib=round(p.total_memory / 2**30, 1))
        else:
            info["gpu"] = "none (dry run: CPU, Triton interpreter)" if dry else "none"
    except Exception as e:  # noqa: BLE001
        info["torch_error"] = _err_str(e)
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        info["triton_error"] = _err_str(e)
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,name,clocks.max.sm,power.limit",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=15)
        info["nvidia_smi"] = out.stdout.strip() or out.stderr.strip()
    except Exception as e:  # noqa: BLE001
        info["nvidia_smi"] = _err_str(e)
    info["cpus"] = os.cpu_count()
    info["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET")
    return info


# ============================================================================ correctness
# name, B, H, Hkv, Nq, Nk, D, dtype, causal, mask
CASES_GPU = [
    ("bf16-d64-causal", 2, 4, 4, 512, 512, 64, "bf16", True, None),
    ("bf16-d128", 2, 4, 4, 384, 384, 128, "bf16", False, None),
    ("fp32-d64", 2, 4, 4, 256, 256, 64, "fp32", False, None),
    ("fp32-d72-causal-gqa-bool", 1, 4, 2, 200, 333, 72, "fp32", True, "bool"),
    ("fp16-d128-causal-gqa-Nq<Nk", 1, 8, 2, 128, 300, 128, "fp16", True, None),
    ("bf16-d128-causal-bool-Nq>Nk", 1, 4, 4, 300, 200, 128, "bf16", True, "bool"),
    ("bf16-d72-additive", 1, 4, 4, 257, 257, 72, "bf16", False, "additive"),
    ("fp16-d64-mqa-keypad", 2, 4, 1, 200, 260, 64, "fp16", False, "keypad"),
    ("fp32-d128-causal", 1, 2, 2, 300, 300, 128, "fp32", True, None),
    ("fp16-d64-causal", 2, 4, 4, 256, 256, 64, "fp16", True, None),
]
CASES_DRY = [
    ("bf16-d64-causal", 1, 2, 2, 64, 64, 64, "bf16", True, None),
    ("fp32-d72-causal-gqa-bool", 1, 4, 2, 40, 67, 72, "fp32", True, "bool"),
    ("fp16-d24-mqa-keypad", 1, 2, 1, 33, 50, 24, "fp16", False, "keypad"),
    ("fp32-d40-additive-Nq>Nk", 1, 2, 2, 70, 40, 40, "fp32", True, "additive"),
]


def _causal_mask(Nq: int, Nk: int, device: str):
    import torch

    i = torch.arange(Nq, device=device)[:, None]
    j = torch.arange(Nk, device=device)[None, :]
    return j <= i + (Nk - Nq)  # bottom-right aligned, as FlashAttention-2


def _reference(q, k, v, mask, causal, scale):
    """Materialised float64 attention -> (o, lse); fully masked rows: o = 0, lse = -inf."""
    import torch

    q, k, v = q.double(), k.double(), v.double()
    B, H, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    k = k.repeat_interleave(H // Hkv, 1)
    v = v.repeat_interleave(H // Hkv, 1)
    s = scale * q @ k.transpose(-1, -2)
    allowed = torch.ones(B, H, Nq, Nk, dtype=torch.bool, device=q.device)
    if mask is not None:
        if mask.dtype == torch.bool:
            allowed = allowed & mask
        else:
            s = s + mask.double()
            allowed = allowed & (mask > float("-inf"))
    if causal:
        allowed = allowed & _causal_mask(Nq, Nk, q.device)
    row_ok = allowed.any(-1, keepdim=True)
    s = torch.where(row_ok, torch.where(allowed, s, float("-inf")), 0.0)
    o = (torch.softmax(s, -1) * row_ok) @ v
    lse = torch.where(row_ok[..., 0], torch.logsumexp(s, -1), float("-inf"))
    return o, lse


def _dense_mask(mask, causal, Nq, Nk, dtype, device):
    import torch

    attn = mask
    if causal:
        c = _causal_mask(Nq, Nk, device)
        if attn is None:
            attn = c
        elif attn.dtype == torch.bool:
            attn = attn & c
        else:
            attn = attn.masked_fill(~c, float("-inf"))
    if attn is not None and attn.dtype != torch.bool:
        attn = attn.to(dtype)
    return attn


def _sdpa_low(q, k, v, mask, causal, scale):
    """SDPA in the inputs' dtype (default backend choice), fully masked rows -> 0."""
    import torch
    import torch.nn.functional as F

    H, Hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(H // Hkv, 1)
    v = v.repeat_interleave(H // Hkv, 1)
    attn = _dense_mask(mask, causal, q.shape[2], k.shape[2], q.dtype, q.device)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn, scale=scale)
    return torch.nan_to_num(o, nan=0.0)


def _naive_low(q, k, v, mask, causal, scale):
    """Materialised attention in the inputs' dtype (a baseline for the JVP error)."""
    import torch

    H, Hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(H // Hkv, 1)
    v = v.repeat_interleave(H // Hkv, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    attn = _dense_mask(mask, causal, q.shape[2], k.shape[2], q.dtype, q.device)
    if attn is not None:
        s = s.masked_fill(~attn, float("-inf")) if attn.dtype == torch.bool else s + attn
    return torch.nan_to_num(torch.softmax(s, -1), nan=0.0) @ v


def _rel(x, ref) -> float:
    """max |x - ref| / max(max |ref|, 1) (inputs ~N(0, 1))."""
    return ((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1.0)).item()


def _make_mask(kind, B, H, Nq, Nk, dtype, gen, device):
    import torch

    if kind is None:
        return None
    if kind == "bool":
        m = torch.rand(B, 1, Nq, Nk, generator=gen, device=device) < 0.7
        m[0, 0, Nq // 2] = False  # a fully masked row
        return m.expand(B, H, Nq, Nk)
    if kind == "additive":
        m = torch.randn(1, 1, Nq, Nk, generator=gen, device=device)
        drop = torch.rand(1, 1, Nq, Nk, generator=gen, device=device) < 0.1
        return m.masked_fill(drop, float("-inf")).to(dtype).expand(B, H, Nq, Nk)
    if kind == "keypad":
        lengths = torch.randint(1, Nk + 1, (B,), generator=gen, device=device)
        m = torch.arange(Nk, device=device)[None, :] < lengths[:, None]
        return m[:, None, None, :].expand(B, H, Nq, Nk)
    raise ValueError(f"mask kind {kind!r}")


def correctness_case(case, dry: bool) -> dict:
    import torch

    from torchfn.kernels import _triton_ops as T

    name, B, H, Hkv, Nq, Nk, D, dname, causal, mkind = case
    dev, dtype = _device(dry), _dtype(dname)
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=dev).to(dtype)

    q, k, v = rnd(B, H, Nq, D), rnd(B, Hkv, Nk, D), rnd(B, Hkv, Nk, D)
    do, tq, tk, tv = rnd(B, H, Nq, D), rnd(B, H, Nq, D), rnd(B, Hkv, Nk, D), rnd(B, Hkv, Nk, D)
    mask = _make_mask(mkind, B, H, Nq, Nk, dtype, gen, dev)
    scale = D**-0.5
    row = {"kind": "correctness", "case": name, "dtype": dname, "shape": [B, H, Hkv, Nq, Nk, D],
           "causal": causal, "mask": mkind}
    t0 = time.time()
    o, lse = T.fwd(q, k, v, mask, causal, scale)
    dq, dk, dv = T.bwd(q, k, v, o, lse, do, mask, causal, scale)
    o2, lse2, to, _ = T.jvp(q, k, v, tq, tk, tv, mask, causal, scale)
    ordered = _ordered_grads(q, k, v, o, lse, do, mask, causal, scale, dry)
    _sync(dry)
    row["kernel_s"] = round(time.time() - t0, 2)

    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ro, rlse = _reference(*leaves, mask, causal, scale)
    rdq, rdk, rdv = torch.autograd.grad(ro, leaves, do.double())
    _, rto = torch.func.jvp(lambda a, b, c: _reference(a, b, c, mask, causal, scale)[0],
                            (q.double(), k.double(), v.double()),
                            (tq.double(), tk.double(), tv.double()))
    fin = rlse.isfinite()
    lse_err = max(((x.double() - rlse).abs() / (1 + rlse.abs()))[fin].max().item()
                  if fin.any() else 0.0 for x in (lse, lse2))
    ours = {"o": _rel(o, ro), "dq": _rel(dq, rdq), "dk": _rel(dk, rdk), "dv": _rel(dv, rdv),
            "to": _rel(to, rto), "o_jvp": _rel(o2, ro)}
    if ordered is not None:  # the ordered dQ's backward: the same bounds as the default's
        (odq, odk, odv), row["ordered_repeatable"], row["ordered_timeouts"] = ordered
        ours.update(dq_ord=_rel(odq, rdq), dk_ord=_rel(odk, rdk), dv_ord=_rel(odv, rdv))
    nan = any(bool(t.isnan().any()) for t in (o, dq, dk, dv, to, lse))
    empty_ok = bool(torch.equal(lse.isfinite(), fin)) and all(
        bool((t[~fin] == 0).all()) for t in (o, dq, to))
    row.update(errors=ours, lse_err=lse_err, nan=nan, empty_rows_ok=empty_ok)
    if dname == "fp32":
        row["bound"] = {n: FP32_TOL for n in ours}
    else:
        lp = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        so = _sdpa_low(*lp, mask, causal, scale)
        sdq, sdk, sdv = torch.autograd.grad(so, lp, do)
        _, nto = torch.func.jvp(lambda a, b, c: _naive_low(a, b, c, mask, causal, scale),
                                (q, k, v), (tq, tk, tv))
        base = {"o": _rel(so, ro), "dq": _rel(sdq, rdq), "dk": _rel(sdk, rdk),
                "dv": _rel(sdv, rdv)}
        # SDPA has no forward AD: bound `to` by the naive same-dtype JVP (or SDPA's o error)
        base["to"] = max(_rel(torch.nan_to_num(nto), rto), base["o"])
        base["o_jvp"] = base["o"]
        base.update({n + "_ord": base[n] for n in ("dq", "dk", "dv")})
        row["sdpa_errors"] = base
        row["bound"] = {n: 2 * base[n] + 1e-6 for n in ours}
    row["fails"] = [n for n in ours if not ours[n] <= row["bound"][n]]
    if lse_err > FP32_TOL:
        row["fails"].append("lse")
    if nan:
        row["fails"].append("nan")
    if not empty_ok:
        row["fails"].append("empty_rows")
    if ordered is not None and not (row["ordered_repeatable"] and not row["ordered_timeouts"]):
        row["fails"].append("ordered_dq")
    row["pass"] = not row["fails"]
    return row


def _ordered_grads(q, k, v, o, lse, do, mask, causal, scale, dry):
    """(dq, dk, dv), bitwise equal on a rerun, no wait timed out: the ordered-dQ backward
    (``TORCHFN_TRITON_ORDERED_DQ=1``) where it runs (sm_90+; the interpreter), else None."""
    import torch

    from torchfn.kernels import _triton_ops as T
    from torchfn.kernels import _triton_ordered_bwd as O

    if not dry and torch.cuda.get_device_capability()[0] < 9:
        return None
    old = os.environ.get("TORCHFN_TRITON_ORDERED_DQ", "auto")
    os.environ["TORCHFN_TRITON_ORDERED_DQ"] = "1"
    try:
        runs = [T.bwd(q, k, v, o, lse, do, mask, causal, scale) for _ in range(3)]
        timeouts = int(O._LAST_LOCKS[0][1].item()) if O._LAST_LOCKS else 0
    finally:
        os.environ["TORCHFN_TRITON_ORDERED_DQ"] = old
    same = all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run))
    return runs[0], same, timeouts


# ============================================================================ warm phase
def _bench_combos(dry: bool) -> list[tuple[str, int, bool]]:
    ds = (64, 16) if dry else (128, 64)
    combos = [(d, dd, c) for dd in ds for c in (False, True) for d in ("bf16",)]
    combos += [("fp16", ds[0], False), ("fp16", ds[0], True)]
    return combos


def warm_tasks(dry: bool, ws: bool = False) -> list[dict]:
    """Kernel configs the bench may pick (first configs first) + correctness cases; with
    ``ws``, the warp-specialized ones too, at the very end."""
    from torchfn.kernels import _triton_configs as C

    first, rest, last = [], [], []
    for dname, D, causal in _bench_combos(dry):
        bd = max(16, 1 << (D - 1).bit_length())
        dt = _dtype(dname)

        def cands(kind, dt=dt, bd=bd):  # (..., tma[, overlap]): in the tuner's order
            return ([(*c, True) for c in C._tma_candidates(kind, dt, bd)]
                    + [(*c, False) for c in C._candidates(kind, dt, bd)]
                    + [tuple(c) for c in C._overlap_candidates(kind, dt, bd, "auto")])

        fc, kc, qc, ac, oc, rc = (cands(kind) for kind in ("fwd", "dkdv", "dq", "dkdv_atomic",
                                                            "dkdv_ordered", "dkdv_reduce"))
        common = {"dtype": dname, "D": D, "causal": causal}
        fwd = [dict(common, type="fwd", cfg=c) for c in fc]
        bwd = [dict(common, type="bwd", cfg=(kc[min(i, len(kc) - 1)], qc[min(i, len(qc) - 1)]),
                    fwd_cfg=fc[0]) for i in range(max(len(kc), len(qc)))]
        atomic = [dict(common, type="bwd_atomic", cfg=(c, qc[0]), fwd_cfg=fc[0]) for c in ac]
        ordered = [dict(common, type="bwd_ordered", cfg=(c, qc[0]), fwd_cfg=fc[0])
                   for c in oc]
        reduce = [dict(common, type="bwd_reduce", cfg=(c, qc[0]), fwd_cfg=fc[0]) for c in rc]
        first += [fwd[0], bwd[0], atomic[0], ordered[0], reduce[0]]
        rest += fwd[1:] + bwd[1:] + atomic[1:] + ordered[1:] + reduce[1:]
        if ws and dt != _dtype("fp32"):
            wc = {kind: [(*c, False, False, True) for c in
                         C._GPU_WS_CONFIGS[kind].get(C._class(dt, bd), [])]
                  for kind in ("fwd", "dkdv", "dq")}
            last += [dict(common, type="fwd", cfg=c) for c in wc["fwd"]]
            last += [dict(common, type="bwd", cfg=(kv, q), fwd_cfg=fc[0])
                     for kv, q in zip(wc["dkdv"], wc["dq"] * len(wc["dkdv"]))]
    cases = [{"type": "case", "case": c} for c in (CASES_DRY if dry else CASES_GPU)]
    # the default configs of every combo, then the correctness cases, then the other
    # configs, the warp-specialized ones last (a worker that hangs on one loses nothing else)
    return first + cases + rest + last


def warm_kernel(task: dict, dry: bool) -> None:
    import torch

    from torchfn.kernels import _triton_ops as T

    D, causal, dtype = task["D"], task["causal"], _dtype(task["dtype"])
    H = 2 if dry else WIDTH // D  # same specialisation (divisibility by 16) as the bench
    N = 32 if dry else 256
    dev = _device(dry)
    q, k, v, do = (torch.randn(1, H, N, D, device=dev, dtype=dtype) for _ in range(4))
    cfg = tuple(task["cfg"]) if task["type"] == "fwd" else tuple(task["fwd_cfg"])
    o, lse = T.fwd(q, k, v, None, causal, D**-0.5, config=cfg)
    if task["type"] in ("bwd", "bwd_atomic", "bwd_ordered", "bwd_reduce"):
        pair = tuple(tuple(c) for c in task["cfg"])
        in_dkdv = task["type"] in ("bwd_ordered", "bwd_reduce")  # dQ by bulk reduces
        os.environ["TORCHFN_TRITON_ORDERED_DQ"] = "1" if in_dkdv else "0"
        try:
            T.bwd(q, k, v, o, lse, do, None, causal, D**-0.5,
                  task["type"] in ("bwd", "bwd_ordered"), config=pair)
        finally:
            os.environ["TORCHFN_TRITON_ORDERED_DQ"] = "auto"
    _sync(dry)


def phase_warm(args) -> None:
    os.environ["TORCHFN_TRITON_AUTOTUNE"] = "0"  # nothing is timed here: default configs
    tasks = warm_tasks(args.dry_run, args.ws)[args.worker_id::args.nworkers]
    for task in tasks:
        if time.time() > args.deadline:
            _append(args.part, {"kind": "warm", "task": task, "skipped": "deadline"})
            continue
        t0 = time.time()
        try:
            if task["type"] == "case":
                row = correctness_case(task["case"], args.dry_run)
            else:
                warm_kernel(task, args.dry_run)
                row = {"kind": "warm", "task": task, "ok": True}
        except Exception as e:  # noqa: BLE001
            row = {"kind": "correctness" if task["type"] == "case" else "warm", "task": task,
                   "error": _err_str(e), "pass": False,
                   "trace": traceback.format_exc()[-1500:]}
            if task["type"] == "case":
                row["case"] = task["case"][0]
        row["secs"] = round(time.time() - t0, 2)
        _append(args.part, row)


# ============================================================================ timing
def _timer(dry: bool):
    if not dry:
        from triton.testing import do_bench

        return lambda fn, grad_to_none=None: do_bench(fn, warmup=25, rep=60,
                                                      grad_to_none=grad_to_none)

    def cpu_time(fn, grad_to_none=None):
        fn()
        t0 = time.perf_counter()
        for _ in range(2):
            fn()
        return (time.perf_counter() - t0) / 2 * 1e3

    return cpu_time


def _measure(args, rows_path, meta: dict, make_fn, timer) -> dict:
    """One measurement row: compile/warm the callable, then time it; never raises."""
    row = dict(meta, kind="bench")
    if time.time() > args.deadline:
        row["skipped"] = "budget"
        _append(rows_path, row)
        return row
    t0 = time.time()
    try:
        fn, grads, ctx = make_fn()
        with ctx():
            fn()
            _sync(args.dry_run)
            row["first_call_s"] = round(time.time() - t0, 2)
            ms = timer(fn, grad_to_none=grads)
        row["ms"] = ms
        row["tflops"] = _flops(meta["B"], meta["H"], meta["N"], meta["D"], meta["causal"],
                               meta["mode"]) / (ms * 1e-3) / 1e12
    except Exception as e:  # noqa: BLE001
        row["error"] = _err_str(e)
    row["secs"] = round(time.time() - t0, 2)
    _append(rows_path, row)
    msg = (f"{row['tflops']:8.1f} TFLOP/s  {row['ms']:.3f} ms" if "tflops" in row
           else f"ERROR {row.get('error', '')[:150]}")
    print(f"  {meta['provider']:>12} {meta['mode']:>7} {meta['dtype']} D={meta['D']} "
          f"N={meta['N']} causal={meta['causal']}: {msg}", flush=True)
    return row


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _providers(dry: bool, ws: bool = False):
    """name -> builder(q, k, v, do, causal, mode) -> (fn, grad_to_none, context factory);
    ``ws``: ``torchfn_ws`` (last) in place of ``torchfn_ptr``."""
    import torch.nn.functional as F

    from torchfn.kernels import _triton_ops as T

    def raw_with(deterministic):
        def raw(q, k, v, do, causal, mode):
            scale = q.shape[-1] ** -0.5
            if mode == "fwd":
                return (lambda: T.fwd(q, k, v, None, causal, scale)), None, _null

            def fb():
                o, lse = T.fwd(q, k, v, None, causal, scale)
                return T.bwd(q, k, v, o, lse, do, None, causal, scale, deterministic)

            return fb, None, _null

        return raw

    def raw_ptr(q, k, v, do, causal, mode):
        fn, grads, ctx = raw_with(True)(q, k, v, do, causal, mode)
        return _with_tma(fn, "0"), grads, ctx

    def autograd_fn(call):
        def build(q, k, v, do, causal, mode, ctx=_null):
            if mode == "fwd":  # inputs without requires_grad: inference path
                return (lambda: call(q, k, v, causal)), None, ctx
            qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))

            def fb():
                call(qg, kg, vg, causal).backward(do)

            return fb, [qg, kg, vg], ctx

        return build

    def sdpa_with(backend_name):
        def build(q, k, v, do, causal, mode):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            backend = getattr(SDPBackend, backend_name)
            inner = autograd_fn(lambda a, b, c, cz: F.scaled_dot_product_attention(
                a, b, c, is_causal=cz))
            return inner(q, k, v, do, causal, mode, ctx=lambda: sdpa_kernel([backend]))

        return build

    def api(q, k, v, do, causal, mode):
        from torchfn.kernels import attention

        return autograd_fn(lambda a, b, c, cz: attention(a, b, c, causal=cz,
                                                         backend="triton"))(
            q, k, v, do, causal, mode)

    def raw_ws(q, k, v, do, causal, mode):
        fn, grads, ctx = raw_with(True)(q, k, v, do, causal, mode)
        return _with_env(fn, "TORCHFN_TRITON_WS", "1", "0"), grads, ctx

    def raw_ordered(q, k, v, do, causal, mode):
        fn, grads, ctx = raw_with(True)(q, k, v, do, causal, mode)
        return _with_env(fn, "TORCHFN_TRITON_ORDERED_DQ", "1", "auto"), grads, ctx

    provs = {"torchfn": raw_with(True), "torchfn_atomic": raw_with(False),
             "torchfn_ordered": raw_ordered}
    if not ws:
        provs["torchfn_ptr"] = raw_ptr
    provs.update({"torchfn_api": api, "sdpa_flash": sdpa_with("FLASH_ATTENTION"),
                  "sdpa_cudnn": sdpa_with("CUDNN_ATTENTION")})
    if ws:
        provs["torchfn_ws"] = raw_ws
    return provs


def phase_bench(args) -> None:
    import torch

    from torchfn.kernels import _triton_ops as T
    from torchfn.kernels import _triton_ordered_bwd as O

    dry, dev = args.dry_run, _device(args.dry_run)
    timer = _timer(dry)
    provs = _providers(dry, args.ws)
    n_list = [64, 128] if dry else N_LIST
    api_n = set(n_list[:2])
    gen = torch.Generator(device=dev).manual_seed(0)
    plan = [(N, dname, D, causal) for N in n_list for dname, D, causal in _bench_combos(dry)
            if dname == "bf16"]
    plan += [(n_list[0], dname, D, causal) for dname, D, causal in _bench_combos(dry)
             if dname == "fp16"]
    checked = set()
    for N, dname, D, causal in plan:
        dtype = _dtype(dname)
        B, H = (1, 2) if dry else (max(1, TOKENS // N), WIDTH // D)
        try:
            q, k, v, do = (torch.randn(B, H, N, D, generator=gen, device=dev).to(dtype)
                           for _ in range(4))
        except Exception as e:  # noqa: BLE001
            print(f"  cannot allocate N={N} D={D}: {_err_str(e)}", flush=True)
            continue
        if (dname, D, causal) not in checked and time.time() < args.deadline:
            checked.add((dname, D, causal))
            _append(args.part, _diff_vs_sdpa(q, k, v, do, causal, dname, D, N, dry))
        for mode in ("fwd", "fwd_bwd"):
            for name, build in provs.items():
                if name == "torchfn_api" and N not in api_n:
                    continue
                if name in ("torchfn_atomic", "torchfn_ordered") and mode == "fwd":
                    continue  # the same forward as torchfn
                meta = {"provider": name, "mode": mode, "dtype": dname, "D": D, "N": N, "B": B,
                        "H": H, "causal": causal}
                _measure(args, args.part, meta,
                         lambda build=build, mode=mode, x=(q, k, v, do, causal):
                         build(*x, mode), timer)
        del q, k, v, do
    _append(args.part, {"kind": "tuned", "configs": {repr(k_): v_ for k_, v_ in
                                                     T.tuned_configs().items()},
                        # per dK/dV shape class: did the ordered dQ time faster?
                        "ordered_dq": {repr(k_): v_ for k_, v_ in O._ORDER_PICKS.items()}})


def _diff_vs_sdpa(q, k, v, do, causal, dname, D, N, dry) -> dict:
    """Sanity check at bench size with the tuned configs: torchfn vs SDPA (default backend)."""
    import torch.nn.functional as F

    from torchfn.kernels import _triton_ops as T

    row = {"kind": "diff_vs_sdpa", "dtype": dname, "D": D, "N": N, "causal": causal}
    try:
        scale = D**-0.5
        o, lse = T.fwd(q, k, v, None, causal, scale)
        dq, dk, dv = T.bwd(q, k, v, o, lse, do, None, causal, scale)
        qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
        so = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
        so.backward(do)
        for name, a, b in (("o", o, so), ("dq", dq, qg.grad), ("dk", dk, kg.grad),
                           ("dv", dv, vg.grad)):
            row[name] = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
        row["ok"] = all(row[n] < 3e-2 for n in ("o", "dq", "dk", "dv"))
    except Exception as e:  # noqa: BLE001
        row["error"] = _err_str(e)
        row["ok"] = False
    print(f"  diff vs SDPA {dname} D={D} N={N} causal={causal}: "
          + (row.get("error") or " ".join(f"{n}={row[n]:.1e}" for n in ("o", "dq", "dk", "dv"))),
          flush=True)
    return row


# ============================================================================ flex
def phase_flex(args, time_it: bool) -> None:
    import torch

    dry, dev = args.dry_run, _device(args.dry_run)
    try:
        import torch._dynamo
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
        # eager flex on CPU keeps the dry run short; the GPU numbers come from the compiled one
        flex = flex_attention if dry else torch.compile(flex_attention, dynamic=False)
    except Exception as e:  # noqa: BLE001
        _append(args.part, {"kind": "bench", "provider": "flex", "error": _err_str(e)})
        return
    timer = _timer(dry) if time_it else None
    gen = torch.Generator(device=dev).manual_seed(0)
    combos = [(N, D, causal) for N in ([64] if dry else FLEX_N)
              for dname, D, causal in _bench_combos(dry) if dname == "bf16"]
    if not time_it:  # warm-up workers split the shapes between them
        combos = combos[args.worker_id::args.nworkers]
    for N, D, causal in combos:
        B, H = (1, 2) if dry else (max(1, TOKENS // N), WIDTH // D)
        q, k, v, do = (torch.randn(B, H, N, D, generator=gen, device=dev, dtype=torch.bfloat16)
                       for _ in range(4))

        def build(mode, q=q, k=k, v=v, do=do, N=N, causal=causal):
            bm = None
            if causal:
                bm = create_block_mask(lambda b, h, i, j: i >= j, None, None, N, N, device=dev)
            if mode == "fwd":
                return (lambda: flex(q, k, v, block_mask=bm)), None, _null
            qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))

            def fb():
                flex(qg, kg, vg, block_mask=bm).backward(do)

            return fb, [qg, kg, vg], _null

        for mode in ("fwd", "fwd_bwd"):
            meta = {"provider": "flex", "mode": mode, "dtype": "bf16", "D": D, "N": N,
                    "B": B, "H": H, "causal": causal}
            if time_it:
                _measure(args, args.part, meta, lambda mode=mode: build(mode), timer)
                continue
            if time.time() > args.deadline:
                return
            t0 = time.time()
            try:
                fn, _, _ = build(mode)
                fn()
                _sync(dry)
                _append(args.part, dict(meta, kind="flex_warm", secs=round(time.time() - t0, 1)))
            except Exception as e:  # noqa: BLE001
                _append(args.part, dict(meta, kind="flex_warm", error=_err_str(e)))


# ============================================================================ sweep
# ``--sweep``: time every kernel over a wide grid of block configs, one kernel at a time,
# to choose ``_triton_configs._GPU_CONFIGS`` / ``_GPU_TMA_CONFIGS`` from measurements. The
# grid holds bf16 configs that bench/aot_sm90.py compiles for sm_90 without spills and
# within 227 KiB of shared memory (mostly one stage count per tile shape, more around
# the previous sweep's winners), plus the tables' own entries.
SWEEP_N = 8192
SWEEP_COMBOS = [(128, False), (128, True), (64, False), (64, True)]  # (D, causal), by priority
SWEEP_GRID: dict[str, dict[int, list[tuple[int, int, int, int]]]] = {
    "fwd": {
        64: [(64, 32, 4, 3), (64, 32, 8, 3), (64, 64, 4, 3), (64, 64, 8, 3), (64, 128, 4, 3),
             (64, 128, 8, 3), (128, 32, 4, 3), (128, 32, 8, 3), (128, 64, 4, 3),
             (128, 64, 8, 3), (128, 128, 8, 3)],
        128: [(64, 32, 4, 3), (64, 32, 8, 3), (64, 64, 4, 3), (64, 64, 8, 3), (64, 128, 4, 2),
              (64, 128, 8, 3), (128, 32, 8, 3), (128, 64, 8, 3), (128, 128, 8, 3),
              (128, 128, 8, 2)],
    },
    "dkdv": {
        64: [(16, 64, 4, 3), (16, 64, 8, 3), (16, 128, 4, 3), (16, 128, 8, 3), (32, 64, 4, 3),
             (32, 64, 8, 3), (32, 128, 8, 3), (64, 64, 4, 3), (64, 64, 8, 3), (64, 128, 8, 3),
             (32, 64, 4, 4), (64, 64, 4, 4), (64, 64, 4, 2)],
        128: [(16, 64, 4, 3), (16, 64, 8, 3), (16, 128, 8, 3), (16, 128, 8, 4), (32, 64, 4, 3),
              (32, 64, 8, 2), (32, 64, 8, 3), (32, 128, 8, 3), (64, 64, 8, 3), (32, 64, 4, 4),
              (32, 64, 4, 2)],
    },
    "dq": {
        64: [(64, 16, 4, 3), (64, 16, 8, 3), (64, 32, 4, 3), (64, 32, 8, 3), (64, 64, 4, 3),
             (64, 64, 8, 3), (128, 16, 4, 3), (128, 16, 8, 3), (128, 32, 4, 3), (128, 32, 8, 3),
             (128, 64, 4, 4), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3)],
        128: [(64, 16, 4, 3), (64, 16, 8, 3), (64, 32, 4, 3), (64, 32, 8, 3), (64, 64, 4, 3),
              (64, 64, 8, 3), (128, 16, 8, 3), (128, 32, 8, 3), (128, 64, 8, 3), (64, 128, 4, 3)],
    },
    "dkdv_atomic": {
        64: [(32, 64, 4, 3), (32, 64, 8, 3), (32, 128, 4, 3), (32, 128, 8, 3), (64, 64, 4, 3),
             (64, 64, 8, 3), (64, 128, 8, 3)],
        128: [(32, 64, 4, 3), (32, 64, 8, 3), (32, 128, 8, 3), (64, 64, 8, 3)],
    },
    # "<op>_tma": the kernel with its streamed tiles through tensor descriptors
    # (forced with TORCHFN_TRITON_TMA=1). Fewer registers than pointer loads (forward,
    # D=128, 128x64: 138 against 182), so bigger tiles fit; an op without its own grid
    # uses the plain one's.
    "dkdv_tma": {
        64: [(16, 128, 8, 3), (32, 64, 8, 3), (32, 128, 8, 3), (64, 64, 8, 3), (64, 128, 8, 3),
             (64, 64, 4, 3), (32, 64, 4, 3)],
        128: [(16, 128, 8, 3), (32, 64, 8, 3), (32, 128, 8, 3), (64, 64, 8, 3), (64, 128, 8, 2),
              (64, 128, 8, 3), (64, 128, 8, 4), (64, 64, 4, 3), (32, 64, 4, 3)],
    },
    "dq_tma": {
        64: [(64, 32, 4, 3), (64, 64, 4, 3), (64, 64, 8, 3), (128, 32, 8, 3), (128, 64, 4, 4),
             (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3)],
        128: [(64, 32, 4, 3), (64, 64, 4, 3), (64, 64, 8, 3), (128, 32, 8, 3), (128, 64, 8, 3),
              (128, 64, 8, 4)],
    },
    # "<op>_ovl[_tma]": the overlap variants (forward: PIPELINE, dK/dV: EARLY_DP), around
    # the winners of the last sweep; none spills on sm_90 (Triton 3.6 and 3.9)
    "fwd_ovl_tma": {
        64: [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3)],
        128: [(128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3)],
    },
    "dkdv_ovl": {
        64: [(32, 64, 4, 3), (64, 64, 4, 3), (64, 128, 8, 3), (32, 128, 8, 3), (32, 64, 4, 4)],
        128: [(32, 64, 4, 3), (32, 128, 8, 3), (16, 64, 4, 3), (32, 64, 4, 2), (32, 64, 8, 3)],
    },
    "dkdv_ovl_tma": {
        64: [(32, 64, 4, 3), (64, 64, 4, 3), (64, 128, 8, 3)],
        128: [(32, 128, 8, 3), (32, 64, 4, 3), (16, 128, 8, 3), (32, 64, 8, 3)],
    },
    # "<op>_ws": the warp-specialized variants, beside their table (`_table`): deeper
    # pipelines that Triton also splits (4 warps -> 12) without spills, 3.6 and 3.9
    "fwd_ws": {64: [(128, 128, 4, 3), (128, 64, 4, 4)], 128: [(128, 64, 4, 4)]},
    "dkdv_ws": {64: [], 128: [(32, 128, 4, 4), (16, 128, 4, 3)]},
    "dq_ws": {64: [(64, 64, 4, 4), (64, 128, 4, 3)], 128: [(64, 64, 4, 4)]},
    "fwd_tma": {
        64: [(64, 64, 4, 3), (64, 128, 8, 3), (128, 32, 8, 3), (128, 64, 4, 3), (128, 64, 8, 3),
             (128, 64, 8, 4), (128, 128, 4, 3), (128, 128, 8, 3), (128, 128, 8, 4),
             (128, 128, 4, 4), (128, 64, 4, 4)],
        128: [(64, 64, 4, 3), (64, 64, 8, 4), (64, 128, 4, 3), (64, 128, 8, 3), (128, 32, 8, 4),
              (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3),
              (128, 64, 4, 3), (128, 32, 4, 3)],
    },
}
_SWEEP_GRID_DRY = {"fwd": [(16, 16, 4, 1), (32, 16, 4, 1)], "dkdv": [(16, 32, 4, 1)],
                   "dq": [(32, 16, 4, 1)], "dkdv_atomic": [(16, 32, 4, 1), (32, 32, 4, 1)],
                   "fwd_ovl": [(16, 16, 4, 1)], "dkdv_ovl": [(16, 32, 4, 1)],
                   "fwd_ws": [(16, 16, 4, 1)], "dkdv_ws": [(16, 32, 4, 1)],
                   "dq_ws": [(32, 16, 4, 1)]}
SWEEP_OPS = ("fwd", "fwd_tma", "fwd_ovl_tma", "fwd_ws", "dkdv", "dkdv_tma", "dq", "dq_tma",
             "dq_ws", "dkdv_ovl", "dkdv_ovl_tma", "dkdv_ws", "dkdv_atomic", "dkdv_atomic_tma")
_SWEEP_NEEDED = ("fwd", "fwd_tma", "dkdv", "dkdv_tma", "dq", "dq_tma", "dkdv_atomic",
                 "dkdv_atomic_tma")  # for the best combinations; the others add to them
# timed last, in a child of their own (`sweepws`): a young compiler pass may miscompile
# a barrier and hang the GPU, which must not cost the rest of the sweep
_WS_OPS = ("fwd_ws", "dkdv_ws", "dq_ws")


def _table(op: str, D: int) -> list[tuple[int, int, int, int]]:
    """The library's own bf16 candidates for sweep op ``op`` (4-tuples, tuner order)."""
    from torchfn.kernels import _triton_configs as C

    base, bf16 = op.removesuffix("_tma"), _dtype("bf16")
    if base.endswith("_ws"):
        return list(C._GPU_WS_CONFIGS[base.removesuffix("_ws")].get(C._class(bf16, D), []))
    if base.endswith("_ovl"):
        listed = C._GPU_OVERLAP_CONFIGS[base.removesuffix("_ovl")].get(C._class(bf16, D), [])
        return [c[:4] for c in listed if c[4] == (op != base)]
    table = C._candidates(base, bf16, D)
    return C._tma_candidates(base, bf16, D) + table if op != base else table


def _sweep_grid(op: str, D: int, dry: bool) -> list[tuple[int, int, int, int]]:
    base = op.removesuffix("_tma")
    if dry:
        return _SWEEP_GRID_DRY[base]

    grid = list((SWEEP_GRID[op] if op in SWEEP_GRID else SWEEP_GRID[base])[D])
    return grid + [c for c in dict.fromkeys(_table(op, D)) if c not in grid]


def _sweep_combos(dry: bool) -> list[tuple[int, bool]]:
    return [(16, False), (16, True)] if dry else SWEEP_COMBOS


def _sweep_defaults(D: int) -> tuple[tuple, tuple, tuple]:
    """The table's first (untuned) fwd / dkdv / dq configs: the fixed partner of a sweep."""
    from torchfn.kernels import _triton_configs as C

    bf16 = _dtype("bf16")
    return tuple(C._candidates(op, bf16, max(16, 1 << (D - 1).bit_length()))[0]
                 for op in ("fwd", "dkdv", "dq"))


def _sweep_call(op: str, cfg, x, causal: bool, D: int):
    """A callable that runs kernel ``op`` with ``cfg`` (the backward's other kernel fixed)."""
    from torchfn.kernels import _triton_ops as T

    q, k, v, do, o, lse = x
    scale = D**-0.5
    _, k0, q0 = _sweep_defaults(D) if D >= 64 else (cfg, cfg, cfg)
    if "_ovl" in op or op.endswith("_ws"):  # the config carries the variant flags
        ovl = _variant_config(op, cfg)
        if op.startswith("dq"):
            return lambda: T.bwd(q, k, v, o, lse, do, None, causal, scale, True,
                                 config=(k0, ovl))
        if op.startswith("fwd"):
            call = lambda: T.fwd(q, k, v, None, causal, scale, config=ovl)  # noqa: E731
        else:
            call = lambda: T.bwd(q, k, v, o, lse, do, None, causal, scale, True,  # noqa: E731
                                 config=(ovl, q0))
        return _with_tma(call) if op.endswith("_tma") else call
    if op.endswith("_tma"):
        return _with_tma(_sweep_call(op.removesuffix("_tma"), cfg, x, causal, D))
    if op == "fwd":
        return lambda: T.fwd(q, k, v, None, causal, scale, config=cfg)
    if op == "dkdv":
        return lambda: T.bwd(q, k, v, o, lse, do, None, causal, scale, True, config=(cfg, q0))
    if op == "dq":
        return lambda: T.bwd(q, k, v, o, lse, do, None, causal, scale, True, config=(k0, cfg))
    return lambda: T.bwd(q, k, v, o, lse, do, None, causal, scale, False, config=(cfg, q0))


def _variant_config(op: str, cfg) -> tuple:
    """Sweep op ``op``'s config as an explicit 7-tuple (BLOCK_M, BLOCK_N, warps, stages,
    tma, overlap, ws): "_tma" / "_ovl" / "_ws" in the name set the flags."""
    return (*cfg[:4], op.endswith("_tma"), "_ovl" in op, op.endswith("_ws"))


def _with_tma(fn, mode: str = "1"):
    """``fn`` run with ``TORCHFN_TRITON_TMA=mode`` ("1": TMA loads forced on, "0": off);
    the variable is read at each launch, and "auto" (the default) is restored after."""
    return _with_env(fn, "TORCHFN_TRITON_TMA", mode, "auto")


def _with_env(fn, name: str, value: str, default: str):
    """``fn`` run with environment variable ``name`` set to ``value``, then ``default``."""
    def run():
        os.environ[name] = value
        try:
            return fn()
        finally:
            os.environ[name] = default

    return run


def _sweep_tasks(dry: bool) -> list[tuple[int, bool, str, tuple]]:
    """Every (D, causal, op, config) of the sweep; the warp-specialized ones last, so a
    warm worker that hangs on one loses nothing else."""
    tasks = [(D, causal, op, cfg) for D, causal in _sweep_combos(dry)
             for op in SWEEP_OPS for cfg in _sweep_grid(op, D, dry)]
    return ([t for t in tasks if t[2] not in _WS_OPS]
            + [t for t in tasks if t[2] in _WS_OPS])


def _sweep_inputs(D: int, N: int, dry: bool, causal: bool, seed: int = 0):
    import torch

    from torchfn.kernels import _triton_ops as T

    dev = _device(dry)
    B, H = (1, 2) if dry else (max(1, TOKENS // N), WIDTH // D)
    gen = torch.Generator(device=dev).manual_seed(seed)
    q, k, v, do = (torch.randn(B, H, N, D, generator=gen, device=dev).to(_dtype("bf16"))
                   for _ in range(4))
    o, lse = T.fwd(q, k, v, None, causal, D**-0.5)
    return B, H, (q, k, v, do, o, lse)


def phase_sweepwarm(args) -> None:
    """Compile this worker's share of the sweep grid into Triton's disk cache."""
    os.environ["TORCHFN_TRITON_AUTOTUNE"] = "0"
    for D, causal, op, cfg in _sweep_tasks(args.dry_run)[args.worker_id::args.nworkers]:
        row = {"kind": "sweep_warm", "D": D, "causal": causal, "op": op, "cfg": cfg}
        if time.time() > args.deadline:
            _append(args.part, dict(row, skipped="deadline"))
            continue
        t0 = time.time()
        try:
            # same specialisation as the timed size: H, N and strides divisible by 16
            _, _, x = _sweep_inputs(D, 32 if args.dry_run else 256, args.dry_run, causal)
            _sweep_call(op, cfg, x, causal, D)()
            _sync(args.dry_run)
            row["ok"] = True
        except Exception as e:  # noqa: BLE001 - out of resources: that config is out
            row["error"] = _err_str(e)
        row["secs"] = round(time.time() - t0, 2)
        _append(args.part, row)


def phase_sweep(args, ws: bool = False) -> None:
    """Time each (op, config) at N = SWEEP_N, then the best fwd + bwd against SDPA cuDNN.

    ``ws``: the warp-specialized ops only (phase ``sweepws``, after the others): their
    best combinations take the other ops' bests from the first child's rows."""
    os.environ["TORCHFN_TRITON_AUTOTUNE"] = "0"
    timer = _timer(args.dry_run)
    provs = _providers(args.dry_run)
    N = 64 if args.dry_run else SWEEP_N
    ops = _WS_OPS if ws else tuple(op for op in SWEEP_OPS if op not in _WS_OPS)
    earlier = {(r["D"], r["causal"]): r["best"] for r in _read_rows(args.main_part or "")
               if r.get("kind") == "sweep_best_configs"} if ws else {}
    for D, causal in _sweep_combos(args.dry_run):
        if time.time() > args.deadline:
            break
        B, H, x = _sweep_inputs(D, N, args.dry_run, causal)
        best: dict[str, tuple[float, tuple]] = {
            op: (b["ms"], tuple(b["cfg"])) for op, b in earlier.get((D, causal), {}).items()}
        first = _sweep_grid("fwd", D, args.dry_run)[0], _sweep_grid("dkdv", D, args.dry_run)[0]
        ref = {"fwd": _sweep_call("fwd", first[0], x, causal, D)(),
               "bwd": _sweep_call("dkdv", first[1], x, causal, D)()}
        for op in ops:
            for cfg in _sweep_grid(op, D, args.dry_run):
                row = {"kind": "sweep", "D": D, "causal": causal, "N": N, "op": op, "cfg": cfg}
                if time.time() > args.deadline:
                    _append(args.part, dict(row, skipped="deadline"))
                    continue
                try:
                    fn = _sweep_call(op, cfg, x, causal, D)
                    out = fn()
                    _sync(args.dry_run)
                    # every config must give the same result as the first one (rounding aside)
                    row["max_rel_diff"] = max(
                        ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                        for a, b in zip(out, ref["fwd" if op.startswith("fwd") else "bwd"]))
                    row["same_result"] = row["max_rel_diff"] < 2e-2
                    row["ms"] = timer(fn)
                    if row["same_result"] and row["ms"] < best.get(op, (float("inf"),))[0]:
                        best[op] = (row["ms"], cfg)
                except Exception as e:  # noqa: BLE001
                    row["error"] = _err_str(e)
                _append(args.part, row)
                print(f"  sweep D={D} causal={causal} {op:>11} {cfg}: "
                      + (f"{row['ms']:.3f} ms, diff {row['max_rel_diff']:.1e}" if "ms" in row
                         else row.get("error", "skipped")), flush=True)
        if all(op in best for op in _SWEEP_NEEDED):
            _sweep_best(args, timer, provs, D, causal, N, B, H, x,
                        {op: cfg for op, (_, cfg) in best.items()},
                        {op: ms for op, (ms, _) in best.items()}, ws_only=ws)
            _append(args.part, {"kind": "sweep_best_configs", "D": D, "causal": causal,
                                "ws": ws,
                                "best": {op: {"ms": t, "cfg": c} for op, (t, c) in best.items()}})


def _sweep_best(args, timer, provs, D, causal, N, B, H, x, cfgs: dict,
                cfgs_ms: dict, ws_only: bool = False) -> None:
    """Time fwd and fwd+bwd with the best config of each kernel, and SDPA cuDNN beside them.

    ``cfgs``: sweep op -> its fastest config; ``cfgs_ms``: op -> that config's time.
    ``ws_only`` (the ``sweepws`` child): only the combinations with a warp-specialized
    kernel (``sweep_best_ws``, and ``sweep_best_any`` again if one of them wins)."""
    from torchfn.kernels import _triton_ops as T

    q, k, v, do, _, _ = x
    scale = D**-0.5

    def fwd(tma="", op=None):
        cfg = cfgs[op or "fwd" + tma]
        if op:  # an overlap variant
            cfg = (*cfg[:4], bool(tma), True)
        return T.fwd(q, k, v, None, causal, scale, config=cfg)

    def fwd_bwd(det, tma="", kv_op=None, fwd_op=None):
        kv_op = kv_op or ("dkdv" if det else "dkdv_atomic") + tma
        kv = cfgs[kv_op]
        if "_ovl" in kv_op:
            kv = (*kv[:4], bool(tma), True)

        def run():
            o, lse = fwd(tma, fwd_op)
            return T.bwd(q, k, v, o, lse, do, None, causal, scale, det,
                         config=(kv, cfgs["dq" + tma]))

        return _with_tma(run) if tma else run

    runs = {("sweep_best", "fwd"): fwd, ("sweep_best_tma", "fwd"): _with_tma(lambda: fwd("_tma")),
            ("sweep_best", "fwd_bwd"): fwd_bwd(True),
            ("sweep_best_atomic", "fwd_bwd"): fwd_bwd(False),
            ("sweep_best_tma", "fwd_bwd"): fwd_bwd(True, "_tma"),
            ("sweep_best_atomic_tma", "fwd_bwd"): fwd_bwd(False, "_tma")}
    if "fwd_ovl_tma" in cfgs:
        runs[("sweep_best_ovl_tma", "fwd")] = _with_tma(lambda: fwd("_tma", "fwd_ovl_tma"))
    if "dkdv_ovl" in cfgs:
        runs[("sweep_best_ovl", "fwd_bwd")] = fwd_bwd(True, "", "dkdv_ovl")
    if "fwd_ovl_tma" in cfgs and "dkdv_ovl_tma" in cfgs:  # as sweep_best_tma, both overlaps
        runs[("sweep_best_ovl_tma", "fwd_bwd")] = fwd_bwd(True, "_tma", "dkdv_ovl_tma",
                                                           "fwd_ovl_tma")
    # the fastest variant of each kernel, whichever it is (and all-warp-specialized)
    pick = {kernel: min((op for op in cfgs if op.split("_")[0] == kernel
                         and "atomic" not in op), key=lambda op: cfgs_ms[op])
            for kernel in ("fwd", "dkdv", "dq")}
    explicit = {kernel: _variant_config(op, cfgs[op]) for kernel, op in pick.items()}
    runs[("sweep_best_any", "fwd")] = lambda: T.fwd(q, k, v, None, causal, scale,
                                                    config=explicit["fwd"])

    def any_fwd_bwd(chosen):
        def run():
            o, lse = T.fwd(q, k, v, None, causal, scale, config=chosen["fwd"])
            return T.bwd(q, k, v, o, lse, do, None, causal, scale, True,
                         config=(chosen["dkdv"], chosen["dq"]))

        return run

    runs[("sweep_best_any", "fwd_bwd")] = any_fwd_bwd(explicit)
    _append(args.part, {"kind": "sweep_best_pick", "D": D, "causal": causal, "pick": pick,
                        "configs": explicit})
    if all(f"{kernel}_ws" in cfgs for kernel in ("fwd", "dkdv", "dq")):
        ws = {kernel: _variant_config(f"{kernel}_ws", cfgs[f"{kernel}_ws"])
              for kernel in ("fwd", "dkdv", "dq")}
        runs[("sweep_best_ws", "fwd")] = lambda: T.fwd(q, k, v, None, causal, scale,
                                                       config=ws["fwd"])
        runs[("sweep_best_ws", "fwd_bwd")] = any_fwd_bwd(ws)
    if ws_only:
        runs = {key: fn for key, fn in runs.items() if key[0] == "sweep_best_ws"
                or (key[0] == "sweep_best_any" and any(op.endswith("_ws")
                                                       for op in pick.values()))}
    for (name, mode), fn in runs.items():
        meta = {"provider": name, "mode": mode, "dtype": "bf16", "D": D, "N": N, "B": B, "H": H,
                "causal": causal, "configs": cfgs}
        _measure(args, args.part, meta, lambda fn=fn: (fn, None, _null), timer)
    if ws_only:
        return
    for mode in ("fwd", "fwd_bwd"):
        meta = {"provider": "sdpa_cudnn", "mode": mode, "dtype": "bf16", "D": D, "N": N,
                "B": B, "H": H, "causal": causal}
        _measure(args, args.part, meta,
                 lambda mode=mode: provs["sdpa_cudnn"](q, k, v, do, causal, mode), timer)


def sweep_markdown(rows: list[dict]) -> str:
    lines = ["### Config sweep (ms per call; dkdv / dq rows time the whole backward with the",
             "other kernel at its default config)", ""]
    timed = [r for r in rows if r.get("kind") == "sweep" and "ms" in r]
    wrong = [r for r in timed if not r.get("same_result", True)]
    if wrong:
        lines += ["**Configs whose result differs from the first config's (> 2e-2), left out "
                  "of 'best':** " + ", ".join(f"{r['op']} D={r['D']} causal={r['causal']} "
                                              f"{tuple(r['cfg'])}: {r['max_rel_diff']:.1e}"
                                              for r in wrong), ""]
    for D, causal in sorted({(r["D"], r["causal"]) for r in timed}, reverse=True):
        lines += [f"**D={D}, causal={causal}, N={timed[0]['N']}**", "",
                  "| kernel | best 3 configs (ms) | table default (ms) |", "|---|---|---|"]
        for op in SWEEP_OPS:
            rs = sorted((r for r in timed if (r["D"], r["causal"], r["op"]) == (D, causal, op)),
                        key=lambda r: r["ms"])
            if not rs:
                continue
            try:
                default = tuple(_table(op, D)[0])
            except Exception:  # noqa: BLE001 - no table entry (dkdv_ovl_tma at D=64)
                default = None
            d_ms = next((r["ms"] for r in rs if tuple(r["cfg"]) == default), None)
            top = ", ".join(f"{tuple(r['cfg'])}: {r['ms']:.3f}" for r in rs[:3])
            lines.append(f"| {op} | {top} | " + (f"{d_ms:.3f} |" if d_ms else "- |"))
        lines.append("")
    bench = [r for r in rows if r.get("kind") == "bench" and "tflops" in r]
    if bench:
        lines += ["| D | causal | mode | provider | TFLOP/s | / SDPA cuDNN |",
                  "|---|---|---|---|---|---|"]
        ref = {(r["D"], r["causal"], r["mode"]): r["tflops"] for r in bench
               if r["provider"] == "sdpa_cudnn"}
        for r in bench:
            c = ref.get((r["D"], r["causal"], r["mode"]))
            tf = f"{r['tflops']:.0f}" if r["tflops"] >= 10 else f"{r['tflops']:.2g}"
            lines.append(f"| {r['D']} | {r['causal']} | {r['mode']} | {r['provider']} | {tf} | "
                         + (f"{r['tflops'] / c:.2f} |" if c else "- |"))
    return "\n".join(lines)


def _start(args, prefix: str) -> tuple[float, float, dict, str]:
    """(start time, global deadline, environment, scratch dir) of an orchestrated run.

    Children share one Triton disk cache (the warm phase fills it)."""
    t0 = time.time()
    os.environ.setdefault("TRITON_CACHE_DIR",
                          os.path.join(tempfile.gettempdir(), "torchfn_triton_cache"))
    info = env_info(args.dry_run)
    print("== environment\n" + json.dumps(info, indent=1), flush=True)
    return t0, t0 + args.budget_s, info, tempfile.mkdtemp(prefix=prefix)


def orchestrate_sweep(args) -> int:
    t0, end, info, tmp = _start(args, "torchfn_gpu_sweep_")
    nw = args.workers or max(1, min(14, (os.cpu_count() or 2) - 2))
    if args.dry_run:
        nw = min(nw, 2)
    warm_deadline = t0 + 0.55 * args.budget_s
    print(f"== sweep warm: {nw} workers, {len(_sweep_tasks(args.dry_run))} kernels "
          f"(deadline +{warm_deadline - t0:.0f}s)", flush=True)
    parts = [os.path.join(tmp, f"sweepwarm{i}.jsonl") for i in range(nw)]
    procs = [_spawn(args, "sweepwarm", parts[i], warm_deadline,
                    os.path.join(tmp, f"sweepwarm{i}.log"), i, nw) for i in range(nw)]
    codes = _wait(procs, warm_deadline + 20)
    warm = [r for p in parts for r in _read_rows(p)]
    print(f"   compiled {sum(1 for r in warm if r.get('ok'))}/{len(warm)}; "
          f"worker exits {codes}", flush=True)
    part, part_ws = os.path.join(tmp, "sweep.jsonl"), os.path.join(tmp, "sweepws.jsonl")
    # the warp-specialized ops get the last share of the time, in a child of their own
    main_end = time.time() + 0.8 * (end - time.time())
    print(f"== sweep timing (deadline +{main_end - t0:.0f}s), then the warp-specialized "
          f"kernels (+{end - t0:.0f}s)", flush=True)
    _wait([_spawn(args, "sweep", part, main_end, None)], main_end + 60)
    codes = _wait([_spawn(args, "sweepws", part_ws, end, None, main_part=part)], end + 30)
    if codes != [0]:
        print(f"   warp-specialized sweep child exited {codes} (None: killed, e.g. a hang)",
              flush=True)
    rows = _read_rows(part) + _read_rows(part_ws)
    md = sweep_markdown(rows)
    result = {"env": info, "args": {"budget_s": args.budget_s, "sweep": True, "workers": nw},
              "warm": warm, "sweep": rows, "markdown": md,
              "elapsed_s": round(time.time() - t0, 1)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(md + "\n")
    print("\n" + md, flush=True)
    print(f"== wrote {args.out} in {result['elapsed_s']} s", flush=True)
    return 0


# ============================================================================ orchestration
def _spawn(args, phase: str, part: str, deadline: float, log: str | None,
           worker_id: int = 0, nworkers: int = 1, main_part: str | None = None,
           ) -> subprocess.Popen:
    cmd = [sys.executable, HERE, "--phase", phase, "--part", part, "--deadline", repr(deadline),
           "--worker-id", str(worker_id), "--nworkers", str(nworkers)]
    if main_part:
        cmd += ["--main-part", main_part]
    if args.ws:
        cmd.append("--ws")
    if args.dry_run:
        cmd.append("--dry-run")
    out = open(log, "w") if log else None  # noqa: SIM115
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None,
                            start_new_session=True)


def _wait(procs: list[subprocess.Popen], hard_deadline: float) -> list[int | None]:
    while any(p.poll() is None for p in procs) and time.time() < hard_deadline:
        time.sleep(0.5)
    codes = []
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                p.kill()
            p.wait()
            codes.append(None)  # killed
        else:
            codes.append(p.returncode)
    return codes


def summarize(bench: list[dict], dry: bool) -> dict:
    """torchfn / best SDPA backend (and / flex) at N >= 4k, forward, fwd+bwd and derived bwd."""
    def key(r):
        return (r["dtype"], r["D"], r["causal"], r["N"])

    ms: dict = {}
    for r in bench:
        if "ms" in r:
            ms[(r["provider"], r["mode"], *key(r))] = r["ms"]
    out: list[dict] = []
    n_min = 0 if dry else 4096
    for k in sorted({key(r) for r in bench if "N" in r}):
        if k[3] < n_min:
            continue
        entry = {"dtype": k[0], "D": k[1], "causal": k[2], "N": k[3]}
        for mode in ("fwd", "fwd_bwd", "bwd"):
            def t(p, mode=mode, k=k):
                if mode != "bwd":
                    return ms.get((p, mode, *k))
                f, fb = ms.get((p, "fwd", *k)), ms.get((p, "fwd_bwd", *k))
                return None if f is None or fb is None or fb <= f else fb - f

            ours = t("torchfn")
            sd = [x for x in (t("sdpa_flash"), t("sdpa_cudnn")) if x is not None]
            if ours and sd:
                entry[f"{mode}_vs_best_sdpa"] = min(sd) / ours  # speed ratio, > 1: faster
            for variant in ("atomic", "ordered"):  # backward variants: torchfn's forward
                x = t(f"torchfn_{variant}") if mode == "fwd_bwd" else None
                fb_x, f = ms.get((f"torchfn_{variant}", "fwd_bwd", *k)), t("torchfn", "fwd")
                if mode == "bwd" and fb_x and f:
                    x = fb_x - f if fb_x > f else None
                if x and sd:
                    entry[f"{mode}_{variant}_vs_best_sdpa"] = min(sd) / x
            for variant in ("ptr", "ws"):
                x = t(f"torchfn_{variant}")
                if x and sd:
                    entry[f"{mode}_{variant}_vs_best_sdpa"] = min(sd) / x
            if ours and t("flex"):
                entry[f"{mode}_vs_flex"] = t("flex") / ours
        out.append(entry)
    agg = {}
    for mode in ("fwd", "fwd_bwd", "bwd", "fwd_ptr", "fwd_bwd_ptr", "bwd_ptr", "fwd_ws",
                 "fwd_bwd_ws", "bwd_ws", "fwd_bwd_atomic", "bwd_atomic", "fwd_bwd_ordered",
                 "bwd_ordered"):
        vals = [e[f"{mode}_vs_best_sdpa"] for e in out if f"{mode}_vs_best_sdpa" in e]
        vals = [x for x in vals if x > 0]
        if vals:
            agg[mode] = {"min": round(min(vals), 3), "geomean": round(math.exp(
                sum(math.log(x) for x in vals) / len(vals)), 3), "n": len(vals),
                "meets_0.9": min(vals) >= 0.9}
    return {"per_shape": out, "overall_torchfn_over_best_sdpa": agg}


def markdown(result: dict) -> str:
    lines = [f"GPU: {result['env'].get('gpu')} | torch {result['env'].get('torch')} | "
             f"triton {result['env'].get('triton')} | CUDA {result['env'].get('cuda_runtime')} | "
             f"driver/nvidia-smi: {result['env'].get('nvidia_smi')}", ""]
    lines += ["### Correctness (raw Triton ops vs float64; fp16/bf16 bound = 2x SDPA error)", "",
              "| case | o | dq | dk | dv | to | lse | pass |", "|---|---|---|---|---|---|---|---|"]
    for r in result["correctness"]:
        e = r.get("errors")
        if not e:
            lines.append(f"| {r.get('case')} | error: {r.get('error', '')[:80]} ||||||  no |")
            continue
        b = r.get("sdpa_errors", {})

        def cell(n, e=e, b=b):
            return f"{e[n]:.1e}" + (f" ({b[n]:.1e})" if n in b else "")

        lines.append(f"| {r['case']} | {cell('o')} | {cell('dq')} | {cell('dk')} | {cell('dv')} "
                     f"| {cell('to')} | {r['lse_err']:.1e} | "
                     f"{'yes' if r['pass'] else 'NO: ' + ','.join(r['fails'])} |")
    lines += ["", "### TFLOP/s (FlashAttention convention; fwd+bwd = 3.5x fwd flops)", "",
              "| dtype | D | causal | N | mode | torchfn | torchfn atomic-dQ | torchfn ordered-dQ "
              "| torchfn no TMA | torchfn api | SDPA flash | SDPA cuDNN | flex | torchfn +WS "
              "| torchfn / best SDPA | atomic-dQ / best SDPA | ordered-dQ / best SDPA "
              "| +WS / best SDPA |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = [r for r in result["bench"] if "N" in r]
    idx = {(r["provider"], r["mode"], r["dtype"], r["D"], r["causal"], r["N"]): r for r in rows}
    keys = sorted({(r["dtype"], r["D"], r["causal"], r["N"], r["mode"]) for r in rows})
    for dt, D, c, N, mode in keys:
        def val(p, dt=dt, D=D, c=c, N=N, mode=mode):
            r = idx.get((p, mode, dt, D, c, N))
            if r is None:
                return None, "-"
            if "tflops" in r:
                x = r["tflops"]
                return x, (f"{x:.0f}" if x >= 10 else f"{x:.2g}")
            return None, "skip" if "skipped" in r else "err"

        vals = {p: val(p) for p in ("torchfn", "torchfn_atomic", "torchfn_ordered",
                                    "torchfn_ptr", "torchfn_api", "sdpa_flash", "sdpa_cudnn",
                                    "flex", "torchfn_ws")}
        best = max([v[0] for p, v in vals.items() if p.startswith("sdpa") and v[0]], default=None)
        ratio = f"{vals['torchfn'][0] / best:.2f}" if best and vals["torchfn"][0] else "-"
        ratios = [f"{vals[p][0] / best:.2f}" if best and vals[p][0] else "-"
                  for p in ("torchfn_atomic", "torchfn_ordered", "torchfn_ws")]
        lines.append(f"| {dt} | {D} | {'yes' if c else 'no'} | {N} | {mode} | "
                     + " | ".join(v[1] for v in vals.values()) + f" | {ratio} | "
                     + " | ".join(ratios) + " |")
    agg = result["summary"].get("overall_torchfn_over_best_sdpa", {})
    if agg:
        lines += ["", "torchfn / best SDPA backend at N >= 4k (speed ratio, bwd = fwd_bwd - fwd): "
                  + "; ".join(f"{m}: min {a['min']}, geomean {a['geomean']} (n={a['n']})"
                              for m, a in agg.items())]
    return "\n".join(lines)


def orchestrate(args) -> int:
    # FlexAttention compiles single-threaded (several processes compile at once; the same
    # inductor config in the warm-up and the timed process keeps its cache keys equal)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    t0, end, info, tmp = _start(args, "torchfn_gpu_attn_")
    phases: dict = {}

    # 1. warm: compile in parallel + correctness; one worker pre-compiles FlexAttention
    nw = args.workers or max(1, min(12, (os.cpu_count() or 2) - 4))
    if args.dry_run:
        nw = min(nw, 2)
    warm_deadline = t0 + 0.4 * args.budget_s
    nflex = 1 if args.dry_run else 4
    print(f"== warm: {nw} Triton workers + {nflex} flex workers "
          f"(deadline +{warm_deadline - t0:.0f}s)", flush=True)
    procs, parts = [], []
    for i in range(nw):
        parts.append(os.path.join(tmp, f"warm{i}.jsonl"))
        procs.append(_spawn(args, "warm", parts[-1], warm_deadline,
                            os.path.join(tmp, f"warm{i}.log"), i, nw))
    flexparts = [os.path.join(tmp, f"flexwarm{j}.jsonl") for j in range(nflex)]
    for j in range(nflex):
        procs.append(_spawn(args, "flexwarm", flexparts[j], warm_deadline,
                            os.path.join(tmp, f"flexwarm{j}.log"), j, nflex))
    codes = _wait(procs, warm_deadline + 20)
    flexwarm_rows = [r for p in flexparts for r in _read_rows(p)]
    phases["warm"] = {"secs": round(time.time() - t0, 1), "exit_codes": codes}
    warm_rows = [r for p in parts for r in _read_rows(p)]
    correctness = [r for r in warm_rows if r.get("kind") == "correctness"]
    warm = [r for r in warm_rows if r.get("kind") == "warm"]
    bad_warm = [r for r in warm if not r.get("ok")]
    print(f"   compiled {sum(1 for r in warm if r.get('ok'))}/{len(warm)} configs; "
          f"flex pre-compiled: {sum(1 for r in flexwarm_rows if 'error' not in r)}/"
          f"{len(flexwarm_rows)}", flush=True)
    for r in bad_warm[:8]:
        print(f"   warm failure {r.get('task')}: {r.get('error') or r.get('skipped')}", flush=True)
    print("== correctness", flush=True)
    for r in correctness:
        if "errors" in r:
            print(f"   {r['case']:32s} {'PASS' if r['pass'] else 'FAIL ' + str(r['fails'])}  "
                  + " ".join(f"{n}={v:.1e}" for n, v in r["errors"].items())
                  + (f"  sdpa: {' '.join(f'{n}={v:.1e}' for n, v in r['sdpa_errors'].items())}"
                     if "sdpa_errors" in r else ""), flush=True)
        else:
            print(f"   {r.get('case')}: ERROR {r.get('error')}", flush=True)
    for i in range(nw):  # a crashed worker: show the end of its log
        if codes[i] not in (0, None):
            with open(os.path.join(tmp, f"warm{i}.log")) as f:
                print(f"   worker {i} exit {codes[i]}:\n" + f.read()[-1500:], flush=True)

    # 2. bench (torchfn, SDPA backends, public API), 3. flex
    bench_part = os.path.join(tmp, "bench.jsonl")
    now = time.time()
    bench_deadline = now + 0.75 * max(0.0, end - now)
    print(f"== bench (deadline +{bench_deadline - t0:.0f}s)", flush=True)
    t1 = time.time()
    codes = _wait([_spawn(args, "bench", bench_part, bench_deadline, None)], bench_deadline + 60)
    phases["bench"] = {"secs": round(time.time() - t1, 1), "exit_code": codes[0]}
    flex_part = os.path.join(tmp, "flex.jsonl")
    print(f"== flex (deadline +{end - t0:.0f}s)", flush=True)
    t1 = time.time()
    codes = _wait([_spawn(args, "flex", flex_part, end, None)], end + 60)
    phases["flex"] = {"secs": round(time.time() - t1, 1), "exit_code": codes[0]}

    bench_rows = _read_rows(bench_part)
    flex_rows = _read_rows(flex_part)
    bench = [r for r in bench_rows + flex_rows if r.get("kind") == "bench"]
    phase_errors = [r for r in warm_rows + bench_rows + flex_rows if r.get("kind") == "phase_error"]
    for r in phase_errors:
        print(f"   phase {r['phase']} crashed: {r['error']}\n{r.get('trace', '')}", flush=True)
    result = {
        "env": info,
        "args": {"budget_s": args.budget_s, "dry_run": args.dry_run, "workers": nw},
        "correctness": correctness,
        "correctness_all_pass": bool(correctness) and all(r.get("pass") for r in correctness),
        "warm": {"compiled": sum(1 for r in warm if r.get("ok")), "tasks": len(warm),
                 "failures": bad_warm, "flex": flexwarm_rows},
        "diff_vs_sdpa": [r for r in bench_rows if r.get("kind") == "diff_vs_sdpa"],
        "bench": bench,
        "tuned_configs": [r for r in bench_rows if r.get("kind") == "tuned"],
        "summary": {},
        "phases": phases,
        "phase_errors": phase_errors,
        "elapsed_s": round(time.time() - t0, 1),
        "tmp_dir": tmp,
    }
    try:
        result["summary"] = summarize(bench, args.dry_run)
    except Exception as e:  # noqa: BLE001 - never lose the measurements to a summary bug
        result["summary"] = {"error": _err_str(e), "trace": traceback.format_exc()[-1500:]}
    try:
        md = markdown(result)
    except Exception as e:  # noqa: BLE001
        md = f"(markdown failed: {_err_str(e)})"
    result["markdown"] = md
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    md_path = os.path.splitext(args.out)[0] + ".md"
    with open(md_path, "w") as f:
        f.write(md + "\n")
    logs = os.path.splitext(args.out)[0] + "_logs"  # worker logs / raw rows, for post-mortems
    try:
        import shutil

        shutil.copytree(tmp, logs, dirs_exist_ok=True)
    except Exception as e:  # noqa: BLE001
        print(f"could not copy the logs: {_err_str(e)}", flush=True)
    print("\n" + md, flush=True)
    print(f"\n== phases: {json.dumps(phases)}", flush=True)
    print(f"== wrote {args.out} and {md_path} in {result['elapsed_s']} s", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "gpu_attention.json"))
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="global deadline: no new measurement starts after it")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU smoke test of this script: Triton interpreter, tiny sizes")
    ap.add_argument("--workers", type=int, default=0, help="parallel compile workers (0: auto)")
    ap.add_argument("--sweep", action="store_true",
                    help="time every kernel over a grid of block configs instead (own run)")
    ap.add_argument("--ws", action="store_true",
                    help="bench the opt-in warp-specialized variants (torchfn_ws), not torchfn_ptr")
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--part", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--worker-id", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--nworkers", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--main-part", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ["TORCHFN_TRITON_TMA"] = "auto"  # the library default; providers switch it
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere
    elif os.environ.get("TRITON_INTERPRET") == "1":
        print("warning: TRITON_INTERPRET=1 is set: the kernels will run in the interpreter",
              flush=True)
    if args.phase is None:
        return orchestrate_sweep(args) if args.sweep else orchestrate(args)
    try:
        if args.phase == "warm":
            phase_warm(args)
        elif args.phase == "bench":
            phase_bench(args)
        elif args.phase == "flex":
            phase_flex(args, time_it=True)
        elif args.phase == "flexwarm":
            phase_flex(args, time_it=False)
        elif args.phase == "sweepwarm":
            phase_sweepwarm(args)
        elif args.phase in ("sweep", "sweepws"):
            phase_sweep(args, ws=args.phase == "sweepws")
    except Exception as e:  # noqa: BLE001
        _append(args.part, {"kind": "phase_error", "phase": args.phase, "error": _err_str(e),
                            "trace": traceback.format_exc()[-2000:]})
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
