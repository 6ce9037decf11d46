#!/usr/bin/env bash
# The prepared GPU checks for one device session (15 device-minutes), in two calls:
#
#   bash bench/gpu_session.sh check   # gpu-marked tests + the benchmark table (~7 min)
#   bash bench/gpu_session.sh sweep   # per-kernel block-config sweep (~1.5-5 min)
#   bash bench/gpu_session.sh features  # window / packed documents vs SDPA, flex (~2.5 min)
#
# Run from the repository root on the CUDA machine; it needs torch, triton, pytest and
# hypothesis there, nothing else (torchfn.kernels imports neither optree nor torchopt).
# Everything goes to $OUT (default /tmp/torchfn_gpu): logs, JSON and markdown tables.
# Copy the tables into bench/RESULTS.md by hand. DRY=1 runs both on a CPU (interpreter,
# tiny sizes) to check the script itself.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/torchfn_gpu}"
WORK=/tmp/torchfn_gpu_work  # worker logs stay here: the device tool returns 8 files at most
mkdir -p "$OUT" "$WORK"
export PYTHONPATH=src PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
DRY_FLAG=${DRY:+--dry-run}

case "${1:-}" in
  check)
    nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv 2>&1 | tee "$OUT/gpu.txt"
    # correctness on the GPU first: transforms, deterministic, atomic-dQ and TMA kernels;
    # the warp-specialized kernels' test last (a hang there must cost nothing else)
    timeout 300 python3 -m pytest -v --tb=short --durations=15 -p no:cacheprovider -m gpu \
      tests/kernels/test_attention_gpu.py tests/kernels/test_triton_gpu.py 2>&1 \
      | tee "$OUT/gpu_tests.txt"
    # the opt-in warp-specialized variants join the table (as torchfn_ws) only if both
    # of their GPU tests passed: a kernel that hangs or miscompiles stays out of it
    WS_FLAG=""
    if [ "$(grep -c 'test_gpu_warp_specialized_kernels_are_the_plain_kernels.*PASSED' \
          "$OUT/gpu_tests.txt")" = 2 ] || [ -n "${DRY:-}" ]; then
      WS_FLAG=--ws
    fi
    echo "bench flags: $DRY_FLAG $WS_FLAG" | tee "$OUT/bench_flags.txt"
    timeout 290 python3 bench/gpu_attention.py $DRY_FLAG $WS_FLAG \
      --out "$WORK/gpu_attention.json" --budget-s "${BUDGET_S:-190}" 2>&1 \
      | tail -120 > "$OUT/bench.log"
    cp "$WORK"/gpu_attention.json "$WORK"/gpu_attention.md "$OUT"/
    ;;
  sweep)
    timeout 330 python3 bench/gpu_attention.py $DRY_FLAG --sweep --out "$WORK/gpu_sweep.json" \
      --budget-s "${BUDGET_S:-270}" 2>&1 | tail -150 > "$OUT/sweep.log"
    cp "$WORK"/gpu_sweep.json "$WORK"/gpu_sweep.md "$OUT"/
    ;;
  features)
    timeout 200 python3 bench/gpu_features.py $DRY_FLAG --out "$WORK/gpu_features.json" \
      --budget-s "${BUDGET_S:-140}" 2>&1 | tail -60 > "$OUT/features.log"
    cp "$WORK"/gpu_features.json "$WORK"/gpu_features.md "$OUT"/
    ;;
  *)
    echo "usage: bash bench/gpu_session.sh check|sweep|features" >&2
    exit 2
    ;;
esac
