"""The benchmarks' result files (README, Benchmarks): every record stamped with the GPU, torch, date and the
SM clock seen; the record's own fields kept; bench_varlen's plot drawn from rows of several implementations
with a failed one among them; the alternating rounds both bench_fwd.py and bench_varlen.py time with. CPU
only: nothing here times a kernel."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import results_file  # noqa: E402


def test_write_results_stamps_every_record(tmp_path):
    records = [
        dict(impl="flash_attn4", hdim=128, fwd_ms=1.5),
        dict(impl="fa4_cute", hdim=128, sm_clock_mhz=1755),
    ]
    path = results_file.write_results(records, tmp_path / "sub" / "x.json", [1980, None, 1650], dtype="bf16")
    rows = json.loads(path.read_text())
    assert [r["impl"] for r in rows] == ["flash_attn4", "fa4_cute"]
    for r in rows:
        assert r["gpu"] == results_file.device_name() and r["torch"] == torch.__version__
        assert len(r["date"]) == 10 and r["dtype"] == "bf16"
    assert rows[0]["sm_clock_mhz"] == [1650, 1980]  # the range of what nvidia-smi said, None left out
    assert rows[1]["sm_clock_mhz"] == 1755  # a record's own field wins
    assert records[0]["gpu"] == rows[0]["gpu"]  # stamped in place, for the caller's table and plot


def test_write_results_without_clocks_leaves_the_field_out(tmp_path):
    rows = json.loads(results_file.write_results([dict(impl="a")], tmp_path / "y.json").read_text())
    assert "sm_clock_mhz" not in rows[0]
    assert results_file.clock_range([None, None]) is None


def test_default_path_names_the_gpu(tmp_path, monkeypatch):
    assert results_file.gpu_slug("NVIDIA H100 80GB HBM3") == "h100_80gb_hbm3"
    assert results_file.gpu_slug("NVIDIA H200") == "h200"
    monkeypatch.delenv("FLASH_ATTN4_RESULTS_DIR", raising=False)
    path = results_file.default_path("varlen")
    assert path.parent == results_file.RESULTS and path.name.endswith("_varlen.json")
    monkeypatch.setenv("FLASH_ATTN4_RESULTS_DIR", str(tmp_path))  # a GPU machine's return folder
    assert results_file.default_path("fwd").parent == tmp_path


def test_bench_varlen_plot_of_two_impls_and_an_error(tmp_path):
    pytest.importorskip("matplotlib")
    import bench_varlen

    base = dict(hdim=128, nheads=16, gpu="test")
    rows = []
    for i, impl in enumerate(("flash_attn4", "fa4_cute")):
        for d in ("fwd", "bwd"):
            rows.append(dict(base, impl=impl, kind="window", direction=d, seqlen=32768, window_left=4096,
                             window_ms=1.0 + i, full_causal_ms=4.0, speedup=4.0 / (1.0 + i)))  # fmt: skip
            tflops = {f"{d}_tflops": 500.0 + i, f"equal_{d}_tflops": 480.0}
            rows.append(dict(base, impl=impl, kind="varlen", direction=d, causal=True, tokens=65536,
                             num_seqs=14, equal_seqlen=4096, **tflops))  # fmt: skip
    rows.append(
        dict(base, impl="fa4_cute", kind="varlen", direction="bwd", causal=False, error="NotImplemented")
    )
    bench_varlen.plot(rows, tmp_path / "v.png")
    assert (tmp_path / "v.png").stat().st_size > 10_000


def test_bench_fwd_gqa_must_divide_the_heads(capsys):
    import bench_fwd

    assert bench_fwd.parse_args(["--gqa", "4"]).gqa == 4  # 32 / 16 / 8 query heads at 64 / 128 / 256
    with pytest.raises(SystemExit):
        bench_fwd.parse_args(["--gqa", "16", "--hdims", "128,256"])  # 8 heads at 256
    assert "at head dims [256]" in capsys.readouterr().err


def test_alternate_reverses_the_order_and_drops_a_failing_impl(monkeypatch):
    import contextlib

    import bench_fwd

    calls = []

    def fake_bench_ms(fn, warmup, rep):
        return fn()

    def timed(name, fail_at=None):
        def fn():
            calls.append(name)
            if len(calls) == fail_at:
                raise RuntimeError("boom")
            return float(len(calls))

        return fn, contextlib.nullcontext

    monkeypatch.setattr(bench_fwd, "bench_ms", fake_bench_ms)
    monkeypatch.setattr(bench_fwd, "sm_clock_mhz", lambda: 1980)
    clocks = []
    ms, errors = bench_fwd.alternate({"a": timed("a"), "b": timed("b", fail_at=6)}, 3, 1, 1, clocks)
    assert calls == ["a", "b", "b", "a", "a", "b"]  # the order reversed every other round
    assert ms == {"a": [1.0, 4.0, 5.0], "b": [2.0, 3.0]}  # b's earlier turns stay
    assert errors == {"b": "RuntimeError: boom"} and clocks == [1980] * 6
