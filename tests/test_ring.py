"""Context parallelism (flash_attn4.distributed) on gloo, 2 to 4 processes on this machine: each rank's
ring_attn shard equals single-process attn on the whole sequence, forward and gradients (through lse too),
causal (zigzag shards) and not (contiguous shards), GQA, odd chunk lengths; ring_attn_varlen's equals
attn_varlen on the whole packed batch, each sequence zigzag-sharded."""

from __future__ import annotations

import faulthandler
import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flash_attn4
from flash_attn4.distributed import (
    ring_attn,
    ring_attn_varlen,
    zigzag_shard,
    zigzag_shard_varlen,
    zigzag_unshard,
    zigzag_unshard_varlen,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, result_dir: str, args: tuple) -> None:
    """One spawned rank: fn(rank, *args) with Python's fault handler writing every thread's stack to
    result_dir/fault<rank>.log on a fatal signal, then an immediate exit. A gloo worker has died of SIGABRT
    ("terminate called without an active exception") now and then under load; leaving through os._exit once
    the group is destroyed skips the interpreter and C++ static teardown, and the log says where a crash
    that still happens was."""
    with open(os.path.join(result_dir, f"fault{rank}.log"), "w") as log:
        faulthandler.enable(file=log, all_threads=True)
        fn(rank, *args)  # an exception propagates to mp.spawn as usual
        log.flush()
    os._exit(0)


def _spawn(fn, world: int, result_dir, *args) -> None:
    """Runs fn(rank, world, port, *args) on `world` processes and checks that every rank wrote its ok file
    into result_dir; a rank killed by a signal fails the test with every rank's stacks."""
    result_dir = str(result_dir)
    try:
        mp.spawn(_entry, args=(fn, result_dir, (world, _free_port(), *args)), nprocs=world, join=True)
    except mp.ProcessExitedException as e:
        logs = [os.path.join(result_dir, f"fault{r}.log") for r in range(world)]
        stacks = [open(f).read() if os.path.exists(f) else "(not started)" for f in logs]
        raise AssertionError(f"{e}\n" + "\n".join(f"rank {r}:\n{t}" for r, t in enumerate(stacks))) from e
    assert sorted(f for f in os.listdir(result_dir) if f.startswith("ok")) == [f"ok{r}" for r in range(world)]


def _worker(
    rank: int, world: int, port: int, causal: bool, chunk: int, result_dir: str, softcap=0.0, window=(-1, -1)
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # up to 4 processes on a 2-core CI machine
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(0)  # every rank builds the same full tensors
        seqlen = 2 * world * chunk
        q, k, v = (torch.randn(2, seqlen, h, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))
        dout = torch.randn(2, seqlen, 4, 16, generator=g, dtype=torch.float64)
        if causal:
            shard = lambda t: zigzag_shard(t)  # noqa: E731
        else:
            shard = lambda t: t.chunk(world, dim=1)[rank]  # noqa: E731
        dlse = torch.randn(2, 4, seqlen, generator=g, dtype=torch.float64)
        lse_shard = lambda t: shard(t.transpose(1, 2)).transpose(1, 2)  # noqa: E731
        ql, kl, vl = (shard(t).clone().requires_grad_() for t in (q, k, v))
        out, lse = ring_attn(ql, kl, vl, causal=causal, window_size=window, softcap=softcap, return_lse=True)
        ((out * shard(dout)).sum() + (lse * lse_shard(dlse)).sum()).backward()
        # The reference on the whole sequence, on every rank, sharded the same way.
        qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
        ref, ref_lse = flash_attn4.attn(
            qf, kf, vf, causal=causal, window_size=window, softcap=softcap, return_lse=True
        )
        ((ref * dout).sum() + (ref_lse * dlse).sum()).backward()
        torch.testing.assert_close(lse, lse_shard(ref_lse), atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(out, shard(ref), atol=1e-10, rtol=1e-10)
        for got, want in ((ql.grad, qf.grad), (kl.grad, kf.grad), (vl.grad, vf.grad)):
            torch.testing.assert_close(got, shard(want), atol=1e-9, rtol=1e-9)
        if causal:
            torch.testing.assert_close(zigzag_unshard(out.detach()), ref.detach(), atol=1e-10, rtol=1e-10)
        open(os.path.join(result_dir, f"ok{rank}"), "w").close()
        dist.barrier()  # no rank tears its connections down while another still talks to it
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world,causal,softcap", [(2, False, 0.0), (2, True, 0.0), (4, False, 5.0),
                                                  (4, True, 0.0), (3, True, 5.0)])  # fmt: skip
def test_ring_attn_equals_whole_sequence_attn(tmp_path, world, causal, softcap):
    chunk = 19  # odd chunk lengths
    _spawn(_worker, world, tmp_path, causal, chunk, str(tmp_path), softcap)


# Windows that skip some blocks, cut others across a shard boundary, and (40 > a 38-token shard) reach past
# the neighbouring shard.
@pytest.mark.parametrize(
    "world,causal,window", [(2, False, (20, 11)), (3, True, (37, 0)), (4, False, (40, -1))]
)
def test_ring_attn_with_a_window_equals_whole_sequence_attn(tmp_path, world, causal, window):
    _spawn(_worker, world, tmp_path, causal, 19, str(tmp_path), 0.0, window)


