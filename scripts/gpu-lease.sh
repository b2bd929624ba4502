#!/usr/bin/env bash
# The GPU evidence inside one 15-minute lease (device tool): install the carried wheels (scripts/gpu-wheels.sh),
# profile the small-shape launch path (scripts/profile_launch_path.py), then `tridist bench all` one step at a
# time while BUDGET seconds last, and tar the results folder into $OUT (at most 8 files come back).
# Run there as:  BUDGET=560 bash scripts/gpu-lease.sh   (carry .whl; STEPS="overlap calibrate" for a subset)
# 2026-11-26 on an H100: profile 25 s, sweep (1 min) 68 s, check 29-38 s, kernels 152-180 s, model 345 s,
# overlap 100 s, calibrate 9 s; a machine's start and transfers ~45 s a call. D=... names another folder.
BUDGET=${BUDGET:-570}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 9
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.log 2>&1 || { tail $OUT/pip.log; exit 9; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee $OUT/gpu.txt
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')
D=${D:-bench/results/${GPU}-$(date -u +%F)}
echo "results -> $D at ${SECONDS}s"
# PRECHECK: a shell command (e.g. the GPU-only tests) that must pass before any bench runs; run with
# TRITON_INTERPRET=0, as tests/conftest.py otherwise sets 1 and the GPU-only tests skip
if [ -n "${PRECHECK:-}" ]; then TRITON_INTERPRET=0 bash -c "$PRECHECK" > $OUT/precheck.log 2>&1; rc=$?; tail -5 $OUT/precheck.log
  echo "precheck exit $rc at ${SECONDS}s"; [ $rc -eq 0 ] || exit 8; fi
[ -n "${NO_PROFILE:-}" ] || timeout 80 python3 scripts/profile_launch_path.py /tmp/prof > $OUT/prof.log 2>&1; echo "profile exit $? at ${SECONDS}s"
# FIRST: tridist commands (';'-separated, {D} for the results folder) run before the steps, for the evidence a
# lease most needs, e.g. FIRST="bench model --targets hf-moe --out {D}/model-moe;bench kernels --ops linear_cross_entropy --out {D}/lce"
IFS=';' read -ra FIRST_COMMANDS <<< "${FIRST:-}"
for c in "${FIRST_COMMANDS[@]}"; do
  [ -n "$c" ] || continue
  left=$((BUDGET - SECONDS - 15))
  timeout $left python3 -m tridist ${c//\{D\}/$D} >> $OUT/steps.log 2>&1
  echo "first '$c' exit $? at ${SECONDS}s"; tail -3 $OUT/steps.log
done
for s in ${STEPS:-sweep check kernels model overlap calibrate}; do
  left=$((BUDGET - SECONDS - 15))
  if [ $left -lt 30 ]; then echo "skip $s: ${left}s left"; continue; fi
  timeout $left python3 -m tridist bench all --out $D --steps $s --sweep-minutes ${SWEEP_MIN:-1} >> $OUT/steps.log 2>&1
  echo "step $s exit $? at ${SECONDS}s"; tail -3 $OUT/steps.log
  tar czf $OUT/results.tgz $D
done
tar czf $OUT/prof.tgz -C /tmp prof 2>/dev/null
echo "done at ${SECONDS}s"
