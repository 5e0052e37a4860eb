"""CPU timing of the PyTorch reference path (flash_attn4.attn on CPU tensors) against torch's own SDPA.

    python3 benchmarks/bench_reference_cpu.py                  # every case, forward and forward+backward
    python3 benchmarks/bench_reference_cpu.py --cases gqa_causal --repeat 3
    python3 benchmarks/bench_reference_cpu.py --no-bwd         # forward only
    git show HEAD:flash_attn4/reference.py > /tmp/ref_old.py
    python3 benchmarks/bench_reference_cpu.py --reference /tmp/ref_old.py   # time another reference.py

Ours is the public path (`flash_attn4.attn`, which on CPU runs `reference.attention_ref` forward and
`reference.attention_bwd_ref` backward). The baseline is `torch.nn.functional.scaled_dot_product_attention`
on the same tensors (transposed views, `enable_gqa=True`); a mask SDPA cannot express with `is_causal`
(bottom-right causal with seqlen_q != seqlen_k, windows) is handed to it as a boolean `attn_mask`, and
softcap (which SDPA lacks) is timed against plain SDPA without it, for scale only ("sdpa*"). For fp16/bf16
inputs "fp32 sdpa" times SDPA on the inputs upcast to float32, the precision the reference computes in
(torch's reduced-precision CPU kernel rounds P to bf16 before P @ V, and on CPUs with AMX its bf16 GEMMs
run several times faster than any float32 GEMM).
Forward: the attention call. Forward+backward: the call plus `out.backward(dout)`. Medians of --repeat
runs after --warmup runs; "max|diff|" is the largest difference between the two outputs (0 expected up to
rounding except in the softcap case).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flash_attn4  # noqa: E402
from flash_attn4 import _ops, reference  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}

# name: (batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, headdim, dtype, attn keywords)
CASES = {
    "gqa_causal": (2, 4096, 4096, 16, 4, 128, "bf16", {"causal": True}),
    "mha_full_fp32": (1, 2048, 2048, 8, 8, 64, "fp32", {}),
    "gqa_causal_sq<sk": (2, 1024, 4096, 16, 4, 128, "bf16", {"causal": True}),
    "gqa_causal_sq>sk": (2, 4096, 1024, 16, 4, 128, "bf16", {"causal": True}),
    "window_256_0": (1, 4096, 4096, 16, 4, 128, "bf16", {"window_size": (256, 0)}),
    "softcap_causal": (1, 2048, 2048, 8, 8, 64, "bf16", {"causal": True, "softcap": 30.0}),
    "mqa_causal_fp64": (1, 1024, 1024, 8, 1, 64, "fp64", {"causal": True}),
}


def _sdpa(q, k, v, kw):
    """SDPA on (b, s, h, d) tensors with our semantics, where SDPA can express them (not softcap)."""
    sq, sk = q.shape[1], k.shape[1]
    causal, window = kw.get("causal", False), kw.get("window_size", (-1, -1))
    is_causal, mask = False, reference.visible_mask(sq, sk, causal=causal, window_size=window)
    if mask is not None and sq == sk and causal and window == (-1, -1):
        is_causal, mask = True, None
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=is_causal,
        scale=kw.get("softmax_scale"),
        enable_gqa=True,
    )
    return out.transpose(1, 2)


def _ours(q, k, v, kw):
    return flash_attn4.attn(q, k, v, **kw)


def _time(fn, repeat: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def run_case(name: str, args) -> dict:
    b, sq, sk, hq, hk, d, dt, kw = CASES[name]
    dtype = DTYPES[dt]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, sq, hq, d, generator=g).to(dtype)
    k = torch.randn(b, sk, hk, d, generator=g).to(dtype)
    v = torch.randn(b, sk, hk, d, generator=g).to(dtype)
    dout = torch.randn(b, sq, hq, d, generator=g).to(dtype)
    sdpa_kw = {x: y for x, y in kw.items() if x != "softcap"}
    row = {"case": name, "shape": f"{b}x{sq}x{sk} {hq}/{hk}x{d} {dt}", "opts": _opts(kw)}
    with torch.no_grad():
        o1, o2 = _ours(q, k, v, kw), _sdpa(q, k, v, sdpa_kw)
    row["diff"] = (o1.double() - o2.double()).abs().max().item()
    with torch.no_grad():
        row["fwd_ours"] = _time(lambda: _ours(q, k, v, kw), args.repeat, args.warmup)
        row["fwd_sdpa"] = _time(lambda: _sdpa(q, k, v, sdpa_kw), args.repeat, args.warmup)
        if dtype in (torch.float16, torch.bfloat16):
            qf, kf, vf = q.float(), k.float(), v.float()
            row["fwd_sdpa32"] = _time(lambda: _sdpa(qf, kf, vf, sdpa_kw), args.repeat, args.warmup)
    if args.bwd:
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

        def step(fn, kw_):
            for t in (qg, kg, vg):
                t.grad = None
            fn(qg, kg, vg, kw_).backward(dout)

        row["fb_ours"] = _time(lambda: step(_ours, kw), args.repeat, args.warmup)
        row["fb_sdpa"] = _time(lambda: step(_sdpa, sdpa_kw), args.repeat, args.warmup)
        if dtype in (torch.float16, torch.bfloat16):
            qg, kg, vg = (t.detach().float().requires_grad_() for t in (q, k, v))
            row["fb_sdpa32"] = _time(lambda: step(_sdpa, sdpa_kw), args.repeat, args.warmup)
    return row


def _opts(kw: dict) -> str:
    parts = []
    if kw.get("causal"):
        parts.append("causal")
    if kw.get("window_size", (-1, -1)) != (-1, -1):
        parts.append(f"window{kw['window_size']}".replace(" ", ""))
    if kw.get("softcap"):
        parts.append(f"softcap{kw['softcap']:g}")
    return ",".join(parts) or "full"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list from {','.join(CASES)}")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--no-bwd", dest="bwd", action="store_false", help="forward only")
    ap.add_argument("--reference", type=Path, help="time this reference.py instead of the package's")
    args = ap.parse_args(argv)
    if args.reference is not None:
        spec = importlib.util.spec_from_file_location("reference_under_test", args.reference)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _ops.reference = module  # the custom ops' CPU path calls _ops.reference.attention_ref / _bwd_ref
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        ap.error(f"unknown cases {unknown}; choose from {list(CASES)}")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, repeat {args.repeat}, warmup"
        f" {args.warmup}, reference {args.reference or 'flash_attn4/reference.py'}"
    )
    head = f"{'case':<18} {'shape':<28} {'opts':<20}"
    head += f" {'fwd ours':>9} {'sdpa':>7} {'x':>5} {'fp32 sdpa':>9} {'x':>5}"
    if args.bwd:
        head += f" {'f+b ours':>9} {'sdpa':>7} {'x':>5} {'fp32 sdpa':>9} {'x':>5}"
    print(head + f" {'max|diff|':>9}   (times in ms)")
    for name in names:
        r = run_case(name, args)
        star = "*" if "softcap" in r["opts"] else " "
        line = f"{r['case']:<18} {r['shape']:<28} {r['opts']:<20}"
        for kind in ("fwd", "fb") if args.bwd else ("fwd",):
            ours, base, base32 = r[f"{kind}_ours"], r[f"{kind}_sdpa"], r.get(f"{kind}_sdpa32")
            line += f" {ours:>9.0f} {base:>6.0f}{star} {ours / base:>5.2f}"
            line += f" {base32:>8.0f}{star} {ours / base32:>5.2f}" if base32 else f" {'-':>9} {'-':>5}"
        print(line + f" {r['diff']:>9.1e}", flush=True)


if __name__ == "__main__":
    main()
