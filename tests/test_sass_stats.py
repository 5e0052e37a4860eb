"""tools/sass_stats.py on a hand-written SASS listing: function split, hottest loop, counts (no GPU)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import sass_stats  # noqa: E402

LISTING = """
Fatbin elf code:
================
arch = sm_90a
code version = [1,8]

	code for sm_90a
		Function : _Z6kernelv
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0020*/                   LDSM.16.M88.4 R4, [R2] ;
        /*0030*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;
        /*0040*/                   IMAD R3, R3, 0x2, RZ ;
        /*0050*/                   IADD3 R3, R3, 0x1, RZ ;
        /*0060*/                   IADD3 R3, R3, 0x1, RZ ;
        /*0070*/                   HMMA.16816.F32.BF16 R12, R4, R6, R12 ;
        /*0080*/                   REDG.E.ADD.F32.FTZ.RN.STRONG.GPU desc[UR4][R2.64], R8 ;
        /*0090*/              @P0  BRA 0x10 ;
        /*00a0*/                   ATOMG.E.ADD.F32.FTZ.RN.STRONG.GPU PT, R9, desc[UR4][R2.64], R8 ;
        /*00b0*/                   BRA 0x90 ;
        /*00c0*/                   EXIT ;
		Function : _Z5otherv
        /*0000*/                   EXIT ;
"""


def test_functions_are_split_and_tagged_with_their_arch():
    funcs = sass_stats.functions(LISTING)
    assert list(funcs) == ["[sm_90a] _Z6kernelv", "[sm_90a] _Z5otherv"]
    assert [op for _, op, _ in funcs["[sm_90a] _Z5otherv"]] == ["EXIT"]


def test_the_hottest_loop_is_the_back_edge_holding_the_mma():
    body = sass_stats.hottest_loop(sass_stats.functions(LISTING)["[sm_90a] _Z6kernelv"])
    # BRA 0x10 at 0x90 encloses both HMMA; BRA 0x90 at 0xb0 encloses none.
    assert (body[0][0], body[-1][0]) == (0x10, 0x90)
    s = sass_stats.stats(body)
    assert s["instructions"] == 9
    assert s["mma"] == 2
    assert s["longest_run_without_mma"] == 3  # IMAD, IADD3, IADD3
    assert s["REDG"] == 1 and "ATOMG" not in s
    assert s["BAR"] == 1 and s["LDSM"] == 1
