"""The block geometry of the kernels (csrc/common/block_info.hpp), checked on the host against brute force.

tests/cpp/test_block_info.cpp is compiled with nvcc as host code (no GPU needed) and run: forward and
backward block ranges cover every visible (query, key) pair, blocks and tiles said to need no mask have
none, and the key blocks adding into each query block in the backward are exactly the forward's range for it
(what the deterministic turn order relies on), for no mask, causal and sliding windows at several tile sizes.
Skipped (with the reason) where nvcc or the CUTLASS headers are missing.
"""

from __future__ import annotations

from host_cpp import run_host_check


def test_block_geometry_matches_brute_force(tmp_path):
    run = run_host_check("test_block_info", tmp_path)
    assert run.returncode == 0, run.stdout[-4000:]
    assert "all checks passed" in run.stdout
