"""`python -m flash_attn4` runs anywhere (CPU included) and its self-test passes."""

from __future__ import annotations

import subprocess
import sys

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
