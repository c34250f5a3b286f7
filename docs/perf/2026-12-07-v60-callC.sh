#!/usr/bin/env bash
# v60 prepared call C (after A and B, if device time is left): make bench's full-bias and plain
# backward rows beside the peers (quick: S 2k and 8k; d 64, 128) on main (KM) with KZ's
# writer-warp kernels as an extra arm, then the window rows (issue 23) on main.
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/checks.txt; }
tar -xzf .device/K.tgz && tar -xzf .device/v58/B2P2.tgz && tar -xzf .device/v60/S60.tgz && tar -xzf .device/v60/Z.tgz
python3 tools/overlay_build.py generated build/P2 build/KP2 --drop '^(bwd_(dbias_)?|fwd_)hopper_.*' > $OUT/overlay.log 2>&1
python3 tools/overlay_build.py build/KP2 build/S60 build/KM --drop '^bwd_hopper_.*' >> $OUT/overlay.log 2>&1  # every hopper bwd kernel of main (v60)
python3 tools/overlay_build.py build/KM build/Z build/KZ1 >> $OUT/overlay.log 2>&1
python3 tools/overlay_build.py build/KZ1 build/Z2 build/KZ >> $OUT/overlay.log 2>&1
cc -O2 -shared -fPIC -I$(python3 -c "import sysconfig;print(sysconfig.get_paths()['include'])") runtime/_launch.c -o runtime/_launch.abi3.so
t "setup rc $?"
timeout 200 tools/pyenv.sh python3 bench/bench.py --quick --passes bwd --bias full --head-dims 64 128 --reps 20 \
  --kernel-dir $PWD/build/KM --extra-kernel-dir writer=$PWD/build/KZ --out $OUT/bench-bias-full > $OUT/bench-bias-full.log 2>&1
t "bench bias full rc $?"
timeout 150 tools/pyenv.sh python3 bench/bench.py --quick --passes bwd --head-dims 64 128 256 --reps 20 \
  --kernel-dir $PWD/build/KM --out $OUT/bench-plain > $OUT/bench-plain.log 2>&1
t "bench plain rc $?"
timeout 200 tools/pyenv.sh python3 bench/bench.py --window --quick --windows 512 --head-dims 64 128 --reps 20 \
  --kernel-dir $PWD/build/KM --out $OUT/bench-window > $OUT/bench-window.log 2>&1
t "bench window rc $?"
