"""flash_attn4::fwd_fp8: the fp8 (e4m3) forward kernel as a torch.library op (forward only, bf16 out).

    flash_attn4::fwd_fp8(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal, window_left,
                         window_right) -> (out, lse)

fp8 WGMMA reads both operands K-major, so the P V product needs V^T with the keys contiguous: the binding
writes it once per call (csrc/fp8_vt.cu, one copy of v), with the keys of every 32 permuted so that the kernel
hands P from its S accumulator to the P V GEMM without shuffles (csrc/sm90/fp8_sm90.hpp).

No `from __future__ import annotations` here: custom_op reads the schema from real annotations.
"""

from typing import Optional

import torch
from torch import Tensor

from flash_attn4 import _build_info, _ops


def kernel_reason(q: Tensor, k: Tensor, v: Tensor, softcap: float) -> str:
    """ "" when the fp8 kernel serves the call, else why the reference runs (q, k, v already validated)."""
    if not q.is_cuda:
        return "not a CUDA tensor"
    arch, why = _build_info.kernel_arch(q.device)
    if arch != 90:
        return why or "the fp8 kernels run on Hopper (sm90) only"
    if not (q.dtype == k.dtype == v.dtype == torch.float8_e4m3fn):
        return "the fp8 kernels take float8_e4m3fn q, k and v (e5m2 runs on the reference)"
    if q.shape[-1] not in _build_info.FP8_HDIMS:
        return f"no fp8 kernel for head dim {q.shape[-1]} (built: {_build_info.FP8_HDIMS})"
    if softcap > 0:
        return "no fp8 kernel with softcap yet"
    return ""


def _descale_or_ones(t: Optional[Tensor], b: int, hk: int, device) -> Tensor:
    if t is None:
        return torch.ones(b, hk, dtype=torch.float32, device=device)
    return t.to(torch.float32).expand(b, hk).contiguous()


@torch.library.custom_op("flash_attn4::fwd_fp8", mutates_args=())
def fwd_fp8(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_descale: Optional[Tensor],
    k_descale: Optional[Tensor],
    v_descale: Optional[Tensor],
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
) -> tuple[Tensor, Tensor]:
    """q (b, sq, hq, d), k / v (b, sk, hk, d) float8_e4m3fn, descales (b, hk) fp32 or None (= 1) -> out
    (b, sq, hq, d) bf16, lse (b, hq, sq) fp32. Validated by the caller (fp8.attn_fp8)."""
    ext, why = _build_info.load_extension()
    if ext is None:
        raise RuntimeError(why)
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    out = torch.empty(b, sq, hq, d, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    if sq == 0 or sk == 0 or b == 0 or hq == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    causal_kernel, left, right = _ops._mask_kind(sq, sk, causal, window_left, window_right)
    ext.fwd_fp8(
        q.contiguous(), k.contiguous(), v.contiguous(), out, lse,
        *(_descale_or_ones(t, b, hk, q.device) for t in (q_descale, k_descale, v_descale)),
        float(softmax_scale), causal_kernel, int(left), int(right),
    )  # fmt: skip
    return out, lse


@fwd_fp8.register_fake
def _fwd_fp8_fake(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal, window_left, window_right):
    b, sq, hq, d = q.shape
    return (
        q.new_empty(b, sq, hq, d, dtype=torch.bfloat16),
        q.new_empty(b, hq, sq, dtype=torch.float32),
    )
