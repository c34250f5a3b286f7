#!/usr/bin/env bash
# v60 call D: F = the dBias kernels above d 64 back on one consumer loop for every route (kAny:
# v58's loop; v59's route loops spilled there), over KM (main at v60). A/B KP2 (v58) / KM / KF on
# d 128's full dbias; KF on the row-dbias and shared-dbias rows (callB has v58 and main's); the bias tests on KF.
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
ab() {  # label dir sweep dims
  FLASHKILN_KERNEL_DIR=$2 timeout 60 tools/pyenv.sh python3 tools/time_backward.py $1 --sweep $3 --dims $4 --seqlens 2048 8192 --reps 10 >> $OUT/ab.jsonl 2>> $OUT/ab.err
}
ab v58 $PWD/build/KP2 dbias 128; ab main $PWD/build/KM dbias 128; ab fix $PWD/build/KF dbias 128
t "ab dbias"
for sweep in row-dbias shared-dbias; do  # v58 and main: callB's rows
  ab fix $PWD/build/KF $sweep 128
  t "ab $sweep"
done
FLASHKILN_KERNEL_DIR=$PWD/build/KF FLASHKILN_REQUIRE_GPU=1 timeout 90 tools/pyenv.sh python3 -m pytest -q -m gpu -x -k bias tests > $OUT/gpu-test-bias-KF.log 2>&1
t "bias tests KF rc $?: $(tail -1 $OUT/gpu-test-bias-KF.log)"
