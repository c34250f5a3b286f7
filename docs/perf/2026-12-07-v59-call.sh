#!/usr/bin/env bash
# v59 last call (200 s): suite on KR128, then dbias d 64 A/B main / R128 / R / R128Q.
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/checks.txt; }
tar -xzf .device/K.tgz && tar -xzf .device/v58/B2P2.tgz && tar -xzf .device/v59/R.tgz && tar -xzf .device/v59/Q.tgz
python3 tools/overlay_build.py generated build/P2 build/KP2 --drop '^(bwd_(dbias_)?|fwd_)hopper_.*' > $OUT/overlay.log 2>&1
python3 tools/overlay_build.py build/KP2 build/R build/KR >> $OUT/overlay.log 2>&1
python3 tools/overlay_build.py build/KR build/R128 build/KR128 --drop '^bwd_hopper_sm90a_(bf16|fp16)_d64_.*dbias_.*' >> $OUT/overlay.log 2>&1
python3 tools/overlay_build.py build/KR128 build/R128Q build/KR128Q >> $OUT/overlay.log 2>&1
t "overlay rc $?"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> $OUT/checks.txt
FLASHKILN_KERNEL_DIR=$PWD/build/KR128 FLASHKILN_REQUIRE_GPU=1 timeout 110 tools/pyenv.sh python3 -m pytest -q -m gpu -rs --maxfail=40 tests > $OUT/gpu-test.log 2>&1
t "suite KR128: $(tail -1 $OUT/gpu-test.log)"
ab() {  # label dir sweep dims
  FLASHKILN_KERNEL_DIR=$2 timeout 40 tools/pyenv.sh python3 tools/time_backward.py $1 --sweep $3 --dims $4 --seqlens 2048 8192 --reps 10 >> $OUT/ab.jsonl 2>> $OUT/ab.err
}
ab main $PWD/build/KP2 dbias 64; t main; ab r128 $PWD/build/KR128 dbias 64; t r128; ab r $PWD/build/KR dbias 64; t r
ab r128q $PWD/build/KR128Q dbias 64; t r128q
