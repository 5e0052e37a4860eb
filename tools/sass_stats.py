"""Instruction mix of a kernel's hottest loop, from the SASS of an object file (no GPU needed).

    python3 tools/compile_check.py --only bwd80 --keep build/objs
    python3 tools/sass_stats.py build/objs/bwd_sm80_bf16_hdim128_noncausal.o --kernel BwdKernelSm80

The loop is the backward branch whose body holds the most tensor-core instructions (HMMA/HGMMA). Printed:
instructions, tensor-core instructions, the longest run without one (where the tensor cores idle unless
other warps fill in), and the counts of the memory instructions that usually matter (ldmatrix, shared
loads/stores, global atomics and reductions, barriers). A proxy to compare versions of a kernel before a
GPU run, not a timing.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_FUNC = re.compile(r"Function : (\S+)")
MMA = ("HMMA", "HGMMA")
WATCH = ("LDSM", "LDS", "STS", "STSM", "LDG", "STG", "LDGSTS", "ATOMG", "REDG", "RED", "ATOM", "BAR")
WATCH += ("UBLKRED",)


def functions(sass: str) -> dict[str, list[tuple[int, str, str]]]:
    """ "[arch] function name" -> [(address, opcode, operands)]."""
    out: dict[str, list[tuple[int, str, str]]] = {}
    current = None
    arch = ""
    for line in sass.splitlines():
        a = re.search(r"(?:arch = |code for )(sm_\w+)", line)
        if a:
            arch = a.group(1)
        m = _FUNC.search(line)
        if m:
            current = f"[{arch}] {m.group(1)}"
            out[current] = []
            continue
        m = _INSN.search(line)
        if m and current is not None:
            out[current].append((int(m.group(1), 16), m.group(3), m.group(4)))
    return out


def hottest_loop(insns: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """The body of the backward branch that encloses the most tensor-core instructions (all if none)."""
    index = {addr: i for i, (addr, _, _) in enumerate(insns)}
    best, best_mma = insns, -1
    for i, (addr, op, operands) in enumerate(insns):
        if not op.startswith("BRA"):
            continue
        m = re.search(r"0x([0-9a-f]+)", operands)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target >= addr or target not in index:
            continue
        body = insns[index[target] : i + 1]
        mma = sum(o.startswith(MMA) for _, o, _ in body)
        if mma > best_mma:
            best, best_mma = body, mma
    return best


def stats(body: list[tuple[int, str, str]]) -> dict:
    ops = Counter(op.split(".")[0] for _, op, _ in body)
    run = longest = 0
    for _, op, _ in body:
        run = 0 if op.startswith(MMA) else run + 1
        longest = max(longest, run)
    mma = sum(ops[m] for m in MMA)
    return {
        "instructions": len(body),
        "mma": mma,
        "per_mma": len(body) / mma if mma else float("inf"),
        "longest_run_without_mma": longest,
        **{w: ops[w] for w in WATCH if ops[w]},
    }


def find_cuobjdump() -> str | None:
    """cuobjdump from PATH, else from the nvidia-cuda-cuobjdump wheel (pip's CUDA 13 layout)."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia

        for root in nvidia.__path__:
            candidate = Path(root) / "cu13" / "bin" / "cuobjdump"
            if candidate.exists():
                return str(candidate)
    except ImportError:
        pass
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("objects", nargs="+", type=Path)
    ap.add_argument("--kernel", default="kernel_entry", help="substring of the function names to report")
    args = ap.parse_args(argv)
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        print("sass_stats.py needs cuobjdump (CUDA toolkit or nvidia-cuda-cuobjdump wheel)", file=sys.stderr)
        return 1
    for obj in args.objects:
        cmd = [cuobjdump, "-sass", str(obj)]
        sass = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        for name, insns in functions(sass).items():
            if args.kernel not in name:
                continue
            s = stats(hottest_loop(insns))
            detail = "  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in s.items())
            print(f"{obj.name}: {name[:90]}\n  loop: {detail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
