"""tools/l2_model.py: its port of the launch order is csrc/common/tile_order.hpp's, launch index by launch
index (compiled with the host C++ compiler; skipped without one), and the model shows what the backward's
launch groups were chosen for: with the forward's 32 MB groups a short causal backward at head dim 64 reads
its Q / dO / dq_accum from HBM several times over in a 25 MB L2, with make_bwd's groups once."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from l2_model import bwd_group_tiles, fwd_group_tiles, simulate, tile_order  # noqa: E402

GRIDS = [(8, 32, 16, 0), (7, 5, 3, 0), (64, 8, 2, 0), (33, 16, 1, 9), (1, 3, 2, 0), (100, 48, 1, 99)]

PRINTER = r"""
#include <cstdio>
#include "common/tile_order.hpp"
int main() {
  const int grids[][5] = {GRIDS};
  for (auto const& g : grids) {
    const flash4::TileOrder o = flash4::TileOrder::make<64>(g[0], g[1], g[2], g[3], g[4]);
    for (int i = 0; i < g[0] * g[1] * g[2]; ++i) {
      const flash4::TileCoord t = o(i);
      std::printf("%d %d %d\n", t.block, t.head, t.batch);
    }
  }
}
"""


GROUPS = [fwd_group_tiles(64), bwd_group_tiles(64), bwd_group_tiles(128, 8), 1]


@pytest.mark.parametrize("group_tiles", GROUPS)
def test_port_matches_the_header(tmp_path, group_tiles):
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    src, exe = tmp_path / "order.cpp", tmp_path / "order"
    rows = ", ".join("{" + ", ".join(map(str, (*g, group_tiles))) + "}" for g in GRIDS)
    src.write_text(PRINTER.replace("GRIDS", rows))
    build = subprocess.run(
        [cxx, "-std=c++17", "-O1", f"-I{ROOT / 'csrc'}", str(src), "-o", str(exe)],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr
    got = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60).stdout.split("\n")
    want = []
    for blocks, heads, batch, tail in GRIDS:
        at, _ = tile_order(blocks, heads, batch, group_tiles, tail)
        want += [" ".join(map(str, at(i))) for i in range(blocks * heads * batch)]
    assert got[: len(want)] == want


def test_backward_groups_read_the_streams_once():
    shape = dict(direction="bwd", seqlen=1024, hdim=64, batch=16, heads=32, l2_mb=25)
    forward_groups = simulate(**shape, group_tiles=fwd_group_tiles(64))
    own_groups = simulate(**shape, group_tiles=bwd_group_tiles(64))
    assert forward_groups["group"] == 128 and own_groups["group"] == 32
    assert forward_groups["reads"] > 2.0
    assert own_groups["reads"] == pytest.approx(1.0, abs=0.01)
    assert own_groups["makespan"] <= 1.02 * own_groups["ideal"]


@pytest.mark.parametrize("policy", ["lru", "random"])
def test_policies_agree_where_everything_fits(policy):
    shape = dict(direction="bwd", seqlen=2048, hdim=64, batch=4, heads=8, group_tiles=fwd_group_tiles(64))
    assert simulate(**shape, l2_mb=1024, policy=policy)["reads"] == 1.0  # every block once
    small = simulate(**shape, l2_mb=1, policy=policy)["reads"]
    assert small > 1.5  # 1 MB: 16 blocks of 64 KB, one head's, while the CTAs in flight sweep 32 heads
    if policy == "random":  # a share of a sweep survives random eviction, none survives LRU
        assert small < simulate(**shape, l2_mb=1, policy="lru")["reads"]
