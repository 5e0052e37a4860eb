"""tools/trace_tiles.py's analysis on synthetic stamps (CPU): per-SM ordering, phases and gaps."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import trace_tiles  # noqa: E402


def _row(sm: int, blocks: int, stamps: dict[int, int]) -> list[int]:
    row = [0] * 16
    row[0] = (sm << 32) | blocks
    for slot, t in stamps.items():
        row[slot] = t
    return row


def test_phases_and_gaps_per_sm():
    # SM 3 runs two CTAs (the second listed first: start order must come from the stamps), SM 5 one; the
    # backward's chain 1 -> 10 -> 2 -> 3 -> 4 -> 5, ends at max(5, 6, 7).
    def cta(sm, t0, blocks):
        return _row(
            sm, blocks, {1: t0, 10: t0 + 10, 2: t0 + 30, 3: t0 + 60, 4: t0 + 160, 5: t0 + 200, 9: t0 + 5}
        )

    rows = torch.tensor([cta(3, 1100, 5), cta(3, 100, 5), cta(5, 100, 3), [0] * 16], dtype=torch.int64)
    a = trace_tiles.analyse(rows, trace_tiles.BWD_PHASES, trace_tiles.BWD_SIDE, (5, 6, 7))
    assert a["sms"] == 2 and a["ctas"] == 3
    p = a["phases_cycles_per_sm"]
    assert p["start->consumer regs"] == pytest.approx((20 + 10) / 2)
    assert p["rest of loop"] == pytest.approx((200 + 100) / 2)
    assert p["gap to next CTA"] == pytest.approx((1000 - 200 + 0) / 2)
    assert a["max_sm_span_cycles"] == 1200 and a["min_sm_span_cycles"] == 200
    assert a["mean_loop_steps_per_sm"] == pytest.approx((4 + 4 + 2) / 2)
    assert a["side_cycles_per_cta"]["producer: start->K/V issued"]["mean_cycles"] == pytest.approx(5)


def test_missing_stamps_are_left_out_and_no_stamps_is_an_error():
    rows = torch.tensor(
        [_row(1, 1, {1: 1, 10: 11, 11: 20, 2: 25, 3: 40, 4: 50, 5: 60, 6: 70})], dtype=torch.int64
    )
    a = trace_tiles.analyse(rows, trace_tiles.FWD_PHASES, trace_tiles.FWD_SIDE, (5, 6, 7))
    assert a["phases_cycles_per_sm"]["first loop step"] == 0  # one block: no loop step stamp
    assert a["side_cycles_per_cta"]["masked left-edge step"]["ctas"] == 0
    with pytest.raises(SystemExit, match="FLASH4_TRACE"):
        trace_tiles.analyse(torch.zeros(4, 16, dtype=torch.int64), trace_tiles.FWD_PHASES, [], (5,))
