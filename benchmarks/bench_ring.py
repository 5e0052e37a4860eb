#!/usr/bin/env python3
"""Context parallelism: flash_attn4.distributed.ring_attn on n GPUs against flash_attn4.attn on one, forward
and backward, in one run.

    python3 benchmarks/bench_ring.py --gpus 2        # 128k and 512k tokens, 16 heads, d 128, causal, bf16
    python3 benchmarks/bench_ring.py --gpus 2,4 --seqlens 131072

For each n in --gpus, one process group of n ranks (NCCL, NVLink multicast off) times, alternating within
each round: rank 0's `attn` on the whole sequence (the one-GPU baseline; the other ranks wait), then every
rank's `ring_attn` on its zigzag shard (the time of the slowest rank), then the exchanges alone: the
forward's n - 1 K / V moves around the ring, and the backward's n - 1 K / V plus n dK / dV moves. Each time
is the median of --rep calls after --warmup, and a record keeps the median of the rounds; the backward is
the gradient call alone on a graph recorded once (retain_graph), as in bench_fwd.py --bwd.

    efficiency = t(attn, 1 GPU) / (n x t(ring_attn, n GPUs))        (1.0: perfect scaling)

A ring time near compute / n + exchanges means the transfers did not overlap the kernels; near compute / n,
they did. Writes benchmarks/results/<gpu>_ring.json (records `flash_attn4` with world 1, `flash_attn4_ring`
with fwd_efficiency / bwd_efficiency, `ring_exchanges`; fwd_ms, bwd_ms) and prints a table. `--device cpu`
runs the same code on gloo with the reference kernels, at toy sizes: it checks the script, it measures
nothing worth quoting.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fwd import _import_flash_attn4  # noqa: E402
from results_file import gpu_slug, results_dir, sm_clock_mhz, write_results  # noqa: E402

# NCCL must not use NVLink SHARP / multicast on the lent machines (device README, KINDS.md).
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", default="2", help="comma-separated world sizes, each >= 2 (default 2)")
    ap.add_argument("--seqlens", default="131072,524288", help="total tokens of the one sequence")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--causal", type=int, choices=(0, 1), default=1)
    ap.add_argument("--no-bwd", action="store_true", help="time the forward only")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rep", type=int, default=5)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", type=Path, default=None, help="result file (default results/<gpu>_ring.json)")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    args.gpus = [int(x) for x in args.gpus.split(",")]
    args.seqlens = [int(x) for x in args.seqlens.split(",")]
    if any(n < 2 for n in args.gpus):
        raise SystemExit("--gpus: world sizes of 2 or more (the one-GPU baseline runs inside each)")
    for n in args.gpus:
        for s in args.seqlens:
            if s % (2 * n):
                raise SystemExit(f"seqlen {s} is not divisible by 2 x {n} (zigzag shards)")
    if args.device == "cuda" and torch.cuda.device_count() < max(args.gpus):
        raise SystemExit(f"--gpus {max(args.gpus)} needs that many GPUs; this machine has "
                         f"{torch.cuda.device_count()}")  # fmt: skip
    return args


# Record names (impl): our kernel on one GPU, the ring on `world` GPUs, and the ring's transfers alone.
IMPLS = {"attn_1gpu": "flash_attn4", "ring_attn": "flash_attn4_ring", "exchanges": "ring_exchanges"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Clock:
    """Milliseconds of fn() on this rank: CUDA events on GPUs, perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)


def _median_ms(fn, clock: _Clock, warmup: int, rep: int, everyone: bool) -> float:
    """Median over `rep` calls of the slowest rank's time; every rank starts each call at a barrier.
    everyone=False: only rank 0 calls fn (the one-GPU baseline), the others wait."""
    for _ in range(warmup):
        if everyone or dist.get_rank() == 0:
            fn()
    times = []
    for _ in range(rep):
        dist.barrier()
        ms = clock(fn) if everyone or dist.get_rank() == 0 else 0.0
        t = torch.tensor([ms], dtype=torch.float64)
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t.item()))
    return statistics.median(times)


def _grad_call(out, leaves):
    dout = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)


