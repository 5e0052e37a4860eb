"""Sliding-window and variable-length benchmarks of flash_attn4 (issue: varlen, windows, softcap).

    python3 benchmarks/bench_varlen.py        # writes benchmarks/results/<gpu>_varlen.json

Rows, bf16, hdim 128, 16 heads (nheads * hdim = 2048 as in bench_fwd.py):
  * window: seqlen 32768, batch 1, causal full vs causal with a 4096-key left window, forward and backward
    times and the speedup of the window;
  * varlen: sequence lengths drawn uniformly from 64..8192 (seeded) up to 65536 tokens, packed into one
    attn_varlen call, against an equal-length batch (seqlen 4096) of the same total tokens; TFLOP/s from
    the FLOPs each call really does (sum over sequences of 4 * h * len^2 * d, halved when causal; backward
    2.5x), causal and not.
Times: do_bench medians (bench_fwd.bench_ms). Backward: autograd.grad on a graph recorded once. The window
cases take --rounds turns in alternating order and keep the median of their round medians.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_fwd import RESULTS, _import_flash_attn4, bench_ms, gpu_slug

try:
    from tqdm import tqdm
except ImportError:  # progress bars are a nicety

    def tqdm(x, **_):
        return x


H, D = 16, 128


def _timed(fn, q, k, v, bwd: bool, warmup: int, rep: int) -> float:
    if not bwd:
        return bench_ms(lambda: fn(q, k, v), warmup, rep)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    dout = torch.randn_like(out)
    return bench_ms(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True), warmup, rep)


def window_rows(args) -> list[dict]:
    import flash_attn4

    s = args.window_seqlen
    q, k, v = (torch.randn(1, s, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    cases = {
        "full": dict(causal=True),
        "window": dict(causal=True, window_size=(args.window, 0)),
        # The window kernel over (almost) the whole causal triangle: its per-block cost against the causal
        # kernel's, which separates kernel efficiency from the per-tile overheads of short rows.
        "probe": dict(causal=True, window_size=(s - 2, 0)),
    }
    if args.no_probe:
        del cases["probe"]
    rows = []
    for bwd in {"fwd": (False,), "bwd": (True,), "both": (False, True)}[args.direction]:
        # The cases take turns (order reversed every round) and each keeps its median over the rounds, so
        # that clock and temperature drift during the run do not favour whichever ran first.
        ms: dict[str, list[float]] = {name: [] for name in cases}
        for r in range(args.rounds):
            for name in list(cases)[:: 1 if r % 2 == 0 else -1]:
                kw = cases[name]
                ms[name].append(
                    _timed(lambda a, b, c, kw=kw: flash_attn4.attn(a, b, c, **kw), q, k, v, bwd, args.warmup,
                           args.window_rep)
                )  # fmt: skip
        full, win = (statistics.median(ms[name]) for name in ("full", "window"))
        probe = statistics.median(ms["probe"]) if "probe" in ms else None
        rows.append({
            "impl": "flash_attn4", "kind": "window", "direction": "bwd" if bwd else "fwd", "hdim": D,
            "nheads": H, "seqlen": s, "causal": True, "window_left": args.window, "full_causal_ms": full,
            "window_ms": win, "speedup": full / win, "window_kernel_full_causal_ms": probe,
            "rounds": args.rounds, "speedup_per_round": [f / w for f, w in zip(ms["full"], ms["window"])],
        })  # fmt: skip
        spread = ", ".join(f"{f / w:.2f}" for f, w in zip(ms["full"], ms["window"]))
        print(f"window {'bwd' if bwd else 'fwd'}: causal {full:.3f} ms, window {args.window}: {win:.3f} ms, "
              f"{full / win:.2f}x (rounds: {spread}"
              + (f"; window kernel, causal: {probe:.3f} ms)" if probe is not None else ")"),
              flush=True)  # fmt: skip
    return rows


def _lengths(total: int, lo: int, hi: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    lens = []
    while sum(lens) < total:
        lens.append(rng.randint(lo, hi))
    lens[-1] -= sum(lens) - total
    if lens[-1] < lo:  # fold a short tail into the previous sequence
        lens[-2] += lens.pop()
    return lens


def varlen_rows(args) -> list[dict]:
    import flash_attn4

    lens = _lengths(args.tokens, 64, 8192, args.seed)
    total = sum(lens)
    cu = F.pad(torch.tensor(lens, device="cuda").cumsum(0), (1, 0)).to(torch.int32)
    q, k, v = (torch.randn(total, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    eq_len = args.equal_seqlen
    qe, ke, ve = (t.view(total // eq_len, eq_len, H, D) for t in (q, k, v))
    rows = []
    combos = [(c, b) for c in (False, True) for b in (False, True)]
    for causal, bwd in tqdm(combos, desc="varlen", unit="case"):
        mult = (0.5 if causal else 1.0) * (2.5 if bwd else 1.0)
        flops_var = mult * sum(4 * H * n * n * D for n in lens)
        flops_eq = mult * (total // eq_len) * 4 * H * eq_len * eq_len * D

        def var(a, b, c, causal=causal):
            return flash_attn4.attn_varlen(a, b, c, cu, cu, max(lens), max(lens), causal=causal)

        def eq(a, b, c, causal=causal):
            return flash_attn4.attn(a, b, c, causal=causal)

        t_var = _timed(var, q, k, v, bwd, args.warmup, args.rep)
        t_eq = _timed(eq, qe, ke, ve, bwd, args.warmup, args.rep)
        tf_var, tf_eq = flops_var / t_var * 1e-9, flops_eq / t_eq * 1e-9
        key = "bwd_tflops" if bwd else "fwd_tflops"
        rows.append({
            "impl": "flash_attn4", "kind": "varlen", "direction": "bwd" if bwd else "fwd", "hdim": D,
            "nheads": H, "causal": causal, "tokens": total, "num_seqs": len(lens), "min_len": min(lens),
            "max_len": max(lens), "equal_seqlen": eq_len, "varlen_ms": t_var, "equal_ms": t_eq, key: tf_var,
            "equal_" + key: tf_eq, "ratio": tf_var / tf_eq,
        })  # fmt: skip
        print(f"varlen {'bwd' if bwd else 'fwd'} causal={causal}: {tf_var:.0f} TFLOP/s vs equal-length "
              f"{tf_eq:.0f} ({tf_var / tf_eq:.2f})", flush=True)  # fmt: skip
    return rows


def plot(rows: list[dict], path: Path) -> None:
    """Two panels: the window's speedup over causal (fwd, bwd, the block-level ideal) and varlen TFLOP/s
    against the equal-length batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    win = [r for r in rows if r["kind"] == "window"]
    var = [r for r in rows if r["kind"] == "varlen"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    if win:
        names = [r["direction"] for r in win]
        a.bar(names, [r["speedup"] for r in win], color="#3b7dd8")
        a.axhline(4.0, color="k", ls="--", lw=1, label="goal 4x")
        a.set_title(f"window {win[0]['window_left']} vs causal, seqlen {win[0]['seqlen']}")
        a.set_ylabel("speedup over full causal")
        for i, r in enumerate(win):
            a.text(i, r["speedup"], f"{r['speedup']:.2f}x", ha="center", va="bottom")
        a.legend()
    if var:
        labels = [f"{r['direction']}{' causal' if r['causal'] else ''}" for r in var]
        key = ["bwd_tflops" if r["direction"] == "bwd" else "fwd_tflops" for r in var]
        xs = range(len(var))
        a_vals = [r[k] for r, k in zip(var, key)]
        e_vals = [r["equal_" + k] for r, k in zip(var, key)]
        b.bar([x - 0.2 for x in xs], a_vals, 0.4, label=f"varlen ({var[0]['num_seqs']} seqs, 64..8192)")
        b.bar([x + 0.2 for x in xs], e_vals, 0.4, label=f"equal length {var[0]['equal_seqlen']}")
        b.set_xticks(list(xs), labels)
        b.set_ylabel("TFLOP/s")
        b.set_title(f"{var[0]['tokens']} tokens, hdim {var[0]['hdim']}, {var[0]['nheads']} heads")
        b.legend(loc="lower right")
    fig.suptitle(f"flash_attn4 on {rows[0].get('gpu', 'GPU')}, bf16")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window-seqlen", type=int, default=32768)
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--equal-seqlen", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=100, help="milliseconds of repetitions per varlen case")
    ap.add_argument("--window-rep", type=int, default=600, help="milliseconds of repetitions per window case")
    ap.add_argument("--rounds", type=int, default=3, help="turns of the window cases (order alternates)")
    ap.add_argument("--window-only", action="store_true", help="only the window rows (A/B runs)")
    ap.add_argument("--no-probe", action="store_true", help="skip the whole-triangle window row")
    ap.add_argument(
        "--direction",
        choices=("fwd", "bwd", "both"),
        default="both",
        help="window rows of one direction only (A/B runs of a forward- or backward-only change)",
    )
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot-only", type=Path, help="redraw the PNG of an existing JSON and exit")
    args = ap.parse_args(argv)
    if args.plot_only:
        plot(json.loads(args.plot_only.read_text()), args.plot_only.with_suffix(".png"))
        return 0
    if not torch.cuda.is_available():
        print("bench_varlen.py needs a CUDA device", file=sys.stderr)
        return 1
    _import_flash_attn4()
    rows = window_rows(args) + ([] if args.window_only else varlen_rows(args))
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": "bf16"}
    out = args.out or RESULTS / f"{gpu_slug(meta['gpu'])}_varlen.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = [{**r, **meta} for r in rows]
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"results: {out}")
    if not args.window_only:
        plot(rows, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
