"""Result files (README, Benchmarks): a JSON list of records, one per implementation and shape, each
stamped with the GPU, torch, date and the SM clock seen during the run, since the card may be power-capped
and only ratios within one file are meaningful. Every benchmark writes through `write_results`."""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
from collections.abc import Iterable
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def results_dir() -> Path:
    """Where result files go by default: $FLASH_ATTN4_RESULTS_DIR if set (a GPU machine whose outputs come
    back from one folder, one `make bench-*` target a run), else benchmarks/results."""
    return Path(os.environ.get("FLASH_ATTN4_RESULTS_DIR") or RESULTS)


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200': the default result file name."""
    name = re.sub(r"^nvidia\s+", "", name.strip(), flags=re.IGNORECASE)
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "gpu"


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def sm_clock_mhz() -> int | None:
    """The current SM clock of the current device from nvidia-smi, or None where it cannot say."""
    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device()
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits", "-i", str(index)],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return int(out.splitlines()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def clock_range(clocks: Iterable[int | None]) -> list[int] | None:
    """[lowest, highest] of the SM clocks sampled during a run (None where nvidia-smi said nothing)."""
    seen = [c for c in clocks if c]
    return [min(seen), max(seen)] if seen else None


def default_path(stem: str) -> Path:
    """<results_dir()>/<gpu>_<stem>.json for the current device."""
    return results_dir() / f"{gpu_slug(device_name())}_{stem}.json"


def write_results(records: list[dict], path: Path, clocks: Iterable[int | None] | None = None, **meta):
    """Write records as a result file. Each record gets (in place, for the caller's table and plot) gpu,
    torch, date, sm_clock_mhz (the range of `clocks`) and `meta`, except where it already has the field
    (bench_fwd.py keeps a clock per shape). Returns the path."""
    stamp = dict(gpu=device_name(), torch=torch.__version__, date=datetime.date.today().isoformat())
    if clocks is not None:
        stamp["sm_clock_mhz"] = clock_range(clocks)
    stamp.update(meta)
    for r in records:
        for k, v in stamp.items():
            r.setdefault(k, v)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=1) + "\n")
    return path
