#!/usr/bin/env python3
"""Compiles one sm_90a forward, one sm_90a backward, one sm_80 forward and one sm_80 backward instantiation
with nvcc (no GPU needed) and reports registers and spills.

CI runs this so that a kernel that no longer compiles fails CI even on a machine without a GPU.
Exit status is non-zero on a compile error or on local-memory spills in a main (fwd/bwd) kernel beyond
SPILL_BUDGET.
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

# Bytes of spill stores tolerated in a main kernel, per (direction, arch); anything more is a regression.
# sm90 backward: 16 (it has spilled up to 12 bytes of per-head loop state, outside the per-query-block loop).
# sm80 backward: 64 (up to 20 bytes non-causal, 24 causal at hdim 128: dK and dV hold 128 of the 255
# registers; docs/design.md, "sm80 kernels").
SPILL_BUDGET = {("fwd", 90): 0, ("bwd", 90): 16, ("fwd", 80): 0, ("bwd", 80): 64, ("decode", 80): 0}
# The sm90 dropout backward at head dim 128 keeps about a dozen loop-invariant values in local memory (stored
# before the step loop, reloaded from L1 inside it: 56-64 B); every variant tried to fit them (keep-bit
# arrays, a tagged P, the dS math fused into the Philox pass) left the same spill.
SPILL_BUDGET[("bwd", 90, "dropout")] = 64
# The persistent sm90 backward: its producer warpgroup runs at 24 registers (the consumers need the other 240
# a thread), and the dQ writer warp and the producer thread keep their tile's indices and loop state in local
# memory: stored and reloaded once a tile or a query head, never inside the steps (28 B causal, 8-16 B else).
PERSISTENT_BWD_SPILL_BUDGET = 32


def compile_one(
    nvcc: str, kernel, arch: int, tmp: Path, sass_archs: tuple[int, ...] = ()
) -> tuple[bool, str]:
    # The generated .cu includes "../launch/...", so it must sit one level under csrc/; a folder per process,
    # so that two checks can run at once.
    gen = Path(tempfile.mkdtemp(prefix="instantiations_check_", dir=ROOT / "csrc"))
    src = gen / f"{kernel.name}.cu"
    src.write_text(kernel.source())
    cmd = [
        nvcc,
        *build_flags.NVCC_FLAGS,
        *(build_flags.gencode(a) for a in sorted({arch, *sass_archs})),
        *[f"-I{p}" for p in build_flags.include_dirs()],
        "-Xptxas=-v",
        "-c",
        str(src),
        "-o",
        str(tmp / f"{kernel.name}.o"),
    ]
    print(f"[compile_check] {kernel.name}: {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    shutil.rmtree(gen, ignore_errors=True)
    return proc.returncode == 0, proc.stdout + proc.stderr


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--dtype", default="bf16", choices=(*generate_kernels.DTYPES, "e4m3"), help="e4m3: fwd90 only"
    )
    ap.add_argument("--hdim", type=int, default=128, choices=generate_kernels.HDIMS)
    ap.add_argument("--causal", action="store_true", help="same as --mask causal")
    ap.add_argument("--mask", choices=("none", "causal", "local"), default="none")
    ap.add_argument(
        "--only",
        help="comma-separated subset of fwd90,bwd90,fwd80,bwd80,decode,decode_paged (decode_kv8, "
        "decode_paged_kv8: e4m3 caches) and the block-sparse "
        "fwd90sparse,bwd90sparse,fwd80sparse,bwd80sparse, ALiBi fwd90alibi,bwd90alibi, dropout "
        "fwd90dropout,bwd90dropout and fwd90mla,bwd90mla (the MLA_HDIMS pair whose q / k head dim is --hdim) "
        "(default: all but the block-sparse, ALiBi, dropout and MLA ones)",
    )
    ap.add_argument("--keep", type=Path, help="keep the objects in this folder (for tools/sass_stats.py)")
    ap.add_argument(
        "--also-sm90", action="store_true", help="sm80 kernels: add the sm_90a code the build runs on Hopper"
    )
    ap.add_argument(
        "--target", type=int, default=80, choices=build_flags.AMPERE_FAMILY,
        help="the SASS target of the Ampere-path (80) and decode kernels: 86 / 89 (RTX 30 / 40), 87 (Jetson "
        "Orin), 120 (RTX 50)",
    )  # fmt: skip
    args = ap.parse_args()
    mask = "causal" if args.causal else args.mask
    causal, local = mask == "causal", mask == "local"

    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    wanted = set((args.only or "fwd90,bwd90,fwd80,bwd80,decode,decode_paged").split(","))
    # (kernel, arch, spill-budget key); the decode family compiles for sm_80 (and sm_90a with --also-sm90).
    # The sm90 family compiles for sm_90a, the Ampere-path and decode families for --target.
    kernels = (
        [
            (k, 90 if k.arch == 90 else args.target, (k.direction, k.arch))
            for name in ("fwd90", "bwd90", "fwd80", "bwd80")
            if name in wanted
            for k in [generate_kernels.Kernel(name[:3], int(name[3:]), args.dtype, args.hdim, causal, local)]
        ]
        + [
            (k, 90 if k.arch == 90 else args.target, (k.direction, k.arch))
            for name in ("fwd90sparse", "bwd90sparse", "fwd80sparse", "bwd80sparse")
            if name in wanted
            for k in [
                generate_kernels.Kernel(
                    name[:3], int(name[3:5]), args.dtype, args.hdim, causal, local, sparse=True
                )
            ]
        ]
        + [
            (k, 90, (k.direction, 90) + (("dropout",) if k.dropout and k.direction == "bwd" else ()))
            for name in ("fwd90alibi", "bwd90alibi", "fwd90dropout", "bwd90dropout")
            if name in wanted
            for k in [
                generate_kernels.Kernel(
                    name[:3],
                    90,
                    args.dtype,
                    args.hdim,
                    causal,
                    local,
                    alibi="alibi" in name,
                    dropout="dropout" in name,
                )
            ]
        ]
        + [
            (kernel, 90, (name[:3], 90))
            for name in ("fwd90mla", "bwd90mla")
            if name in wanted
            for h, hv in generate_kernels.MLA_HDIMS
            if h == args.hdim
            for kernel in [generate_kernels.Kernel(name[:3], 90, args.dtype, h, causal, local, hdim_v=hv)]
        ]
        + [
            (
                generate_kernels.DecodeKernel(args.dtype, args.hdim, "paged" in name, name.endswith("kv8")),
                args.target,
                ("decode", 80),
            )
            for name in ("decode", "decode_paged", "decode_kv8", "decode_paged_kv8")
            if name in wanted
        ]
    )
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for kernel, arch, budget_key in kernels:
            t0 = time.time()
            ok, out = compile_one(nvcc, kernel, arch, Path(tmp), (90,) if args.also_sm90 else ())
            if not ok:
                print(out[-20000:])
                print(f"[compile_check] {kernel.name} FAILED ({time.time() - t0:.0f} s)")
                failed = True
                continue
            # ptxas reports one block per entry function: the name line, then properties, then registers.
            entry = None
            for line in out.splitlines():
                m = re.search(r"Compiling entry function '(\S+)'", line)
                if m:
                    entry = m.group(1)
                if re.search(r"registers|spill", line):
                    print(f"[compile_check]   {line.strip()}")
                spill = re.search(r"(\d+) bytes spill stores", line)
                main_kernel = entry is not None and ("kernel_entry_sm" in entry or "decode_entry" in entry)
                budget = SPILL_BUDGET[budget_key]
                if entry is not None and "BwdPersistentKernelSm90" in entry:
                    budget = max(budget, PERSISTENT_BWD_SPILL_BUDGET)
                if spill and int(spill.group(1)) > budget and main_kernel:
                    print(f"[compile_check] {kernel.name} FAILED: spills {spill.group(1)} bytes")
                    failed = True
                # C7513: ptxas serialized the WGMMAs (a wait after every one), a silent loss of most of the
                # kernel's speed; it happens when a non-WGMMA instruction writes a WGMMA input register while
                # the WGMMA pipeline is open.
                if "Potential Performance Loss" in line:
                    print(f"[compile_check] {kernel.name} FAILED: {line.strip()[:200]}")
                    failed = True
            print(f"[compile_check] {kernel.name} compiled ({time.time() - t0:.0f} s)")
            if args.keep:
                args.keep.mkdir(parents=True, exist_ok=True)
                shutil.copy(Path(tmp) / f"{kernel.name}.o", args.keep / f"{kernel.name}.o")
    print("[compile_check] FAILED" if failed else "[compile_check] OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
