"""Plot and tabulate benchmark records (benchmarks/results/*.json).

    python3 benchmarks/plot.py benchmarks/results/h200_fwd.json [--out plot.png] [--table-only]

A record is a dict with impl, hdim, seqlen, causal, batch, nheads, dtype, and fwd_ms/fwd_tflops (forward
runs) or bwd_ms/bwd_tflops (backward runs), and error when that impl failed on that shape. Records of one
file come from one run, so ratios are meaningful.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

OURS = "flash_attn4"
# Column order of the table and the plot legend; impls not listed here follow in name order.
IMPL_ORDER = ["flash_attn4", "flash_attn4_sm80", "fa4_cute", "sdpa_cudnn", "sdpa_flash", "sdpa_mem_eff"]


def _impls(records: list[dict]) -> list[str]:
    names = {r["impl"] for r in records}
    return [i for i in IMPL_ORDER if i in names] + sorted(names - set(IMPL_ORDER))


def metric(records: list[dict]) -> str:
    """'bwd' for backward records, else 'fwd'."""
    return "bwd" if any("bwd_tflops" in r for r in records) else "fwd"


def _tflops(records: list[dict]) -> dict[tuple, float]:
    """(impl, hdim, seqlen, causal) -> TFLOP/s of the records' metric, successful measurements only."""
    key = f"{metric(records)}_tflops"
    return {
        (r["impl"], r["hdim"], r["seqlen"], bool(r["causal"])): r[key]
        for r in records
        if r.get(key) is not None
    }


def format_table(records: list[dict]) -> str:
    """One row per (hdim, seqlen, causal): TFLOP/s per impl, then ours/fa4 (fa4_cute), ours/cudnn and ours/fa2
    (sdpa_flash)."""
    impls, tf = _impls(records), _tflops(records)
    shapes = sorted({(r["hdim"], r["seqlen"], bool(r["causal"])) for r in records})
    head = ["hdim", "seqlen", "causal", *impls, "ours/fa4", "ours/cudnn", "ours/fa2"]
    rows = []
    for h, s, c in shapes:
        vals = [tf.get((i, h, s, c)) for i in impls]
        ours = tf.get((OURS, h, s, c))

        def ratio(other: str, ours: float | None = ours, h: int = h, s: int = s, c: bool = c) -> str:
            base = tf.get((other, h, s, c))
            return f"{ours / base:.2f}" if ours and base else "-"

        cells = [f"{v:.0f}" if v is not None else "-" for v in vals]
        ratios = [ratio("fa4_cute"), ratio("sdpa_cudnn"), ratio("sdpa_flash")]
        rows.append([str(h), str(s), "yes" if c else "no", *cells, *ratios])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(x.rjust(w) for x, w in zip(line, widths)) for line in [head, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    flops = "4*b*h*s*s*d" if metric(records) == "fwd" else "2.5 * 4*b*h*s*s*d"
    return "\n".join(lines) + f"\n({metric(records)} TFLOP/s, {flops} FLOPs, halved when causal)"


def plot_records(records: list[dict], path: str | Path, title: str = "") -> Path:
    """One subplot per (hdim, causal): TFLOP/s against seqlen, one line per impl. Returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")  # headless: GPU boxes have no display
    import matplotlib.pyplot as plt

    impls, tf = _impls(records), _tflops(records)
    hdims = sorted({r["hdim"] for r in records})
    causals = sorted({bool(r["causal"]) for r in records})
    fig, axes = plt.subplots(
        len(hdims), len(causals), figsize=(5 * len(causals), 3.2 * len(hdims)), squeeze=False, sharey=True
    )
    for row, h in enumerate(hdims):
        for col, c in enumerate(causals):
            ax = axes[row][col]
            for n, impl in enumerate(impls):
                pts = sorted((s, v) for (i, hh, s, cc), v in tf.items() if i == impl and hh == h and cc == c)
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, marker="o", label=impl, color=f"C{n}")  # one color per impl everywhere
            ax.set_xscale("log", base=2)
            ax.set_title(f"hdim {h}, {'causal' if c else 'non-causal'}")
            ax.set_xlabel("seqlen")
            ax.set_ylabel(f"{metric(records)} TFLOP/s")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    # Shared y from 0 to the best result: set once, after plotting (an early set_ylim freezes autoscale).
    axes[0][0].set_ylim(0, 1.08 * max(tf.values(), default=1.0))
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", help="results file written by bench_fwd.py (forward or --bwd)")
    ap.add_argument("--out", help="PNG path (default: the JSON path with .png)")
    ap.add_argument("--table-only", action="store_true", help="print the table, do not plot")
    args = ap.parse_args()
    records = json.loads(Path(args.json).read_text())
    print(format_table(records))
    if not args.table_only:
        gpu = next((r.get("gpu") for r in records if r.get("gpu")), "")
        print(f"plot: {plot_records(records, args.out or Path(args.json).with_suffix('.png'), title=gpu)}")


if __name__ == "__main__":
    main()
