"""Who converts dq when "the key block whose write completes a query block converts it"
(docs/wip/bwd_finish_dq_in_kernel*.patch)? A list-scheduling model of the sm90 backward at hdim 128
(key blocks of 128, query blocks of 64, 132 SMs, the grouped launch order of csrc/common/tile_order.hpp
with window tails last), every step one time unit, a CTA's start `--overhead` units.

    python3 docs/wip/last_contributor_sim.py

Session 10's output: causal 32k x 16 heads: 62 of 4096 CTAs do all 8192 conversions, in runs of up to 248
consecutive steps (one a step); window 4096: 1654 CTAs convert, 0.77 conversions a CTA fall in its last two
steps. So a converter slower than one query block a step throttles causal's longest CTAs, and the window's
CTAs end with a conversion.
"""

from __future__ import annotations

import argparse
import collections
import heapq


def launch_order(num_blocks: int, heads: int, tail: int, group_tiles: int = 512) -> list[tuple[int, int]]:
    head_blocks = num_blocks - tail
    target = max(1, min(heads, group_tiles // head_blocks if head_blocks > 0 else 1))
    num_groups = (heads + target - 1) // target
    small = heads // num_groups
    num_big = heads - small * num_groups
    order, h = [], 0
    for g in range(num_groups):
        size = small + 1 if g < num_big else small
        order += [(b, hh) for b in range(head_blocks) for hh in range(h, h + size)]
        h += size
    return order + [(b, hh) for b in range(head_blocks, num_blocks) for hh in range(heads)]


def simulate(seqlen: int, left: int | None, heads: int, sms: int, overhead: float) -> str:
    bm, bn = 64, 128
    nq, nk = seqlen // bm, seqlen // bn

    def m_range(n: int) -> tuple[int, int]:
        hi = nq if left is None else min(nq, ((n + 1) * bn - 1 + left) // bm + 1)
        return n * bn // bm, hi

    tail = 0 if left is None else (left + 1) // bn + 2
    tail = tail if 2 * tail <= nk else 0
    free = [(0.0, i) for i in range(sms)]
    last: dict[tuple[int, int], tuple[float, int]] = {}
    ctas = []
    for idx, (n, h) in enumerate(launch_order(nk, heads, tail)):
        t0, sm = heapq.heappop(free)
        lo, hi = m_range(n)
        start = t0 + overhead
        for j, m in enumerate(range(lo, hi)):
            t = start + j + 1
            if (h, m) not in last or last[(h, m)][0] < t:
                last[(h, m)] = (t, idx)
        end = start + (hi - lo) + 1
        ctas.append(end)
        heapq.heappush(free, (end, sm))
    conv = collections.defaultdict(list)
    for t, idx in last.values():
        conv[idx].append(t)
    longest, at_end = 0, 0
    for idx, ts in conv.items():
        ts.sort()
        run = 1
        for a, b in zip(ts, ts[1:]):
            run = run + 1 if b - a <= 1.01 else 1
            longest = max(longest, run)
        at_end += sum(1 for t in ts if ctas[idx] - t <= 2.01)
    name = "causal" if left is None else f"window {left}"
    return (
        f"{name}: {len(ctas)} CTAs, {len(conv)} convert {len(last)} query blocks; longest run of conversions"
        f" in consecutive steps {longest}; in a CTA's last two steps {at_end / len(ctas):.2f} a CTA"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--overhead", type=float, default=2.5, help="a CTA's start, in steps")
    args = ap.parse_args()
    for left in (None, 4096):
        print(simulate(args.seqlen, left, args.heads, args.sms, args.overhead))


if __name__ == "__main__":
    main()
