#!/usr/bin/env python3
"""How many bytes the launch order of a causal grid makes the kernels read from HBM: a model of the L2.

    python3 tools/l2_model.py                          # fwd and bwd, head dims 64 / 128, 1k / 2k / 8k tokens
    python3 tools/l2_model.py --direction bwd --hdims 64 --seqlens 1024 --group-div 1,4 --l2-mb 25,50

The grid is csrc/common/tile_order.hpp's (`tile_order` below is its port; tests/test_l2_model.py checks the
two against each other): heads in balanced groups of about `group_tiles / num_blocks`, the block index slow
inside a group, heaviest tile first. Every SM runs one CTA at a time and takes the next launch index when its
tile ends (the hardware's order; the persistent backward's dynamic schedule hands out the same order). A tile
is a sequence of equal steps, each reading one 128-row block of the streamed operands of its head:

- forward: query tile m (launch block 0 = the last, heaviest) reads K and V blocks m, m - 1, ..., 0:
  4 * head_dim bytes a row;
- backward: key tile n reads Q, dO (16-bit) and dq_accum (fp32) blocks n, ..., num_blocks - 1 of each of its
  kv head's `--gqa` query heads: 8 * head_dim * gqa bytes a row.

The L2 is one fully associative set of `--l2-mb` megabytes of such blocks, least recently used out first
(`--policy lru`) or a random one (`--policy random`, seeded). LRU is the optimistic model while a group's
streams fit and the pessimistic one once they do not: concurrent sweeps over more blocks than it holds miss on
every read (6-30x the compulsory bytes at 8k tokens and head dim 256 or GQA, which the measured speed there
rules out), where random replacement keeps a share. An H100 / H200 has 50 / 60 MB in two partitions,
so both 25 and 50 MB are printed; the measured backward follows 25 MB (its +13% at head dim 128, 1k tokens, is
predicted there only; docs/design.md, "Grouped heads, heaviest first"). Printed: the group size in
head-batches, the reads of the streamed operands over their compulsory bytes (1.00 = each block read from HBM
once), and the makespan in steps against the ideal (all steps over all SMs). Not modelled: Q / K / V of the
tile itself (read once either way), writes, other kernels' data, the L2's hashing and set associativity,
unequal step times (masked diagonal steps), clock and bandwidth: the model says where reads multiply, not how
much time that costs (at 8k tokens the backward barely moved where the model had reads fall 2-4x).
"""

from __future__ import annotations

import argparse
import heapq
import random
from collections import OrderedDict
from collections.abc import Callable

BLOCK = 128  # rows of a query / key block (the sm90 tiles' kBlockM for the model's purpose)


def fwd_group_tiles(hdim: int) -> int:
    """TileOrder::make's default group: 32 MB of K and V."""
    return 512 * 128 // hdim


