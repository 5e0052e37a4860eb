#!/usr/bin/env python3
"""Compiles one sm_90a forward instantiation with nvcc (no GPU needed) and reports registers/spills.

CI runs this so that a kernel that no longer compiles fails CI even on a machine without a GPU.
Exit status is non-zero on a compile error or on any local-memory spill.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "csrc"))
import build_flags  # noqa: E402
import generate_kernels  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="bf16", choices=generate_kernels.DTYPES)
    ap.add_argument("--hdim", type=int, default=128, choices=generate_kernels.HDIMS)
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()

    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    kernel = generate_kernels.FwdKernel(90, args.dtype, args.hdim, args.causal)
    with tempfile.TemporaryDirectory() as tmp:
        # The generated .cu includes "../launch/...", so it must sit one level under csrc/.
        gen = ROOT / "csrc" / "instantiations_check"
        gen.mkdir(exist_ok=True)
        src = gen / f"{kernel.name}.cu"
        src.write_text(kernel.source())
        cmd = [
            nvcc,
            *build_flags.NVCC_FLAGS,
            build_flags.GENCODE_SM90A,
            *[f"-I{p}" for p in build_flags.include_dirs()],
            "-Xptxas=-v",
            "-c",
            str(src),
            "-o",
            str(Path(tmp) / "kernel.o"),
        ]
        print(f"[compile_check] {kernel.name}: {' '.join(cmd)}", flush=True)
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        shutil.rmtree(gen, ignore_errors=True)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        print(out[-20000:])
        print(f"[compile_check] FAILED ({time.time() - t0:.0f} s)")
        return 1
    for line in out.splitlines():
        if re.search(r"registers|spill", line):
            print(f"[compile_check] {line.strip()}")
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", out)]
    if any(spills):
        print("[compile_check] FAILED: the kernel spills to local memory")
        return 1
    print(f"[compile_check] OK ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
