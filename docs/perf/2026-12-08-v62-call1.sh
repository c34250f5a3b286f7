#!/usr/bin/env bash
# v62 call 1 (prepared; no device ran it). Main's kernels (KF: .device/KF.tgz, v61's overlay of the
# full build with P2, S60 and F flattened into one archive; if lost: extract .device/K.tgz,
# .device/v58/B2P2.tgz, .device/v60/S60.tgz and F.tgz, run v61-call1.sh's three overlay_build.py
# lines, then `cp -rL build/KF` into a fresh build/ and tar it), then:
# 1. the GPU tests through the SDPA drop-in and the plan caches (v62 moved the eager autograd
#    backward's plan onto the forward's: backward.backward_after), and bench/host_overhead.py;
# 2. v61's prepared probe (-next.sh): the timeline probe (build/TL61: `generate --probe timeline`
#    of the bf16 d 64 plain, biased and dBias kernels and the d 64 / d 128 plain and windowed ones)
#    laid over KF: where the d 64 full dBias's CTAs wait, a windowed CTA's fixed cost against its
#    tiles, the kernel split of windowed calls. TL61, if lost: generate --specs specs --set full
#    --probe timeline --out build/TL61 --filter
#    '^bwd_hopper_sm90a_bf16_d64_(causal-br_)?bias-additive_(dbias_)?[0-9a-f]+$|^bwd_hopper_sm90a_bf16_d(64|128)_(causal-br_)?(window_)?[0-9a-f]+$'
#    (12 variants, 112 s on two cores);
# 3. bench/memory.py (not rerun since v53).
# Few output files: the device returns about eight. Carry .device/KF.tgz, .device/v61, .device/v62.
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/checks.txt; }
tar -xzf .device/KF.tgz && tar -xzf .device/v61/TL61.tgz
python3 tools/overlay_build.py build/KF build/TL61 build/KTL > build/overlay.log 2>&1
cc -O2 -shared -fPIC -I$(python3 -c "import sysconfig;print(sysconfig.get_paths()['include'])") runtime/_launch.c -o runtime/_launch.abi3.so
t "setup rc $?"
FLASHKILN_KERNEL_DIR=$PWD/build/KF timeout 240 tools/pyenv.sh python3 -m pytest -q tests/test_ops_gpu.py tests/test_gradients_gpu.py tests/test_plan_cache_gpu.py > $OUT/tests.txt 2>&1
t "drop-in tests rc $? $(tail -1 $OUT/tests.txt)"
FLASHKILN_KERNEL_DIR=$PWD/build/KF timeout 200 tools/pyenv.sh python3 bench/host_overhead.py --out build/bench-host > $OUT/host.txt 2>&1
t "host rc $?"
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
FLASHKILN_KERNEL_DIR=$PWD/build/KF timeout 200 tools/pyenv.sh python3 bench/memory.py --out build/bench-memory > $OUT/memory.txt 2>&1
t "memory rc $?"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> $OUT/checks.txt
python3 -c "import torch;print(torch.__version__, torch.backends.cudnn.version())" >> $OUT/checks.txt
