"""The block geometry of the kernels (csrc/common/block_info.hpp), checked on the host against brute force.

tests/cpp/test_block_info.cpp is compiled with nvcc as host code (no GPU needed) and run: forward and
backward block ranges cover every visible (query, key) pair, blocks and tiles said to need no mask have
none, and the key blocks adding into each query block in the backward are exactly the forward's range for it
(what the deterministic turn order relies on), for no mask, causal and sliding windows at several tile sizes.
Skipped (with the reason) where nvcc or the CUTLASS headers are missing.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "csrc"))
import build_flags  # noqa: E402


def test_block_geometry_matches_brute_force(tmp_path):
    nvcc = shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None
    )
    if nvcc is None:
        pytest.skip("nvcc not found")
    try:
        includes = [f"-I{p}" for p in build_flags.include_dirs()]
    except RuntimeError as e:
        pytest.skip(str(e))
    exe = tmp_path / "test_block_info"
    src = ROOT / "tests" / "cpp" / "test_block_info.cpp"
    cmd = [
        nvcc,
        "-std=c++17",
        "-O1",
        "-x",
        "cu",
        "--expt-relaxed-constexpr",
        *includes,
        str(src),
        "-o",
        str(exe),
    ]
    build = subprocess.run(cmd, capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-4000:]
    assert "all checks passed" in run.stdout
