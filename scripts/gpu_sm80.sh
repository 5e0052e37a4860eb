#!/usr/bin/env bash
# The Ampere path on a Hopper GPU: build the Ampere-path kernels alone (as sm_90a SASS), run the GPU tests
# with FLASH_ATTN4_FORCE_SM80=1 (forward, backward, windows, softcap, varlen, decode, block masks, the 99 KB
# tiles), and benchmark it against SDPA's FA2 backend and under the 99 KB cap (flash_attn4_99kb).
#
#   bash scripts/gpu_sm80.sh                    # logs and benchmarks/results-style JSON in $OUT (or build/gpu_sm80)
#   SMEM_CAP=101376 bash scripts/gpu_sm80.sh    # the tests as a 99 KB card (sm86 / 89 / 120) runs them
#
# Env: FLASH_ATTN4_HDIMS (default 64,128), FLASH_ATTN4_DTYPES (default bf16), MAX_JOBS (default 16),
#      TEST_TIMEOUT (default 240), SKIP_BUILD=1, SMEM_CAP (bytes; the tests only, the benchmark runs both).
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG=${OUT:-build/gpu_sm80}
mkdir -p "$LOG"
# shellcheck source=carried_wheels.sh
source scripts/carried_wheels.sh
export FLASH_ATTN4_ARCHS=90 FLASH_ATTN4_FAMILIES=80
export FLASH_ATTN4_HDIMS=${FLASH_ATTN4_HDIMS:-64,128}
export FLASH_ATTN4_DTYPES=${FLASH_ATTN4_DTYPES:-bf16}
build_rc=0
if [[ "${SKIP_BUILD:-0}" != 1 ]]; then
  t0=$(date +%s)
  MAX_JOBS=${MAX_JOBS:-16} $PY setup.py build_ext --inplace >"$LOG/build.log" 2>&1
  build_rc=$?
  echo "build: $(($(date +%s) - t0))s (rc $build_rc)"
fi
export FLASH_ATTN4_FORCE_SM80=1
$PY -m flash_attn4 --no-self-test 2>&1 | tail -n 6
FLASH_ATTN4_SMEM_CAP=${SMEM_CAP:-} timeout "${TEST_TIMEOUT:-240}" $PY -m pytest -q tests/test_fwd_gpu.py \
  tests/test_bwd_gpu.py tests/test_features_gpu.py tests/test_decode_gpu.py tests/test_block_sparse_kernel.py \
  tests/test_smem_cap.py tests/test_fp16_accum_gpu.py 2>&1 | tee "$LOG/test.log" | tail -n 15
test_rc=${PIPESTATUS[0]}
for d in fwd bwd; do
  flag=$([[ $d == bwd ]] && echo --bwd)
  # shellcheck disable=SC2086
  $PY benchmarks/bench_fwd.py $flag --hdims "$FLASH_ATTN4_HDIMS" --seqlens 2048,4096,8192 \
    --impls flash_attn4,flash_attn4_99kb,sdpa_flash --out "$LOG/sm80path_$d.json" 2>&1 | grep -v "shape/s" | tail -n 12
done
# One file with forward and backward records (impl, hdim, seqlen, causal, fwd_tflops / bwd_tflops).
$PY - "$LOG" <<'PYEOF'
import json, sys
from pathlib import Path
log = Path(sys.argv[1])
records = []
for d in ("fwd", "bwd"):
    f = log / f"sm80path_{d}.json"
    if f.exists():
        data = json.loads(f.read_text())
        records += data if isinstance(data, list) else data["records"]
(log / "h200_sm80path.json").write_text(json.dumps(records, indent=1) + "\n")
print(f"{len(records)} records -> {log / 'h200_sm80path.json'}")
PYEOF
((build_rc == 0 && test_rc == 0))
