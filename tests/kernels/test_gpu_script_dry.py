"""The GPU benchmark script's own CPU dry run: every phase runs and the JSON is complete.

Device time is scarce (minutes per session), so a crash in ``bench/gpu_attention.py``
must show up here first. The dry run uses the Triton interpreter and tiny shapes; the
speed numbers it writes mean nothing, but the correctness cases it runs are real.
Slow (about a minute): the kernels themselves are covered by ``test_triton_kernels.py``.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton is not installed")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "gpu_attention.py")


def _run(tmp_path, *extra):
    out = tmp_path / "result.json"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--budget-s", "300",
                           "--out", str(out), *extra],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("ws", [False, True], ids=["defaults", "ws"])
def test_bench_dry_run_is_complete(tmp_path, ws):
    result = _run(tmp_path, *(["--ws"] if ws else []))
    assert result["correctness"] and result["correctness_all_pass"]
    assert not result["phase_errors"]
    providers = {r["provider"] for r in result["bench"] if "ms" in r}
    # --ws: the tuner with the warp-specialized variants in place of the pointer-load run
    variant = "torchfn_ws" if ws else "torchfn_ptr"
    assert {"torchfn", "torchfn_atomic", "torchfn_ordered", variant, "torchfn_api",
            "sdpa_flash"} <= providers
    assert ("torchfn_ptr" if ws else "torchfn_ws") not in providers
    assert result["warm"]["compiled"] == result["warm"]["tasks"]  # the WS configs too
    if ws:
        assert "+WS / best SDPA" in result["markdown"]


@pytest.mark.slow
def test_sweep_dry_run_times_every_kernel(tmp_path):
    result = _run(tmp_path, "--sweep")
    timed = {(r["op"], r["causal"]) for r in result["sweep"] if r.get("kind") == "sweep"
             and "ms" in r}
    ops = [f"{op}{tma}" for op in ("fwd", "dkdv", "dq", "dkdv_ovl", "dkdv_atomic")
           for tma in ("", "_tma")] + ["fwd_ovl_tma", "fwd_ws", "dkdv_ws", "dq_ws"]
    assert timed == {(op, c) for op in ops for c in (False, True)}
    # every config gives the first config's result, TMA or not
    assert all(r["same_result"] for r in result["sweep"] if "ms" in r and "op" in r)
    best = {r["provider"] for r in result["sweep"] if r.get("kind") == "bench" and "ms" in r}
    assert {"sweep_best", "sweep_best_tma", "sweep_best_atomic", "sweep_best_atomic_tma",
            "sweep_best_ovl", "sweep_best_ovl_tma", "sweep_best_ws", "sweep_best_any"} <= best
    picks = [r for r in result["sweep"] if r.get("kind") == "sweep_best_pick"]
    assert len({(r["D"], r["causal"]) for r in picks}) == 2
    assert all(set(r["pick"]) == {"fwd", "dkdv", "dq"} for r in picks)
    # the warp-specialized ops were timed by a child of their own, after the others
    ws_best = [r for r in result["sweep"] if r.get("kind") == "sweep_best_configs" and r["ws"]]
    assert len(ws_best) == 2 and all("dkdv_ws" in r["best"] for r in ws_best)


def test_features_dry_run_times_every_case(tmp_path):
    # bench/gpu_features.py (decode, window / packed documents vs SDPA with a dense mask): a few
    # seconds in the interpreter, so in the default run
    out = tmp_path / "features.json"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_features.py"),
                           "--dry-run", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    timed = {(r["case"], r["provider"], r["mode"]) for r in rows if "ms" in r}
    want = {(c, p, m) for c, p in [("window", "torchfn"), ("window", "sdpa_mask"),
                                   ("documents", "torchfn"), ("documents", "sdpa_mask"),
                                   ("softcap", "torchfn"), ("softcap", "eager"),
                                   ("dropout", "torchfn"), ("dropout", "sdpa_dropout"),
                                   ("causal", "torchfn"), ("causal", "sdpa")]
            for m in ("fwd", "fwd_bwd")}
    want |= {("decode-256", p, "fwd") for p in ("torchfn", "torchfn_nosplit", "sdpa")}
    want |= {("mla", p, m) for p in ("torchfn", "sdpa") for m in ("fwd", "fwd_bwd")}
    assert timed == want
    # torchfn gives its peer's output (fp32 in the dry run), split (4 runs) or not, and
    # with Dv != D (padded)
    assert all(r["rel_diff"] < 1e-5 for r in rows if "rel_diff" in r)
    assert len([r for r in rows if "rel_diff" in r]) == 7
    assert (tmp_path / "features.md").read_text().count("| torchfn |") == 13
