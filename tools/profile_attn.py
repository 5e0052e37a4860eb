"""Per-kernel GPU time of one attention forward + backward, flash_attn4 beside SDPA's cuDNN backend.

    python3 tools/profile_attn.py                          # the HF training shape: 2 x 4096, 16 heads, d 128
    python3 tools/profile_attn.py --batch 1 --seqlen 32768 --window 4096

Inputs are laid out as a HuggingFace Llama hands them over: q and k contiguous in (batch, heads, seqlen,
d) after RoPE, v a transposed view of the projection, so the layouts (and any copies they cost) are the
model's. Prints each kernel's mean microseconds per iteration, so a gap in a training step can be traced
to the forward, the backward's main kernel or its pre/post passes.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import torch


def make_inputs(args):
    b, s, h, d = args.batch, args.seqlen, args.heads, args.hdim
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    q = rand(b, h, s, d).requires_grad_()
    k = rand(b, h, s, d).requires_grad_()
    v = rand(b, s, h, d).requires_grad_()
    grad = rand(b, s, h, d)
    return q, k, v, grad


def run_fa4(q, k, v, grad, args):
    import flash_attn4

    window = (args.window, 0) if args.window else (-1, -1)
    out = flash_attn4.attn(q.transpose(1, 2), k.transpose(1, 2), v, causal=True, window_size=window)
    out.backward(grad)


def run_cudnn(q, k, v, grad, args):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    if args.window:
        raise SystemExit("SDPA has no sliding window; profile --impls fa4 only")
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = sdpa(q, k, v.transpose(1, 2), is_causal=True)
    out.transpose(1, 2).backward(grad)


def profile(fn, inputs, args, iters: int) -> dict[str, float]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    def step():
        fn(*inputs, args)
        for t in inputs[:3]:
            t.grad = None  # no gradient accumulation kernels in the profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = defaultdict(float)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[evt.name] += evt.device_time / iters
    return dict(per_kernel)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--window", type=int, default=0, help="left window (causal); 0 = full causal")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--impls", default="fa4,cudnn")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_attn.py needs a CUDA device", file=sys.stderr)
        return 1
    runners = {"fa4": run_fa4, "cudnn": run_cudnn}
    inputs = make_inputs(args)
    shape = f"batch {args.batch} seqlen {args.seqlen} heads {args.heads} hdim {args.hdim}"
    print(f"{shape}, causal, window {args.window or None}")
    for impl in args.impls.split(","):
        kernels = profile(runners[impl], inputs, args, args.iters)
        total = sum(kernels.values())
        print(f"\n{impl}: {total:.1f} us per forward + backward")
        for name, us in sorted(kernels.items(), key=lambda kv: -kv[1]):
            print(f"  {us:9.1f} us  {name[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