def _one_shape(args, n: int, seqlen: int, device: torch.device, clock: _Clock) -> list[dict]:
    import flash_attn4
    from flash_attn4.distributed import _finish, _start_exchange, ring_attn, zigzag_shard

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    causal = bool(args.causal)
    g = torch.Generator(device=device).manual_seed(0)  # every rank draws the same full tensors
    full = [torch.randn(1, seqlen, args.heads, args.hdim, device=device, dtype=dtype, generator=g)
            for _ in range(3)]  # fmt: skip
    shard = zigzag_shard if causal else (lambda t: t.chunk(n, dim=1)[dist.get_rank()].contiguous())
    local = [shard(t).contiguous() for t in full]
    if dist.get_rank() != 0:
        del full  # only rank 0 runs the baseline
        full = None
    one = lambda: flash_attn4.attn(*full, causal=causal)  # noqa: E731
    ring = lambda: ring_attn(*local, causal=causal)  # noqa: E731

    def exchanges(count: int, tensors):
        def run():
            for _ in range(count):
                pending, _ = _start_exchange(tensors, None)
                _finish(pending)

        return run

    fns = {"attn_1gpu": (one, False), "ring_attn": (ring, True),
           "exchanges": (exchanges(n - 1, local[1:]), True)}  # fmt: skip
    bwd = {}
    if not args.no_bwd:
        # Leaves that share the inputs' storage, so the forward timings above record no graph.
        leaves1 = [t.detach().requires_grad_() for t in full] if full is not None else None
        leaves = [t.detach().requires_grad_() for t in local]
        bwd["attn_1gpu"] = (_grad_call(flash_attn4.attn(*leaves1, causal=causal), leaves1)
                            if leaves1 is not None else None, False)  # fmt: skip
        bwd["ring_attn"] = (_grad_call(ring_attn(*leaves, causal=causal), leaves), True)
        kv = [t.detach() for t in local[1:]]
        dkv = [torch.zeros_like(t, dtype=torch.float32) for t in kv]  # the ring's gradients travel in fp32

        def bwd_exchanges():
            exchanges(n - 1, kv)()
            exchanges(n, dkv)()

        bwd["exchanges"] = (bwd_exchanges, True)
    rounds = {(d, name): [] for d, table in (("fwd", fns), ("bwd", bwd)) for name in table}
    clocks = []
    for r in range(args.rounds):
        for direction, table in (("fwd", fns), ("bwd", bwd)):
            order = list(table)[:: 1 if r % 2 == 0 else -1]
            for name in order:
                fn, everyone = table[name]
                rounds[(direction, name)].append(_median_ms(fn, clock, args.warmup, args.rep, everyone))
        clocks.append(sm_clock_mhz() if device.type == "cuda" else None)
    # One record per impl (DESIGN.md's result schema): `world` GPUs, fwd_ms / bwd_ms medians of the rounds.
    base = dict(seqlen=seqlen, nheads=args.heads, hdim=args.hdim, causal=causal, batch=1,
                dtype=str(dtype).replace("torch.", ""), ring_world=n)  # fmt: skip
    seen = [c for c in clocks if c]
    records = {name: dict(impl=IMPLS[name], world=1 if name == "attn_1gpu" else n, **base) for name in fns}
    for (direction, name), times in rounds.items():
        records[name][f"{direction}_ms"] = statistics.median(times)
        records[name][f"{direction}_ms_rounds"] = times
    ring = records["ring_attn"]
    for direction in ("fwd", "bwd"):
        if f"{direction}_ms" in ring:
            ring[f"{direction}_efficiency"] = records["attn_1gpu"][f"{direction}_ms"] / (
                n * ring[f"{direction}_ms"]
            )
    for r in records.values():
        r["sm_clock_mhz"] = [min(seen), max(seen)] if seen else None
    return list(records.values())


def _worker(rank: int, n: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=n, device_id=device)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=n)
    _import_flash_attn4()
    records = []
    try:
        for seqlen in args.seqlens:
            shape_records = _one_shape(args, n, seqlen, device, _Clock(device))
            records += shape_records
            if rank == 0:
                print(format_table(shape_records), flush=True)
        if rank == 0:
            Path(out_path).write_text(json.dumps(records))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def format_table(records: list[dict]) -> str:
    rows = ["| GPUs | seqlen | dir | attn, 1 GPU (ms) | ring_attn (ms) | exchanges alone (ms) | efficiency |",
            "|---:|---:|:-:|---:|---:|---:|---:|"]  # fmt: skip
    keyed = {(r["ring_world"], r["seqlen"], r["impl"]): r for r in records}
    for n, s in sorted({(r["ring_world"], r["seqlen"]) for r in records}):
        one, ring, ex = (keyed[(n, s, IMPLS[i])] for i in ("attn_1gpu", "ring_attn", "exchanges"))
        for d in ("fwd", "bwd"):
            if f"{d}_ms" in ring:
                rows.append(f"| {n} | {s} | {d} | {one[f'{d}_ms']:.2f} | {ring[f'{d}_ms']:.2f} | "
                            f"{ex[f'{d}_ms']:.2f} | {ring[f'{d}_efficiency']:.3f} |")  # fmt: skip
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for key, value in NCCL_ENV.items():
        os.environ.setdefault(key, value)
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.gpus:
            out = os.path.join(tmp, f"world{n}.json")
            mp.spawn(_worker, args=(n, _free_port(), args, out), nprocs=n, join=True)
            records += json.loads(Path(out).read_text())
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    meta = dict(gpu=name, device=args.device)  # "cpu" runs name no GPU; the writer adds torch and the date
    for r in records:
        r.update(meta)
    print(format_table(records))
    if not args.no_save:
        print(f"wrote {write_results(records, args.out or results_dir() / f'{gpu_slug(name)}_ring.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
