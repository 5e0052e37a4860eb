#!/usr/bin/env python3
"""What fp8 (e4m3) inputs cost in accuracy: attention of the dequantized q, k, v against attention of the
originals (fp64), on Gaussian inputs and on inputs with outlier channels (q and k get three channels 20x /
50x / 100x larger, as LLM activations have). Rows: per-tensor, per-head and per-block (128 tokens) scales,
with and without the Hadamard rotation of q and k; bf16 inputs for comparison. Prints a markdown table of
cosine similarity and relative RMSE of the output. --kernel adds the fp8 kernel's own rows (sm90: per-tensor
and per-head scales, P rounded to e4m3 for P V, two-level accumulation), the error a user sees.

    python3 tools/fp8_error.py                 # seqlen 2048, 4 heads, head dim 128, causal, on the CPU
    python3 tools/fp8_error.py --seqlen 32768 --heads 2 --device cuda --kernel
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flash_attn4  # noqa: E402
from flash_attn4 import fp8, reference  # noqa: E402


def inputs(seqlen, heads, d, outliers, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (
        torch.randn(1, seqlen, heads, d, generator=g, device=device, dtype=torch.float64) for _ in range(3)
    )
    if outliers:
        boost = torch.ones(d, dtype=torch.float64, device=device)
        boost[:3] = torch.tensor([20.0, 50.0, 100.0])
        q, k = q * boost / 10, k * boost / 10  # keep the scores' spread moderate
    return q, k, v


def attention(q, k, v, causal):
    return reference.attention_ref(q, k, v, causal=causal)[0].double()


def kernel(q, k, v, granularity, causal):
    """The fp8 kernel's output for fp64 q, k, v quantized per tensor (the scale broadcast to every head) or
    per head."""
    quant = []
    for t in (q, k, v):
        t8, descale = flash_attn4.quantize_fp8(t.float(), granularity=granularity)
        quant += [t8, descale.expand(t.shape[0], t.shape[2]).contiguous()]
    q8, qd, k8, kd, v8, vd = quant
    out = flash_attn4.attn(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=causal)
    return out.double()


def metrics(out, truth):
    cos = torch.nn.functional.cosine_similarity(out.flatten(), truth.flatten(), dim=0).item()
    rmse = ((out - truth).norm() / truth.norm()).item()
    return cos, rmse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-causal", action="store_true")
    ap.add_argument("--kernel", action="store_true", help="add the fp8 kernel's rows (needs --device cuda)")
    args = ap.parse_args()
    causal = not args.no_causal
    print(f"seqlen {args.seqlen}, {args.heads} heads, head dim {args.hdim}, causal {causal}; out vs fp64\n")
    print("| inputs | q, k, v as | cosine | rel. RMSE |")
    print("|---|---|---:|---:|")
    for outliers in (False, True):
        q, k, v = inputs(args.seqlen, args.heads, args.hdim, outliers, args.device)
        truth = attention(q, k, v, causal)
        name = "outlier channels" if outliers else "Gaussian"
        bf16 = [t.to(torch.bfloat16).double() for t in (q, k, v)]
        rows = [("bf16", attention(*bf16, causal))]
        for gran in ("tensor", "head", "block"):
            for rotate in (False, True):
                qq, kk = flash_attn4.hadamard_rotate(q, k) if rotate else (q, k)
                deq = [fp8.dequantize_fp8(*flash_attn4.quantize_fp8(t, granularity=gran)).double()
                       for t in (qq, kk, v)]  # fmt: skip
                label = f"e4m3, per {gran}" + (", Hadamard q/k" if rotate else "")
                rows.append((label, attention(*deq, causal)))
                if args.kernel and gran != "block":
                    rows.append((f"{label}, kernel", kernel(qq, kk, v, gran, causal)))
        for label, out in rows:
            cos, rmse = metrics(out, truth)
            print(f"| {name} | {label} | {cos:.6f} | {rmse:.4f} |", flush=True)


if __name__ == "__main__":
    main()
