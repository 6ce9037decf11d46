#!/usr/bin/env python
"""Compile every GPU config candidate of the Triton attention kernels for sm_90, on a CPU.

No GPU is needed: Triton's ahead-of-time compiler targets ``cuda:90`` with the
``ptxas`` and ``cuobjdump`` bundled in the triton wheel. Each candidate of
``_triton_configs._GPU_CONFIGS`` (bf16 or ``--dtype fp32``, head dims 64 and 128 by default,
``--dims 256`` too, causal off) is compiled with
the same specialisation the JIT gives a realistic launch (pointers and strides
divisible by 16, GQA group 1), and the script prints, per config:

* ``regs``: registers per thread (255 is the ceiling),
* ``spill``: bytes of local-memory stack (register spills; 0 is the goal),
* ``smem``: shared memory per block (an H100 / H200 block may use 227 KiB).

A kind ending in ``_tma`` (``fwd_tma``, ``dkdv_tma``, ...) is that kernel with ``USE_TMA``
and the configs of ``_GPU_TMA_CONFIGS``: its streamed tiles come through tensor
descriptors, which the GPU autotuner tries on sm_90+. ``fwd_ovl`` and ``dkdv_ovl`` are
the overlap variants (``PIPELINE``, ``EARLY_DP``) with the configs of
``_GPU_OVERLAP_CONFIGS``, each with its own TMA flag. ``dkdv_ordered`` is dK/dV with the
ordered dQ (``DQ_ORDERED``: TMA bulk reduces behind spin locks, ``_triton_ordered_dq``),
``dkdv_reduce`` the same reduces without the locks (``deterministic=False``).
``fwd_ws``, ``dkdv_ws`` and ``dq_ws`` are the warp-specialized variants (``WARP_SPEC``,
``_GPU_WS_CONFIGS``); for them ``warps`` is what Triton made of the 4 requested (12: a
producer and two consumer warpgroups) and ``setmaxnreg`` counts the register
hand-overs between them. A ``_ws``
candidate that Triton did not specialize (12 warps, ``setmaxnreg`` > 0) fails the check.

It exits 1 when a candidate spills or overflows shared memory, so it can guard edits
to the config table. Without the divisibility hints the pipeliner cannot prove 16-byte
alignment, emits no ``cp.async`` and every config looks single-buffered: the hints are
what makes this match the GPU. Usage, from the repository root::

    PYTHONPATH=src python bench/aot_sm90.py [--kinds fwd dkdv] [--dims 128]

``--sass`` prints each candidate's SASS opcode counts instead (``sass_counts``), a
proxy for per-tile work when no GPU can time a change, and ``ovl``: how many of the
``MUFU`` (exp2) instructions are issued while a wgmma is in flight (``wgmma_overlap``),
i.e. overlap tensor-core work::

    PYTHONPATH=src python bench/aot_sm90.py --sass --kinds fwd_tma --dims 128

Results depend on the Triton version (3.9 here; the lent H200 ran 3.6). To check with
3.6 on this machine: a second virtual environment with ``triton==3.6.0`` and a ``.pth``
file naming this environment's site-packages (for torch), then
``PYTHONPATH=src <its python> bench/aot_sm90.py``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the JIT's default, without a warning

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

SMEM_LIMIT = 227 * 1024
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_PTRS = {"Q", "K", "V", "TQ", "TK", "TV", "MASK", "O", "TO", "DO", "DQ", "DK", "DV"}
_FP32_PTRS = {"LSE", "LSE2", "DELTA", "DQACC", "TLSE"}
_SEG_PTRS = {"QSEG": "*i32", "KSEG": "*i32", "RLO": "*i32", "RHI": "*i32"}  # segment labels
_INT_ONE = {"GROUP"}  # the JIT turns an int argument equal to 1 into a constant


def _kernel(kind: str):
    from torchfn.kernels import _triton_bwd, _triton_fwd, _triton_jvp

    return {
        "fwd": _triton_fwd._attn_fwd,
        "jvp": _triton_jvp._attn_jvp,
        "dkdv": _triton_bwd._attn_bwd_dkdv,
        "dkdv_atomic": _triton_bwd._attn_bwd_dkdv,
        "dkdv_ordered": _triton_bwd._attn_bwd_dkdv,
        "dkdv_reduce": _triton_bwd._attn_bwd_dkdv,
        "dq": _triton_bwd._attn_bwd_dq,
    }[kind]


# the tiles each kernel reads through tensor descriptors with USE_TMA: BLOCK_M or BLOCK_N rows
_TMA_DESCS = {
    "fwd": {"desc_q": "m", "desc_k": "n", "desc_v": "n"},
    "dkdv": {"desc_q": "m", "desc_do": "m"},
    "dkdv_atomic": {"desc_q": "m", "desc_do": "m"},
    "dkdv_ordered": {"desc_q": "m", "desc_do": "m"},
    "dkdv_reduce": {"desc_q": "m", "desc_do": "m"},
    "dq": {"desc_k": "n", "desc_v": "n"},
}


def _compile(kind: str, head_dim: int, cfg: tuple[int, int, int, int], dtype: str,
             causal: bool = False, gqa: bool = False, window: bool = False,
             segments: bool = False, softcap: bool = False, dropout: bool = False,
             alibi: bool = False, split: bool = False):
    """The Triton-compiled sm_90 kernel of one (kind, head dim, config, dtype); ``gqa``:
    the GQA group size is a runtime integer (the JIT makes it a constant when it is 1);
    ``window``: the sliding-window (band) kernel, which the launcher never warp-specializes;
    ``segments``: the band kernel with segment ids (document masking); ``softcap``: with
    logit soft-capping (no scale fold); ``dropout``: with keyed attention dropout;
    ``alibi``: with the ALiBi bias (no scale fold); ``split``: the split-KV forward."""
    int_one = set() if gqa else _INT_ONE
    from torchfn.kernels._triton_configs import _OVERLAP

    tma = kind.endswith("_tma")
    kind = kind.removesuffix("_tma")
    ovl = kind.endswith("_ovl")
    kind = kind.removesuffix("_ovl")
    ws = kind.endswith("_ws")
    kind = kind.removesuffix("_ws")
    fn = _kernel(kind)
    bm, bn, warps, stages = cfg[:4]
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    consts = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, IS_CAUSAL=causal, MASK_KIND=0,
                  DOT_PREC="tf32x3" if dtype == "fp32" else "tf32", UPCAST=False,
                  BLOCK_M=bm, BLOCK_N=bn)
    if kind == "dkdv_atomic":
        consts["DQ_ATOMIC"] = True
    if kind in ("dkdv_ordered", "dkdv_reduce"):  # dQ by TMA bulk reduce, in turn or not
        consts["DQ_ORDERED"] = 1 if kind == "dkdv_ordered" else 2
    if ovl:
        consts[_OVERLAP[kind]] = True
    if ws:  # warp-specialized: descriptors made in the kernel, every block masked
        consts["WARP_SPEC"] = True  # (WS_MASKED's default: the costlier case, always built)
    # the options the launcher never warp-specializes; FOLD_SCALE: the forward's scale fold
    options = {"window": (window or segments, {"WINDOW": True, "IS_CAUSAL": False}),
               "softcap": (softcap, {"SOFTCAP": True, "FOLD_SCALE": False}),
               "dropout": (dropout, {"DROPOUT": True}),
               "alibi": (alibi, {"ALIBI": True, "FOLD_SCALE": False}),
               "split": (split, {"SPLIT": True})}
    for name, (on, flags) in options.items():
        if not on:
            continue
        if ws:
            raise ValueError(f"the launcher never warp-specializes a kernel with {name}")
        # (a window folds causal into its band; only the forward has FOLD_SCALE)
        consts.update({f: v for f, v in flags.items() if f != "FOLD_SCALE" or kind == "fwd"})
    consts["SEGMENTS"] = segments
    descs = {}
    if tma:
        consts["USE_TMA"] = True
        descs = {n: bm if r == "m" else bn for n, r in _TMA_DESCS[kind].items()}
    if kind == "jvp":
        consts.update(HAS_TQ=True, HAS_TK=True, HAS_TV=True)
    for param in fn.params:  # constexpr parameters left out take their defaults
        if param.is_constexpr and param.name not in consts and param.has_default:
            consts[param.name] = param.default
    sig = {}
    for name in fn.arg_names:
        if name in descs:
            sig[name] = f"tensordesc<{dtype}[1, 1, {descs[name]}, {block_d}]>"
        elif name in _SEG_PTRS:
            if not segments:  # left at its default, None
                consts[name] = None
            sig[name] = _SEG_PTRS[name] if segments else "constexpr"
        elif name == "SEED":
            if not dropout:  # left at its default, None
                consts[name] = None
            sig[name] = "*i32" if dropout else "constexpr"
        elif name == "SLOPES":
            if not alibi:
                consts[name] = None
            sig[name] = "*fp32" if alibi else "constexpr"
        elif name == "desc_dq" and "DQ_ORDERED" in consts:  # the float32 dQ accumulator
            sig[name] = f"tensordesc<fp32[1, 1, {bm}, {block_d}]>"
        elif name == "LOCKS" and "DQ_ORDERED" in consts:
            sig[name] = "*i32"
        elif name in ("LOCKS", "desc_dq"):  # unused: the launch passes None
            consts[name] = None
            sig[name] = "constexpr"
        elif name.startswith("desc_"):  # unused descriptor: the launch passes None
            consts[name] = None
            sig[name] = "constexpr"
        elif name in consts or name in int_one:
            sig[name] = "constexpr"
        elif name in _PTRS:
            sig[name] = f"*{dtype}"
        elif name in _FP32_PTRS:
            sig[name] = "*fp32"
        elif name in ("qk_scale", "sm_scale", "cap2", "drop_scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    consts.update({n: 1 for n in int_one if n in fn.arg_names})
    sig.update({n: "constexpr" for n in consts if n in sig})
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n] == "i32" or sig[n].startswith("*")}
    src = ASTSource(fn=fn, signature=sig, attrs=attrs,
                    constexprs={(fn.arg_names.index(n),): v for n, v in consts.items()
                                if n in fn.arg_names})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages))


def _cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([os.path.join(_BIN, "cuobjdump"), flag, f.name],
                              capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def _sass(kind: str, head_dim: int, cfg: tuple, dtype: str = "bf16",
          causal: bool = False) -> str:
    return _cuobjdump(_compile(kind, head_dim, cfg, dtype, causal).asm["cubin"], "-sass")


def sass_counts(kind: str, head_dim: int, cfg: tuple[int, int, int, int],
                dtype: str = "bf16", causal: bool = False) -> dict[str, int]:
    """Opcode -> count in the kernel's sm_90 SASS (the whole kernel, loop bodies once).

    A proxy for per-tile work when no GPU can time a change: e.g. ``FMUL`` + ``FFMA``
    per score element in the online softmax.
    """
    return _opcode_counts(_sass(kind, head_dim, cfg, dtype, causal))


def _opcode_counts(sass: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    opcode = r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)"
    for m in re.finditer(opcode, sass):
        op = m.group(1).split(".")[0]
        counts[op] = counts.get(op, 0) + 1
    return counts


def wgmma_overlap(sass: str, ops: tuple[str, ...] = ("MUFU",)) -> dict[str, tuple[int, int]]:
    """Opcode -> (issued while a wgmma is in flight, total), in SASS order.

    In flight: from a group's first ``HGMMA`` until a ``WARPGROUP.DEPBAR.LE gsb0, n``
    leaves no committed group pending (a group commits at its ``HGMMA ... gsb0``). A
    static reading of straight-line code, loop bodies once: it shows whether the
    compiler lets the softmax arithmetic run beside the tensor cores, not how long.
    """
    pending, open_group = 0, False
    counts: dict[str, list[int]] = {op: [0, 0] for op in ops}
    line_re = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
    for m in line_re.finditer(sass):
        op, rest = m.group(1), m.group(2)
        base = op.split(".")[0]
        if base == "HGMMA":
            if "gsb0" in rest:
                pending, open_group = pending + 1, False
            else:
                open_group = True
        elif op.startswith("WARPGROUP.DEPBAR"):
            pending = min(pending, int(rest.split(",")[-1].strip(), 16))
        elif base in counts:
            counts[base][1] += 1
            counts[base][0] += bool(pending or open_group)
    return {op: (a, b) for op, (a, b) in counts.items()}


def compile_sm90(kind: str, head_dim: int, cfg: tuple[int, int, int, int],
                 dtype: str = "bf16", causal: bool = False, gqa: bool = False,
                 window: bool = False, segments: bool = False, softcap: bool = False,
                 dropout: bool = False, alibi: bool = False, split: bool = False) -> dict:
    """Compile one (kind, head dim, config) for sm_90: {'regs', 'spill', 'smem', 'warps',
    'setmaxnreg'}.

    ``dtype``: "bf16" or "fp32" (fp32 dots as 3xTF32, the GPU default). A kind ending
    in ``_tma`` is that kernel with ``USE_TMA`` (tensor-descriptor loads), one ending in
    ``_ws`` the warp-specialized variant.
    """
    if split and kind.removesuffix("_tma").removesuffix("_ovl") not in ("fwd", "dq"):
        raise ValueError(f"only the forward and dQ split their keys, not {kind}")
    compiled = _compile(kind, head_dim, cfg, dtype, causal, gqa, window, segments, softcap,
                        dropout, alibi, split)
    usage = _cuobjdump(compiled.asm["cubin"], "-res-usage")
    regs, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    sass = _cuobjdump(compiled.asm["cubin"], "-sass") if kind.endswith("_ws") else ""
    return {"regs": int(regs.group(1)), "spill": int(stack.group(1)) if stack else 0,
            "smem": compiled.metadata.shared, "warps": compiled.metadata.num_warps,
            "setmaxnreg": sass.count("SETMAXREG")}


def compile_merge_sm90(head_dim: int, splits: int, dtype: str = "bf16") -> dict:
    """Compile the split-KV merge kernel (``_triton_merge``) for sm_90: as ``compile_sm90``."""
    from torchfn.kernels._triton_merge import _merge_splits as fn

    consts = dict(HEAD_DIM=head_dim, BLOCK_D=max(16, 1 << (head_dim - 1).bit_length()),
                  BLOCK_S=max(2, 1 << (splits - 1).bit_length()))
    sig = {n: "constexpr" if n in consts else "*fp32" if n in ("O_PART", "LSE_PART", "LSE")
           else f"*{dtype}" if n == "O" else "i32" for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={
        (fn.arg_names.index(n),): v for n, v in consts.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=4, num_stages=1))
    usage = _cuobjdump(compiled.asm["cubin"], "-res-usage")
    stack = re.search(r"STACK:(\d+)", usage)
    return {"regs": int(re.search(r"REG:(\d+)", usage).group(1)),
            "spill": int(stack.group(1)) if stack else 0, "smem": compiled.metadata.shared}


def main(argv: list[str] | None = None) -> int:
    from torchfn.kernels._triton_configs import (
        _GPU_CONFIGS,
        _GPU_OVERLAP_CONFIGS,
        _GPU_TMA_CONFIGS,
        _GPU_WS_CONFIGS,
    )

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kinds", nargs="+",
                    default=[*_GPU_CONFIGS, *(f"{k}_tma" for k in _GPU_TMA_CONFIGS),
                             *(f"{k}_ovl" for k in _GPU_OVERLAP_CONFIGS),
                             *(f"{k}_ws" for k in _GPU_WS_CONFIGS)])
    ap.add_argument("--causal", action="store_true",
                    help="build the causal kernels (the warp-specialized ones differ most)")
    ap.add_argument("--window", action="store_true",
                    help="build the sliding-window (band) kernels (not for the _ws kinds)")
    ap.add_argument("--segments", action="store_true",
                    help="build the band kernels with segment ids (document masking)")
    ap.add_argument("--softcap", action="store_true",
                    help="build the kernels with logit soft-capping")
    ap.add_argument("--dropout", action="store_true",
                    help="build the kernels with keyed attention dropout (not for the _ws kinds)")
    ap.add_argument("--alibi", action="store_true",
                    help="build the kernels with the ALiBi bias (not for the _ws kinds)")
    ap.add_argument("--split", action="store_true",
                    help="build the split-KV forward and dQ (only the fwd and dq kinds but _ws)")
    ap.add_argument("--gqa", action="store_true",
                    help="build for a GQA group > 1 (a runtime integer, not the constant 1)")
    ap.add_argument("--dims", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                    help="fp32 checks the table's fp32 lists (head dim <= 128 or 256)")
    ap.add_argument("--sass", action="store_true",
                    help="print SASS opcode counts (FMUL, FFMA, MUFU, HGMMA, ...) per candidate")
    args = ap.parse_args(argv)
    bad = 0
    for kind in args.kinds:
        for d in args.dims:
            base = kind.removesuffix("_tma")
            if base.endswith("_ovl"):  # entries carry their own TMA flag
                table = _GPU_OVERLAP_CONFIGS[base.removesuffix("_ovl")]
            elif base.endswith("_ws"):
                table = _GPU_WS_CONFIGS[base.removesuffix("_ws")]
            else:
                table = _GPU_TMA_CONFIGS.get(base, {}) if kind != base else _GPU_CONFIGS[base]
            if args.dtype == "fp32":
                row = "fp32" if d <= 64 else ("fp32_d128" if d <= 128 else "fp32_d256")
            else:
                row = f"d{d}"
            for cfg in table.get(row, []):
                name = kind
                if base.endswith("_ovl"):
                    name, cfg = base + ("_tma" if cfg[4] else ""), cfg[:4]
                if args.sass:
                    sass = _sass(name, d, cfg, args.dtype, args.causal)
                    c = _opcode_counts(sass)
                    ops = ("FMUL", "FFMA", "FADD", "FMNMX", "MUFU", "FSEL", "HGMMA", "HMMA")
                    ovl, mufu = wgmma_overlap(sass)["MUFU"]
                    print(f"{name:>15} {args.dtype} D={d:<3} {str(cfg):<18} "
                          f"total={sum(c.values())} "
                          + " ".join(f"{o}={c.get(o, 0)}" for o in ops)
                          + f" ovl={ovl}/{mufu}", flush=True)
                    continue
                r = compile_sm90(name, d, cfg, args.dtype, args.causal, args.gqa, args.window,
                                 args.segments, args.softcap, args.dropout, args.alibi,
                                 args.split)
                ws = name.endswith("_ws")
                ok = r["spill"] == 0 and r["smem"] <= SMEM_LIMIT and (
                    not ws or (r["warps"] == 12 and r["setmaxnreg"] > 0))
                bad += not ok
                extra = f" warps={r['warps']} setmaxnreg={r['setmaxnreg']}" if ws else ""
                print(f"{name:>15} {args.dtype} D={d:<3} {str(cfg):<18} regs={r['regs']:<3} "
                      f"spill={r['spill']:<5} smem={r['smem'] // 1024} KiB{extra}"
                      f"{'' if ok else '  <-- spills, overflows or is not specialized'}",
                      flush=True)
    print(f"{bad} candidate(s) spill, overflow shared memory or are not specialized")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
