#!/usr/bin/env bash
# Prepared in v61 for the next session (perf.md v61, Next 1 and 2): the timeline probe
# (build/TL61: `generate --probe timeline` of the bf16 d 64 plain, biased and dBias kernels and the
# d 64 / d 128 plain and windowed ones, at e79614d's templates) laid over main's kernels (KF), then
# where the d 64 full dBias's CTAs wait, and a windowed CTA's fixed cost against its tiles; the
# kernel split of windowed calls. Few output files: the device returns about eight. TL61, if lost:
# generate --specs specs --set full --probe timeline --out build/TL61 --filter
# '^bwd_hopper_sm90a_bf16_d64_(causal-br_)?bias-additive_(dbias_)?[0-9a-f]+$|^bwd_hopper_sm90a_bf16_d(64|128)_(causal-br_)?(window_)?[0-9a-f]+$'
# (12 variants, 112 s on two cores).
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/checks.txt; }
tar -xzf .device/K.tgz && tar -xzf .device/v58/B2P2.tgz && tar -xzf .device/v60/S60.tgz && tar -xzf .device/v60/F.tgz
tar -xzf .device/v61/TL61.tgz
python3 tools/overlay_build.py generated build/P2 build/KP2 --drop '^(bwd_(dbias_)?|fwd_)hopper_.*' > $OUT/overlay.log 2>&1
python3 tools/overlay_build.py build/KP2 build/S60 build/KM --drop '^bwd_hopper_.*' >> $OUT/overlay.log 2>&1
python3 tools/overlay_build.py build/KM build/F build/KF >> $OUT/overlay.log 2>&1
python3 tools/overlay_build.py build/KF build/TL61 build/KTL >> $OUT/overlay.log 2>&1
cc -O2 -shared -fPIC -I$(python3 -c "import sysconfig;print(sysconfig.get_paths()['include'])") runtime/_launch.c -o runtime/_launch.abi3.so
t "setup rc $?"
tl() {  # args...
  FLASHKILN_KERNEL_DIR=$PWD/build/KTL timeout 120 tools/pyenv.sh python3 tools/bwd_timeline.py "$@" >> $OUT/timeline.txt 2>&1
  t "timeline $* rc $?"
}
tl --dims 64 --seqlens 2048 8192 --bias none bias dbias
tl --dims 64 128 --seqlens 4096 16384 --windows -1 128 512
FLASHKILN_KERNEL_DIR=$PWD/build/KF timeout 120 tools/pyenv.sh python3 tools/bwd_timeline.py --time-only --dims 64 \
  --seqlens 2048 8192 --bias none bias dbias >> $OUT/timeline.txt 2>&1
t "probe cost rc $?"
FLASHKILN_KERNEL_DIR=$PWD/build/KF timeout 120 tools/pyenv.sh python3 tools/bwd_kernels.py \
  --cases 128:4096:w128 128:4096:causal:w128 128:16384:w512 128:16384:causal:w512 64:16384:causal:w128 > $OUT/kernels.txt 2>&1
t "kernel split rc $?"
