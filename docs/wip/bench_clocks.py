"""SM clock and power while each case of the window benchmark runs (do_bench, rep 600 ms, as bench_varlen.py):
prints wall-clock intervals of each case, to be matched with nvidia-smi samples taken meanwhile. Session 16,
call 5.

    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active \
      --format=csv,noheader -lms 20 > smi.csv &
    python3 docs/wip/bench_clocks.py out.json; kill %1    # from the repository root, flash_attn4 built
"""

import json
import sys
import time

import torch

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


cases = {"causal": dict(causal=True), "window": dict(causal=True, window_size=(4096, 0))}
rows = []
for rnd in range(2):
    for direction in ("fwd", "bwd"):
        for name in ("causal", "window") if rnd == 0 else ("window", "causal"):
            kw = cases[name]
            fn = make_call(direction, kw)
            torch.cuda.synchronize()
            t0 = time.time()
            ms = bench_ms(fn, 100, 600)
            t1 = time.time()
            rows.append({"round": rnd, "direction": direction, "case": name, "ms": ms, "t0": t0, "t1": t1})
            print(json.dumps(rows[-1]), flush=True)
            time.sleep(0.3)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
