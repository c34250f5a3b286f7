#!/usr/bin/env bash
# v60 prepared call B: sanitizers on main's kernels (KM: memcheck on every case, racecheck on
# the first ten), the rows v59 left (row-dbias d 64; shared-dbias, row-dbias d 128: KP2 = pre-v59
# against KM = main), host time.
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/checks.txt; }
tar -xzf .device/K.tgz && tar -xzf .device/v58/B2P2.tgz && tar -xzf .device/v60/S60.tgz
python3 tools/overlay_build.py generated build/P2 build/KP2 --drop '^(bwd_(dbias_)?|fwd_)hopper_.*' > $OUT/overlay.log 2>&1
python3 tools/overlay_build.py build/KP2 build/S60 build/KM --drop '^bwd_hopper_.*' >> $OUT/overlay.log 2>&1  # every hopper bwd kernel of main (v60)
cc -O2 -shared -fPIC -I$(python3 -c "import sysconfig;print(sysconfig.get_paths()['include'])") runtime/_launch.c -o runtime/_launch.abi3.so
t "setup rc $?"
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
FLASHKILN_KERNEL_DIR=$PWD/build/KM timeout 170 compute-sanitizer --tool memcheck --print-limit 20 --report-api-errors no tools/pyenv.sh python3 tools/sanitize.py > $OUT/memcheck.log 2>&1
t "memcheck rc $?: $(grep SUMMARY $OUT/memcheck.log) cases $(grep -c finite=True $OUT/memcheck.log) bad $(grep -c finite=False $OUT/memcheck.log)"
FLASHKILN_KERNEL_DIR=$PWD/build/KM timeout 90 compute-sanitizer --tool racecheck --print-limit 20 --report-api-errors no tools/pyenv.sh python3 tools/sanitize.py 10 > $OUT/racecheck.log 2>&1
t "racecheck rc $?: $(grep SUMMARY $OUT/racecheck.log)"
unset PYTORCH_NO_CUDA_MEMORY_CACHING
ab() {  # label dir sweep dims
  FLASHKILN_KERNEL_DIR=$2 timeout 60 tools/pyenv.sh python3 tools/time_backward.py $1 --sweep $3 --dims $4 --seqlens 2048 8192 --reps 10 >> $OUT/ab.jsonl 2>> $OUT/ab.err
}
ab main-v58 $PWD/build/KP2 row-dbias 64; ab main $PWD/build/KM row-dbias 64
for sweep in shared-dbias row-dbias; do
  ab main-v58 $PWD/build/KP2 $sweep 128; ab main $PWD/build/KM $sweep 128
done
t "ab rows v59 left"
FLASHKILN_KERNEL_DIR=$PWD/build/KM timeout 60 tools/pyenv.sh python3 bench/host_overhead.py --out $OUT/host > $OUT/host.log 2>&1
t "host rc $?"
