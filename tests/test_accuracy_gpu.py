"""Accuracy beside the anchors: on the same bf16 inputs (2 x 1024 tokens x 8 heads, standard normal), our max
absolute error against fp64 attention in out, dq, dk and dv, the largest over three seeds, is at most 1.1x
the smaller of cuDNN SDPA's and FlashAttention-4's (flash_attn.cute, where it imports), at every built head
dim, causal and not. The measurement is benchmarks/accuracy_anchors.py's table. Three seeds, not one: a max
error is one element, and which implementation's rounding lands worst on it changes from seed to seed while
the RMS errors agree. Without any anchor on the machine the test skips and says so.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from flash_attn4 import _build_info

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from accuracy_anchors import ANCHORS, NAMES, available, max_errors, worst_over_seeds  # noqa: E402

BOUND = 1.1  # issue 31: at most 1.1x the better anchor
SEEDS = 3
HDIMS = list(_build_info.HDIMS) or [64, 96, 128, 192, 256]


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hdim", HDIMS)
def test_error_within_the_better_anchor(hdim, causal):
    arch, why = _build_info.kernel_available(torch.device("cuda"), torch.bfloat16, hdim)
    if arch is None:
        pytest.skip(f"flash_attn4 CUDA kernels unavailable: {why}")
    impls = ["flash_attn4", *available(ANCHORS)]
    errors = worst_over_seeds([max_errors(hdim, causal, seed, impls) for seed in range(SEEDS)])
    ours = errors.pop("flash_attn4")
    assert isinstance(ours, dict), f"flash_attn4 failed: {ours}"
    ran = {name: e for name, e in errors.items() if isinstance(e, dict)}
    if not ran:
        pytest.skip(f"no anchor ran at head dim {hdim}: {errors}")
    worse = []
    for n in NAMES:
        best_name = min(ran, key=lambda name: ran[name][n])
        best = ran[best_name][n]
        if ours[n] > BOUND * best:
            worse.append(f"{n}: ours {ours[n]:.3e} > {BOUND} x {best_name} {best:.3e}")
    assert not worse, f"hdim {hdim} causal={causal}: " + "; ".join(worse)
