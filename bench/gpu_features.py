#!/usr/bin/env python
"""GPU timing of the attention features that skip work: sliding windows and packed
documents (``window=``, ``segment_ids=``), next to what PyTorch users write today.

Per case, forward and forward+backward, bf16, B=2, H=16, D=128, N=8192 (causal):

* ``window``: each query sees itself and the 1023 keys before it;
* ``documents``: 8 documents of N/8 tokens packed into each sequence;
* ``softcap``: causal with logit soft-capping at 30 (SDPA cannot: its peer is eager
  materialised attention, what one writes without a kernel; ~40 GB at this size);
* ``causal``: plain causal, for scale;
* ``decode``: first, forward only: one query per sequence against a long cache (B=8,
  H=32 query heads over 8 kv heads, D=128, Nk 4k and 32k), where the split-KV forward
  spreads the keys over the SMs. Peers: ``torchfn_nosplit`` (``TORCHFN_TRITON_SPLIT_KV=0``),
  SDPA (GQA, its best backend) and flex; it reports GB/s of k and v read, the bound of a
  decode step;
* ``dropout``: causal with attention dropout 0.1, keyed (its peer is SDPA's ``dropout_p``,
  which draws another mask from torch's global RNG: timed, not compared; no flex, which
  has no dropout).
* ``mla``: values with their own head dim, causal, B=2, H=16, N=4096, D=192, Dv=128
  (DeepSeek's MLA): torchfn zero-pads v to 192 (BLOCK_D 256); peers SDPA and flex, which
  take Dv != D as it is. What padding costs, and whether native Dv in the kernels would
  pay. Last, so the budget cuts it first.

Providers: ``torchfn`` (the public ``attention``, autotuned), ``sdpa_mask`` (SDPA given the
same pattern as a dense bool mask: the only way to say it to SDPA), ``sdpa`` (plain
causal, SDPA's best backend: the floor a skipping kernel can beat) and ``flex``
(compiled FlexAttention with the pattern as a block mask). Each row gives ms and
effective TFLOP/s over the *attended* pairs (4 D per pair forward, 2.5x that backward),
and torchfn's relative difference from ``sdpa_mask``. Run from the repository root on
the CUDA machine::

    PYTHONPATH=src python bench/gpu_features.py --out /tmp/gpu_features.json

``--dry-run`` runs it on a CPU (the Triton interpreter, tiny sizes, no flex).
``--budget-s`` (default 140) is a deadline: past it no new case starts, and the JSON and
its markdown table (same name, ``.md``) are always written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback


def _setup(dry: bool) -> None:
    if dry:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton.language is imported
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__))), "src"))


def _timer(dry: bool):
    if not dry:
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=60)

    def cpu_time(fn):
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return cpu_time


CAP = 30.0
P_DROP = 0.1


def _patterns(N: int, W: int, docs: int, device: str):
    """name -> (torchfn kwargs, dense (N, N) bool mask, flex mask_mod or None)."""
    import torch

    i = torch.arange(N, device=device)
    causal = i[None, :] <= i[:, None]
    ids = (i * docs // N)[None]  # (1, N)
    same = ids[0, :, None] == ids[0, None, :]
    return {
        "window": (dict(causal=True, window=(W - 1, None)),
                   causal & (i[None, :] > i[:, None] - W),
                   lambda b, h, q, k: (k <= q) & (k > q - W)),
        "documents": (dict(causal=True, segment_ids=ids), causal & same,
                      lambda b, h, q, k: (k <= q) & (ids[0, q] == ids[0, k])),
        "softcap": (dict(causal=True, softcap=CAP), causal, lambda b, h, q, k: k <= q),
        "causal": (dict(causal=True), causal, lambda b, h, q, k: k <= q),
        "dropout": (dict(causal=True, dropout=P_DROP), causal, None),  # last: the first cut
    }


def _eager_softcap(q, k, v, mask):
    """Materialised soft-capped attention in the inputs' dtype (scores in fp32)."""
    import torch

    s = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    s = (CAP * torch.tanh(s / CAP)).masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1).to(q.dtype) @ v


