#!/usr/bin/env python3
"""Summary of scripts/ab_trees.sh's timings (ab_runs.jsonl: one line per process, round and case).

    python3 scripts/ab_summary.py ab_runs.jsonl old new      # the first variant is the baseline

bench_varlen.py rows: each variant's median causal / window times and speedup over the rounds. bench_fwd.py
rows: per shape, each variant's median time of flash_attn4 over the rounds, its ratio to the first variant's
(below 1: faster), the other implementations' medians from the first variant's processes, and the SM clocks
seen.
"""

from __future__ import annotations

import collections
import json
import statistics
import sys


def summarize_varlen(rows: list[dict]) -> list[str]:
    by = collections.defaultdict(list)
    for r in rows:
        by[(r["variant"], r["direction"])].append(r)
    lines = []
    for (name, d), rs in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):

        def med(key: str, rs: list[dict] = rs) -> float:
            return statistics.median(r[key] for r in rs)

        rounds = ", ".join(f"{r['speedup']:.3f}" for r in rs)
        lines.append(
            f"{d} {name:>10}: causal {med('full_causal_ms'):.3f} ms  window {med('window_ms'):.3f} ms  "
            f"{med('speedup'):.3f}x  (rounds: {rounds})"
        )
    return lines


def summarize_fwd(rows: list[dict], names: list[str]) -> list[str]:
    key = "bwd_ms" if any(r.get("bwd_ms") for r in rows) else "fwd_ms"
    ms = collections.defaultdict(list)
    for r in rows:
        if r.get(key):
            ms[(r["impl"], r["variant"], r["hdim"], r["seqlen"], bool(r["causal"]))].append(r[key])
    shapes = sorted({k[2:] for k in ms})
    others = sorted({k[0] for k in ms} - {"flash_attn4"})
    base = names[0]
    head = ["hdim", "seqlen", "causal", *names, *(f"{n}/{base}" for n in names[1:]), *others]
    table, ratios = [], collections.defaultdict(list)
    for h, s, c in shapes:
        med = {
            n: statistics.median(ms[("flash_attn4", n, h, s, c)])
            for n in names
            if ms[("flash_attn4", n, h, s, c)]
        }
        cells = [f"{med[n]:.3f}" if n in med else "-" for n in names]
        for n in names[1:]:
            if n in med and base in med:
                ratios[n].append(med[n] / med[base])
                cells.append(f"{med[n] / med[base]:.3f}")
            else:
                cells.append("-")
        for i in others:
            t = ms.get((i, base, h, s, c))
            cells.append(f"{statistics.median(t):.3f}" if t else "-")
        table.append([str(h), str(s), "yes" if c else "no", *cells])
    widths = [max(len(x) for x in col) for col in zip(head, *table)]
    lines = [f"{key} medians over the rounds (ms); {base} is the baseline, a ratio below 1 is faster"]
    lines += ["  ".join(x.rjust(w) for x, w in zip(line, widths)) for line in [head, *table]]
    for n, rs in ratios.items():
        spread = f"range {min(rs):.3f}-{max(rs):.3f} over {len(rs)} shapes"
        lines.append(f"{n} / {base}: median {statistics.median(rs):.3f}, {spread}")
    clocks = [r["sm_clock_mhz"] for r in rows if r.get("sm_clock_mhz")]
    if clocks:
        lines.append(
            f"SM clock seen: {min(clocks):.0f}-{max(clocks):.0f} MHz, median {statistics.median(clocks):.0f}"
        )
    return lines


def main(argv: list[str]) -> int:
    path, names = argv[0], argv[1:]
    rows = [json.loads(line) for line in open(path)]
    if not rows:
        print("no timings")
        return 1
    names = names or list(dict.fromkeys(r["variant"] for r in rows))
    lines = summarize_varlen(rows) if "window_ms" in rows[0] else summarize_fwd(rows, names)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
