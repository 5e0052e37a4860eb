"""Sliding-window and variable-length benchmarks: flash_attn4 beside FlashAttention-4 (`fa4_cute`, when
`flash_attn.cute` imports; torch SDPA has neither windows nor packed batches).

    python3 benchmarks/bench_varlen.py        # writes benchmarks/results/<gpu>_varlen.json and .png
    python3 benchmarks/bench_varlen.py --impls flash_attn4 --window-only --direction bwd   # an A/B run

Rows, bf16, hdim 128, 16 heads (nheads * hdim = 2048 as in bench_fwd.py):
  * window: seqlen 32768, batch 1, causal full vs causal with a 4096-key left window, forward and backward
    times and the speedup of the window;
  * varlen: sequence lengths drawn uniformly from 64..8192 (seeded) up to 65536 tokens, packed into one
    attn_varlen call, against an equal-length batch (seqlen 4096) of the same total tokens; TFLOP/s from
    the FLOPs each call really does (sum over sequences of 4 * h * len^2 * d, halved when causal; backward
    2.5x), causal and not.
Times: do_bench medians (bench_fwd.bench_ms). Backward: autograd.grad on a graph recorded once. Every case
of every implementation takes --rounds turns in alternating order and keeps the median of its round medians;
compare implementations within one file (the SM clock seen is recorded).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_fwd import _import_flash_attn4, alternate, available_impls
from results_file import default_path, write_results

try:
    from tqdm import tqdm
except ImportError:  # progress bars are a nicety

    def tqdm(x, **_):
        return x


H, D = 16, 128


def _grad_fn(fn, q, k, v):
    """The timed backward call: autograd.grad on a graph recorded once (retain_graph)."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out = out[0] if isinstance(out, tuple) else out  # flash_attn.cute returns (out, lse)
    dout = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)


def _median(x):
    """The median of a list of round times; an error message (or None) as it is."""
    return statistics.median(x) if isinstance(x, list) else x


def _attn(impl: str):
    """attn(q, k, v, causal, window) and attn_varlen(q, k, v, cu, max_len, causal) of one implementation."""
    if impl == "fa4_cute":
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

        def dense(q, k, v, causal, window=None):
            return flash_attn_func(
                q, k, v, causal=causal, window_size=(window, 0) if window else (None, None)
            )

        def packed(q, k, v, cu, max_len, causal):
            return flash_attn_varlen_func(
                q,
                k,
                v,
                cu_seqlens_q=cu,
                cu_seqlens_k=cu,
                max_seqlen_q=max_len,
                max_seqlen_k=max_len,
                causal=causal,
            )

        return dense, packed
    import flash_attn4

    def dense(q, k, v, causal, window=None):
        return flash_attn4.attn(q, k, v, causal=causal, **({"window_size": (window, 0)} if window else {}))

    def packed(q, k, v, cu, max_len, causal):
        return flash_attn4.attn_varlen(q, k, v, cu, cu, max_len, max_len, causal=causal)

    return dense, packed


