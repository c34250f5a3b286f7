#!/usr/bin/env bash
# v61 call 5 (the session's device time allows one more call): call 4's half skips (KHS) with
# their tests and racecheck, beside memcheck's packed list on main's kernels (KF, owed from call
# 1); then the A/B of KHS against KF (windows d 128, one round; plain d 128, two), then call 3's
# 128-row softcapped d 64 backward (KSC) against KF, one round each.
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/checks.txt; }
tar -xzf .device/K.tgz && tar -xzf .device/v58/B2P2.tgz && tar -xzf .device/v60/S60.tgz && tar -xzf .device/v60/F.tgz
tar -xzf .device/v61/HS.tgz && tar -xzf .device/v61/SC128.tgz
python3 tools/overlay_build.py generated build/P2 build/KP2 --drop '^(bwd_(dbias_)?|fwd_)hopper_.*' > $OUT/overlay.log 2>&1
python3 tools/overlay_build.py build/KP2 build/S60 build/KM --drop '^bwd_hopper_.*' >> $OUT/overlay.log 2>&1
python3 tools/overlay_build.py build/KM build/F build/KF >> $OUT/overlay.log 2>&1
python3 tools/overlay_build.py build/KF build/HS build/KHS >> $OUT/overlay.log 2>&1
python3 tools/overlay_build.py build/KF build/SC128 build/KSC --drop '^bwd_hopper_sm90a_bf16_d64_(causal-br_)?softcap_[0-9a-f]+$' >> $OUT/overlay.log 2>&1
cc -O2 -shared -fPIC -I$(python3 -c "import sysconfig;print(sysconfig.get_paths()['include'])") runtime/_launch.c -o runtime/_launch.abi3.so
t "setup rc $?"
san() {  # kernels tool log args...
  local dir=$1 tool=$2 log=$3; shift 3
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 FLASHKILN_KERNEL_DIR=$PWD/build/$dir timeout 160 compute-sanitizer --tool $tool \
    --target-processes all --print-limit 20 --report-api-errors no tools/pyenv.sh python3 tools/sanitize.py "$@" \
    > $OUT/$log 2>&1
  echo "rc $?" >> $OUT/$log
}
san KHS racecheck racecheck-KHS.log --only dense & P1=$!
san KF memcheck memcheck-packed-KF.log --only packed & P2=$!
FLASHKILN_KERNEL_DIR=$PWD/build/KHS FLASHKILN_REQUIRE_GPU=1 timeout 170 tools/pyenv.sh python3 -m pytest -q -m gpu \
  tests/test_hopper_backward_gpu.py tests/test_window_gpu.py tests/test_softcap_gpu.py tests/test_varlen_gpu.py \
  tests/test_backward_gpu.py > $OUT/tests-KHS.log 2>&1
t "tests KHS rc $?: $(tail -1 $OUT/tests-KHS.log)"
wait $P1 $P2
for f in racecheck-KHS memcheck-packed-KF; do
  t "$f: $(grep SUMMARY $OUT/$f.log) cases $(grep -c finite=True $OUT/$f.log) bad $(grep -c finite=False $OUT/$f.log) $(tail -1 $OUT/$f.log)"
done
for arm in KF KHS; do
  FLASHKILN_KERNEL_DIR=$PWD/build/$arm timeout 90 tools/pyenv.sh python3 tools/time_score_mods.py --mod window --quick \
    --dims 128 --backend hopper > $OUT/window-$arm.json 2>> $OUT/ab.err
  t "window $arm"
done
for round in 1 2; do
  for arm in KF KHS; do
    FLASHKILN_KERNEL_DIR=$PWD/build/$arm timeout 60 tools/pyenv.sh python3 tools/time_backward.py $arm --sweep plain \
      --dims 128 --seqlens 2048 8192 --reps 10 >> $OUT/ab-plain.jsonl 2>> $OUT/ab.err
    t "plain $arm round $round"
  done
done
for arm in KF KSC; do
  FLASHKILN_KERNEL_DIR=$PWD/build/$arm timeout 60 tools/pyenv.sh python3 tools/time_score_mods.py --mod softcap --quick \
    --dims 64 --backend hopper > $OUT/softcap-$arm.json 2>> $OUT/ab.err
  t "softcap $arm"
done