DECODE = dict(B=8, H=32, Hkv=8, D=128, Nks=(4096, 32768))
DECODE_DRY = dict(B=1, H=2, Hkv=1, D=16, Nks=(256,))


def _split_env(split: str):
    """torchfn's attention with ``TORCHFN_TRITON_SPLIT_KV=split`` for the call."""
    from torchfn.kernels import attention

    def fn(q, k, v):
        os.environ["TORCHFN_TRITON_SPLIT_KV"] = split
        try:
            return attention(q, k, v, backend="triton")
        finally:
            os.environ.pop("TORCHFN_TRITON_SPLIT_KV")

    return fn


def _failed(row: dict, e: Exception) -> None:
    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    traceback.print_exc()


def _rel_diffs(rows: list[dict], ref, providers) -> None:
    """Each row of one of ``providers`` that kept its output gets its relative difference
    from ``ref``; every kept output is dropped (not JSON)."""
    for row in rows:
        out = row.pop("out", None)
        if (out is not None and ref is not None and row["provider"] in providers
                and "rel_diff" not in row):
            row["rel_diff"] = float((out.float() - ref).norm() / ref.norm())


def run_decode(args, timer, flex, deadline) -> list[dict]:
    """The decode rows: forward only, Nq = 1; ``torchfn`` with the split heuristic (forced
    to 4 splits in a dry run, whose interpreter never splits by itself)."""
    import torch
    import torch.nn.functional as F

    dry = args.dry_run
    dev, dtype = ("cpu", torch.float32) if dry else ("cuda", torch.bfloat16)
    c = DECODE_DRY if dry else DECODE
    B, H, Hkv, D = c["B"], c["H"], c["Hkv"], c["D"]
    rows = []
    for Nk in c["Nks"]:
        g = torch.Generator(device=dev).manual_seed(1)
        q = torch.randn(B, H, 1, D, generator=g, device=dev, dtype=dtype)
        k, v = (torch.randn(B, Hkv, Nk, D, generator=g, device=dev, dtype=dtype)
                for _ in range(2))

        providers = {"torchfn": _split_env("4" if dry else "auto"),
                     "torchfn_nosplit": _split_env("0"),
                     "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v,
                                                                            enable_gqa=True)}
        if flex is not None:
            providers["flex"] = lambda q, k, v: flex(q, k, v, enable_gqa=True)
        ref = None
        for prov, fn in providers.items():
            row = {"case": f"decode-{Nk}", "provider": prov, "mode": "fwd", "B": B, "H": H,
                   "N": Nk, "D": D, "pairs": B * H * Nk}
            if time.time() > deadline:
                rows.append(dict(row, error="budget"))
                continue
            try:
                with torch.no_grad():
                    out = fn(q, k, v).float()
                    if prov == "sdpa":
                        ref = out
                    row["ms"] = timer(lambda fn=fn, q=q, k=k, v=v: fn(q, k, v))
                row["out"] = out
                row["tflops"] = round(4 * D * row["pairs"] / row["ms"] / 1e9, 1)
                row["gbps"] = round(2 * k.numel() * k.element_size() / row["ms"] / 1e6, 1)
                row["ms"] = round(row["ms"], 4)
            except Exception as e:  # noqa: BLE001
                _failed(row, e)
            rows.append(row)
        _rel_diffs(rows, ref, ("torchfn", "torchfn_nosplit", "flex"))
    return rows


MLA = dict(B=2, H=16, N=4096, D=192, DV=128)
MLA_DRY = dict(B=1, H=2, N=64, D=24, DV=16)


