"""Install and import messages: setup.py stops early without torch and says how to install it; an install
without kernels says it runs on the reference; the package warns once at import when a CUDA device is
visible but the kernels are not there, and stays silent on CPU-only machines.

Every run of setup.py here stops before it writes anything (require_torch() is the first thing main()
does), and the helpers are reached by importing setup.py as a module (it calls main() only as __main__).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "setup.py"


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **env},
        timeout=300,
    )


@pytest.fixture(scope="module")
def setup_module():
    """setup.py as a module named fa4_setup (so main() does not run), sys.path restored afterwards."""
    saved = list(sys.path)
    spec = importlib.util.spec_from_file_location("fa4_setup", SETUP)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path[:] = saved


# --- setup.py without torch ---------------------------------------------------------------------------

_RUN_SETUP_WITHOUT_TORCH = (
    "import runpy, sys; sys.modules['torch'] = None; sys.argv = ['setup.py', '--version']; "
    f"runpy.run_path({str(SETUP)!r}, run_name='__main__')"
)


@pytest.mark.parametrize("skip", ["0", "1"], ids=["default", "skip_cuda_build"])
def test_setup_stops_early_without_torch(skip):
    config = ROOT / "flash_attn4" / "_build_config.py"
    before = config.read_text() if config.exists() else None
    proc = _python(_RUN_SETUP_WITHOUT_TORCH, FLASH_ATTN4_SKIP_CUDA_BUILD=skip)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    text = proc.stderr
    assert "Traceback" not in text
    assert (
        "install torch first (pip install torch, see pytorch.org for the CUDA build matching your driver)"
        in text
    )
    assert "then run pip install --no-build-isolation . again" in text
    assert "if torch is installed, you ran pip without --no-build-isolation" in text.lower()
    assert ("FLASH_ATTN4_SKIP_CUDA_BUILD=1 skips the kernels, not torch" in text) == (skip == "1")
    # Nothing was written: the check comes before everything else.
    assert (config.read_text() if config.exists() else None) == before


def test_torch_missing_message_sees_pip_build_isolation(setup_module, monkeypatch):
    monkeypatch.setattr(sys, "path", [*sys.path, "/tmp/pip-build-env-abc123/overlay/lib/site-packages"])
    text = setup_module.torch_missing_message(ModuleNotFoundError("No module named 'torch'", name="torch"))
    assert "isolated environment (/tmp/pip-build-env-abc123" in text
    assert "you ran pip without --no-build-isolation" in text


def test_torch_missing_message_reports_a_broken_torch(setup_module):
    error = ImportError("libtorch_cuda.so: cannot open shared object file")
    text = setup_module.torch_missing_message(error)
    assert "torch fails to import there: libtorch_cuda.so" in text
    assert "install torch first" in text


# --- setup.py with torch but no kernels ----------------------------------------------------------------


@pytest.mark.parametrize(
    "reason, how",
    [
        ("torch 2.13.0+cpu is a CPU-only build", "install a CUDA build of torch"),
        ("nvcc was not found (set CUDA_HOME or put nvcc on PATH)", "nvcc of the same CUDA major version"),
        ("FLASH_ATTN4_SKIP_CUDA_BUILD=1", "unset FLASH_ATTN4_SKIP_CUDA_BUILD"),
    ],
    ids=["cpu_torch", "no_nvcc", "skip"],
)
def test_no_kernels_log_line(setup_module, reason, how):
    text = setup_module.no_kernels_message(reason)
    assert reason in text
    assert "flash_attn4 will run on the slow PyTorch reference" in text
    assert how in text and "pip install --no-build-isolation -v ." in text


def test_why_no_cuda_build_here(setup_module, monkeypatch):
    import torch

    monkeypatch.setenv("FLASH_ATTN4_SKIP_CUDA_BUILD", "1")
    assert setup_module.why_no_cuda_build() == "FLASH_ATTN4_SKIP_CUDA_BUILD=1"
    monkeypatch.delenv("FLASH_ATTN4_SKIP_CUDA_BUILD")
    if torch.version.cuda is None:
        assert "CPU-only build" in setup_module.why_no_cuda_build()


# --- the warning at import -------------------------------------------------------------------------------

# Imports flash_attn4 in a fresh interpreter with torch.cuda.is_available() forced, and prints the
# ReferenceFallbackWarnings seen (importing twice: the second import must not warn again).
_IMPORT_SHIM = """
import json, sys, warnings
import torch
torch.cuda.is_available = lambda: {cuda}
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    import flash_attn4
    import flash_attn4
