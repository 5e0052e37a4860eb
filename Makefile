# Developer entry points. Build knobs come from the environment or the make command line and reach
# setup.py unchanged (make exports both to recipes), e.g.:
#   make build FLASH_ATTN4_HDIMS=128 FLASH_ATTN4_DTYPES=bf16 MAX_JOBS=8
# BENCH_ARGS adds flags to the bench_fwd.py targets, e.g. make bench-fwd BENCH_ARGS="--hdims 128 --causal 1";
# DECODE_ARGS to bench-decode's (e.g. DECODE_ARGS="--pages 16"); FLASH_ATTN4_RESULTS_DIR=DIR puts every result
# file in DIR instead of benchmarks/results.

PYTHON ?= python3
BENCH_ARGS ?=
DECODE_ARGS ?=

.PHONY: install build test bench bench-fwd bench-bwd bench-decode bench-varlen bench-ring bench-quick gpu-check gpu-sm80 compile-check lint format clean

install:  ## build against the torch you run (no build isolation: ABI) and install
	$(PYTHON) -m pip install --no-build-isolation -v .

build:  ## compile flash_attn4/_C in place, for working from the source tree
	$(PYTHON) setup.py build_ext --inplace

test:  ## the README's test command; GPU tests skip (with the reason) without a GPU and built kernels
	$(PYTHON) -m pytest -q tests

bench: bench-fwd bench-bwd bench-varlen bench-decode  ## all four below, one after the other

bench-fwd:  ## the FlashAttention papers' grid, forward -> benchmarks/results/<gpu>_fwd.json + .png
	$(PYTHON) benchmarks/bench_fwd.py $(BENCH_ARGS)

bench-bwd:  ## the same grid, backward -> <gpu>_bwd.json + .png
	$(PYTHON) benchmarks/bench_fwd.py --bwd $(BENCH_ARGS)

bench-decode:  ## decode from contiguous and paged KV caches, host time per call -> <gpu>_decode.json + .png
	$(PYTHON) benchmarks/bench_decode.py $(DECODE_ARGS)

bench-varlen:  ## window 4096 at 32k vs causal, varlen 64..8192 vs equal length -> benchmarks/results/<gpu>_varlen.json
	$(PYTHON) benchmarks/bench_varlen.py

bench-ring:  ## ring_attn on 2 GPUs vs attn on one, 128k / 512k tokens, fwd and bwd -> <gpu>_ring.json (BENCH_ARGS="--gpus 2,4")
	$(PYTHON) benchmarks/bench_ring.py $(BENCH_ARGS)

bench-quick:  ## hdim 64/128/256 x seqlen 4096/8192 x causal both, forward and backward -> <gpu>_{fwd,bwd}_quick.json
	$(PYTHON) benchmarks/bench_fwd.py --quick $(BENCH_ARGS)
	$(PYTHON) benchmarks/bench_fwd.py --quick --bwd $(BENCH_ARGS)

gpu-check:  ## build + tests + quick bench on a GPU machine without network; logs in $$OUT or build/gpu_check
	bash scripts/gpu_check.sh

gpu-sm80:  ## the Ampere path on a Hopper GPU (FLASH_ATTN4_FORCE_SM80=1): build, GPU tests, bench vs FA2 and the 99 KB tiles (SMEM_CAP=101376: tests as a 99 KB card)
	bash scripts/gpu_sm80.sh

compile-check:  ## compile one sm_90a forward instantiation with nvcc (no GPU needed)
	$(PYTHON) tools/compile_check.py

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

format:
	$(PYTHON) -m ruff check --fix .
	$(PYTHON) -m ruff format .

clean:
	rm -rf build dist *.egg-info flash_attn4/_C*.so flash_attn4/_build_config.py \
		csrc/instantiations csrc/instantiations_check_* .pytest_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