def run_mla(args, timer, flex, deadline) -> list[dict]:
    """The ``mla`` rows: causal attention with Dv != D, forward and forward+backward."""
    import torch
    import torch.nn.functional as F

    from torchfn.kernels import attention

    dry = args.dry_run
    dev, dtype = ("cpu", torch.float32) if dry else ("cuda", torch.bfloat16)
    c = MLA_DRY if dry else MLA
    B, H, N, D, DV = c["B"], c["H"], c["N"], c["D"], c["DV"]
    g = torch.Generator(device=dev).manual_seed(2)
    q, k = (torch.randn(B, H, N, D, generator=g, device=dev, dtype=dtype) for _ in range(2))
    v, do = (torch.randn(B, H, N, DV, generator=g, device=dev, dtype=dtype) for _ in range(2))
    providers = {"torchfn": lambda q, k, v: attention(q, k, v, causal=True, backend="triton"),
                 "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
    if flex is not None:
        from torch.nn.attention.flex_attention import create_block_mask

        bm = create_block_mask(lambda b, h, i, j: j <= i, None, None, N, N, device=dev)
        providers["flex"] = lambda q, k, v: flex(q, k, v, block_mask=bm)
    pairs = B * H * N * (N + 1) // 2
    rows, ref = [], None
    # torchfn tunes its BLOCK_D 256 kernels here first (tens of seconds of compiling):
    # start only with a minute of budget left, so that the caller's hard timeout never
    # cuts the run before the files are written
    late = time.time() > deadline - (0 if dry else 60)
    for prov, fn in providers.items():
        for mode in ("fwd", "fwd_bwd"):
            row = {"case": "mla", "provider": prov, "mode": mode, "B": B, "H": H, "N": N,
                   "D": D, "pairs": pairs}
            if late or time.time() > deadline:
                rows.append(dict(row, error="budget"))
                continue
            try:
                if mode == "fwd":
                    with torch.no_grad():
                        out = fn(q, k, v).float()
                        row["ms"] = timer(lambda fn=fn: fn(q, k, v))
                    if prov == "sdpa":
                        ref = out
                    row["out"] = out
                else:
                    xs = tuple(x.detach().clone().requires_grad_() for x in (q, k, v))
                    row["ms"] = timer(lambda fn=fn, xs=xs: torch.autograd.grad(fn(*xs), xs, do))
                # FLOPs of the unpadded problem: 2 (D + Dv) per pair forward, 2.5x backward
                flops = 2 * (D + DV) * pairs * (3.5 if mode == "fwd_bwd" else 1.0)
                row["tflops"] = round(flops / row["ms"] / 1e9, 1)
                row["ms"] = round(row["ms"], 3)
            except Exception as e:  # noqa: BLE001
                _failed(row, e)
            rows.append(row)
    _rel_diffs(rows, ref, ("torchfn",))
    return rows


def run(args) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from torchfn import random
    from torchfn.kernels import attention

    dry = args.dry_run
    dev = "cpu" if dry else "cuda"
    dtype = torch.float32 if dry else torch.bfloat16
    B, H, N, D, W, DOCS = (1, 2, 128, 16, 32, 4) if dry else (2, 16, 8192, 128, 1024, 8)
    deadline = time.time() + args.budget_s
    timer = _timer(dry)
    flex = None
    if not dry:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            flex = torch.compile(flex_attention, dynamic=False)
        except Exception:  # noqa: BLE001 - an older torch: no flex column
            flex = None
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, D, generator=g, device=dev, dtype=dtype)
                   for _ in range(4))
    rows = run_decode(args, timer, flex, deadline)
    for name, (kw, dense, mask_mod) in _patterns(N, W, DOCS, dev).items():
        pairs = int(dense.sum()) * B * H
        if "dropout" in kw:
            kw = dict(kw, key=random.key(0))
        providers = {"torchfn": lambda q, k, v, kw=kw: attention(
            q, k, v, backend="triton", **kw)}
        if name == "dropout":
            providers["sdpa_dropout"] = lambda q, k, v: F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=P_DROP)
        elif name == "causal":
            providers["sdpa"] = lambda q, k, v: F.scaled_dot_product_attention(
                q, k, v, is_causal=True)
        elif name == "softcap":
            providers["eager"] = lambda q, k, v, m=dense: _eager_softcap(q, k, v, m)
        else:
            providers["sdpa_mask"] = lambda q, k, v, m=dense: F.scaled_dot_product_attention(
                q, k, v, attn_mask=m)
        if flex is not None and mask_mod is not None:
            bm = create_block_mask(mask_mod, None, None, N, N, device=dev)
            mod = (lambda s, b, h, i, j: CAP * torch.tanh(s / CAP)) if name == "softcap" else None
            providers["flex"] = lambda q, k, v, bm=bm, mod=mod: flex(q, k, v, score_mod=mod,
                                                                      block_mask=bm)
        ref = None
        for prov, fn in providers.items():
            for mode in ("fwd", "fwd_bwd"):
                if time.time() > deadline:
                    rows.append({"case": name, "provider": prov, "mode": mode,
                                 "error": "budget"})
                    continue
                row = {"case": name, "provider": prov, "mode": mode, "B": B, "H": H, "N": N,
                       "D": D, "pairs": pairs}
                try:
                    if mode == "fwd":
                        with torch.no_grad():
                            out = fn(q, k, v)
                            if prov != "torchfn" and ref is None and name != "dropout":
                                ref = out.float()
                            row["ms"] = timer(lambda fn=fn: fn(q, k, v))
                        row["out"] = out
                    else:
                        xs = tuple(x.detach().clone().requires_grad_() for x in (q, k, v))
                        row["ms"] = timer(lambda fn=fn, xs=xs: torch.autograd.grad(fn(*xs), xs,
                                                                                   do))
                    flops = 4 * D * pairs * (3.5 if mode == "fwd_bwd" else 1.0)
                    row["tflops"] = round(flops / row["ms"] / 1e9, 1)
                    row["ms"] = round(row["ms"], 3)
                except Exception as e:  # noqa: BLE001
                    _failed(row, e)
                rows.append(row)
        _rel_diffs(rows, ref, ("torchfn",))  # from the dense-mask (or causal) SDPA
    return rows + run_mla(args, timer, flex, deadline)


