"""Attention benchmark over the FlashAttention papers' grid, ours against the SDPA backends and flash-attn-4.

    python3 benchmarks/bench_fwd.py                # full grid, writes benchmarks/results/<gpu>_fwd.json/.png
    python3 benchmarks/bench_fwd.py --bwd          # the backward: <gpu>_bwd.json/.png
    python3 benchmarks/bench_fwd.py --quick        # hdim 64/128/256 x seqlen 4096/8192 x causal both,
                                                   # into <gpu>_{fwd,bwd}_quick.json/.png
    python3 benchmarks/bench_fwd.py --hdims 128 --seqlens 8192 --causal 1 --impls flash_attn4,sdpa_cudnn
    python3 benchmarks/bench_fwd.py --seqlens 8192 --impls flash_attn4,flash_attn4_sinks --out sinks.json
    python3 benchmarks/bench_fwd.py --dtype fp8    # our e4m3 forward beside our bf16 one, FA4 and cuDNN
                                                   # (bf16) and an e4m3 matmul, into <gpu>_fwd_fp8.json
    python3 benchmarks/bench_fwd.py --bwd --gqa 4  # k / v with a quarter of q's heads: <gpu>_bwd_gqa4.json

Shapes follow the FlashAttention papers: batch * seqlen = 16384 tokens, nheads * headdim = 2048, q/k/v of
equal shape (--gqa N: k and v with nheads / N heads; SDPA then runs with enable_gqa), random normal inputs.
Forward FLOPs = 4 * b * h * s^2 * d, halved when causal; backward FLOPs = 2.5x that. Times are do_bench
medians (CUDA-event medians when triton is missing); every shape takes --rounds rounds (default 3) with the
implementations alternating (the order reversed every other round), and records the median of the rounds, each
round's time and the SM clock nvidia-smi reported during them (the card may be power-capped: compare
implementations within a run). Forward: only the attention call is timed. Backward: only the gradient
computation, `torch.autograd.grad(out, (q, k, v), dout)` on a graph recorded once (retain_graph), so no
forward is inside the timed call.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch
from plot import format_table, plot_records  # benchmarks/ is on sys.path when run as a script
from results_file import default_path, sm_clock_mhz, write_results

IMPLS = ["flash_attn4", "fa4_cute", "sdpa_cudnn", "sdpa_flash"]
# --dtype fp8: flash_attn4_fp8 takes q, k, v quantized per head (flash_attn4.quantize_fp8, outside the timed
# call); the others run bf16 on the same values; fp8_matmul is an 8192^3 e4m3 matmul (torch._scaled_mm, bf16
# out), the fp8 tensor-core rate in the same run (its FLOPs are its own, 2 * 8192^3).
FP8_IMPLS = ["flash_attn4_fp8", "flash_attn4", "fa4_cute", "sdpa_cudnn", "fp8_matmul"]
# Only when asked for: what an option costs beside the plain kernels.
# flash_attn4_99kb: our kernels under FLASH_ATTN4_SMEM_CAP=101376, the tiles of a 99 KB card (sm86 / 89 /
# 120); beside flash_attn4 on the Ampere path (FLASH_ATTN4_FORCE_SM80=1 on Hopper) it is what the cap costs.
# flash_attn4_dropout / sdpa_cudnn_dropout: attention dropout at DROPOUT_P, ours and cuDNN's (FA4 has none).
OPTIONAL_IMPLS = ["flash_attn4_sinks", "flash_attn4_alibi", "flash_attn4_99kb", "flash_attn4_dropout"]
OPTIONAL_IMPLS += ["sdpa_cudnn_dropout"]
DROPOUT_P = 0.1
SMEM_99KB = "101376"
HDIMS = [64, 128, 256]
SEQLENS = [512, 1024, 2048, 4096, 8192, 16384]
TOKENS, WIDTH = 16384, 2048  # batch * seqlen, nheads * hdim
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}  # fp8: see FP8_IMPLS
MATMUL_N = 8192


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdims", type=_ints, default=HDIMS, help="comma list (default 64,128,256)")
    ap.add_argument("--seqlens", type=_ints, default=SEQLENS, help="comma list (default 512..16384)")
    ap.add_argument("--causal", choices=["0", "1", "both"], default="both")
    ap.add_argument("--quick", action="store_true", help="hdim 64/128/256 x seqlen 4096/8192 x causal both")
    ap.add_argument(
        "--impls",
        help=f"comma list from {','.join(IMPLS + OPTIONAL_IMPLS + ['flash_attn4_fp8', 'fp8_matmul'])} "
        f"(default {','.join(IMPLS)}; with --dtype fp8, {','.join(FP8_IMPLS)})",
    )
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument(
        "--hdim-v", type=int, help="v's head dim when it differs from q / k's (MLA: --hdims 192 --hdim-v 128)"
    )
    ap.add_argument("--bwd", action="store_true", help="time the backward instead of the forward")
    ap.add_argument("--gqa", type=int, default=1, help="query heads per kv head (default 1)")
    ap.add_argument("--deterministic", action="store_true", help="flash_attn4 with deterministic=True")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warmup (ms)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetition time (ms)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per shape, implementations alternating")
    ap.add_argument(
        "--out", type=Path, help="JSON path (default benchmarks/results/<gpu>_{fwd,bwd}[_quick].json)"
    )
    ap.add_argument("--plot", type=Path, help="PNG path (default: the JSON path with .png)")
    args = ap.parse_args(argv)
    if args.quick:
        args.hdims, args.seqlens, args.causal = HDIMS, [4096, 8192], "both"
    if args.dtype == "fp8" and args.bwd:
        ap.error("the fp8 kernels are forward-only")
    bad = [h for h in args.hdims if args.gqa < 1 or (WIDTH // h) % args.gqa]
    if bad:
        ap.error(f"--gqa {args.gqa} must divide the query heads ({WIDTH} // head dim) at head dims {bad}")
    default = FP8_IMPLS if args.dtype == "fp8" else IMPLS
    args.impls = [i.strip() for i in args.impls.split(",") if i.strip()] if args.impls else default
    known = set(IMPLS) | set(OPTIONAL_IMPLS) | set(FP8_IMPLS)
    unknown = sorted(set(args.impls) - known)
    if unknown:
        ap.error(f"unknown impls {unknown}; choose from {sorted(known)}")
    return args


def bench_ms(fn: Callable[[], object], warmup: int, rep: int) -> float:
    """Median milliseconds of fn() on the current stream."""
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    # Fallback: CUDA events around each call, after a warmup; the median resists clock/boost noise.
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(max(10, rep // 2)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def alternate(fns: dict, rounds: int, warmup: int, rep: int, clocks: list) -> tuple[dict, dict]:
    """fns: {key: (fn, factory of the context to time fn in)} (make_impl's pairs). Returns ({key: fn's
    milliseconds in each turn}, {key: error message}) over `rounds` turns, the order reversed every other
    turn, so that clock and temperature drift land on all alike; the SM clock is sampled after each timing.
    A key whose timing raises is timed no more (its earlier turns stay)."""
    ms: dict = {key: [] for key in fns}
    errors: dict = {}
    for r in range(rounds):
        for key in list(fns)[:: 1 if r % 2 == 0 else -1]:
            if key in errors:
                continue
            fn, ctx = fns[key]
            try:
                with ctx():
                    ms[key].append(bench_ms(fn, warmup, rep))
            except Exception as e:  # one impl failing on one shape must not end the run
                errors[key] = f"{type(e).__name__}: {e}"[:500]
            clocks.append(sm_clock_mhz())
    return ms, errors


def _import_flash_attn4() -> None:
    """Import flash_attn4 (registers torch.ops.flash_attn4.fwd): the installed package, else the source
    tree (`make build` compiles _C in place; running this file puts benchmarks/, not the repo root, on
    sys.path)."""
    try:
        import flash_attn4  # noqa: F401
    except ImportError:
        sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
        import flash_attn4  # noqa: F401
    print(f"flash_attn4 from {sys.modules['flash_attn4'].__file__}", file=sys.stderr)


def _kernel_path() -> str:
    """Which flash_attn4 kernel family serves this GPU ("sm90", "sm80" when FLASH_ATTN4_FORCE_SM80=1 or on
    Ampere, else "reference"), recorded with each of its rows."""
    from flash_attn4 import _build_info

    arch, _ = _build_info.kernel_arch(torch.device("cuda"))
    return f"sm{arch}" if arch else "reference"


def make_impl(name: str, q, k, v, causal: bool, bwd: bool = False, deterministic: bool = False):
    """(fn, a factory of the context manager to hold while timing) for one impl; raises when it cannot run.

    q, k, v are (b, s, h, d) contiguous. SDPA wants (b, h, s, d): it gets its own contiguous copies, made
    here, so no transpose or copy lands inside the timed call. With bwd, fn computes the gradients of one
    recorded forward (made here, under the same context) for a fixed random dout.
    """

    if name == "fp8_matmul":
        a = torch.randn(MATMUL_N, MATMUL_N, device=q.device).to(torch.float8_e4m3fn)
        b = torch.randn(MATMUL_N, MATMUL_N, device=q.device).to(torch.float8_e4m3fn).t()  # column-major
        one = torch.ones((), device=q.device)
        fn = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
        return fn, contextlib.nullcontext
    if name == "flash_attn4_fp8":
        import flash_attn4
        from flash_attn4 import _ops_fp8

        (q, qd), (k, kd), (v, vd) = (flash_attn4.quantize_fp8(t) for t in (q, k, v))
        why = _ops_fp8.kernel_reason(q, k, v, 0.0)
        if why:
            raise RuntimeError(f"fp8 kernel unavailable: {why}")
        fwd = lambda q, k, v: flash_attn4.attn(  # noqa: E731
            q, k, v, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd
        )
        return (lambda: fwd(q, k, v)), contextlib.nullcontext
    if name in ("flash_attn4", "flash_attn4_99kb"):
        from flash_attn4 import _build_info, attn

        ok, why = _build_info.kernel_available(q.device, q.dtype, q.shape[-1])
        if not ok:
            raise RuntimeError(f"kernel unavailable: {why}")
        fwd = lambda q, k, v: attn(q, k, v, causal=causal, deterministic=deterministic)  # noqa: E731
        layout, ctx = (lambda t: t), contextlib.nullcontext
        if name == "flash_attn4_99kb":  # the binding reads the cap on every call, backward included
            ctx = lambda: _env("FLASH_ATTN4_SMEM_CAP", SMEM_99KB)  # noqa: E731
    elif name == "flash_attn4_sinks":  # the plain kernels plus GPT-OSS's sinks (their cost beside the above)
        from flash_attn4 import attn

        sinks = torch.randn(q.shape[2], device=q.device, requires_grad=bwd)
        fwd = lambda q, k, v: attn(q, k, v, causal=causal, deterministic=deterministic, sinks=sinks)  # noqa: E731
        layout, ctx = (lambda t: t), contextlib.nullcontext
    elif name == "flash_attn4_alibi":  # the ALiBi kernels with the paper's slopes (cost beside the plain)
        from flash_attn4 import _build_info, attn

        if _build_info.padded_hdim(q.shape[-1]) not in _build_info.ALIBI_HDIMS:
            raise RuntimeError(f"no ALiBi kernel at head dim {q.shape[-1]} ({_build_info.ALIBI_HDIMS} built)")
        h = q.shape[2]
        slopes = 2.0 ** (-8.0 * torch.arange(1, h + 1, device=q.device, dtype=torch.float32) / h)
        fwd = lambda q, k, v: attn(  # noqa: E731
            q, k, v, causal=causal, deterministic=deterministic, alibi_slopes=slopes
        )
        layout, ctx = (lambda t: t), contextlib.nullcontext
    elif name == "flash_attn4_dropout":  # the dropout kernels (their cost beside the plain ones)
        from flash_attn4 import _build_info, attn

        if _build_info.padded_hdim(q.shape[-1]) not in _build_info.DROPOUT_HDIMS:
            built = _build_info.DROPOUT_HDIMS
            raise RuntimeError(f"no dropout kernel at head dim {q.shape[-1]} ({built} built)")
        fwd = lambda q, k, v: attn(  # noqa: E731
            q, k, v, causal=causal, deterministic=deterministic, dropout_p=DROPOUT_P
        )
        layout, ctx = (lambda t: t), contextlib.nullcontext
    elif name == "fa4_cute":
        from flash_attn.cute import flash_attn_func

        fwd = lambda q, k, v: flash_attn_func(q, k, v, causal=causal)  # noqa: E731
        layout, ctx = (lambda t: t), contextlib.nullcontext
    elif name in ("sdpa_cudnn", "sdpa_flash", "sdpa_cudnn_dropout"):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        backend = SDPBackend.FLASH_ATTENTION if name == "sdpa_flash" else SDPBackend.CUDNN_ATTENTION
        p = DROPOUT_P if name == "sdpa_cudnn_dropout" else 0.0
        gqa = {"enable_gqa": True} if q.shape[2] != k.shape[2] else {}  # (b, s, h, d) here
        fwd = lambda q, k, v: sdpa(q, k, v, is_causal=causal, dropout_p=p, **gqa)  # noqa: E731
        # sdpa_kernel's context manager is single-use: a new one for every timed round.
        layout, ctx = (lambda t: t.transpose(1, 2).contiguous()), (lambda: sdpa_kernel(backend))
    else:
        raise ValueError(name)
    q, k, v = (layout(t) for t in (q, k, v))
    if not bwd:
        return (lambda: fwd(q, k, v)), ctx
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with ctx():  # the backend is chosen at forward time
        out = fwd(q, k, v)
        out = out[0] if isinstance(out, tuple) else out  # flash_attn.cute returns (out, lse)
    dout = torch.randn_like(out)
    bwd_ctx = ctx if name == "flash_attn4_99kb" else contextlib.nullcontext
    return (lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)), bwd_ctx


@contextlib.contextmanager
def _env(key: str, value: str):
    """os.environ[key] = value inside the block (putenv too, so C++ getenv sees it), restored after."""
    old = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[key]
        else:
            os.environ[key] = old


def available_impls(requested: list[str]) -> list[str]:
    """The requested impls that can run here at all; says why the others are left out."""
    keep = []
    for name in requested:
        why = ""
        if name.startswith("flash_attn4"):
            from flash_attn4 import _build_info

            ext, why = _build_info.load_extension()
        elif name == "fa4_cute":
            try:
                import flash_attn.cute  # noqa: F401
            except Exception as e:  # ImportError, or a broken install failing inside its import
                why = f"flash_attn.cute does not import ({type(e).__name__}: {e})"
        if why:
            print(f"skipping {name}: {why}", file=sys.stderr)
        else:
            keep.append(name)
    return keep


def run(args: argparse.Namespace) -> list[dict]:
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    dtype = DTYPES[args.dtype]
    causals = {"0": [False], "1": [True], "both": [False, True]}[args.causal]
    grid = [(h, s, c) for h in args.hdims for s in args.seqlens for c in causals]
    records = []
    direction = "bwd" if args.bwd else "fwd"
    bar = tqdm(grid, desc=direction, unit="shape") if tqdm else grid
    for i, (hdim, seqlen, causal) in enumerate(bar):
        if tqdm is None:
            print(f"[{i + 1}/{len(grid)}] hdim={hdim} seqlen={seqlen} causal={causal}", flush=True)
        batch, nheads = max(1, TOKENS // seqlen), WIDTH // hdim
        dv = args.hdim_v or hdim
        q, k, v = (
            torch.randn(batch, seqlen, h, e, dtype=dtype, device="cuda")
            for h, e in ((nheads, hdim), (nheads // args.gqa, hdim), (nheads // args.gqa, dv))
        )
        # Per (query, key) pair: Q K^T and P V forward (2 (d + dv)); the backward recomputes Q K^T and runs
        # dO V^T, P^T dO, dS K, dS^T Q (2 (3 d + 2 dv): 2.5x the forward when dv = d).
        per_pair = 2 * (3 * hdim + 2 * dv) if args.bwd else 2 * (hdim + dv)
        flops = batch * nheads * seqlen * seqlen * per_pair / (2 if causal else 1)
        recs, fns = {}, {}
        for impl in args.impls:
            rec = {"impl": impl, "hdim": hdim, "seqlen": seqlen, "causal": causal, "batch": batch}
            rec.update(nheads=nheads, dtype=args.dtype)
            if dv != hdim:
                rec["hdim_v"] = dv
            if args.gqa > 1:
                rec["nheads_kv"] = nheads // args.gqa
            if args.dtype == "fp8":
                rec["dtype"] = "fp8_e4m3" if impl in ("flash_attn4_fp8", "fp8_matmul") else "bf16"
            if impl == "flash_attn4" and args.deterministic:
                rec["deterministic"] = True
            if impl in ("flash_attn4", "flash_attn4_fp8"):
                rec["kernel_path"] = _kernel_path()
            try:
                fns[impl] = make_impl(impl, q, k, v, causal, args.bwd, args.deterministic)
            except Exception as e:  # one impl failing on one shape must not end the sweep
                rec["error"] = f"{type(e).__name__}: {e}"[:500]
            recs[impl] = rec
        clocks = []
        times, failed = alternate(fns, args.rounds, args.warmup, args.rep, clocks)
        for impl, err in failed.items():
            recs[impl]["error"] = err
        clocks = [c for c in clocks if c is not None]
        for impl, rec in recs.items():
            ts = times.get(impl, [])
            ms = statistics.median(ts) if ts and "error" not in rec else None
            rec[f"{direction}_ms"] = ms
            work = 2 * MATMUL_N**3 if impl == "fp8_matmul" else flops
            rec[f"{direction}_tflops"] = work / (ms * 1e-3) / 1e12 if ms else None
            rec[f"{direction}_ms_rounds"] = ts
            rec["sm_clock_mhz"] = statistics.median(clocks) if clocks else None
            records.append(rec)
        del fns  # frees the recorded backward graphs before the next shape allocates its own
        del q, k, v
        torch.cuda.empty_cache()
    return records


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fwd.py needs a CUDA device; none is visible.", file=sys.stderr)
        return 1
    _import_flash_attn4()
    args.impls = available_impls(args.impls)
    records = run(args)
    direction = "bwd" if args.bwd else "fwd"
    tags = (("_fp8", args.dtype == "fp8"), ("_mla", bool(args.hdim_v)), (f"_gqa{args.gqa}", args.gqa > 1))
    tags += (("_quick", args.quick),)
    suffix = "".join(tag for tag, on in tags if on)
    out = args.out or default_path(direction + suffix)
    write_results(records, out)
    print(format_table(records))
    errors = sorted({(r["impl"], r["error"]) for r in records if r.get("error")})
    for impl, err in errors:
        print(f"  {impl}: {err}")
    print(f"results: {out}")
    try:
        png = plot_records(records, args.plot or out.with_suffix(".png"), title=records[0]["gpu"])
        print(f"plot: {png}")
    except ImportError as e:
        print(f"no plot ({e}); pip install matplotlib")
    key = f"{direction}_tflops"
    ok = [r for r in records if r.get(key) is not None and not math.isnan(r[key])]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
