#!/usr/bin/env python3
"""Developer check of the raw kernel binding on a GPU: correctness of flash_attn4._C.fwd against an fp32
PyTorch reference on a few shapes, then a timing of a few shapes beside SDPA's cuDNN backend.

Independent of the Python package's dispatch so that a kernel bug shows up here undiluted.
Usage: python3 tools/kernel_check.py [--no-bench]
"""

from __future__ import annotations

import argparse
import math
import sys

import torch


def ref_attention(q, k, v, causal, scale):
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    kf = kf.repeat_interleave(hq // hk, dim=1)
    vf = vf.repeat_interleave(hq // hk, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    o = torch.matmul(p, vf).transpose(1, 2)
    return o, lse


def check(C, b, sq, sk, hq, hk, d, causal, dtype) -> bool:
    torch.manual_seed(sq * 7 + sk)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, hq, sq), float("nan"), device="cuda", dtype=torch.float32)
    scale = 1.0 / math.sqrt(d)
    C.fwd(q, k, v, out, lse, scale, causal)
    torch.cuda.synchronize()
    o_ref, lse_ref = ref_attention(q, k, v, causal, scale)
    o_lp, _ = ref_attention(q, k, v, causal, scale)
    o_lp = o_lp.to(dtype)
    err = (out.float() - o_ref).abs().max().item()
    err_lp = (o_lp.float() - o_ref).abs().max().item()
    fin = torch.isfinite(lse_ref)
    lse_ok = (
        bool(torch.equal(fin, torch.isfinite(lse)))
        and ((lse[fin] - lse_ref[fin]).abs().max().item() if fin.any() else 0.0) < 1e-3
    )
    ok = bool(torch.isfinite(out).all()) and err <= 2 * err_lp + 1e-3 and lse_ok
    print(
        f"{'ok  ' if ok else 'FAIL'} b={b} sq={sq} sk={sk} hq={hq} hk={hk} d={d} causal={causal} {dtype}: "
        f"max|out-ref|={err:.2e} (bf16-rounded ref {err_lp:.2e}) lse_ok={lse_ok}",
        flush=True,
    )
    return ok


def bench(C, d, seqlen, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    b, h = 16384 // seqlen, 2048 // d
    q, k, v = (torch.randn(b, seqlen, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(b, h, seqlen, device="cuda", dtype=torch.float32)
    scale = 1 / math.sqrt(d)
    ms = do_bench(lambda: C.fwd(q, k, v, out, lse, scale, causal), warmup=50, rep=200, return_mode="median")
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ms_cudnn = do_bench(
            lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal),
            warmup=50,
            rep=200,
            return_mode="median",
        )
    flops = 4 * b * h * seqlen * seqlen * d / (2 if causal else 1)
    print(
        f"bench d={d} s={seqlen} causal={causal}: ours {flops / ms / 1e9:.0f} TFLOP/s, "
        f"cudnn {flops / ms_cudnn / 1e9:.0f} TFLOP/s, ratio {ms_cudnn / ms:.3f}",
        flush=True,
    )


def load_extension(root=None):
    """Loads <root>/flash_attn4/_C*.so directly, bypassing the package's __init__ and dispatch."""
    import importlib.util
    from pathlib import Path

    root = Path(root or Path(__file__).resolve().parents[1]) / "flash_attn4"
    so = sorted(root.glob("_C*.so"))
    if not so:
        raise SystemExit(
            f"no flash_attn4/_C*.so under {root}: build first (python3 setup.py build_ext --inplace)"
        )
    spec = importlib.util.spec_from_file_location("flash_attn4._C", so[0])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--bench-only", action="store_true")
    ap.add_argument("--root", default=None, help="source tree whose flash_attn4/_C*.so to load")
    ap.add_argument("--seqlens", default="4096,8192")
    args = ap.parse_args()
    _C = load_extension(args.root)

    kernels = _C.compiled_kernels()
    hdims = sorted({int(n.split("hdim")[1].split("_")[0]) for n in kernels})
    print("compiled:", len(kernels), "kernels, hdims", hdims)
    ok = True
    for d in [] if args.bench_only else hdims:
        for causal in (False, True):
            for b, sq, sk, hq, hk in (
                (2, 128, 128, 4, 4),
                (1, 1, 1, 2, 1),
                (2, 113, 203, 6, 2),
                (1, 239, 17, 4, 1),
                (1, 1023, 1024, 4, 4),
                (3, 517, 4224, 2, 2),
            ):
                ok &= check(_C, b, sq, sk, hq, hk, d, causal, torch.bfloat16)
        if any(n.startswith("fwd_sm90_fp16") for n in kernels):
            ok &= check(_C, 2, 300, 300, 4, 2, d, True, torch.float16)
    if not args.no_bench:
        for d in [h for h in (64, 128, 256) if h in hdims]:
            for causal in (False, True):
                for s in map(int, args.seqlens.split(",")):
                    bench(_C, d, s, causal)
    print("ALL OK" if ok else "SOME FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