def markdown(rows: list[dict], env: dict) -> str:
    lines = [f"GPU: {env.get('gpu')}; torch {env.get('torch')}; triton {env.get('triton')}", "",
             "| case | mode | provider | ms | TFLOP/s (attended pairs) | torchfn / best other "
             "| rel diff | GB/s (k, v) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "ms" not in r:
            lines.append(f"| {r['case']} | {r['mode']} | {r['provider']} | "
                         f"{r.get('error', '')} | | | | |")
            continue
        others = [o["ms"] for o in rows if o["case"] == r["case"] and o["mode"] == r["mode"]
                  and not o["provider"].startswith("torchfn") and "ms" in o]
        ratio = (f"{r['ms'] / min(others):.2f}x" if r["provider"] == "torchfn" and others
                 else "")
        diff = f"{r['rel_diff']:.1e}" if "rel_diff" in r else ""
        lines.append(f"| {r['case']} | {r['mode']} | {r['provider']} | {r['ms']} | "
                     f"{r['tflops']} | {ratio} | {diff} | {r.get('gbps', '')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="/tmp/gpu_features.json")
    ap.add_argument("--budget-s", type=float, default=140.0)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    _setup(args.dry_run)
    import torch

    env = {"torch": torch.__version__}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    env["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (dry run)"
    try:
        rows = run(args)
    except Exception as e:  # noqa: BLE001 - the files are written all the same
        traceback.print_exc()
        rows = [{"error": f"{type(e).__name__}: {e}"}]
    with open(args.out, "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    table = markdown([r for r in rows if "case" in r], env)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(table)
    print(table)
    return 0 if rows and all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
