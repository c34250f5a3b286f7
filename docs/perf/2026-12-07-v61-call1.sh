#!/usr/bin/env bash
# v61 call 1: main's own checks on main's kernels (KF = K + P2 + S60 + F; every older hopper
# backward name dropped): the whole GPU suite beside memcheck (dense and packed lists in two
# processes) and racecheck, then host time and make bench's plain backward rows.
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/checks.txt; }
tar -xzf .device/K.tgz && tar -xzf .device/v58/B2P2.tgz && tar -xzf .device/v60/S60.tgz && tar -xzf .device/v60/F.tgz
python3 tools/overlay_build.py generated build/P2 build/KP2 --drop '^(bwd_(dbias_)?|fwd_)hopper_.*' > $OUT/overlay.log 2>&1
python3 tools/overlay_build.py build/KP2 build/S60 build/KM --drop '^bwd_hopper_.*' >> $OUT/overlay.log 2>&1
python3 tools/overlay_build.py build/KM build/F build/KF >> $OUT/overlay.log 2>&1
cc -O2 -shared -fPIC -I$(python3 -c "import sysconfig;print(sysconfig.get_paths()['include'])") runtime/_launch.c -o runtime/_launch.abi3.so
t "setup rc $?"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $OUT/gpu.txt 2>&1
export FLASHKILN_KERNEL_DIR=$PWD/build/KF
san() {  # tool log args...
  local tool=$1 log=$2; shift 2
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 280 compute-sanitizer --tool $tool --print-limit 20 --report-api-errors no \
    tools/pyenv.sh python3 tools/sanitize.py "$@" > $OUT/$log 2>&1
  echo "rc $?" >> $OUT/$log
}
san memcheck memcheck-dense.log --only dense & P1=$!
san memcheck memcheck-packed.log --only packed & P2=$!
san racecheck racecheck.log 10 & P3=$!
FLASHKILN_REQUIRE_GPU=1 timeout 280 tools/pyenv.sh python3 -m pytest -q -m gpu tests > $OUT/suite.log 2>&1
t "suite rc $?: $(tail -1 $OUT/suite.log)"
wait $P1 $P2 $P3
for f in memcheck-dense memcheck-packed racecheck; do
  t "$f: $(grep SUMMARY $OUT/$f.log) cases $(grep -c finite=True $OUT/$f.log) bad $(grep -c finite=False $OUT/$f.log) $(tail -1 $OUT/$f.log)"
done
timeout 60 tools/pyenv.sh python3 bench/host_overhead.py --out $OUT/host > $OUT/host.log 2>&1
t "host rc $?"
timeout 170 tools/pyenv.sh python3 bench/bench.py --quick --passes bwd --head-dims 64 128 256 --reps 20 \
  --kernel-dir $PWD/build/KF --out $OUT/bench-plain > $OUT/bench-plain.log 2>&1
t "bench plain rc $?"
