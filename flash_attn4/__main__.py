"""`python -m flash_attn4`: what is installed, what was compiled, which path a call takes, and a self-test.

python -m flash_attn4                       # report + self-test
python -m flash_attn4 --shape 2,4096,16,4,128 --dtype bf16 --causal   # which path this call takes
python -m flash_attn4 --dtype fp16          # self-test in fp16 (default: CPU fp32, CUDA bf16 and fp16)
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import warnings

import torch

import flash_attn4
from flash_attn4 import _build_info, _ops
from flash_attn4.reference import attention_ref

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _section(title: str) -> None:
    print(f"\n== {title}")


def report_environment() -> None:
    _section("versions")
    print(f"flash_attn4 {flash_attn4.__version__} ({flash_attn4.__file__})")
    print(f"python {platform.python_version()}, torch {torch.__version__}, torch CUDA {torch.version.cuda}")
    _section("build")
    if _build_info.BUILT:
        print(
            f"CUDA kernels: families {_build_info.ARCHS}, targets {_build_info.TARGETS}, "
            f"dtypes {_build_info.DTYPES}, "
            f"head dims {_build_info.HDIMS}, against torch {_build_info.TORCH_VERSION}"
        )
        print(
            f"block-sparse head dims {_build_info.BLOCK_SPARSE_HDIMS}, "
            f"fp8 (e4m3 forward) head dims {_build_info.FP8_HDIMS}, ALiBi (sm90) head dims "
            f"{_build_info.ALIBI_HDIMS}, dropout (sm90) head dims {_build_info.DROPOUT_HDIMS}, MLA (sm90 "
            f"forward; q / k, v) head dims {_build_info.MLA_HDIMS}"
        )
    else:
        print(f"no CUDA kernels: {_build_info.REASON}")
        print(build_instructions())
    ext, why = _build_info.load_extension()
    if ext is not None:
        names = ext.compiled_kernels()
        print(f"flash_attn4._C imports; {len(names)} kernel instantiations:")
        for name in names:
            print(f"  {name}")
    elif _build_info.BUILT:
        print(f"flash_attn4._C does not import: {why}")
    _section("GPUs")
    if not torch.cuda.is_available():
        print("no CUDA device visible: every call runs on the PyTorch reference")
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        print(f"cuda:{i} {torch.cuda.get_device_name(i)} sm{major}{minor}")


def build_instructions() -> str:
    """How to get the kernels: the same words every "why not" message carries (_build_info._REBUILD_HINT)."""
    return (
        "to build the CUDA kernels: install torch first (the CUDA build matching your driver, see "
        "pytorch.org), then, from a flash_attn4 source checkout, "
        f"{_build_info._REBUILD_HINT}"
    )


def shape_problem(shape: tuple[int, ...]) -> str:
    """Why (b, seqlen_q, nheads_q, nheads_kv, headdim) cannot be a call, or "" when it can."""
    b, sq, hq, hk, d = shape
    if min(shape) < 0:
        return f"--shape {','.join(map(str, shape))}: sizes cannot be negative"
    if hq == 0 or hk == 0 or d == 0:
        return (
            f"--shape {','.join(map(str, shape))}: nheads_q, nheads_kv and headdim must be at least 1 "
            f"(got nheads_q={hq}, nheads_kv={hk}, headdim={d})"
        )
    if hq % hk != 0:
        divisors = [x for x in range(1, hq + 1) if hq % x == 0]
        return (
            f"--shape {','.join(map(str, shape))}: nheads_q ({hq}) is not a multiple of nheads_kv ({hk}), "
            "so the heads cannot be split into GQA/MQA groups (each K/V head serves nheads_q / nheads_kv "
            f"query heads); attn() rejects such q, k, v. Choose nheads_kv from {divisors}"
        )
    return ""


def explain_path(shape: tuple[int, ...], dtype: torch.dtype, causal: bool) -> None:
    b, sq, hq, hk, d = shape
    _section(f"path for q ({b}, {sq}, {hq}, {d}), k/v ({b}, ?, {hk}, {d}), {dtype}, causal={causal}")
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    arch, why = _build_info.kernel_available(device, dtype, d)
    if arch is not None:
        padded = _build_info.padded_hdim(d)
        pad = f" (head dim zero-padded to {padded})" if padded != d else ""
        major, minor = torch.cuda.get_device_capability(device)
        why_arch = (
            "compute capability 9.0 runs the Hopper kernels"
            if arch == 90
            else "FLASH_ATTN4_FORCE_SM80=1"
            if (major, minor) == (9, 0) and _build_info.force_sm80()
            else f"compute capability {major}.{minor} runs the Ampere-path kernels"
        )
        binary = _build_info.binary_for(major, minor)
        print(f"forward and backward: the sm{arch} CUDA kernels on {device}{pad} ({why_arch}; {binary})")
        print("sliding windows, softcap, attn_varlen: on the same kernels")
        if arch == 80:
            smem = _build_info.smem_per_block(device)
            capped = " (FLASH_ATTN4_SMEM_CAP)" if os.environ.get("FLASH_ATTN4_SMEM_CAP") else ""
            print(f"shared memory a block: {smem} bytes{capped}; each kernel takes its tile of "
                  "csrc/common/tile_size.h where that fits, else its 99 KB row")  # fmt: skip
        if d not in _build_info.DECODE_HDIMS:
            print(f"decoding (query length 1): the forward kernels; no decode kernel at head dim {d} (built: "
                  f"{_build_info.DECODE_HDIMS}), so attn_with_kvcache runs the reference")  # fmt: skip
        elif not _build_info.decode_fits(device, d):
            print(f"decoding (query length 1): the forward kernels; the decode kernel at head dim {d} needs "
                  f"{_build_info.DECODE_WIDE_SMEM} bytes of shared memory a block")  # fmt: skip
        if arch == 80 and os.environ.get("FLASH_ATTN4_FP16_ACCUM") == "1":
            print("FLASH_ATTN4_FP16_ACCUM=1: float16 forwards up to head dim 128 without a window or block "
                  "mask accumulate P V in fp16")  # fmt: skip
    else:
        print(f"forward and backward: the PyTorch reference on {device}, because {why}")


def _self_test_case(device: torch.device, dtype: torch.dtype, causal: bool) -> tuple[bool, str]:
    torch.manual_seed(0)
    b, sq, sk, hq, hk, d = 2, 113, 203, 4, 2, 64
    q = torch.randn(b, sq, hq, d, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, sk, hk, d, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    dout = torch.randn(b, sq, hq, d, device=device, dtype=dtype)
    scale = 1 / math.sqrt(d)
    out, lse = flash_attn4.attn(q, k, v, causal=causal, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    # An independent float64 softmax(QK^T)V, not the package's reference, so the reference is tested too.
    def independent(q, k, v):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = (t.repeat_interleave(hq // hk, dim=1) for t in (k, v))
        s = q @ k.transpose(-1, -2) * scale
        if causal:
            i = torch.arange(sq, device=device)[:, None]
            j = torch.arange(sk, device=device)[None, :]
            s = s.masked_fill(j > i + sk - sq, -math.inf)
        return (torch.softmax(s, -1).nan_to_num(0.0) @ v).transpose(1, 2), torch.logsumexp(s, -1)

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want, want_lse = independent(q64, k64, v64)
    want_grads = torch.autograd.grad(want, (q64, k64, v64), dout.double())
    # Twice the error of the same math in the input dtype, plus rounding, as in the test-suite.
    qlp, klp, vlp = (t.detach().requires_grad_() for t in (q, k, v))
    lp, _ = attention_ref(qlp, klp, vlp, causal=causal, upcast=False)
    lp_grads = torch.autograd.grad(lp, (qlp, klp, vlp), dout)

    def err(a, b):
        return (a.double() - b).abs().max().item()

    ok = True
    parts = []
    for name, got, truth, low in zip(
        ("out", "dq", "dk", "dv"), (out, *grads), (want, *want_grads), (lp, *lp_grads)
    ):
        e, bound = err(got, truth), 2 * err(low, truth) + err(truth.to(dtype), truth) + 1e-4
        ok &= math.isfinite(e) and e <= bound
        parts.append(f"{name} {e:.1e} (<= {bound:.1e})")
    lse_err = err(lse, want_lse.detach())
    ok &= lse_err < 1e-2
    return ok, f"max errors: {', '.join(parts)}, lse {lse_err:.1e}"


def self_test(dtype: torch.dtype | None = None) -> bool:
    """Forward and backward on CPU and, when visible, CUDA: in `dtype` on each device, or by default in
    float32 on CPU and bfloat16 and float16 on CUDA (the dtypes the kernels are built for)."""
    _section("self-test (forward and backward against an independent float64 softmax(QK^T)V)")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    if dtype is not None:
        cases = [(cpu, dtype)] + ([(cuda, dtype)] if torch.cuda.is_available() else [])
    else:
        cases = [(cpu, torch.float32)]
        if torch.cuda.is_available():
            cases += [(cuda, torch.bfloat16), (cuda, torch.float16)]
    all_ok = True
    for device, dtype in cases:
        arch = _build_info.kernel_available(device, dtype, 64)[0]
        path = f"sm{arch} kernels" if arch else "reference"
        for causal in (False, True):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", _ops.ReferenceFallbackWarning)
                ok, detail = _self_test_case(device, dtype, causal)
            all_ok &= ok
            print(f"{'PASS' if ok else 'FAIL'} {device.type} {dtype} causal={causal} [{path}]: {detail}")
    print(f"\nself-test: {'PASS' if all_ok else 'FAIL'}")
    return all_ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flash_attn4", description=__doc__.splitlines()[0])
    ap.add_argument("--shape", help="b,seqlen_q,nheads_q,nheads_kv,headdim: say which path such a call takes")
    ap.add_argument(
        "--dtype",
        choices=sorted(_DTYPES),
        help="dtype of the --shape call (default bf16) and of the self-test (default: fp32 on CPU, bf16 "
        "and fp16 on CUDA)",
    )
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--no-self-test", action="store_true")
    args = ap.parse_args(argv)
    try:
        shape = tuple(int(x) for x in args.shape.split(",")) if args.shape else (2, 4096, 16, 16, 128)
    except ValueError:
        shape = ()
    if len(shape) != 5:
        ap.error("--shape takes five integers: b,seqlen_q,nheads_q,nheads_kv,headdim")
    problem = shape_problem(shape)
    if problem:
        ap.error(problem)
    dtype = _DTYPES[args.dtype] if args.dtype else None
    report_environment()
    explain_path(shape, dtype or torch.bfloat16, args.causal)
    return 0 if args.no_self_test or self_test(dtype) else 1


if __name__ == "__main__":
    sys.exit(main())
