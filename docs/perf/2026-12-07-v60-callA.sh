#!/usr/bin/env bash
# v60 prepared call A (run by a later session): main's whole GPU suite (v59 did not run it), the
# copy-bandwidth probe, then Z (a full dBias's hidden rows zeroed by an idle producer warp; every
# bias_grad variant: Z d 64 + d 128, Z2 d 96, 192/128, 256) against main: dBias A/B, two rounds,
# and the bias tests on KZ. KM = K + P2 + S60 = main's kernels (S60: every hopper bwd variant built from main at v60).
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/checks.txt; }
tar -xzf .device/K.tgz && tar -xzf .device/v58/B2P2.tgz && tar -xzf .device/v60/S60.tgz && tar -xzf .device/v60/Z.tgz
python3 tools/overlay_build.py generated build/P2 build/KP2 --drop '^(bwd_(dbias_)?|fwd_)hopper_.*' > $OUT/overlay.log 2>&1
python3 tools/overlay_build.py build/KP2 build/S60 build/KM --drop '^bwd_hopper_.*' >> $OUT/overlay.log 2>&1  # every hopper bwd kernel of main (v60)
python3 tools/overlay_build.py build/KM build/Z build/KZ1 >> $OUT/overlay.log 2>&1
python3 tools/overlay_build.py build/KZ1 build/Z2 build/KZ >> $OUT/overlay.log 2>&1
t "overlay rc $?"
cc -O2 -shared -fPIC -I$(python3 -c "import sysconfig;print(sysconfig.get_paths()['include'])") runtime/_launch.c -o runtime/_launch.abi3.so
t "launch rc $?"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> $OUT/checks.txt
FLASHKILN_KERNEL_DIR=$PWD/build/KM FLASHKILN_REQUIRE_GPU=1 timeout 240 tools/pyenv.sh python3 -m pytest -q -m gpu -rs --maxfail=40 tests > $OUT/gpu-test-main.log 2>&1
t "suite main (KM) rc $?: $(tail -1 $OUT/gpu-test-main.log)"
timeout 60 python3 - > $OUT/copy-bw.txt 2>&1 <<'PY'
# What this card's HBM gives a stream of equal reads and writes (a full dBias's bias read + dS
# write), a write-only stream (the hidden rows' zeros) and a read-only one, in TB/s.
import torch
n = 2 * 1024**3  # bf16 elements: 4.3 GB per tensor
a = torch.ones(n, dtype=torch.bfloat16, device="cuda"); b = torch.empty_like(a)
def rate(fn, nbytes):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    best = 1e9
    for _ in range(5):
        s.record(); fn(); e.record(); e.synchronize(); best = min(best, s.elapsed_time(e))
    return nbytes / best / 1e9
print(f"copy (read+write) {rate(lambda: b.copy_(a), 4 * n):.2f} TB/s")
print(f"zero (write)      {rate(lambda: b.zero_(), 2 * n):.2f} TB/s")
print(f"sum (read)        {rate(lambda: a.sum(), 2 * n):.2f} TB/s")
PY
t "copy-bw $(tr '\n' ';' < $OUT/copy-bw.txt)"
ab() {  # label dir sweep dims
  FLASHKILN_KERNEL_DIR=$2 timeout 60 tools/pyenv.sh python3 tools/time_backward.py $1 --sweep $3 --dims $4 --seqlens 2048 8192 --reps 10 >> $OUT/ab.jsonl 2>> $OUT/ab.err
}
for round in 1 2; do
  ab main $PWD/build/KM dbias 64; ab z $PWD/build/KZ dbias 64
  ab main $PWD/build/KM dbias 128; ab z $PWD/build/KZ dbias 128
  t "ab round $round"
done
FLASHKILN_KERNEL_DIR=$PWD/build/KZ FLASHKILN_REQUIRE_GPU=1 timeout 90 tools/pyenv.sh python3 -m pytest -q -m gpu -x -k bias tests > $OUT/gpu-test-bias-KZ.log 2>&1
t "bias tests KZ rc $?: $(tail -1 $OUT/gpu-test-bias-KZ.log)"