from flash_attn4 import _build_info, _ops
print(json.dumps({{
    "warnings": [str(w.message) for w in seen if issubclass(w.category, _ops.ReferenceFallbackWarning)],
    "is_built": flash_attn4.is_built(),
    "why": _build_info.load_extension()[1],
    "said_once": _build_info.load_extension()[1] in _ops._warned,
    "category": flash_attn4.ReferenceFallbackWarning is _ops.ReferenceFallbackWarning,
}}))
"""


def _import_report(cuda: bool) -> dict:
    proc = _python(_IMPORT_SHIM.format(cuda=cuda))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_warns_once_with_a_cuda_device_and_no_kernels():
    report = _import_report(cuda=True)
    assert report["category"]
    if report["is_built"]:
        assert report["warnings"] == []  # kernels there: nothing to say
        return
    (message,) = report["warnings"]
    assert message.startswith("flash_attn4: ")
    assert "slow PyTorch reference" in message
    assert report["why"] in message  # the reason (REASON) and the fix (_REBUILD_HINT) ...
    assert "pip install --no-build-isolation -v ." in message
    assert report["said_once"]  # ... and the first CUDA call does not repeat it


def test_import_is_silent_on_a_cpu_only_machine():
    assert _import_report(cuda=False)["warnings"] == []


def test_import_warning_can_be_filtered_before_import():
    code = (
        "import warnings; warnings.filterwarnings('error', message='flash_attn4'); "
        "warnings.filterwarnings('ignore', message='flash_attn4: '); "
        "import torch; torch.cuda.is_available = lambda: True; import flash_attn4; print('ok')"
    )
    proc = _python(code)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr


# --- build targets -----------------------------------------------------------------------------------------


def test_build_targets_from_the_environment(setup_module):
    assert setup_module.parse_targets(["90", "sm_86", "SM120", "80"]) == [80, 86, 90, 120]
    with pytest.raises(SystemExit, match="not a build target"):
        setup_module.parse_targets(["ampere"])


@pytest.mark.parametrize(
    "caps, want",
    [
        ([], [80, 90]),  # no GPU: both families
        ([(9, 0)], [90]),
        ([(8, 0), (8, 6)], [80, 86]),
        ([(8, 9), (12, 0)], [89, 120]),
        ([(12, 1)], [120]),  # sm_121: sm_120 SASS runs on it
        ([(10, 0)], [80]),  # a GPU with no listed target: the sm_80 PTX
    ],
)
def test_default_targets_follow_the_gpus_found(setup_module, monkeypatch, caps, want):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(caps))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: caps[i])
    targets, line = setup_module.default_targets()
    assert targets == want and ("no GPU" in line) == (not caps)


def test_gencodes_and_families():
    sys.path.insert(0, str(ROOT / "csrc"))
    try:
        import build_flags
        import generate_kernels
    finally:
        sys.path.remove(str(ROOT / "csrc"))
    flags = build_flags.gencodes([120, 86, 90])
    assert flags == [
        "-gencode=arch=compute_86,code=sm_86",
        "-gencode=arch=compute_90a,code=sm_90a",
        "-gencode=arch=compute_120,code=sm_120",
        "-gencode=arch=compute_86,code=compute_86",  # PTX of the lowest Ampere-path target
    ]
    assert build_flags.gencodes([90]) == ["-gencode=arch=compute_90a,code=sm_90a"]
    assert generate_kernels.families([86, 120]) == (80,) and generate_kernels.families([80, 90]) == (80, 90)
    assert {k.arch for k in generate_kernels.kernels(archs=[89], hdims=[64], dtypes=["bf16"])} == {80}


def test_fp8_kernels_are_sm90_forwards_beside_bf16(tmp_path):
    """e4m3 instantiations: sm90 forwards of FP8_HDIMS, every mask, only where bf16 and the sm90 family are
    built; no decode or backward kernel of theirs (the decode family has no fp8 variant)."""
    sys.path.insert(0, str(ROOT / "csrc"))
    try:
        import generate_kernels
    finally:
        sys.path.remove(str(ROOT / "csrc"))
    ks = generate_kernels.kernels(archs=[90, 80], dtypes=["bf16"], hdims=[64, 128, 256])
    fp8 = [k for k in ks if k.dtype == "e4m3"]
    assert {(k.direction, k.arch, k.sparse) for k in fp8} == {("fwd", 90, False)}
    assert {k.hdim for k in fp8} == set(generate_kernels.FP8_HDIMS) and len(fp8) == 3 * len(
        generate_kernels.FP8_HDIMS
    )
    assert generate_kernels.fp8_hdims(ks) == generate_kernels.FP8_HDIMS
    assert not [k for k in generate_kernels.kernels(archs=[90], dtypes=["fp16"]) if k.dtype == "e4m3"]
    assert not [k for k in generate_kernels.kernels(archs=[86], dtypes=["bf16"]) if k.dtype == "e4m3"]
    sources = generate_kernels.generate(tmp_path, ks)
    assert not [p for p in sources if p.name.startswith("decode_e4m3")]
    assert "DType::kE4M3" in (tmp_path / "kernel_table.cpp").read_text()


def test_families_override_and_decode_head_dims(setup_module, monkeypatch):
    """FLASH_ATTN4_FAMILIES picks the kernel families whatever the targets (the Ampere path alone as sm_90a
    SASS); decode kernels only at head dims whose 16-byte row vectors divide the loader's 128 threads."""
    sys.path.insert(0, str(ROOT / "csrc"))
    try:
        import generate_kernels
    finally:
        sys.path.remove(str(ROOT / "csrc"))
    monkeypatch.setenv("FLASH_ATTN4_FAMILIES", "80")
    assert setup_module.kernel_families([90]) == (80,)
    ks = generate_kernels.kernels(
        archs=[90], dtypes=["bf16"], hdims=[128], fams=setup_module.kernel_families([90])
    )
    assert {k.arch for k in ks} == {80}
    for bad in ("90", "70", "x"):  # 90 without the sm_90a target, an unknown family, not a number
        monkeypatch.setenv("FLASH_ATTN4_FAMILIES", bad)
        with pytest.raises(SystemExit, match="FLASH_ATTN4_FAMILIES"):
            setup_module.kernel_families([80])
    monkeypatch.delenv("FLASH_ATTN4_FAMILIES")
    assert setup_module.kernel_families([80, 90]) == (80, 90)
    assert all(128 % (h // 8) == 0 for h in generate_kernels.DECODE_HDIMS)
    hdims = [k.hdim for k in generate_kernels.decode_kernels(["bf16"], generate_kernels.HDIMS)]
    assert (
        sorted(set(hdims)) == sorted(generate_kernels.DECODE_HDIMS) and 96 not in hdims and 192 not in hdims
    )


def test_options_pick_the_optional_kernel_sets(setup_module, monkeypatch):
    """FLASH_ATTN4_OPTIONS limits the optional kernel sets (block-sparse, fp8, ALiBi, dropout, MLA, decode) a
    build generates; the plain kernels of every built head dim and mask stay; a typo fails the build."""
    monkeypatch.delenv("FLASH_ATTN4_OPTIONS", raising=False)
    ks, ds = setup_module.build_kernels([90], ["bf16"], [128])
    # plain, sparse, ALiBi, dropout (6 each), fp8 (3); decode: contiguous, paged, each also for e4m3 caches
    assert len(ks) == 27 and len(ds) == 4 and sum(d.kv8 for d in ds) == 2
    monkeypatch.setenv("FLASH_ATTN4_OPTIONS", "dropout")
    ks, ds = setup_module.build_kernels([90], ["bf16"], [128])
    assert len(ks) == 12 and not ds and sum(k.dropout for k in ks) == 6
    assert not [k for k in ks if k.sparse or k.alibi or k.dtype == "e4m3"]
    monkeypatch.setenv("FLASH_ATTN4_OPTIONS", "none")
    ks, ds = setup_module.build_kernels([90], ["bf16"], [192])
    assert len(ks) == 6 and not ds and not [k for k in ks if k.hdim_v]
    monkeypatch.setenv("FLASH_ATTN4_OPTIONS", "mla,decode")
    ks, ds = setup_module.build_kernels([90], ["bf16"], [128, 192])
    assert sum(1 for k in ks if k.hdim_v) == 6 and {d.hdim for d in ds} == {128}  # contiguous, paged
    assert not [d for d in ds if d.kv8]  # e4m3 caches come with the fp8 option
    for bad in ("dropuot", "none,mla", ","):
        monkeypatch.setenv("FLASH_ATTN4_OPTIONS", bad)
        with pytest.raises(SystemExit, match="FLASH_ATTN4_OPTIONS"):
            setup_module.kernel_options()


def test_mla_kernels_are_sm90_ones_of_the_q_head_dim(tmp_path):
    """MLA instantiations: sm90 kernels of both directions for every MLA_HDIMS pair whose q / k head dim is
    built, every mask and dtype, named and dispatched with v's head dim; none on the Ampere path."""
    sys.path.insert(0, str(ROOT / "csrc"))
    try:
        import generate_kernels
    finally:
        sys.path.remove(str(ROOT / "csrc"))
    ks = generate_kernels.kernels(archs=[90, 80], dtypes=["bf16", "fp16"], hdims=[128, 192])
    mla = [k for k in ks if k.hdim_v]
    assert {(k.arch, k.hdim, k.hdim_v) for k in mla} == {(90, 192, 128)}
    assert {k.direction for k in mla} == {"fwd", "bwd"}
    assert len(mla) == 2 * 2 * 3 and generate_kernels.mla_hdims(ks) == ((192, 128),)
    assert not [k for k in generate_kernels.kernels(archs=[90], hdims=[128]) if k.hdim_v]
    assert not [k for k in generate_kernels.kernels(archs=[80], hdims=[192]) if k.hdim_v]
    generate_kernels.generate(tmp_path, ks)
    source = (tmp_path / "fwd_sm90_bf16_hdim192v128_causal.cu").read_text()
    assert "run_fwd_sm90<DType::kBF16, 192, true, false, DenseBand, NoBias, 128>" in source
    source = (tmp_path / "bwd_sm90_bf16_hdim192v128_causal.cu").read_text()
    assert "run_bwd_sm90<DType::kBF16, 192, true, false, DenseBand, NoBias, 128>" in source
    table = (tmp_path / "kernel_table.cpp").read_text()
    assert table.count("{90, DType::kBF16, 192, 128, true, false,") == 2  # forward and backward rows
    assert table.count("{90, DType::kBF16, 192, 192, true, false,") == 2  # the plain hdim 192 rows
