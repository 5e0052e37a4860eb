#!/usr/bin/env python3
"""Block-sparse attention, forward and backward: flash_attn4 with a BlockMask beside flash_attn4 dense,
FlexAttention (compiled, the same block mask) and FlashAttention-4's block-sparse path (when importable),
in one run.

    python3 benchmarks/bench_sparse.py            # writes benchmarks/results/<gpu>_sparse.json

Shape: batch 1, 32768 tokens, 16 heads, head dim 128, bf16, not causal. Masks: each (head, query block)
keeps a random `density` share of the 128 x 128 key blocks (seeded), all of them full blocks (no element
mask inside), plus the diagonal block so that no row is empty. Times: do_bench medians, implementations
alternating for --rounds rounds, the median round kept; `vs_dense` = our dense time / this time. The
backward times the gradient call alone on a graph recorded once (retain_graph), as bench_fwd.py --bwd does.
The estimator row times estimate_block_mask(q, k, density=0.1) against our dense forward.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from bench_fwd import _import_flash_attn4, bench_ms
from results_file import default_path, sm_clock_mhz, write_results

S, H, D, BLK = 32768, 16, 128, 128


def random_blocks(density: float, seed: int) -> torch.Tensor:
    n = S // BLK
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks = torch.rand(1, H, n, n, device="cuda", generator=g) < density
    return blocks | torch.eye(n, dtype=torch.bool, device="cuda")


def impls(q, k, v, blocks):
    """name -> zero-argument forward callable (or the reason it cannot run)."""
    import flash_attn4
    from flash_attn4 import _ops_sparse

    mask = flash_attn4.BlockMask.from_dense(blocks, S, S, full=blocks)
    out = {"flash_attn4_dense": lambda: flash_attn4.attn(q, k, v)}
    # Without the block-sparse kernels attn falls back to the PyTorch reference (seconds a call, and its
    # backward keeps S x S probabilities a head: out of memory at 32k): report that instead of timing it.
    plan, why = _ops_sparse.kernel_plan(q, k, v, mask.block_size, False, -1, -1)
    if plan is None:
        out["flash_attn4_sparse"] = f"not timed, no block-sparse kernel for it: {why}"
    else:
        out["flash_attn4_sparse"] = lambda: flash_attn4.attn(q, k, v, block_mask=mask)
    try:
        from torch.nn.attention.flex_attention import BlockMask as FlexMask
        from torch.nn.attention.flex_attention import flex_attention

        empty = torch.zeros_like(mask.full_count)
        fm = FlexMask.from_kv_blocks(empty, torch.zeros_like(mask.full_index), mask.full_count,
                                     mask.full_index, BLOCK_SIZE=BLK, seq_lengths=(S, S))  # fmt: skip
        flex = torch.compile(flex_attention, dynamic=False)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        flex(qt, kt, vt, block_mask=fm)
        out["flex_compiled"] = lambda: flex(qt, kt, vt, block_mask=fm).transpose(1, 2)
    except Exception as e:  # noqa: BLE001 - an anchor that cannot run is reported, not fatal
        out["flex_compiled"] = f"{type(e).__name__}: {str(e)[:200]}"
    try:
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
        from flash_attn.cute.interface import flash_attn_func

        zc = torch.zeros_like(mask.full_count)
        bst = BlockSparseTensorsTorch(zc, torch.zeros_like(mask.full_index), mask.full_count, mask.full_index,
                                      block_size=(BLK, BLK))  # fmt: skip
        zq = torch.zeros_like(mask.full_q_count)
        bst_bwd = BlockSparseTensorsTorch(zq, torch.zeros_like(mask.full_q_index), mask.full_q_count,
                                          mask.full_q_index, block_size=(BLK, BLK))  # fmt: skip
        flash_attn_func(q, k, v, block_sparse_tensors=bst)

        def fa4():
            o = flash_attn_func(q, k, v, block_sparse_tensors=bst, block_sparse_tensors_bwd=bst_bwd)
            return o[0] if isinstance(o, tuple) else o

        out["fa4_cute_sparse"] = fa4
    except Exception as e:  # noqa: BLE001
        out["fa4_cute_sparse"] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


def backward_of(fwd, leaves):
    """A zero-argument call of the gradient alone, on a graph recorded once (retain_graph); fwd closes over
    `leaves` (q, k, v requiring grad)."""
    out = fwd()
    dout = torch.randn_like(out)
    torch.autograd.grad(out, leaves, dout, retain_graph=True)  # compiles / warms the backward once
    return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)


def timed(fns: dict, rounds: int, warmup: int, rep: int, clocks: list) -> dict:
    """name -> median ms over `rounds` alternating rounds, for the callable entries of fns."""
    times = {n: [] for n, f in fns.items() if callable(f)}
    for r in range(rounds):
        for name in list(times)[:: 1 if r % 2 == 0 else -1]:
            times[name].append(bench_ms(fns[name], warmup, rep))
        clocks.append(sm_clock_mhz())
    return {n: (statistics.median(t), t) for n, t in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--densities", default="0.05,0.1,0.25,0.5")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--no-bwd", action="store_true", help="time the forward only")
    ap.add_argument("--out", type=Path, help="result file (default benchmarks/results/<gpu>_sparse.json)")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    _import_flash_attn4()
    import flash_attn4

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]  # the backward's q, k, v
    base = dict(hdim=D, seqlen=S, causal=False, batch=1, nheads=H, dtype="bf16")
    records, clocks = [], []
    for density in (float(x) for x in args.densities.split(",")):
        blocks = random_blocks(density, seed=int(density * 1000))
        real = blocks.float().mean().item()  # the share actually computed (the diagonal included)
        fwd = impls(q, k, v, blocks)
        fwd_t = timed(fwd, args.rounds, args.warmup, args.rep, clocks)
        bwd_t, bwd_errors = {}, {}
        if not args.no_bwd:
            bwd = {}
            for name, f in impls(*leaves, blocks).items():
                try:
                    bwd[name] = backward_of(f, leaves) if callable(f) else f
                except Exception as e:  # noqa: BLE001 - an anchor without a backward is reported, not fatal
                    bwd[name] = f"{type(e).__name__}: {str(e)[:200]}"
            bwd_t = timed(bwd, args.rounds, args.warmup, args.rep, clocks)
            bwd_errors = {n: f for n, f in bwd.items() if not callable(f)}
            del bwd  # frees the recorded graphs
        for direction, fns, t in (("fwd", fwd, fwd_t), ("bwd", bwd_errors, bwd_t)):
            if not t:
                continue
            dense = t["flash_attn4_dense"][0]
            line = f"{direction} density {density:.2f} (computed {real:.3f}):"
            for name, (ms, rounds) in t.items():
                line += f"  {name} {ms:.2f} ms ({dense / ms:.2f}x dense)"
                records.append({"impl": name, "density": real, f"{direction}_ms": ms,
                                f"{direction}_ms_rounds": rounds, f"{direction}_vs_dense": dense / ms,
                                **base})  # fmt: skip
            for name, f in fns.items():
                if not callable(f):
                    line += f"  {name}: {f}"
                    records.append(dict(impl=name, density=real, error=f"{direction}: {f}", **base))
            print(line, flush=True)
    est = bench_ms(lambda: flash_attn4.estimate_block_mask(q, k, density=0.1), args.warmup, args.rep)
    dense = bench_ms(lambda: flash_attn4.attn(q, k, v), args.warmup, args.rep)
    print(f"estimate_block_mask(density=0.1): {est:.3f} ms = {est / dense:.1%} of the dense forward")
    records.append(
        dict(impl="estimate_block_mask", density=0.1, fwd_ms=est, fwd_vs_dense=dense / est, **base)
    )
    if any(r["impl"] == "flash_attn4_sparse" and "error" in r for r in records):
        print("not saved: flash_attn4_sparse did not run on its kernels (a result file needs its column)")
    elif not args.no_save:
        print(f"wrote {write_results(records, args.out or default_path('sparse'), clocks)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
