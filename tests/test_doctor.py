"""`python -m flash_attn4` runs anywhere (CPU included) and its self-test passes."""

from __future__ import annotations

import subprocess
import sys

import pytest

import flash_attn4
from flash_attn4 import _build_info
from flash_attn4.__main__ import main


def test_doctor_runs_and_self_test_passes(capsys):
    assert main([]) == 0
    text = capsys.readouterr().out
    for heading in ("== versions", "== build", "== GPUs", "== path for", "self-test: PASS"):
        assert heading in text
    assert "FAIL" not in text


def test_doctor_explains_the_path_for_a_shape(capsys):
    assert main(["--shape", "1,128,8,2,80", "--dtype", "fp16", "--causal", "--no-self-test"]) == 0
    text = capsys.readouterr().out
    assert "path for q (1, 128, 8, 80)" in text
    assert "forward: the " in text or "forward and backward: the " in text
    assert "backward" in text


def test_doctor_rejects_a_bad_shape():
    cmd = [sys.executable, "-m", "flash_attn4", "--shape", "1,2,3", "--no-self-test"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 2
    assert "five integers" in proc.stderr


def _doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flash_attn4", *args], capture_output=True, text=True)


@pytest.mark.parametrize(
    "shape, words",
    [
        ("1,128,8,3,64", ["nheads_q (8) is not a multiple of nheads_kv (3)", "[1, 2, 4, 8]"]),
        ("1,128,8,0,64", ["nheads_kv=0", "at least 1"]),
        ("1,128,8,-2,64", ["negative"]),
    ],
    ids=["not_a_multiple", "zero_kv_heads", "negative"],
)
def test_doctor_rejects_an_impossible_gqa_split(shape, words):
    proc = _doctor("--shape", shape, "--no-self-test")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "== path for" not in proc.stdout  # no path is explained for a call that cannot be made
    for word in words:
        assert word in proc.stderr


def test_doctor_accepts_gqa_and_mqa_splits(capsys):
    for shape in ("1,16,8,8,64", "1,16,8,2,64", "1,16,8,1,64"):
        assert main(["--shape", shape, "--no-self-test"]) == 0
    assert "path for" in capsys.readouterr().out


@pytest.mark.parametrize("dtype, name", [("fp16", "torch.float16"), ("bf16", "torch.bfloat16")])
def test_self_test_honours_dtype(capsys, dtype, name):
    assert main(["--dtype", dtype]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert lines and all(name in line for line in lines), lines
    assert all(line.startswith("PASS") for line in lines)


def test_self_test_default_dtypes(capsys):
    assert main([]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("PASS cpu")]
    assert lines and all("torch.float32" in line for line in lines)


@pytest.mark.skipif(flash_attn4.is_built(), reason="the kernels are built here: nothing to build")
def test_doctor_says_how_to_build_the_kernels(capsys):
    assert main(["--no-self-test"]) == 0
    text = capsys.readouterr().out
    assert _build_info._REBUILD_HINT in text
    assert "pip install --no-build-isolation -v ." in text
    assert "install torch first" in text
