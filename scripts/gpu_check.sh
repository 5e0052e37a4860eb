#!/usr/bin/env bash
# Build, test and benchmark flash_attn4 on a GPU machine that has no network.
#
#   bash scripts/gpu_check.sh            # or: make gpu-check
#
# Wheels carried in .whl/ (git-ignored) stand in for PyPI: nvidia_cutlass-*.whl gives the CUTLASS headers
# (setup.py finds them through `cutlass_library`, or CUTLASS_INCLUDE_DIR), ninja-*.whl a parallel build.
# Logs, the benchmark JSON/PNG and summary.txt go to $OUT (the device tool's return folder) or
# build/gpu_check; at most 10 files so that all of them come back.
#
# Env: SKIP_BUILD=1 (reuse flash_attn4/_C*.so), MAX_JOBS (default 16), TEST_ARGS (extra pytest args),
#      TEST_TIMEOUT (seconds for the test suite, default 420),
#      BENCH_ARGS (default --quick), SKIP_BENCH=1, FLASH_ATTN4_HDIMS / FLASH_ATTN4_DTYPES (passed to setup.py).
set -uo pipefail  # not -e: a failing build or test must still reach the summary
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG=${OUT:-build/gpu_check}
mkdir -p "$LOG"
SUMMARY="$LOG/summary.txt"
: >"$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

note "== gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /' | tee -a "$SUMMARY"
$PY -c 'import torch; print(f"torch {torch.__version__} cuda {torch.version.cuda}")' 2>&1 | tee -a "$SUMMARY"

# 1. Carried wheels into a private site dir (never over the system packages).
# shellcheck source=carried_wheels.sh
source scripts/carried_wheels.sh
$PY -c 'import cutlass_library, os; print("cutlass_library:", os.path.dirname(cutlass_library.__file__))' \
  2>/dev/null | tee -a "$SUMMARY" || note "cutlass_library: not importable (the build needs it, or CUTLASS_INCLUDE_DIR)"

# 2. Build in place, timed.
build_rc=0
build_s=skipped
if [[ "${SKIP_BUILD:-0}" != 1 ]]; then
  t0=$(date +%s)
  MAX_JOBS=${MAX_JOBS:-16} $PY setup.py build_ext --inplace >"$LOG/build.log" 2>&1
  build_rc=$?
  build_s=$(($(date +%s) - t0))
  tail -n 5 "$LOG/build.log"
fi
note "build: ${build_s}$([[ $build_s == skipped ]] || echo s) (rc $build_rc, MAX_JOBS=${MAX_JOBS:-16}, log $LOG/build.log)"

# 3. The whole test suite (not -x: every failure is worth seeing).
# shellcheck disable=SC2086  # TEST_ARGS is a list of words
# A deadlocked kernel must not eat the whole device slot: the suite gets TEST_TIMEOUT seconds (default 420).
timeout "${TEST_TIMEOUT:-420}" $PY -m pytest -q tests ${TEST_ARGS:-} 2>&1 | tee "$LOG/test.log"
test_rc=$?
note "tests: $(grep -E '(passed|failed|skipped|error|no tests ran).* in [0-9.]+s' "$LOG/test.log" | tail -n 1) (rc $test_rc)"

# 4. A short benchmark; its JSON and PNG land in the log folder.
if [[ "${SKIP_BENCH:-0}" != 1 ]]; then
  # shellcheck disable=SC2086
  $PY benchmarks/bench_fwd.py ${BENCH_ARGS:---quick} --out "$LOG/bench_fwd.json" 2>&1 | tee "$LOG/bench.log"
  bench_rc=$?
  # shellcheck disable=SC2086
  $PY benchmarks/bench_fwd.py --bwd ${BENCH_ARGS:---quick} --out "$LOG/bench_bwd.json" 2>&1 | tee -a "$LOG/bench.log"
  bench_rc=$((bench_rc | $?))
  note "bench: rc $bench_rc (log $LOG/bench.log)"
fi

echo
echo "================ summary ================"
cat "$SUMMARY"
for f in "$LOG/bench_fwd.json" "$LOG/bench_bwd.json"; do
  [[ -f $f ]] && $PY benchmarks/plot.py "$f" --table-only | tee -a "$SUMMARY"
done
((build_rc == 0 && test_rc == 0))
