"""Builds flash_attn4: the Python package, plus flash_attn4._C when torch has CUDA and nvcc is found.

Build against the torch you run: `pip install --no-build-isolation .` (an isolated build would pull
another torch and produce an extension that fails to import with undefined symbols).

Environment knobs:
  FLASH_ATTN4_HDIMS=64,128        head dims to compile (default 64,96,128,192,256)
  FLASH_ATTN4_DTYPES=bf16         dtypes to compile (default bf16,fp16)
  FLASH_ATTN4_ARCHS=90,80         build targets, of 80, 86, 87, 89, 90, 120 (default: the GPUs this machine
                                  has, or 80,90 when it sees none). 90 builds the sm_90a kernels; each other
                                  one the Ampere-path kernels as SASS for it (plus PTX of the lowest); with
                                  90 and 80 both, Hopper also runs the Ampere path (FLASH_ATTN4_FORCE_SM80=1)
  FLASH_ATTN4_FAMILIES=80         kernel families to generate, of 80 (Ampere path) and 90 (default: what the
                                  targets ask for). For testing: FLASH_ATTN4_ARCHS=90 FLASH_ATTN4_FAMILIES=80
                                  builds only the Ampere-path kernels, as sm_90a SASS, so a Hopper GPU runs
                                  that path without building the Hopper kernels
  FLASH_ATTN4_OPTIONS=dropout     the optional kernel sets to compile, of sparse, fp8, alibi, dropout, mla and
                                  decode, or none (default: all); the rest run on the PyTorch reference. For
                                  development builds that need one variant: FLASH_ATTN4_HDIMS=128
                                  FLASH_ATTN4_OPTIONS=dropout compiles 12 instantiations instead of 29
  FLASH_ATTN4_SKIP_CUDA_BUILD=1   install the Python package only (reference path; torch is still required)
  MAX_JOBS=N                      parallel nvcc jobs (default: sized to cores and memory)
  CUTLASS_INCLUDE_DIR=...         CUTLASS headers (default: the pinned nvidia-cutlass wheel)
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "csrc"))
import build_flags  # noqa: E402
import generate_kernels  # noqa: E402

BUILD_CONFIG = ROOT / "flash_attn4" / "_build_config.py"
# Peak resident memory of one nvcc job on one sm90 forward instantiation is about 2.5 GB; keep headroom.
GB_PER_JOB = 3.0


def log(msg: str) -> None:
    print(f"[flash_attn4 setup] {msg}", flush=True)


def env_list(name: str, default: tuple) -> list[str]:
    raw = os.environ.get(name, "")
    return [x.strip() for x in raw.split(",") if x.strip()] if raw else [str(x) for x in default]


def torch_missing_message(error: ImportError) -> str:
    """Why the build stops when torch does not import, and what to run instead."""
    broken = not (isinstance(error, ModuleNotFoundError) and error.name == "torch")
    isolated = [p for p in sys.path if "pip-build-env-" in p]
    lines = [
        "flash_attn4 is built against the torch you run, so torch must be installed BEFORE flash_attn4 "
        "(otherwise pip would pull a multi-GB torch of its own choosing and still build no kernels).",
        f"This build runs on {sys.executable} and "
        + (f"torch fails to import there: {error}" if broken else "cannot import torch."),
        "Fix: install torch first (pip install torch, see pytorch.org for the CUDA build matching your "
        "driver), then run pip install --no-build-isolation . again.",
    ]
    if isolated:
        lines.append(
            "pip is building in an isolated environment (" + isolated[0] + ") that cannot see an installed "
            "torch: you ran pip without --no-build-isolation."
        )
    else:
        lines.append("If torch is installed, you ran pip without --no-build-isolation.")
    if os.environ.get("FLASH_ATTN4_SKIP_CUDA_BUILD", "0") == "1":
        lines.append(
            "FLASH_ATTN4_SKIP_CUDA_BUILD=1 skips the kernels, not torch: flash_attn4 imports torch at run "
            "time; for the reference path alone a CPU-only torch is enough "
            "(pip install torch --index-url https://download.pytorch.org/whl/cpu)."
        )
    return "\n".join(f"[flash_attn4 setup] {line}" for line in lines)


def require_torch() -> None:
    """Stops the build at once (SystemExit with the fix) when torch does not import: the first thing
    main() does, so pip fails while reading metadata, before it resolves and downloads dependencies."""
    try:
        import torch  # noqa: F401
    except ImportError as e:
        raise SystemExit(torch_missing_message(e)) from None


def no_kernels_message(reason: str) -> str:
    """The log line for an install without kernels: why, what it means, how to get them."""
    if reason.startswith("FLASH_ATTN4_SKIP_CUDA_BUILD"):
        how = "unset FLASH_ATTN4_SKIP_CUDA_BUILD and run pip install --no-build-isolation -v . again"
    else:
        how = (
            "install a CUDA build of torch (pytorch.org) and the CUDA toolkit's nvcc of the same CUDA major "
            "version, then run pip install --no-build-isolation -v . again"
        )
    return (
        f"building the Python package only, without CUDA kernels: {reason}. flash_attn4 will run on the "
        f"slow PyTorch reference. To get the kernels: {how}"
    )


def why_no_cuda_build() -> str:
    """Empty string when the CUDA extension can be built, else the reason it cannot."""
    if os.environ.get("FLASH_ATTN4_SKIP_CUDA_BUILD", "0") == "1":
        return "FLASH_ATTN4_SKIP_CUDA_BUILD=1"
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError as e:  # require_torch() ran first; this is a torch without torch.utils.cpp_extension
        return f"torch.utils.cpp_extension does not import ({e})"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    nvcc = Path(CUDA_HOME) / "bin" / "nvcc" if CUDA_HOME else None
    if nvcc is None or not nvcc.exists():
        if shutil.which("nvcc") is None:
            return "nvcc was not found (set CUDA_HOME or put nvcc on PATH)"
    return ""


def default_max_jobs() -> int:
    cores = os.cpu_count() or 1
    try:
        avail_gb = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (ValueError, OSError):
        avail_gb = 8.0
    return max(1, min(cores, int(avail_gb / GB_PER_JOB)))


def parse_targets(items: list[str]) -> list[int]:
    """FLASH_ATTN4_ARCHS items ("90", "sm_86", "sm120") -> sorted ints; anything else stops the build."""
    targets = set()
    for item in items:
        digits = item.lower().removeprefix("sm").lstrip("_")
        if not digits.isdigit():
            raise SystemExit(
                f"FLASH_ATTN4_ARCHS: {item!r} is not a build target; give comma-separated numbers from "
                f"{generate_kernels.SUPPORTED_ARCHS}, e.g. FLASH_ATTN4_ARCHS=90,80"
            )
        targets.add(int(digits))
    return sorted(targets)


def default_targets() -> tuple[list[int], str]:
    """The build targets of the GPUs torch sees (as TORCH_CUDA_ARCH_LIST's default does), or 80 and 90
    when it sees none; and a line saying which."""
    try:
        import torch

        caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    except Exception:  # no CUDA torch, or no driver: nothing to detect
        caps = []
    if not caps:
        return [80, 90], "no GPU found: building for sm_80 (Ampere path) and sm_90a"
    targets = set()
    for major, minor in caps:
        cc = 10 * major + minor
        if cc == 90:
            targets.add(90)
        elif cc in generate_kernels.SUPPORTED_ARCHS:
            targets.add(cc)
        elif major == 12:
            targets.add(120)
        elif cc >= 80:
            targets.add(80)  # another GPU from Ampere on: the sm_80 PTX is JIT-compiled for it
    found = ", ".join(f"sm_{10 * a + b}" for a, b in caps)
    return sorted(targets), f"building for the GPUs found ({found}): targets {sorted(targets)}"


def kernel_families(archs: list[int]) -> tuple[int, ...]:
    """The kernel families to generate: FLASH_ATTN4_FAMILIES, else the ones the build targets ask for."""
    if not os.environ.get("FLASH_ATTN4_FAMILIES"):
        return generate_kernels.families(archs)
    fams = tuple(sorted({int(f) for f in env_list("FLASH_ATTN4_FAMILIES", ()) if f.isdigit()}))
    if not fams or any(f not in (80, 90) for f in fams) or (90 in fams and 90 not in archs):
        raise SystemExit(
            "FLASH_ATTN4_FAMILIES: give 80 and/or 90 (90 needs 90 in FLASH_ATTN4_ARCHS), e.g. "
            "FLASH_ATTN4_ARCHS=90 FLASH_ATTN4_FAMILIES=80"
        )
    return fams


KERNEL_OPTIONS = ("sparse", "fp8", "alibi", "dropout", "mla", "decode")


def kernel_options() -> dict[str, bool]:
    """FLASH_ATTN4_OPTIONS: which optional kernel sets to generate (all by default, none with "none")."""
    items = env_list("FLASH_ATTN4_OPTIONS", KERNEL_OPTIONS)
    chosen = set() if items == ["none"] else set(items)
    bad = sorted(chosen - set(KERNEL_OPTIONS))
    if bad or not items:
        raise SystemExit(
            f"FLASH_ATTN4_OPTIONS: unknown {bad or items}; give a comma list of {', '.join(KERNEL_OPTIONS)} "
            "(default: all), or none"
        )
    return {name: name in chosen for name in KERNEL_OPTIONS}


def build_kernels(archs: list[int], dtypes: list[str], hdims: list[int]):
    """(kernels, decode kernels) this build compiles: FLASH_ATTN4_FAMILIES / FLASH_ATTN4_OPTIONS applied."""
    opts = kernel_options()
    decode = opts.pop("decode")
    ks = generate_kernels.kernels(
        archs=archs, dtypes=dtypes, hdims=hdims, fams=kernel_families(archs), **opts
    )
    # fp8 caches: the decode kernels' e4m3-cache variants come with both options.
    return ks, generate_kernels.decode_kernels_for(ks, kv8=opts["fp8"]) if decode else []


def write_build_config(
    built: bool, reason: str, archs: list[int], dtypes: list[str], hdims: list[int]
) -> None:
    torch_version = cuda_version = ""
    try:
        import torch

        torch_version = torch.__version__
        cuda_version = torch.version.cuda or ""
    except ImportError:
        pass
    kernels, decode_kernels = build_kernels(archs, dtypes, hdims)
    sparse_hdims = generate_kernels.sparse_hdims(kernels)
    fp8_hdims = generate_kernels.fp8_hdims(kernels)
    alibi_hdims = generate_kernels.alibi_hdims(kernels)
    dropout_hdims = generate_kernels.dropout_hdims(kernels)
    mla_hdims = generate_kernels.mla_hdims(kernels)
    text = (
        "# Generated by setup.py: what this install compiled. Do not edit.\n"
        f"BUILT = {built!r}\n"
        f"REASON = {reason!r}\n"
        f"ARCHS = {tuple([f'sm{a}' for a in kernel_families(archs)] if built else [])!r}\n"
        f"TARGETS = {tuple(sorted(archs) if built else [])!r}\n"
        f"DTYPES = {tuple(dtypes if built else [])!r}\n"
        f"HDIMS = {tuple(hdims if built else [])!r}\n"
        f"BLOCK_SPARSE_HDIMS = {sparse_hdims if built else ()!r}\n"
        f"FP8_HDIMS = {fp8_hdims if built else ()!r}\n"
        f"ALIBI_HDIMS = {alibi_hdims if built else ()!r}\n"
        f"DROPOUT_HDIMS = {dropout_hdims if built else ()!r}\n"
        f"MLA_HDIMS = {mla_hdims if built else ()!r}\n"
        f"DECODE_HDIMS = {tuple(sorted({k.hdim for k in decode_kernels})) if built else ()!r}\n"
        f"DECODE_KV8_HDIMS = {tuple(sorted({k.hdim for k in decode_kernels if k.kv8})) if built else ()!r}\n"
        f"TORCH_VERSION = {torch_version!r}\n"
        f"CUDA_VERSION = {cuda_version!r}\n"
    )
    if not BUILD_CONFIG.exists() or BUILD_CONFIG.read_text() != text:
        BUILD_CONFIG.write_text(text)


def cuda_extension(archs: list[int], dtypes: list[str], hdims: list[int]):
    from torch.utils.cpp_extension import CUDAExtension

    # archs: build targets
    kernels, decode_kernels = build_kernels(archs, dtypes, hdims)
    sources = generate_kernels.generate(ROOT / "csrc" / "instantiations", kernels, decode_kernels)
    count = len(kernels) + len(decode_kernels)
    log(f"compiling {count} kernel instantiations: archs={archs} dtypes={dtypes} hdims={hdims}")
    return CUDAExtension(
        name="flash_attn4._C",
        sources=[
            str(ROOT / "csrc" / f)
            for f in (
                "flash_api.cpp",
                "decode_api.cpp",
                "fp8_api.cpp",
                "fp8_vt.cu",
                "sparse_api.cpp",
                "sparse_estimate.cu",
            )
        ]
        + [str(s) for s in sources],
        include_dirs=[str(p) for p in build_flags.include_dirs()],
        extra_compile_args={
            "cxx": ["-O3"],  # the C++ standard is torch's choice (C++20 for torch >= 2.13)
            # Every file for every target: each kernel entry compiles its body only for the archs it
            # supports (the sm90 entries are empty stubs outside the sm_90a pass), so the extra passes
            # are cheap.
            "nvcc": [*build_flags.NVCC_FLAGS, *build_flags.gencodes(archs)],
        },
    )


def main() -> None:
    require_torch()
    dtypes = env_list("FLASH_ATTN4_DTYPES", generate_kernels.DTYPES)
    hdims = [int(h) for h in env_list("FLASH_ATTN4_HDIMS", generate_kernels.HDIMS)]
    if os.environ.get("FLASH_ATTN4_ARCHS"):
        archs, why_archs = parse_targets(env_list("FLASH_ATTN4_ARCHS", ())), "FLASH_ATTN4_ARCHS"
    else:
        archs, why_archs = default_targets()
        why_archs = f"FLASH_ATTN4_ARCHS not set: {why_archs}"
    bad = (
        [d for d in dtypes if d not in generate_kernels.DTYPES]
        + [str(h) for h in hdims if h not in generate_kernels.HDIMS]
        + [str(a) for a in archs if a not in generate_kernels.SUPPORTED_ARCHS]
    )
    if bad:
        raise SystemExit(
            f"FLASH_ATTN4_DTYPES/FLASH_ATTN4_HDIMS/FLASH_ATTN4_ARCHS contain unsupported values {bad}; "
            f"choose from {generate_kernels.DTYPES}, {generate_kernels.HDIMS} and "
            f"{generate_kernels.SUPPORTED_ARCHS}"
        )

    reason = why_no_cuda_build()
    if not reason:
        log(f"build targets {archs} ({why_archs})")
    ext_modules, cmdclass = [], {}
    if reason:
        log(no_kernels_message(reason))
    else:
        from torch.utils.cpp_extension import BuildExtension

        os.environ.setdefault("MAX_JOBS", str(default_max_jobs()))
        log(f"MAX_JOBS={os.environ['MAX_JOBS']}")
        ext_modules = [cuda_extension(archs, dtypes, hdims)]
        cmdclass = {"build_ext": BuildExtension.with_options(use_ninja=True)}
    write_build_config(not reason, reason, archs, dtypes, hdims)

    setup(
        packages=find_packages(include=["flash_attn4", "flash_attn4.*"]),
        ext_modules=ext_modules,
        cmdclass=cmdclass,
    )


# setuptools' build backend and `python setup.py` run this file as __main__; tests import it to reach the
# helpers without building.
if __name__ == "__main__":
    main()
