#!/usr/bin/env python3
"""Developer check of the raw backward binding on a GPU: dq, dk, dv of flash_attn4._C.bwd against an fp32
reference on a few shapes (errors printed per gradient, so a wrong one is named), then backward timings
beside SDPA's cuDNN backend (the time of the gradient computation alone, FLOPs 2.5x the forward's).

Usage: python3 tools/bwd_check.py [--no-bench] [--bench-only] [--seqlens 4096,8192] [--deterministic]
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from kernel_check import load_extension, ref_attention


def grads_ref(q, k, v, dout, causal, scale, dtype=torch.float32):
    qa, ka, va = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out, _ = ref_attention(qa, ka, va, causal, scale)
    out = out.to(dtype)
    return torch.autograd.grad(out, (qa, ka, va), dout.to(dtype))


def run_bwd(C, q, k, v, dout, causal, scale, det):
    b, sq, hq, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(b, hq, sq, device="cuda", dtype=torch.float32)
    C.fwd(q, k, v, out, lse, scale, causal)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    args = (dout, q, k, v, out, lse, dq, dk, dv, scale, causal)
    C.bwd(*args, det) if det is not None else C.bwd(*args)
    torch.cuda.synchronize()
    return dq, dk, dv


def check(C, b, sq, sk, hq, hk, d, causal, dtype, det) -> bool:
    torch.manual_seed(sq * 7 + sk)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
    dout = torch.randn_like(q)
    scale = 1.0 / math.sqrt(d)
    ours = run_bwd(C, q, k, v, dout, causal, scale, det)
    truth = grads_ref(q, k, v, dout, causal, scale)
    lp = grads_ref(q, k, v, dout, causal, scale, dtype)
    ok, parts = True, []
    for name, g, t, g_lp in zip(("dq", "dk", "dv"), ours, truth, lp):
        err = (g.float() - t).abs().max().item()
        err_lp = (g_lp.float() - t).abs().max().item()
        floor = (t.to(dtype).float() - t).abs().max().item() + 1e-4
        good = bool(torch.isfinite(g).all()) and err <= 2 * err_lp + floor
        ok &= good
        nan = int(g.isnan().sum())
        if not good and g.numel():
            e = (g.float() - t).abs().nan_to_num(float("inf"))
            bad = e > 2 * err_lp + floor
            idx = [int(i) for i in torch.nonzero(bad)[0]]
            rows = torch.nonzero(bad.any(-1).any(-1))  # (batch, seq) pairs with a bad element
            parts.append(
                f"[{name}: {int(bad.sum())} bad of {g.numel()}, first at {idx}, "
                f"bad seq rows {rows[:, 1].unique()[:12].tolist()}...]"
            )
        parts.append(f"{name} {err:.2e}/{err_lp:.2e}{'' if good else ' BAD'}{f' nan={nan}' if nan else ''}")
    print(
        f"{'ok  ' if ok else 'FAIL'} b={b} sq={sq} sk={sk} hq={hq} hk={hk} d={d} causal={causal} "
        f"{str(dtype)[6:]}: " + ", ".join(parts),
        flush=True,
    )
    return ok


def bench(C, d, seqlen, causal, det):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    b, h = 16384 // seqlen, 2048 // d
    q, k, v, dout = (torch.randn(b, seqlen, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = 1 / math.sqrt(d)
    out = torch.empty_like(q)
    lse = torch.empty(b, h, seqlen, device="cuda", dtype=torch.float32)
    C.fwd(q, k, v, out, lse, scale, causal)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    args = (dout, q, k, v, out, lse, dq, dk, dv, scale, causal)
    ms = do_bench(lambda: C.bwd(*args, det) if det is not None else C.bwd(*args), warmup=30, rep=200)
    qt, kt, vt = (t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    dot = dout.transpose(1, 2).contiguous()
    res = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION)):
        with sdpa_kernel(backend):
            o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            res[name] = do_bench(
                lambda o=o: torch.autograd.grad(o, (qt, kt, vt), dot, retain_graph=True), warmup=30, rep=200
            )
    flops = 2.5 * 4 * b * h * seqlen * seqlen * d / (2 if causal else 1)
    print(
        f"bwd d={d} s={seqlen} causal={causal}: ours {flops / ms / 1e9:.0f} TFLOP/s ({ms:.3f} ms), "
        f"cudnn {flops / res['cudnn'] / 1e9:.0f}, fa2 {flops / res['fa2'] / 1e9:.0f}, "
        f"ratio vs cudnn {res['cudnn'] / ms:.3f}",
        flush=True,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--bench-only", action="store_true")
    ap.add_argument("--root", default=None, help="source tree whose flash_attn4/_C*.so to load")
    ap.add_argument("--seqlens", default="1024,4096,8192")
    ap.add_argument("--small", action="store_true", help="two small shapes at the smallest and largest hdim")
    ap.add_argument("--deterministic", action="store_true", help="pass deterministic=True to the binding")
    args = ap.parse_args()
    C = load_extension(args.root)
    det = True if args.deterministic else None
    kernels = [n for n in C.compiled_kernels() if n.startswith("bwd")]
    hdims = sorted({int(n.split("hdim")[1].split("_")[0]) for n in kernels})
    print("compiled backward:", len(kernels), "kernels, hdims", hdims, flush=True)
    ok = True
    if det:
        for d in hdims:
            for causal in (False, True):
                torch.manual_seed(0)
                q, k, v, dout = (
                    torch.randn(2, 1000, 4, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)
                )
                k, v = k[:, :, :2].contiguous(), v[:, :, :2].contiguous()
                runs = [run_bwd(C, q, k, v, dout, causal, d**-0.5, det) for _ in range(10)]
                same = all(torch.equal(a, b) for r in runs[1:] for a, b in zip(r, runs[0]))
                print(
                    f"{'ok  ' if same else 'FAIL'} deterministic d={d} causal={causal}: "
                    f"10 runs bitwise equal={same}"
                )
                ok &= same
    if args.small:
        # The smallest and the largest head dim built: the narrow and (above 128) the wide backward kernel.
        for d in sorted({hdims[0], hdims[-1]}):
            ok &= check(C, 1, 128, 128, 1, 1, d, False, torch.bfloat16, det)
            ok &= check(C, 2, 113, 203, 4, 2, d, True, torch.bfloat16, det)
        return 0 if ok else 1
    for d in [] if args.bench_only else hdims:
        for causal in (False, True):
            for b, sq, sk, hq, hk in (
                (1, 128, 128, 1, 1),
                (2, 128, 128, 4, 4),
                (1, 1, 1, 2, 1),
                (2, 113, 203, 6, 2),
                (1, 239, 17, 4, 1),
                (1, 1023, 1024, 4, 4),
                (2, 517, 1100, 4, 2),
            ):
                ok &= check(C, b, sq, sk, hq, hk, d, causal, torch.bfloat16, det)
        if any(n.startswith("bwd_sm90_fp16") for n in kernels):
            ok &= check(C, 2, 300, 300, 4, 2, d, True, torch.float16, det)
    if not args.no_bench:
        for d in [h for h in (64, 128, 256) if h in hdims]:
            for causal in (False, True):
                for s in map(int, args.seqlens.split(",")):
                    bench(C, d, s, causal, det)
    print("ALL OK" if ok else "SOME FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
