"""The grouped launch order of masked grids (csrc/common/tile_order.hpp), checked on the host.

tests/cpp/test_tile_order.cpp is compiled with the host C++ compiler (the header needs neither CUDA nor
CUTLASS) and run: the order is a bijection onto the tiles, each head gets its blocks in launch order (the
deterministic backward relies on it), groups are contiguous and balanced. Skipped without a C++ compiler.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_grouped_tile_order(tmp_path):
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    exe = tmp_path / "test_tile_order"
    src = ROOT / "tests" / "cpp" / "test_tile_order.cpp"
    build = subprocess.run(
        [cxx, "-std=c++17", "-O1", "-Wall", "-Werror", f"-I{ROOT / 'csrc'}", str(src), "-o", str(exe)],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-4000:]
    assert "all checks passed" in run.stdout
