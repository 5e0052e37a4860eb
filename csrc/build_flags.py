"""Compiler flags and header locations shared by setup.py and tools/compile_check.py."""

from __future__ import annotations

import os
from pathlib import Path

CSRC = Path(__file__).resolve().parent
CUTLASS_PIN = "nvidia-cutlass==4.2.0.0"

# sm_90a (not sm_90): wgmma and setmaxnreg exist only in the arch-specific target.
GENCODE_SM90A = "-gencode=arch=compute_90a,code=sm_90a"
# The Ampere-path kernels (cp.async + mma.sync) run on every GPU from Ampere on: these are the targets they
# are compiled for as SASS (A100, RTX 30, Jetson Orin, RTX 40, RTX 50 / sm_120); SASS also runs on later
# minor versions of its major (sm_80 code on an sm_86 card), and the PTX of the lowest target is embedded
# too, so a GPU newer than every target JIT-compiles it.
AMPERE_FAMILY = (80, 86, 87, 89, 120)


def gencode(arch: int) -> str:
    return GENCODE_SM90A if arch == 90 else f"-gencode=arch=compute_{arch},code=sm_{arch}"


def gencodes(targets) -> list[str]:
    """nvcc -gencode flags for these targets (90 = sm_90a), plus the PTX of the lowest Ampere-family one."""
    flags = [gencode(a) for a in sorted(set(targets))]
    ampere = sorted(a for a in targets if a in AMPERE_FAMILY)
    if ampere:
        flags.append(f"-gencode=arch=compute_{ampere[0]},code=compute_{ampere[0]}")
    return flags


NVCC_FLAGS = [
    "-O3",
    "-std=c++17",
    "--expt-relaxed-constexpr",
    # Enables the WGMMA N sizes that are not multiples of 32 (kBlockN = 112 for hdim 192).
    "-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED",
    "-DNDEBUG",
    "-lineinfo",
    # torch's default flags turn these off for its own half types; CUTLASS brings its own.
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
]


def cutlass_include_dir() -> Path:
    """CUTLASS/CuTe headers: $CUTLASS_INCLUDE_DIR, else the pinned nvidia-cutlass wheel's copy."""
    env = os.environ.get("CUTLASS_INCLUDE_DIR")
    if env:
        path = Path(env)
    else:
        try:
            import cutlass_library  # from the nvidia-cutlass wheel
        except ImportError as e:
            raise RuntimeError(
                f"CUTLASS headers not found. Install them with `pip install {CUTLASS_PIN}` "
                "or point CUTLASS_INCLUDE_DIR at a CUTLASS include/ directory."
            ) from e
        path = Path(cutlass_library.__file__).resolve().parent / "source" / "include"
    if not (path / "cute" / "tensor.hpp").exists():
        raise RuntimeError(
            f"{path} does not contain cute/tensor.hpp; expected the CUTLASS include/ directory."
        )
    return path


def include_dirs() -> list[Path]:
    return [CSRC, cutlass_include_dir()]
