#!/usr/bin/env bash
# v62 call 2 (prepared; no device ran it): a window's hidden key tiles skipped per consumer
# warpgroup in the hopper forward (fwd_traits.hpp kSkipHidden for windows, kSkipHiddenLeft; branch
# wip/window-wg-skips). WL62 = every d 64 and d 256 windowed forward built from the branch, WB62 =
# the same selection built from main (a partial build compiles other code than the full one, so the
# A/B compares like with like), each laid over main's kernels (KF). Then the window GPU tests on
# KWL, three interleaved rounds of time_score_mods at d 64 and one at d 256, and the other forward
# tests that run windowed kernels. Carry .device/KF.tgz and .device/v62.
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/checks.txt; }
[ -d build/KF ] || tar -xzf .device/KF.tgz
tar -xzf .device/v62/WB62.tgz && tar -xzf .device/v62/WL62.tgz
python3 tools/overlay_build.py build/KF build/WB62 build/KWB >> build/overlay.log 2>&1
python3 tools/overlay_build.py build/KF build/WL62 build/KWL >> build/overlay.log 2>&1
cc -O2 -shared -fPIC -I$(python3 -c "import sysconfig;print(sysconfig.get_paths()['include'])") runtime/_launch.c -o runtime/_launch.abi3.so
t "setup rc $?"
FLASHKILN_KERNEL_DIR=$PWD/build/KWL timeout 240 tools/pyenv.sh python3 -m pytest -q -x tests/test_window_gpu.py > $OUT/wl-tests.txt 2>&1
t "KWL window tests rc $? $(tail -1 $OUT/wl-tests.txt)"
ab() {  # build dims
  echo "== $1 dims $2" >> $OUT/ab.txt
  FLASHKILN_KERNEL_DIR=$PWD/build/$1 timeout 120 tools/pyenv.sh python3 tools/time_score_mods.py --mod window --quick --dims $2 --backend hopper >> $OUT/ab.txt 2>&1
  t "ab $1 d $2 rc $?"
}
for r in 1 2 3; do ab KWB 64; ab KWL 64; done
ab KWB 256; ab KWL 256
FLASHKILN_KERNEL_DIR=$PWD/build/KWL timeout 200 tools/pyenv.sh python3 -m pytest -q tests/test_hopper_forward_gpu.py tests/test_varlen_gpu.py tests/test_softcap_gpu.py tests/test_bias_gpu.py -k "window" > $OUT/wl-tests2.txt 2>&1
t "KWL other window tests rc $? $(tail -1 $OUT/wl-tests2.txt)"
