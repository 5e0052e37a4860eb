#!/usr/bin/env python3
"""Decode from a KV cache: flash_attn4 (contiguous and paged caches, and an e4m3 cache where its kernels are
built) beside cuDNN SDPA and FlashAttention-4 (when importable), alternating implementations, several rounds;
TB/s = bytes of K and V read once / time (an e4m3 cache's bytes for it).

Writes benchmarks/results/<gpu>_decode.json (schema: shared records + seqlen_q, seqlen_k, nheads_q, nheads_kv,
page_size, us, tbps) unless --no-save.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "benchmarks"))
from results_file import clock_range, default_path, sm_clock_mhz, write_results  # noqa: E402

import flash_attn4  # noqa: E402

ROWS = [  # batch, cache length, hq, hk, hdim
    (1, 131072, 32, 8, 128),
    (16, 8192, 32, 8, 128),
    (16, 65536, 32, 8, 128),
    (128, 8192, 32, 8, 128),
    (16, 8192, 32, 8, 64),
    (16, 8192, 32, 8, 256),
]


def time_us(fn, warmup=3, calls=20, samples=5) -> float:
    """Median over `samples` of the mean time of `calls` back-to-back calls: the host work of one call
    overlaps the GPU work of the previous one, as in a decoding loop."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(samples):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def host_us(fn, calls=100, samples=7) -> float:
    """Host time of one call: the CPU time to issue `calls` calls back to back (small enough that the launch
    queue never fills, so the GPU never throttles the loop), median over `samples`."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) * 1e6 / calls)
        torch.cuda.synchronize()
    return statistics.median(times)


def impls(b, sk, hq, hk, d, pages):
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(b, 1, hq, d, device=dev, dtype=dt)
    k = torch.randn(b, sk, hk, d, device=dev, dtype=dt)
    v = torch.randn_like(k)
    lens = torch.full((b,), sk, dtype=torch.int32, device=dev)
    out = {"flash_attn4": lambda: flash_attn4.attn_with_kvcache(q, k, v, cache_seqlens=lens)}
    paged = {}
    for ps in pages:
        npg = b * sk // ps
        kp = k.view(npg, ps, hk, d)
        vp = v.view(npg, ps, hk, d)
        pt = torch.randperm(npg, device=dev, dtype=torch.int32).view(b, sk // ps)
        kp2, vp2 = kp.clone(), vp.clone()
        kp2[pt.flatten().long()] = kp.clone()  # page pt[b, j] holds token block j of sequence b
        vp2[pt.flatten().long()] = vp.clone()
        paged[ps] = (kp2, vp2, pt)
        out[f"flash_attn4_paged{ps}"] = lambda kp2=kp2, vp2=vp2, pt=pt: flash_attn4.attn_with_kvcache(
            q, kp2, vp2, cache_seqlens=lens, page_table=pt
        )
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

    def fa2():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

    out["sdpa_cudnn"] = cudnn
    out["sdpa_flash"] = fa2
    if d in flash_attn4._build_info.DECODE_KV8_HDIMS:  # an e4m3 cache of the same values, per-head scales
        (k8, kd), (v8, vd) = flash_attn4.quantize_fp8(k), flash_attn4.quantize_fp8(v)
        out["flash_attn4_kv8"] = lambda: flash_attn4.attn_with_kvcache(
            q, k8, v8, cache_seqlens=lens, k_descale=kd, v_descale=vd
        )
    # HF's DynamicCache decoding: `attn` with one query token over the whole (contiguous) cache.
    out["flash_attn4_attn"] = lambda: flash_attn4.attn(q, k, v, causal=True)
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func  # FlashAttention-4
    except Exception:
        return out
    out["fa4_cute"] = lambda: flash_attn_func(q, k, v, causal=True, num_splits=0)
    for ps in pages:
        kp2, vp2, pt = paged[ps]
        out[f"fa4_cute_paged{ps}"] = lambda kp2=kp2, vp2=vp2, pt=pt: flash_attn_varlen_func(
            q,
            kp2,
            vp2,
            seqused_k=lens,
            page_table=pt,
            max_seqlen_q=1,
            max_seqlen_k=sk,
            causal=True,
            num_splits=0,
        )
    return out


def record(name, b, sk, hq, hk, d, **fields):
    ps = int(name.split("paged")[1]) if "paged" in name else 0
    impl = name.split("_paged")[0]
    return dict(impl=impl, hdim=d, seqlen=sk, causal=True, batch=b, nheads=hq, dtype="bf16",
                kv_dtype="e4m3" if impl.endswith("kv8") else "bf16",
                seqlen_q=1, seqlen_k=sk, nheads_q=hq, nheads_kv=hk, page_size=ps, **fields)  # fmt: skip


def bandwidth_rows(args, pages, clocks):
    records = []
    for b, sk, hq, hk, d in ROWS:
        if d not in flash_attn4._build_info.HDIMS:
            print(f"b{b:4d} sk{sk:7d} d{d:3d}: skipped (head dim {d} not built: FLASH_ATTN4_HDIMS)")
            continue
        fns = impls(b, sk, hq, hk, d, pages if d == 128 else [])
        fns.pop("flash_attn4_attn")  # the same kernel as flash_attn4; its host cost is timed separately
        samples = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                try:
                    samples[name].append(time_us(fn))
                except Exception as e:  # an implementation that cannot run this row
                    print(f"  {name}: {type(e).__name__}: {str(e)[:120]}")
                    samples[name] = None
                    break
                clocks.append(sm_clock_mhz())
            fns = {n: f for n, f in fns.items() if samples[n] is not None}
        nbytes = 2 * b * sk * hk * d * 2
        line = f"b{b:4d} sk{sk:7d} d{d:3d}:"
        for name, ts in samples.items():
            if ts:
                us = min(ts)
                nb = nbytes // 2 if name.endswith("kv8") else nbytes  # an e4m3 cache is half the bytes
                records.append(record(name, b, sk, hq, hk, d, us=us, us_rounds=ts, tbps=nb / us / 1e6))
                line += f"  {name} {nb / us / 1e6:.2f} TB/s ({us:.1f} us)"
        print(line, flush=True)
        del fns
        torch.cuda.empty_cache()
    return records


def host_rows(args):
    """Host time per call of a small decode step (b1, 4096 keys), under no_grad as in HF generate."""
    b, sk, hq, hk, d = 1, 4096, 32, 8, 128
    records = []
    with torch.no_grad():
        fns = impls(b, sk, hq, hk, d, [16])
        samples = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                try:
                    samples[name].append(host_us(fn))
                except Exception:
                    samples[name] = None
            fns = {n: f for n, f in fns.items() if samples[n] is not None}
    line = "host us per call (b1 sk4096):"
    for name, ts in samples.items():
        if ts:
            records.append(record(name, b, sk, hq, hk, d, host_us=min(ts), host_us_rounds=ts))
            line += f"  {name} {min(ts):.1f}"
    print(line, flush=True)
    return records


def label(r) -> str:
    return r["impl"] + (f" paged{r['page_size']}" if r["page_size"] else "")


def table(records) -> str:
    """Markdown table of the bandwidth records: one row per shape, one column per implementation."""
    rows = [r for r in records if "tbps" in r]
    cols = list(dict.fromkeys(label(r) for r in rows))
    shapes = list(dict.fromkeys((r["batch"], r["seqlen_k"], r["hdim"]) for r in rows))
    tb = {(label(r), r["batch"], r["seqlen_k"], r["hdim"]): r["tbps"] for r in rows}
    out = ["| batch | keys | hdim | " + " | ".join(cols) + " |", "|---:|---:|---:|" + "---:|" * len(cols)]
    for b, sk, d in shapes:
        cells = [f"{tb[(c, b, sk, d)]:.2f}" if (c, b, sk, d) in tb else "-" for c in cols]
        out.append(f"| {b} | {sk} | {d} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(records, path: Path) -> None:
    """Grouped bars of TB/s per shape and implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in records if "tbps" in r]
    cols = list(dict.fromkeys(label(r) for r in rows))
    shapes = list(dict.fromkeys((r["batch"], r["seqlen_k"], r["hdim"]) for r in rows))
    tb = {(label(r), r["batch"], r["seqlen_k"], r["hdim"]): r["tbps"] for r in rows}
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(cols)
    for i, c in enumerate(cols):
        xs = [j + i * width for j, s in enumerate(shapes) if (c, *s) in tb]
        ax.bar(xs, [tb[(c, *s)] for s in shapes if (c, *s) in tb], width, label=c)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
    ax.set_xticklabels([f"b{b} x {sk // 1024}k\nd{d}" for b, sk, d in shapes])
    ax.set_ylabel("TB/s of K + V read")
    meta = records[0]
    ax.set_title(f"Decode, one query token, GQA {meta['nheads_q']}/{meta['nheads_kv']}, bf16 ({meta['gpu']})")
    ax.legend(fontsize=7, ncol=4, loc="lower center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pages", default="16,64", help="page sizes of the paged rows (head dim 128)")
    ap.add_argument("--out", type=Path, help="result file (default benchmarks/results/<gpu>_decode.json)")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument(
        "--table", metavar="JSON", help="print the table of a result file and redraw its plot; no runs"
    )
    args = ap.parse_args()
    if args.table:
        records = json.loads(Path(args.table).read_text())
        print(table(records))
        plot(records, Path(args.table).with_suffix(".png"))
        return
    pages = [int(p) for p in args.pages.split(",") if p]
    clocks = []
    records = host_rows(args) + bandwidth_rows(args, pages, clocks)
    print(f"SM clock seen: {clock_range(clocks)} MHz")
    print(table(records))
    if not args.no_save:
        path = write_results(records, args.out or default_path("decode"), clocks)
        plot(records, path.with_suffix(".png"))
        print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
