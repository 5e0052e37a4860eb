"""Shared pytest setup: a fixed seed per test and a header that says which flash_attn4 is under test."""

from __future__ import annotations

import pytest
import torch

import flash_attn4
from flash_attn4 import _build_info


def pytest_report_header(config: pytest.Config) -> list[str]:
    # Printed first, so a log shows at once whether the installed or the source package ran, and whether
    # the GPU tests could run at all.
    cuda = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    built = "kernels built" if _build_info.BUILT else f"not built ({_build_info.REASON})"
    return [
        f"flash_attn4 {flash_attn4.__version__} from {flash_attn4.__file__}",
        f"  {built}; archs={_build_info.ARCHS} dtypes={_build_info.DTYPES} hdims={_build_info.HDIMS}",
        f"  torch {torch.__version__}, {cuda}",
    ]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_terminal_summary(terminalreporter) -> None:
    # Also under -q (which hides the header): which package ran, for .ci/run's installed-package check.
    terminalreporter.write_line(f"flash_attn4 under test: {flash_attn4.__file__}")
