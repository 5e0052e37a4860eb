#!/usr/bin/env python3
"""Where the sm90 kernels' time goes between and inside their tiles, from per-CTA clock stamps.

    NVCC_APPEND_FLAGS=-DFLASH4_TRACE python3 setup.py build_ext --inplace   # a trace build (not for timing)
    python3 tools/trace_tiles.py --out trace.json

Each CTA of a trace build writes clock64() at a few events (the TraceSlot enum of csrc/common/trace.hpp, read
by this script; the stamps sit outside the kernels' loops) and the SM it ran on. clock64 counts one SM's
cycles, so only stamps of one SM are compared: per SM the CTAs are put in start order and the time is split
into the gap between one CTA's end and the next one's start, and each CTA's phases:

  forward:  start -> consumer registers (setmaxnreg) -> Q ready -> first K ready -> first block's softmax
            done (prologue) -> first loop step -> loop done -> last P V and normalization (tail) -> epilogue
  backward: start -> consumer registers -> K and V ready -> first query block done -> loop done -> dK / dV
            stored
and on the side the producer's start, the window's masked left-edge step and, in the forward, warpgroup 1's
leader: how far it trails thread 0 at Q, the first K, the loop's end and the epilogue's end, and its own
prologue, tail and epilogue (the phases above are thread 0's, warpgroup 0's).

Cases: hdim 128, 16 heads, bf16, one sequence of --seqlen (32k), causal against a causal --window (4096)
window, the shapes of benchmarks/bench_varlen.py (--batch / --hdim / --heads / --window 0 for others, e.g.
the short causal rows: --batch 16 --seqlen 1024 --hdim 64 --heads 32 --window 0). Prints a table per case and
writes the per-SM sums as JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _slots(header: Path = ROOT / "csrc" / "common" / "trace.hpp") -> dict[str, int]:
    """Names and numbers of `enum class TraceSlot` in csrc/common/trace.hpp, the one list of trace slots."""
    text = header.read_text()
    body = re.search(r"enum class TraceSlot : int \{(.*?)\};", text, re.S)
    if body is None:
        raise RuntimeError(f"no `enum class TraceSlot` in {header}")
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"\b(k\w+) = (\d+),", body.group(1))}


SLOT = _slots()


def _chain(*steps: tuple[str, str, str]) -> list[tuple[str, int, int]]:
    return [(name, SLOT[a], SLOT[b]) for name, a, b in steps]


# (name, from slot, to slot): the chain of consumer thread 0 first (it adds up to the CTA's time), then side
# measurements.
FWD_PHASES = _chain(
    ("start->consumer regs", "kStart", "kConsumerRegs"),
    ("regs->Q ready", "kConsumerRegs", "kQReady"),
    ("Q->first K ready", "kQReady", "kFirstKV"),
    ("prologue", "kFirstKV", "kFirstStep"),
    ("first loop step", "kFirstStep", "kFirstLoopStep"),
    ("rest of loop", "kFirstLoopStep", "kLoopDone"),
    ("tail", "kLoopDone", "kMmaDone"),
    ("epilogue", "kMmaDone", "kEpilogueDone"),
)
FWD_SIDE = _chain(
    ("producer: start->regs", "kStart", "kProducerStart"),
    ("producer: ->Q, K issued", "kProducerStart", "kProducerIssued"),
    ("masked left-edge step", "kEdgeStepStart", "kEdgeStepEnd"),
    # Warpgroup 1 (thread 128): when it reaches thread 0's events (lag), and its own phases.
    ("wg1 lag: Q ready", "kQReady", "kWg1QReady"),
    ("wg1 lag: first K ready", "kFirstKV", "kWg1FirstKV"),
    ("wg1 lag: loop done", "kLoopDone", "kWg1LoopDone"),
    ("wg1 lag: epilogue done", "kEpilogueDone", "kWg1EpilogueDone"),
    ("wg1: prologue", "kWg1FirstKV", "kWg1FirstStep"),
    ("wg1: tail", "kWg1LoopDone", "kWg1MmaDone"),
    ("wg1: epilogue", "kWg1MmaDone", "kWg1EpilogueDone"),
)
BWD_PHASES = _chain(
    ("start->consumer regs", "kStart", "kConsumerRegs"),
    ("regs->K/V ready", "kConsumerRegs", "kFirstKV"),
    ("first step", "kFirstKV", "kFirstStep"),
    ("rest of loop", "kFirstStep", "kLoopDone"),
    ("dK/dV store", "kLoopDone", "kMmaDone"),
)
BWD_SIDE = _chain(("producer: start->K/V issued", "kStart", "kProducerIssued"))
# The events that can end a CTA: its last stamp is the latest of these.
FWD_END = tuple(SLOT[n] for n in ("kMmaDone", "kEpilogueDone", "kWg1MmaDone", "kWg1EpilogueDone"))
BWD_END = tuple(SLOT[n] for n in ("kMmaDone", "kEpilogueDone", "kWg1MmaDone"))


def run_traced(fn, slots: int, max_ctas: int) -> torch.Tensor:
    from flash_attn4 import _C

    buf = torch.zeros(max_ctas * slots, dtype=torch.int64, device="cuda")
    fn()
    torch.cuda.synchronize()
    _C.set_trace(buf)
    try:
        fn()
        torch.cuda.synchronize()
    finally:
        _C.set_trace(None)
    return buf.view(max_ctas, slots).cpu()


def analyse(rows: torch.Tensor, phases, side, end_slots) -> dict:
    valid = rows[:, 0] != 0
    if not bool(valid.any()):
        raise SystemExit("no stamps: build the extension with NVCC_APPEND_FLAGS=-DFLASH4_TRACE")
    rows = rows[valid].tolist()
    per_sm: dict[int, list] = {}
    for r in rows:
        per_sm.setdefault(r[0] >> 32, []).append(r)

    def span(r, a, b):  # None where the CTA did not reach both events (a loop of one block, no masked step)
        return r[b] - r[a] if r[a] and r[b] else None

    sums = {name: [] for name, _, _ in phases}
    sums["gap to next CTA"] = []
    spans, steps, tiles = [], [], []
    for ctas in per_sm.values():
        ctas.sort(key=lambda r: r[1])
        end = [max(r[s] for s in end_slots) for r in ctas]
        for name, a, b in phases:
            sums[name].append(sum(span(r, a, b) or 0 for r in ctas))
        sums["gap to next CTA"].append(sum(ctas[i + 1][1] - end[i] for i in range(len(ctas) - 1)))
        spans.append(end[-1] - ctas[0][1])
        steps.append(sum(max(0, (r[0] & 0xFFFFFFFF) - 1) for r in ctas))
        tiles.append(len(ctas))
    side_means = {}
    for name, a, b in side:
        xs = [x for x in (span(r, a, b) for r in rows) if x is not None]
        side_means[name] = {"ctas": len(xs), "mean_cycles": statistics.mean(xs) if xs else None}
    out = {
        "sms": len(per_sm),
        "ctas": len(rows),
        "mean_sm_span_cycles": statistics.mean(spans),
        "max_sm_span_cycles": max(spans),
        "min_sm_span_cycles": min(spans),
        "mean_tiles_per_sm": statistics.mean(tiles),
        "mean_loop_steps_per_sm": statistics.mean(steps),
        "phases_cycles_per_sm": {k: statistics.mean(v) for k, v in sums.items()},
        "side_cycles_per_cta": side_means,
    }
    loop = sum(v for k, v in out["phases_cycles_per_sm"].items() if "loop" in k)
    out["cycles_per_loop_step"] = loop / max(1.0, out["mean_loop_steps_per_sm"])
    return out


def show(name: str, a: dict) -> None:
    span, tiles = a["mean_sm_span_cycles"], a["mean_tiles_per_sm"]
    lo, hi, step = a["min_sm_span_cycles"] / 1e6, a["max_sm_span_cycles"] / 1e6, a["cycles_per_loop_step"]
    print(f"\n{name}: {a['ctas']} CTAs on {a['sms']} SMs, {tiles:.1f} a SM; SM span mean {span / 1e6:.3f} M "
          f"cycles (min {lo:.3f}, max {hi:.3f}); {step:.0f} cycles a loop step")  # fmt: skip
    print(f"  {'phase':<28} {'cycles/SM':>12} {'% span':>8} {'cycles/tile':>12}")
    for k, v in a["phases_cycles_per_sm"].items():
        print(f"  {k:<28} {v:>12.0f} {100 * v / span:>7.1f}% {v / tiles:>12.0f}")
    for k, v in a["side_cycles_per_cta"].items():
        if v["mean_cycles"] is not None:
            print(f"  {k:<28} {'':>12} {'':>8} {v['mean_cycles']:>12.0f}  ({v['ctas']} CTAs)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--window", type=int, default=4096, help="the window case's left size; 0: causal only")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import flash_attn4
    from flash_attn4 import _C

    slots = _C.trace_slots()
    b, h, d, s = args.batch, args.heads, args.hdim, args.seqlen
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    max_ctas = 4 * ((s + 63) // 64) * h * b
    cases = {"causal": dict(causal=True)}
    if args.window > 0:
        cases[f"window {args.window}"] = dict(causal=True, window_size=(args.window, 0))
    results = {}
    for name, kw in cases.items():
        rows = run_traced(lambda kw=kw: flash_attn4.attn(q, k, v, **kw), slots, max_ctas)
        results[f"fwd {name}"] = analyse(rows, FWD_PHASES, FWD_SIDE, FWD_END)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = flash_attn4.attn(*leaves, **kw)
        dout = torch.randn_like(out)
        grad = lambda o=out, x=leaves, g=dout: torch.autograd.grad(o, x, g, retain_graph=True)  # noqa: E731
        rows = run_traced(grad, slots, max_ctas)
        results[f"bwd {name}"] = analyse(rows, BWD_PHASES, BWD_SIDE, BWD_END)
    for name, a in results.items():
        show(name, a)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
