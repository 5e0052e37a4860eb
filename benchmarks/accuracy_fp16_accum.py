"""Error of the Ampere path's opt-in fp16 accumulation of P V (FLASH_ATTN4_FP16_ACCUM=1) against the fp32 one.

    python3 benchmarks/accuracy_fp16_accum.py          # -> benchmarks/results/<gpu>_fp16_accum.json

float16 q, k, v (standard normal; batch x seqlen = 16k tokens, 16 heads), the forward on the Ampere-path
kernels (FLASH_ATTN4_FORCE_SM80=1 on Hopper) with fp32 and with fp16 accumulation, and torch's float16
attention (the reference computed in float16), each against the reference in float64: max and mean absolute
error of out. The speed the option buys is a GeForce matter (fp16-accumulate tensor-core rate twice the
fp32 one there; the same on A100 / H100), not measured here.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

try:  # the installed package, else the source tree (`make build` compiles _C in place)
    import flash_attn4
except ImportError:
    sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
    import flash_attn4
from results_file import default_path, sm_clock_mhz, write_results  # benchmarks/ is on sys.path as a script

from flash_attn4 import _build_info
from flash_attn4.reference import attention_ref


def _errors(out: torch.Tensor, truth: torch.Tensor) -> tuple[float, float]:
    d = (out.double() - truth).abs()
    return d.max().item(), d.mean().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdims", default="64,128")
    ap.add_argument("--seqlens", default="1024,8192")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    os.environ.setdefault("FLASH_ATTN4_FORCE_SM80", "1")
    dev = torch.device("cuda")
    records, clocks = [], []
    print("hdim  seqlen  causal  max err fp32-acc  fp16-acc  torch fp16   mean err fp32-acc  fp16-acc  "
          "torch fp16")  # fmt: skip
    for hdim in (int(h) for h in args.hdims.split(",")):
        arch, why = _build_info.kernel_available(dev, torch.float16, hdim)
        if arch != 80:
            print(f"hdim {hdim}: skipped ({why or f'the sm{arch} kernels serve it, not the Ampere path'})")
            continue
        for seqlen in (int(s) for s in args.seqlens.split(",")):
            for causal in (False, True):
                g = torch.Generator(device=dev).manual_seed(seqlen + hdim)
                b = max(1, 16384 // seqlen)
                q, k, v = (torch.randn(b, seqlen, 16, hdim, device=dev, generator=g) for _ in range(3))
                truth = attention_ref(q.double(), k.double(), v.double(), causal=causal)[0]
                h = [t.half() for t in (q, k, v)]
                os.environ["FLASH_ATTN4_FP16_ACCUM"] = "0"
                e32 = _errors(flash_attn4.attn(*h, causal=causal), truth)
                os.environ["FLASH_ATTN4_FP16_ACCUM"] = "1"
                e16 = _errors(flash_attn4.attn(*h, causal=causal), truth)
                os.environ["FLASH_ATTN4_FP16_ACCUM"] = "0"
                elp = _errors(attention_ref(*h, causal=causal, upcast=False)[0], truth)
                clocks.append(sm_clock_mhz())
                print(
                    f"{hdim:4d}  {seqlen:6d}  {'yes' if causal else 'no':>6}  {e32[0]:17.2e}  {e16[0]:8.2e}  "
                    f"{elp[0]:10.2e}   {e32[1]:18.2e}  {e16[1]:8.2e}  {elp[1]:10.2e}"
                )
                for impl, (mx, mean) in (("flash_attn4_sm80", e32), ("flash_attn4_sm80_fp16acc", e16),
                                         ("torch_fp16", elp)):  # fmt: skip
                    records.append({
                        "impl": impl, "hdim": hdim, "seqlen": seqlen, "causal": causal, "batch": b,
                        "nheads": 16, "dtype": "fp16", "max_abs_err": mx, "mean_abs_err": mean,
                    })  # fmt: skip
    print(f"results: {write_results(records, args.out or default_path('fp16_accum'), clocks)}")


if __name__ == "__main__":
    main()