def bwd_group_tiles(hdim: int, gqa: int = 1) -> int:
    """TileOrder::make_bwd's group: 16 MB of Q, dO and dq_accum."""
    return max(1, 512 * 128 // hdim // 4 // max(1, gqa))


def tile_order(
    num_blocks: int, num_heads: int, num_batch: int, group_tiles: int, tail_blocks: int = 0
) -> tuple[Callable[[int], tuple[int, int, int]], int]:
    """(launch index -> (block, head, batch), head-batches a group), as TileOrder::make / operator()."""
    head_blocks = num_blocks - tail_blocks
    hb_total = num_heads * num_batch
    target = group_tiles // head_blocks if head_blocks > 0 else 1
    target = max(1, min(target, hb_total))
    num_groups = (hb_total + target - 1) // target
    small = hb_total // num_groups
    num_big = hb_total - small * num_groups
    big = small + 1

    def at(linear: int) -> tuple[int, int, int]:
        grouped = head_blocks * hb_total
        if linear >= grouped:
            r = linear - grouped
            hb = r % hb_total
            return head_blocks + r // hb_total, hb % num_heads, hb // num_heads
        big_tiles = num_big * big * head_blocks
        if linear < big_tiles:
            g = linear // (big * head_blocks)
            first, size, offset = g * big, big, linear - g * big * head_blocks
        else:
            r = linear - big_tiles
            g = r // ((big - 1) * head_blocks)
            first, size, offset = num_big * big + g * (big - 1), big - 1, r - g * (big - 1) * head_blocks
        hb = first + offset % size
        return offset // size, hb % num_heads, hb // num_heads

    return at, target


def simulate(
    direction: str,
    seqlen: int,
    hdim: int,
    batch: int,
    heads: int,
    l2_mb: float,
    group_tiles: int,
    *,
    sms: int = 132,
    gqa: int = 1,
    overhead: float = 0.5,
    policy: str = "lru",
    seed: int = 0,
) -> dict:
    """One causal grid through the model. heads: kv heads for the backward (its grid's y), query heads for the
    forward. overhead: steps a tile costs outside its loop."""
    nb = seqlen // BLOCK
    total = nb * heads * batch
    at, group = tile_order(nb, heads, batch, group_tiles)
    row_bytes = 4 * hdim if direction == "fwd" else 8 * hdim * gqa
    capacity = max(1, int(l2_mb * 2**20) // (BLOCK * row_bytes))
    lru: OrderedDict = OrderedDict()  # policy "lru": the blocks held, least recently used first
    held: list = []  # policy "random": the blocks held, and where each sits in the list
    where: dict = {}
    rng = random.Random(seed)
    misses = 0

    def steps(linear: int) -> list[tuple[int, int, int]]:
        block, h, b = at(linear)
        if direction == "fwd":
            m = nb - 1 - block
            return [(b, h, j) for j in range(m, -1, -1)]
        return [(b, h, i) for i in range(block, nb)]

    # (time, sm, launch index, step): every SM runs its tile's steps, then takes the next launch index.
    heap = [(0.0, s, s, 0) for s in range(min(sms, total))]
    heapq.heapify(heap)
    next_tile, makespan, work = len(heap), 0.0, 0
    running: dict[int, list] = {}
    while heap:
        t, s, linear, k = heapq.heappop(heap)
        st = running.setdefault(linear, steps(linear))
        if k < len(st):
            key = st[k]
            if policy == "random":
                if key not in where:
                    misses += 1
                    if len(held) >= capacity:  # evict a random block: the last one moves into its place
                        i = rng.randrange(len(held))
                        del where[held[i]]
                        last = held.pop()
                        if i < len(held):
                            held[i], where[last] = last, i
                    where[key] = len(held)
                    held.append(key)
            elif key in lru:
                lru.move_to_end(key)
            else:
                misses += 1
                lru[key] = None
                if len(lru) > capacity:
                    lru.popitem(last=False)
            work += 1
            heapq.heappush(heap, (t + 1, s, linear, k + 1))
            continue
        del running[linear]
        makespan = max(makespan, t)
        if next_tile < total:
            heapq.heappush(heap, (t + overhead, s, next_tile, 0))
            next_tile += 1
    ideal = (work + overhead * total) / min(sms, total)
    return {"group": group, "reads": misses / (nb * heads * batch), "makespan": makespan, "ideal": ideal}


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--direction", choices=["fwd", "bwd", "both"], default="both")
    ap.add_argument("--hdims", type=_ints, default=[64, 128])
    ap.add_argument("--seqlens", type=_ints, default=[1024, 2048, 8192])
    ap.add_argument("--tokens", type=int, default=16384, help="batch x seqlen (bench_fwd.py's 16k)")
    ap.add_argument("--hidden", type=int, default=2048, help="query heads x head dim (bench_fwd.py's 2048)")
    ap.add_argument("--gqa", type=int, default=1, help="query heads per kv head")
    ap.add_argument("--l2-mb", type=lambda s: [float(x) for x in s.split(",")], default=[25.0, 50.0])
    ap.add_argument(
        "--group-div",
        type=_ints,
        default=[1, 2, 4],
        help="the forward's group (32 MB of K / V) over these; the backward's own (make_bwd) is 4 x gqa",
    )
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--policy", choices=["lru", "random"], default="lru", help="which block the L2 evicts")
    args = ap.parse_args()
    dirs = ["fwd", "bwd"] if args.direction == "both" else [args.direction]
    print(
        f"{'dir':>3} {'hdim':>4} {'seqlen':>6} {'div':>3} {'group':>5} "
        + " ".join(f"{f'reads@{m:g}MB':>11}" for m in args.l2_mb)
        + f" {'makespan/ideal':>14}"
    )
    for d in dirs:
        for hdim in args.hdims:
            q_heads = args.hidden // hdim
            heads = q_heads if d == "fwd" else max(1, q_heads // args.gqa)
            gqa = 1 if d == "fwd" else args.gqa
            for seqlen in args.seqlens:
                batch = max(1, args.tokens // seqlen)
                for div in args.group_div:
                    tiles = max(1, fwd_group_tiles(hdim) // div)
                    res = [
                        simulate(
                            d, seqlen, hdim, batch, heads, m, tiles, sms=args.sms, gqa=gqa, policy=args.policy
                        )
                        for m in args.l2_mb
                    ]
                    reads = " ".join(f"{r['reads']:>11.2f}" for r in res)
                    print(
                        f"{d:>3} {hdim:>4} {seqlen:>6} {div:>3} {res[0]['group']:>5} {reads} "
                        f"{res[0]['makespan'] / res[0]['ideal']:>14.3f}"
                    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
