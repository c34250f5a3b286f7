#!/usr/bin/env bash
# What one device call runs: unpack the carried kernels, GPU tests, sanitizers, benchmark.
# Usage (on the GPU machine, repo root): tools/device_run.sh [steps...]; steps default to
# "info test sanitize bench". Logs go to $OUT (or build/device-logs).
set -uo pipefail
out=${OUT:-build/device-logs}
mkdir -p "$out"
steps=${*:-info test sanitize bench}
if [ -f .device/kernels.tar.gz ]; then tar -xzf .device/kernels.tar.gz; fi
export PYTHONUNBUFFERED=1
for step in $steps; do
  echo "=== $step ($(date -u +%T))"
  case $step in
    info)
      nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
      python3 -c 'import torch, cuda.bindings; print("torch", torch.__version__, "cuda-bindings", cuda.bindings.__version__, "cudnn", torch.backends.cudnn.version())'
      ;;
    test)
      FLASHKILN_REQUIRE_GPU=1 timeout ${TEST_TIMEOUT:-300} make gpu-test 2>&1 | tee "$out/gpu-test.log" | tail -40
      ;;
    sanitize)
      for tool in memcheck racecheck; do
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 90 compute-sanitizer --tool $tool --print-limit 20 --report-api-errors no \
          tools/pyenv.sh python3 tools/sanitize.py $([ $tool = racecheck ] && echo 2) 2>&1 \
          | tee "$out/sanitize-$tool.log" | tail -8
      done
      ;;
    profile)
      timeout 200 ncu --clock-control none --kernel-name regex:'flashkiln_bwd_portable|flash_bwd_dq_dk_dv' \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy \
        --section LaunchStats tools/pyenv.sh python3 tools/profile_bwd.py ${PROFILE_ARGS:-128 4096} 2>&1 \
        | tee "$out/profile.log" | grep -E "bwd|Duration|Throughput|Stall|Warp Cycles|Issued|Eligible|Registers|Achieved Occupancy|Theoretical Occupancy" | head -60
      ;;
    bench)
      extra=()
      for d in build/sweep/c*/; do [ -f "$d/manifest.json" ] && extra+=(--extra-kernel-dir "$(basename "$d")=$d"); done
      timeout ${BENCH_TIMEOUT:-200} tools/pyenv.sh python3 bench/bench.py --out "$out" ${BENCH_ARGS:-} "${extra[@]}" 2>&1 | tee "$out/bench.log" | tail -60
      ;;
  esac
done
