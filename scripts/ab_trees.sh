#!/usr/bin/env bash
# Same-card A/B of kernel variants on the GPU machine: each variant is this tree plus zero or more patches,
# copied to a fresh folder (so that NVCC_APPEND_FLAGS and edits are not hidden by a warm ninja cache), built
# side by side, then timed in alternating processes (a process per variant per round, the order reversed every
# round), so that clock and temperature drift hit every variant.
#
#   bash scripts/ab_trees.sh main= skip=.ab/skip.patch both=.ab/a.patch,.ab/b.patch
#   git diff HEAD <old commit> > .ab/old.patch && AB_BENCH=fwd bash scripts/ab_trees.sh old=.ab/old.patch new=
#
# Patches are paths relative to this tree (a git-ignored folder such as .ab/ travels with the device's `carry`);
# a variant with none is this tree as it is.
# Env: AB_BENCH (varlen: `bench_varlen.py --window-only`, the default; fwd: `bench_fwd.py`),
#      AB_ROUNDS (default 3), AB_TEST_TIMEOUT / AB_BENCH_TIMEOUT (seconds, default 300 / 150),
#      AB_BENCH_ARGS (the bench's arguments; varlen default --no-probe --rounds 1, add --direction fwd for a
#      forward-only change; fwd default --quick --bwd --rounds 1 --impls flash_attn4,sdpa_cudnn),
#      AB_TEST (a pytest command line run in every variant but the first after the build, e.g.
#      "tests/test_features_gpu.py -k window"), AB_APPEND_FLAGS (NVCC_APPEND_FLAGS of every build),
#      FLASH_ATTN4_HDIMS (default 128), FLASH_ATTN4_DTYPES (default bf16), MAX_JOBS (split between variants),
#      AB_BUILD=0 (reuse the variants an earlier call in the same machine session built in /tmp/ab),
#      AB_TRACE=1 (trace builds: also set AB_APPEND_FLAGS=-DFLASH4_TRACE, and AB_ROUNDS=0 since trace builds are
#      not for timing; runs tools/trace_tiles.py in every variant after the tests: $OUT/trace_<variant>.json, its
#      tables appended to ab_<variant>.log).
# Logs: $OUT/ab_<variant>.log (build, bench), ab_<variant>_tests.log, $OUT/ab_runs.jsonl (one line per process and
# case), $OUT/ab_summary.txt (scripts/ab_summary.py).
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG=${OUT:-build/ab}
mkdir -p "$LOG"
# shellcheck source=carried_wheels.sh
source scripts/carried_wheels.sh
export FLASH_ATTN4_HDIMS=${FLASH_ATTN4_HDIMS:-128}
export FLASH_ATTN4_DTYPES=${FLASH_ATTN4_DTYPES:-bf16}
((${#})) || { echo "usage: $0 name=[patch,...] ..." >&2; exit 2; }
jobs_each=$(((${MAX_JOBS:-16} + $# - 1) / $#))
names=()
for spec in "$@"; do
  name=${spec%%=*}
  patches=${spec#*=}
  dir=/tmp/ab/$name
  names+=("$name")
  [[ ${AB_BUILD:-1} == 0 ]] && continue
  rm -rf "$dir" && mkdir -p "$dir"
  tar --exclude=./build --exclude=./.git --exclude='*.so' --exclude=./csrc/instantiations --exclude=./.fa4A \
    --exclude=./.fa4B -cf - . | tar -xf - -C "$dir"
  for p in ${patches//,/ }; do
    (cd "$dir" && patch -p1 -s <"$OLDPWD/$p") || { echo "$name: $p does not apply" >&2; exit 2; }
  done
  (cd "$dir" && NVCC_APPEND_FLAGS="${AB_APPEND_FLAGS:-}" MAX_JOBS=$jobs_each $PY setup.py build_ext --inplace \
    >"$LOG/ab_$name.log" 2>&1; echo "build rc $?" >>"$LOG/ab_$name.log") &
done
t0=$(date +%s)
wait
echo "builds: $(($(date +%s) - t0))s"
# A variant that did not build would import without its extension and time the PyTorch reference (~1 s a call)
# instead of its kernels: stop here, with the first compiler error.
for name in "${names[@]}"; do
  tail -n 1 "$LOG/ab_$name.log" | sed "s/^/$name: /"
  if [[ ${AB_BUILD:-1} != 0 ]] && ! tail -n 1 "$LOG/ab_$name.log" | grep -q "^build rc 0$"; then
    grep -m 3 -E "error|FAILED" "$LOG/ab_$name.log" | cut -c1-300 | sed "s/^/$name: /" >&2
    echo "$name: build failed, nothing timed (see $LOG/ab_$name.log)" >&2
    exit 1
  fi
done
# Every variant's processes import its own build: its folder goes first on PYTHONPATH (a PYTHONPATH that names
# another checkout would time that checkout, or an unbuilt package's PyTorch reference), and the bench's
# "flash_attn4 from ..." line is checked.
in_variant() { (cd /tmp/ab/"$1" && shift && PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} "$@"); }
if [[ -n ${AB_TEST:-} ]]; then
  for name in "${names[@]:1}"; do
    # shellcheck disable=SC2086  # AB_TEST is a list of words
    in_variant "$name" timeout "${AB_TEST_TIMEOUT:-300}" $PY -m pytest -q --tb=short $AB_TEST \
      >"$LOG/ab_${name}_tests.log" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed" "$LOG/ab_${name}_tests.log" | tail -n 12 | sed "s/^/$name tests: /"
  done
fi
if [[ ${AB_TRACE:-0} == 1 ]]; then
  for name in "${names[@]}"; do
    in_variant "$name" timeout "${AB_BENCH_TIMEOUT:-150}" $PY tools/trace_tiles.py --out "$LOG/trace_$name.json" \
      >>"$LOG/ab_$name.log" 2>&1 || echo "$name: trace failed"
    grep -E "^(fwd|bwd) .*SM span" "$LOG/ab_$name.log" | sed "s/^/$name trace: /"
  done
fi
if [[ ${AB_BENCH:-varlen} == fwd ]]; then
  # shellcheck disable=SC2206  # AB_BENCH_ARGS is a list of words
  bench=(benchmarks/bench_fwd.py ${AB_BENCH_ARGS:---quick --bwd --rounds 1 --impls flash_attn4,sdpa_cudnn})
else
  # shellcheck disable=SC2206
  bench=(benchmarks/bench_varlen.py --window-only ${AB_BENCH_ARGS:---no-probe --rounds 1})
fi
for ((r = 0; r < ${AB_ROUNDS:-3}; ++r)); do
  order=("${names[@]}")
  ((r % 2)) && order=($(printf '%s\n' "${names[@]}" | tac))
  for name in "${order[@]}"; do
    in_variant "$name" timeout "${AB_BENCH_TIMEOUT:-150}" $PY "${bench[@]}" --out "/tmp/ab/$name.json" \
      >"/tmp/ab/$name.out" 2>&1 || echo "$name: bench failed (round $r)"
    cat "/tmp/ab/$name.out" >>"$LOG/ab_$name.log"
    grep -q "^flash_attn4 from /tmp/ab/$name/" "/tmp/ab/$name.out" ||
      { echo "$name: the bench did not import /tmp/ab/$name (see $LOG/ab_$name.log)" >&2; exit 1; }
    $PY - "$name" "$r" "/tmp/ab/$name.json" >>"$LOG/ab_runs.jsonl" <<'EOF'
import json, sys
name, rnd, path = sys.argv[1:]
for row in json.load(open(path)):
    if "window_ms" in row:  # bench_varlen.py
        keep = {k: row[k] for k in ("direction", "full_causal_ms", "window_ms", "speedup")}
    else:  # bench_fwd.py
        keep = {k: row.get(k) for k in ("impl", "hdim", "seqlen", "causal", "fwd_ms", "bwd_ms", "sm_clock_mhz")}
    print(json.dumps({"variant": name, "round": int(rnd), **keep}))
EOF
  done
done
[[ -f $LOG/ab_runs.jsonl ]] || exit 0  # AB_ROUNDS=0: nothing timed
$PY scripts/ab_summary.py "$LOG/ab_runs.jsonl" "${names[@]}" | tee "$LOG/ab_summary.txt"
