"""tools/trace_tiles.py's analysis on synthetic stamps (CPU): per-SM ordering, phases and gaps."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import trace_tiles  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SLOTS = int(re.search(r"kTraceSlots = (\d+);", (ROOT / "csrc/common/trace.hpp").read_text()).group(1))


def test_slots_come_from_the_enum_and_kernels_stamp_only_named_slots():
    slot = trace_tiles.SLOT
    assert slot["kInfo"] == 0 and len(set(slot.values())) == len(slot) and max(slot.values()) < SLOTS
    stamps = []
    for f in (ROOT / "csrc").rglob("*.hpp"):
        stamps += re.findall(r"\bstamp\(([^()]*)\)", f.read_text())
        stamps += re.findall(r"trace_stamp\([^;]*?,\s*([^,()]+)\)", f.read_text())
    assert len(stamps) > 30
    for arg in stamps:
        if arg.strip() in ("TraceSlot slot", "slot"):  # the declarations and forwarding in trace.hpp
            continue
        m = re.fullmatch(r"TraceSlot::(k\w+)", arg.strip())
        assert m and m.group(1) in slot, f"stamp({arg}) is not a TraceSlot name"


def _row(sm: int, blocks: int, stamps: dict[int, int]) -> list[int]:
    row = [0] * SLOTS
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

    rows = torch.tensor([cta(3, 1100, 5), cta(3, 100, 5), cta(5, 100, 3), [0] * SLOTS], dtype=torch.int64)
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
        trace_tiles.analyse(torch.zeros(4, SLOTS, dtype=torch.int64), trace_tiles.FWD_PHASES, [], (5,))


def test_forward_warpgroup1_lag_and_phases():
    # Thread 0: K ready at 25, loop done at 50, epilogue done at 70; warpgroup 1's leader 10 cycles behind at
    # the first K (15), its prologue 30 cycles (15 -> 16), its loop done at 65 (17), tail to 80 (7), epilogue
    # to 95 (18), which is also the CTA's end.
    stamps = {
        1: 1,
        11: 20,
        2: 25,
        3: 40,
        14: 45,
        4: 50,
        5: 60,
        6: 70,
        19: 22,
        15: 35,
        16: 65,
        17: 65,
        7: 80,
        18: 95,
    }
    rows = torch.tensor([_row(1, 2, stamps)], dtype=torch.int64)
    a = trace_tiles.analyse(rows, trace_tiles.FWD_PHASES, trace_tiles.FWD_SIDE, (5, 6, 7, 18))
    side = {k: v["mean_cycles"] for k, v in a["side_cycles_per_cta"].items()}
    assert side["wg1 lag: first K ready"] == 10 and side["wg1 lag: loop done"] == 15
    assert side["wg1: prologue"] == 30 and side["wg1: tail"] == 15 and side["wg1: epilogue"] == 15
    assert a["max_sm_span_cycles"] == 94