@pytest.mark.parametrize("nq,nk", [(5, 5), (7, 3), (3, 8), (1, 4), (6, 1)])
def test_band_block_covers_the_band_exactly(nq, nk):
    """_band_block's trimmed sub-block and window, as the kernels read them (bottom-right aligned), mark
    exactly the pairs lo <= j - i <= hi of the block, for every band."""
    from flash_attn4.distributed import _band_block

    def kernel_mask(nq, nk, left, right):
        i, j, d = torch.arange(nq)[:, None], torch.arange(nk)[None, :], nk - nq
        return ((j >= i + d - left) | (left < 0)) & ((j <= i + d + right) | (right < 0))

    i, j = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
    for lo in [None, *range(-10, 11)]:
        for hi in [None, *range(-10, 11)]:
            if lo is not None and hi is not None and hi < lo:
                continue
            want = ((j - i >= lo) if lo is not None else True) & ((j - i <= hi) if hi is not None else True)
            want = torch.as_tensor(want).expand(nq, nk)
            got = torch.zeros(nq, nk, dtype=torch.bool)
            block = _band_block(lo, hi, nq, nk)
            if block is not None:
                qs, ks, left, right = block
                assert left >= -1 and right >= -1 and qs.stop > qs.start and ks.stop > ks.start
                got[qs, ks] = kernel_mask(qs.stop - qs.start, ks.stop - ks.start, left, right)
            assert torch.equal(got, want), (lo, hi, block)


def _varlen_worker(rank: int, world: int, port: int, causal: bool, result_dir: str, window=(-1, -1)) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(1)
        lens = [2 * world * c for c in (3, 1, 5, 2)]  # odd chunk lengths among them
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        total = sum(lens)
        q, k, v = (torch.randn(total, h, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))
        dout = torch.randn(total, 4, 16, generator=g, dtype=torch.float64)
        dlse = torch.randn(4, total, generator=g, dtype=torch.float64)
        shard = lambda t: zigzag_shard_varlen(t, cu)[0]  # noqa: E731
        _, cu_local, max_local = zigzag_shard_varlen(q, cu)
        ql, kl, vl = (shard(t).clone().requires_grad_() for t in (q, k, v))
        out, lse = ring_attn_varlen(ql, kl, vl, cu_local, max_local, causal=causal, window_size=window,
                                    return_lse=True)  # fmt: skip
        ((out * shard(dout)).sum() + (lse * shard(dlse.T).T).sum()).backward()
        qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
        ref, ref_lse = flash_attn4.attn_varlen(qf, kf, vf, cu, cu, max(lens), max(lens), causal=causal,
                                               window_size=window, return_lse=True)  # fmt: skip
        ((ref * dout).sum() + (ref_lse * dlse).sum()).backward()
        torch.testing.assert_close(out, shard(ref), atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(lse, shard(ref_lse.T).T, atol=1e-10, rtol=1e-10)
        for got, want in ((ql.grad, qf.grad), (kl.grad, kf.grad), (vl.grad, vf.grad)):
            torch.testing.assert_close(got, shard(want), atol=1e-9, rtol=1e-9)
        whole = zigzag_unshard_varlen(out.detach(), cu)
        torch.testing.assert_close(whole, ref.detach(), atol=1e-10, rtol=1e-10)
        open(os.path.join(result_dir, f"ok{rank}"), "w").close()
        dist.barrier()
    finally:
        dist.destroy_process_group()


# Two processes: three-process causal runs have aborted a gloo worker now and then (SIGABRT, "terminate
# called without an active exception"; cause not found, see _entry); the fixed-length tests cover odd worlds.
@pytest.mark.parametrize("world,causal", [(2, False), (2, True)])
def test_ring_attn_varlen_equals_whole_batch_attn_varlen(tmp_path, world, causal):
    _spawn(_varlen_worker, world, tmp_path, causal, str(tmp_path))


# Windows: sequences of 4 to 20 tokens (chunks of 1 to 5 on 2 ranks) against windows that skip, cut and
# reach past a chunk, so the chunk pairs of one call carry different trims.
WINDOWS = [(False, (7, 3)), (True, (5, 0)), (False, (-1, 4)), (True, (30, 0))]


@pytest.mark.parametrize("causal,window", WINDOWS)
def test_ring_attn_varlen_with_a_window_equals_whole_batch(tmp_path, causal, window):
    _spawn(_varlen_worker, 2, tmp_path, causal, str(tmp_path), window)


def test_bench_ring_runs_on_gloo(tmp_path):
    """benchmarks/bench_ring.py's worker on two gloo ranks at toy sizes: one record per (direction, impl),
    positive times, the efficiency on the ring rows, and a table with both directions."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_ring

    args = bench_ring.parse_args(["--device", "cpu", "--gpus", "2", "--seqlens", "32", "--heads", "2",
                                  "--hdim", "8", "--rounds", "1", "--warmup", "0", "--rep", "1"])  # fmt: skip
    out = tmp_path / "ring.json"
    _spawn(_bench_ring_worker, 2, tmp_path, args, str(out), str(tmp_path))
    records = json.loads(out.read_text())
    assert sorted((r["impl"], r["world"]) for r in records) == [
        ("flash_attn4", 1), ("flash_attn4_ring", 2), ("ring_exchanges", 2)]  # fmt: skip
    for r in records:
        assert {"hdim", "seqlen", "causal", "batch", "nheads", "dtype"} <= set(r)
        assert r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and len(r["fwd_ms_rounds"]) == 1
    ring = next(r for r in records if r["impl"] == "flash_attn4_ring")
    assert ring["fwd_efficiency"] > 0 and ring["bwd_efficiency"] > 0
    table = bench_ring.format_table(records)
    assert "| 2 | 32 | fwd |" in table and "| 2 | 32 | bwd |" in table


def _bench_ring_worker(rank, world, port, args, out, result_dir):
    import bench_ring

    bench_ring._worker(rank, world, port, args, out)
    open(os.path.join(result_dir, f"ok{rank}"), "w").close()
