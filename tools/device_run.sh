#!/usr/bin/env bash
# What one device call runs: unpack the carried kernels, GPU tests, sanitizers, benchmark.
# Usage (on the GPU machine, repo root): tools/device_run.sh [steps...]; steps default to
# "info test sanitize bench". Logs go to $OUT (or build/device-logs). The carried kernels:
# $KERNELS (default .device/kernels.tar.gz, a tar of generated/). A/B of a partial build:
#   overlay  lays the build $PARTIAL over generated/ into build/overlay (tools/overlay_build.py,
#            --drop $DROP where its variants have other names) and makes the steps after it run on it;
#   ab       $AB_ROUNDS (2) alternations of tools/time_backward.py on build/overlay and on
#            generated/, --sweep each of $AB_SWEEPS (plain) --dims $AB_DIMS (64 128) --seqlens
#            $AB_SEQLENS (2048 8192), into $OUT/ab.jsonl, then their table (tools/ab_table.py).
set -uo pipefail
out=${OUT:-build/device-logs}
mkdir -p "$out"
steps=${*:-info test sanitize bench}
kernels=${KERNELS:-.device/kernels.tar.gz}
if [ -f "$kernels" ]; then tar -xzf "$kernels"; fi
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
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout ${SANITIZE_TIMEOUT:-150} compute-sanitizer --tool $tool --print-limit 20 --report-api-errors no \
          tools/pyenv.sh python3 tools/sanitize.py $([ $tool = racecheck ] && echo 10) 2>&1 \
          | tee "$out/sanitize-$tool.log" | tail -8
      done
      ;;
    profile)
      timeout 200 ncu --clock-control none --kernel-name regex:${PROFILE_KERNELS:-'flashkiln_bwd_hopper|flash_bwd_dq_dk_dv'} \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy \
        --section LaunchStats tools/pyenv.sh python3 tools/profile_bwd.py ${PROFILE_ARGS:-128 4096} 2>&1 \
        | tee "$out/profile.log" | grep -E "bwd|Duration|Throughput|Stall|Warp Cycles|Issued|Eligible|Registers|Achieved Occupancy|Theoretical Occupancy" | head -60
      ;;
    metrics)
      m=lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,lts__t_sectors_op_red.sum,lts__t_sectors_op_atom.sum
      m=$m,l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_local_op_st.sum
      m=$m,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum
      m=$m,smsp__inst_executed.sum,sm__inst_executed_pipe_tensor_op_hmma.sum,l1tex__t_requests_pipe_lsu_mem_global_op_red.sum
      m=$m,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__cycles_elapsed.avg.per_second
      for r in barrier long_scoreboard short_scoreboard mio_throttle math_pipe_throttle lg_throttle wait membar drain \
               not_selected selected dispatch_stall no_instruction imc_miss branch_resolving sleeping tex_throttle; do
        m=$m,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio
      done
      timeout 200 ncu --clock-control none --kernel-name regex:${PROFILE_KERNELS:-'flashkiln_bwd_hopper|flash_bwd_dq_dk_dv'} --metrics $m \
        tools/pyenv.sh python3 tools/profile_bwd.py ${PROFILE_ARGS:-128 4096} 2>&1 | tee "$out/metrics.log" \
        | grep -E "bwd|sum|ratio" | grep -v "==PROF==" | head -80
      ;;
    conflicts)
      timeout 200 ncu --clock-control none --kernel-name regex:'flashkiln_bwd_portable' --section SourceCounters \
        --print-details all tools/pyenv.sh python3 tools/profile_bwd.py ${PROFILE_ARGS:-128 4096} > "$out/conflicts.log" 2>&1
      ncu --version | head -2; grep -n -i -A30 "shared" "$out/conflicts.log" | head -80
      ;;
    overlay)
      python3 tools/overlay_build.py generated "$PARTIAL" build/overlay ${DROP:+--drop "$DROP"}
      export FLASHKILN_KERNEL_DIR=$PWD/build/overlay
      ;;
    ab)
      for _ in $(seq ${AB_ROUNDS:-2}); do
        for arm in overlay:$PWD/build/overlay main:$PWD/generated; do
          for sweep in ${AB_SWEEPS:-plain}; do
            FLASHKILN_KERNEL_DIR=${arm#*:} timeout ${AB_TIMEOUT:-60} tools/pyenv.sh python3 tools/time_backward.py \
              "${arm%%:*}" --sweep $sweep --dims ${AB_DIMS:-64 128} --seqlens ${AB_SEQLENS:-2048 8192} --reps 10 \
              >> "$out/ab.jsonl" 2>> "$out/ab.err"
          done
        done
      done
      python3 tools/ab_table.py "$out/ab.jsonl" | tee "$out/ab.md"
      ;;
    bench)
      extra=()
      for d in build/sweep/c*/; do [ -f "$d/manifest.json" ] && extra+=(--extra-kernel-dir "$(basename "$d")=$d"); done
      timeout ${BENCH_TIMEOUT:-200} tools/pyenv.sh python3 bench/bench.py --out "$out" ${BENCH_ARGS:-} "${extra[@]}" 2>&1 | tee "$out/bench.log" | tail -60
      ;;
  esac
done