def window_rows(args, clocks: list) -> list[dict]:
    s = args.window_seqlen
    q, k, v = (torch.randn(1, s, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    windows = {"full": None, "window": args.window}
    if not args.no_probe:
        # The window kernel over (almost) the whole causal triangle: its per-block cost against the causal
        # kernel's, which separates kernel efficiency from the per-tile overheads of short rows (ours only).
        windows["probe"] = s - 2
    rows = []
    for bwd in {"fwd": (False,), "bwd": (True,), "both": (False, True)}[args.direction]:
        direction = "bwd" if bwd else "fwd"
        fns, errors = {}, {}
        for impl in args.impls:
            dense = _attn(impl)[0]
            for case, w in windows.items():
                if case == "probe" and impl != "flash_attn4":
                    continue
                call = lambda a, b, c, w=w, dense=dense: dense(a, b, c, True, w)  # noqa: E731
                try:
                    fn = _grad_fn(call, q, k, v) if bwd else (lambda call=call: call(q, k, v))
                    fns[(impl, case)] = fn, contextlib.nullcontext
                except Exception as e:  # recorded in the row; the other impls go on
                    errors[(impl, case)] = f"{type(e).__name__}: {e}"[:300]
        ms, failed = alternate(fns, args.rounds, args.warmup, args.window_rep, clocks)
        ms |= failed | errors
        for impl in args.impls:
            full, win, probe = (_median(ms.get((impl, case))) for case in ("full", "window", "probe"))
            row = {
                "impl": impl,
                "kind": "window",
                "direction": direction,
                "hdim": D,
                "nheads": H,
                "seqlen": s,
                "causal": True,
                "window_left": args.window,
                "rounds": args.rounds,
            }
            bad = [x for x in (full, win) if isinstance(x, str)]
            if bad:
                rows.append(dict(row, error=bad[0]))
                print(f"window {direction} {impl}: {bad[0]}", flush=True)
                continue
            fr, wr = ms[(impl, "full")], ms[(impl, "window")]
            rows.append(
                dict(
                    row,
                    full_causal_ms=full,
                    window_ms=win,
                    speedup=full / win,
                    speedup_per_round=[f / w for f, w in zip(fr, wr)],
                    **({"window_kernel_full_causal_ms": probe} if isinstance(probe, float) else {}),
                )
            )
            print(
                f"window {direction} {impl}: causal {full:.3f} ms, window {args.window}: {win:.3f} ms, "
                f"{full / win:.2f}x",
                flush=True,
            )
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


def varlen_rows(args, clocks: list) -> list[dict]:
    lens = _lengths(args.tokens, 64, 8192, args.seed)
    total = sum(lens)
    cu = F.pad(torch.tensor(lens, device="cuda").cumsum(0), (1, 0)).to(torch.int32)
    q, k, v = (torch.randn(total, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    eq_len = args.equal_seqlen
    qe, ke, ve = (t.view(total // eq_len, eq_len, H, D) for t in (q, k, v))
    rows = []
    combos = [(c, b) for c in (False, True) for b in (False, True)]
    for causal, bwd in tqdm(combos, desc="varlen", unit="case"):
        direction, key = ("bwd", "bwd_tflops") if bwd else ("fwd", "fwd_tflops")
        mult = (0.5 if causal else 1.0) * (2.5 if bwd else 1.0)
        flops = {
            "varlen": mult * sum(4 * H * n * n * D for n in lens),
            "equal": mult * (total // eq_len) * 4 * H * eq_len * eq_len * D,
        }
        fns, errors = {}, {}
        for impl in args.impls:
            dense, packed = _attn(impl)
            calls = {
                "varlen": (lambda a, b, c, p=packed, m=causal: p(a, b, c, cu, max(lens), m), (q, k, v)),
                "equal": (lambda a, b, c, d=dense, m=causal: d(a, b, c, m), (qe, ke, ve)),
            }
            for case, (call, qkv) in calls.items():
                try:
                    fn = _grad_fn(call, *qkv) if bwd else (lambda call=call, qkv=qkv: call(*qkv))
                    fns[(impl, case)] = fn, contextlib.nullcontext
                except Exception as e:  # recorded in the row; the other impls go on
                    errors[(impl, case)] = f"{type(e).__name__}: {e}"[:300]
        ms, failed = alternate(fns, args.rounds, args.warmup, args.rep, clocks)
        ms |= failed | errors
        for impl in args.impls:
            t_var, t_eq = _median(ms[(impl, "varlen")]), _median(ms[(impl, "equal")])
            row = {
                "impl": impl,
                "kind": "varlen",
                "direction": direction,
                "hdim": D,
                "nheads": H,
                "causal": causal,
                "tokens": total,
                "num_seqs": len(lens),
                "min_len": min(lens),
                "max_len": max(lens),
                "equal_seqlen": eq_len,
                "rounds": args.rounds,
            }
            if isinstance(t_var, str):
                rows.append(dict(row, error=t_var))
                print(f"varlen {direction} causal={causal} {impl}: {t_var}", flush=True)
                continue
            tf_var = flops["varlen"] / t_var * 1e-9
            tf_eq = flops["equal"] / t_eq * 1e-9 if isinstance(t_eq, float) else None
            rows.append(
                dict(
                    row,
                    varlen_ms=t_var,
                    equal_ms=t_eq if tf_eq else None,
                    **{key: tf_var},
                    **{"equal_" + key: tf_eq, "ratio": tf_var / tf_eq if tf_eq else None},
                )
            )
            print(
                f"varlen {direction} causal={causal} {impl}: {tf_var:.0f} TFLOP/s"
                + (f" vs equal-length {tf_eq:.0f} ({tf_var / tf_eq:.2f})" if tf_eq else ""),
                flush=True,
            )
    return rows


def plot(rows: list[dict], path: Path) -> None:
    """Two panels of grouped bars, one bar per implementation: the windowed causal call's time (fwd, bwd)
    and varlen TFLOP/s (the equal-length batch as a hatched bar beside it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    impls = list(dict.fromkeys(r["impl"] for r in ok))
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / max(1, len(impls))
    win = [r for r in ok if r["kind"] == "window"]
    if win:
        dirs = list(dict.fromkeys(r["direction"] for r in win))
        for i, impl in enumerate(impls):
            for j, d in enumerate(dirs):
                r = next((r for r in win if r["impl"] == impl and r["direction"] == d), None)
                if r:
                    x = j + (i - (len(impls) - 1) / 2) * width
                    a.bar(x, r["window_ms"], width, color=f"C{i}", label=impl if j == 0 else None)
                    a.text(
                        x,
                        r["window_ms"],
                        f"{r['window_ms']:.2f}\n({r['speedup']:.1f}x)",
                        ha="center",
                        va="bottom",
                        fontsize=7,
                    )
        a.set_ylim(top=a.get_ylim()[1] * 1.12)  # room for the labels above the tallest bar
        a.set_xticks(range(len(dirs)), dirs)
        a.set_ylabel("ms (lower is better); (x) = speedup over full causal")
        a.set_title(f"causal, window {win[0]['window_left']}, seqlen {win[0]['seqlen']}")
        a.legend(fontsize=8)
    var = [r for r in ok if r["kind"] == "varlen"]
    if var:
        cases = list(dict.fromkeys((r["direction"], r["causal"]) for r in var))
        for i, impl in enumerate(impls):
            for j, (d, c) in enumerate(cases):
                r = next(
                    (r for r in var if r["impl"] == impl and (r["direction"], r["causal"]) == (d, c)), None
                )
                if r:
                    key = f"{d}_tflops"
                    x = j + (i - (len(impls) - 1) / 2) * width
                    b.bar(x - width / 4, r[key], width / 2, color=f"C{i}", label=impl if j == 0 else None)
                    if r.get("equal_" + key):
                        b.bar(
                            x + width / 4,
                            r["equal_" + key],
                            width / 2,
                            color=f"C{i}",
                            alpha=0.45,
                            hatch="//",
                            label=f"{impl}, equal length {r['equal_seqlen']}" if j == 0 else None,
                        )
        b.set_xticks(range(len(cases)), [f"{d}{' causal' if c else ''}" for d, c in cases])
        b.set_ylabel("TFLOP/s")
        b.set_title(
            f"varlen: {var[0]['tokens']} tokens in {var[0]['num_seqs']} sequences, hdim {var[0]['hdim']}"
        )
        b.set_ylim(top=b.get_ylim()[1] * 1.3)  # room for the legend above the bars
        b.legend(fontsize=7, loc="upper center", ncol=2)
    fig.suptitle(f"{rows[0].get('gpu', 'GPU')}, bf16, {rows[0].get('nheads', H)} heads")
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
    ap.add_argument("--rounds", type=int, default=3, help="turns of every case (the order alternates)")
    ap.add_argument("--window-only", action="store_true", help="only the window rows (A/B runs)")
    ap.add_argument("--no-probe", action="store_true", help="skip the whole-triangle window row")
    ap.add_argument(
        "--direction",
        choices=("fwd", "bwd", "both"),
        default="both",
        help="window rows of one direction only (A/B runs of a forward- or backward-only change)",
    )
    ap.add_argument("--impls", default="flash_attn4,fa4_cute", help="comma list (fa4_cute: FlashAttention-4)")
    ap.add_argument("--out", type=Path, help="result file (default benchmarks/results/<gpu>_varlen.json)")
    ap.add_argument("--plot-only", type=Path, help="redraw the PNG of an existing JSON and exit")
    args = ap.parse_args(argv)
    if args.plot_only:
        plot(json.loads(args.plot_only.read_text()), args.plot_only.with_suffix(".png"))
        return 0
    if not torch.cuda.is_available():
        print("bench_varlen.py needs a CUDA device", file=sys.stderr)
        return 1
    _import_flash_attn4()
    args.impls = available_impls(args.impls.split(","))
    clocks = []
    rows = window_rows(args, clocks) + ([] if args.window_only else varlen_rows(args, clocks))
    out = write_results(rows, args.out or default_path("varlen"), clocks, dtype="bf16")
    print(f"results: {out}")
    if not args.window_only:
        plot(rows, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
