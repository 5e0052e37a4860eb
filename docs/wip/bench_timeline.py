"""Where a do_bench-style timing of one call goes (window 4096 vs causal, 32k x 16 heads, hdim 128, bf16,
forward and backward): per rep an L2 flush (256 MB zero_), a start event, the call, an end event, no sync
between reps (as triton.testing.do_bench). Under torch.profiler: each rep's kernels (between two flushes),
their span, the idle time between the flush and the rep's first kernel, against the event time of the same
rep, the GPU time from its last kernel to the end of the next rep's flush, and the CPU time a rep takes to
enqueue (a CPU slower than the GPU leaves the GPU idle between reps); the same loop without the profiler
first. Session 16, call 4 (docs/perf_notes.md; the CPU time and the gap to the next flush came after it).
With --clocks instead (call 5): each case under do_bench (rep 600 ms, as bench_varlen.py), printing its
wall-clock interval, to be matched with nvidia-smi samples of the SM clock and power taken meanwhile.

    python3 docs/wip/bench_timeline.py out.json     # from the repository root, flash_attn4 built
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active \
      --format=csv,noheader -lms 20 > smi.csv &
    python3 docs/wip/bench_timeline.py --clocks out.json; kill %1
"""

import json
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "benchmarks")
from bench_fwd import bench_ms  # noqa: E402

import flash_attn4  # noqa: E402

print("flash_attn4 from", flash_attn4.__file__)
S, H, D = 32768, 16, 128
torch.manual_seed(0)
q, k, v = (torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))


def make_call(direction, kw):
    """One forward, or one backward (autograd.grad on a graph recorded once), as bench_varlen.py."""
    if direction == "fwd":
        return lambda: flash_attn4.attn(q, k, v, **kw)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flash_attn4.attn(*leaves, **kw)
    dout = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)


def timeline(out_path):
    cache = torch.empty(int(256e6 // 4), dtype=torch.int32, device="cuda")
    res = {}
    med = statistics.median
    for direction in ("fwd", "bwd"):
        for name, kw in (("window", dict(causal=True, window_size=(4096, 0))), ("causal", dict(causal=True))):
            call = make_call(direction, kw)
            n = 40 if name == "window" else 12
            n = n * 3 if direction == "fwd" else n

            def loop(n, call=call):
                ev = [
                    (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                    for _ in range(n)
                ]
                cpu = []
                for a, b in ev:
                    t0 = time.perf_counter()
                    cache.zero_()
                    a.record()
                    call()
                    b.record()
                    cpu.append((time.perf_counter() - t0) * 1e6)
                torch.cuda.synchronize()
                return [a.elapsed_time(b) * 1000 for a, b in ev], cpu

            loop(5)
            plain, cpu_plain = loop(n)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                evs, cpu_prof = loop(n)
            kern = sorted(
                (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start,
            )
            reps, cur = [], None
            for e in kern:
                if "FillFunctor<int>" in e.name:
                    if cur:
                        reps.append(cur)
                    cur = {"flush_end": e.time_range.end, "k": []}
                elif cur is not None:
                    cur["k"].append(e)
            if cur:
                reps.append(cur)
            rows = []
            for i, r in enumerate(reps):
                ks = r["k"]
                # GPU time from the rep's last kernel to the next rep's flush: the end event sits there, and
                # a CPU slower than the GPU shows up as this gap.
                nxt = reps[i + 1]["flush_end"] if i + 1 < len(reps) else None
                rows.append(
                    {
                        "span": ks[-1].time_range.end - ks[0].time_range.start,
                        "sum": sum(x.time_range.elapsed_us() for x in ks),
                        "idle_after_flush": ks[0].time_range.start - r["flush_end"],
                        "to_next_flush_end": None if nxt is None else nxt - ks[-1].time_range.end,
                        "n": len(ks),
                    }
                )
            names = {}
            for r in reps:
                for x in r["k"]:
                    names.setdefault(x.name[:70], []).append(x.time_range.elapsed_us())
            out = {
                "event_us_profiled": med(evs),
                "event_us_plain": med(plain),
                "reps": len(rows),
                "kernels_per_rep": med(r["n"] for r in rows),
                "span_us": med(r["span"] for r in rows),
                "sum_us": med(r["sum"] for r in rows),
                "idle_after_flush_us": med(r["idle_after_flush"] for r in rows),
                # includes the next flush itself (~55 us for 256 MB)
                "last_kernel_to_next_flush_end_us": med(r["to_next_flush_end"] for r in rows[:-1]),
                "cpu_us_per_rep_plain": med(cpu_plain),
                "cpu_us_per_rep_profiled": med(cpu_prof),
                "kernels": {k2: med(v2) for k2, v2 in names.items()},
            }
            res[f"{direction} {name}"] = out
            print(direction, name, json.dumps(out, indent=1), flush=True)
    for d in ("fwd", "bwd"):
        c, w = res[f"{d} causal"], res[f"{d} window"]
        print(
            f"{d}: ratio events (plain) {c['event_us_plain'] / w['event_us_plain']:.3f}x, events (profiled) "
            f"{c['event_us_profiled'] / w['event_us_profiled']:.3f}x, "
            f"kernel spans {c['span_us'] / w['span_us']:.3f}x"
        )
    json.dump(res, open(out_path, "w"), indent=1)


def clocks(out_path):
    cases = {"causal": dict(causal=True), "window": dict(causal=True, window_size=(4096, 0))}
    rows = []
    for rnd in range(2):
        for direction in ("fwd", "bwd"):
            for name in ("causal", "window") if rnd == 0 else ("window", "causal"):
                fn = make_call(direction, cases[name])
                torch.cuda.synchronize()
                t0 = time.time()
                ms = bench_ms(fn, 100, 600)
                t1 = time.time()
                rows.append(
                    {"round": rnd, "direction": direction, "case": name, "ms": ms, "t0": t0, "t1": t1}
                )
                print(json.dumps(rows[-1]), flush=True)
                time.sleep(0.3)
    json.dump(rows, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "--clocks":
        clocks(sys.argv[2])
    else:
        timeline(sys.argv[1])
