#!/usr/bin/env python3
"""How approximate `estimate_block_mask` is: for Gaussian q / k / v and for inputs with a planted block
pattern (each query block aligned with one key block), the density it keeps, the exact attention mass
inside its blocks, and the relative RMSE of attn(..., block_mask=estimate) against dense attention.

    python3 tools/sparse_error.py              # 4096 tokens, 4 heads, head dim 64, on the CPU (a minute)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flash_attn4  # noqa: E402

BLK = 128


def planted(s, h, d, gen):
    nb = s // BLK
    perm = torch.randperm(nb, generator=gen)
    u = 3 * torch.randn(nb, d, generator=gen)
    q = 0.3 * torch.randn(1, s, h, d, generator=gen)
    k = 0.3 * torch.randn(1, s, h, d, generator=gen)
    for i in range(nb):
        q[:, i * BLK : (i + 1) * BLK] += u[i]
        k[:, perm[i] * BLK : (perm[i] + 1) * BLK] += u[i]
    return q, k


def row(name, q, k, v, causal, **kw):
    mask = flash_attn4.estimate_block_mask(q, k, causal=causal, **kw)
    partial, full = mask.to_dense()
    kept = partial | full
    some, _ = flash_attn4.sparsity.block_visibility(q.shape[1], k.shape[1], BLK, causal, (-1, -1), q.device)
    density = (kept.float().sum() / (some.float().sum() * kept.shape[0] * kept.shape[1])).item()
    dense, lse = flash_attn4.attn(q, k, v, causal=causal, return_lse=True)
    sparse, lse_s = flash_attn4.attn(q, k, v, causal=causal, block_mask=mask, return_lse=True)
    mass = torch.exp(lse_s - lse).mean().item()  # the kept keys' share of each row's softmax denominator
    rmse = ((sparse - dense).norm() / dense.norm()).item()
    opts = ", ".join(f"{k}={v}" for k, v in kw.items())
    print(
        f"| {name} | {'yes' if causal else 'no'} | {opts} | {density:.3f} | {mass:.4f} | {rmse:.4f} |",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--hdim", type=int, default=64)
    args = ap.parse_args()
    s, h, d = args.seqlen, args.heads, args.hdim
    gen = torch.Generator().manual_seed(0)
    print(f"seqlen {s}, {h} heads, head dim {d}, {BLK}-token blocks; mass = kept share of the softmax sum\n")
    print("| inputs | causal | estimator | density | mass kept | rel. RMSE of out |")
    print("|---|:-:|---|---:|---:|---:|")
    gauss = [torch.randn(1, s, h, d, generator=gen) for _ in range(3)]
    pq, pk = planted(s, h, d, gen)
    for causal in (False, True):
        for kw in (dict(threshold=0.9), dict(threshold=0.99), dict(density=0.25)):
            row("Gaussian", *gauss, causal, **kw)
        for kw in (dict(threshold=0.9), dict(density=0.1)):
            row("planted", pq, pk, gauss[2], causal, **kw)


if __name__ == "__main__":
    main()
