"""Building and running the host-side C++ checks of tests/cpp/ (kernel headers walked on the CPU: layouts,
partitions, block geometry, dropout bits), shared by the tests that drive them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_host_check(name: str, tmp_path: Path, args=(), sm90: bool = False) -> subprocess.CompletedProcess:
    """Compiles tests/cpp/<name>.cpp with nvcc as host code (CUTLASS / CuTe headers from the build's include
    dirs; `sm90`: with the sm90 kernels' WGMMA shapes) and runs it with `args`; skips the calling test where
    nvcc or the headers are missing. Returns the run (its stdout for the caller to read); a failed build fails
    the test with the compiler's output."""
    sys.path.insert(0, str(ROOT / "csrc"))
    try:
        import build_flags
    finally:
        sys.path.remove(str(ROOT / "csrc"))
    nvcc = shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None
    )
    if nvcc is None:
        pytest.skip("nvcc not found")
    try:
        includes = [f"-I{p}" for p in build_flags.include_dirs()]
    except RuntimeError as e:
        pytest.skip(str(e))
    exe = tmp_path / name
    flags = ["-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED"] if sm90 else []
    cmd = [nvcc, "-std=c++17", "-O1", "-x", "cu", "--expt-relaxed-constexpr", *flags, *includes,
           str(ROOT / "tests" / "cpp" / f"{name}.cpp"), "-o", str(exe)]  # fmt: skip
    build = subprocess.run(cmd, capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    return subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=120)
