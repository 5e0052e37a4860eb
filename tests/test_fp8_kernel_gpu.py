"""The fp8 (e4m3) forward kernels (sm90). The kernel's own error is measured against fp64 attention of the
dequantized inputs, with DESIGN.md's rule: at most 2x the error of a PyTorch emulation of the same
quantization (P = 2^8 exp(s - max) rounded to e4m3, fp32 row sums; bf16 out) plus a rounding floor. The
user-visible error (against attention of the original inputs) is tools/fp8_error.py's and the README's."""

from __future__ import annotations

import pytest
import torch

import flash_attn4
from flash_attn4 import _build_info, _ops_fp8, fp8, reference


def _fp8_kernels() -> tuple[int, ...]:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return ()
    return _build_info.FP8_HDIMS if _build_info.kernel_arch(torch.device("cuda"))[0] == 90 else ()


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _fp8_kernels(), reason="needs an sm90 GPU and a build with fp8 kernels"),
]
HDIMS = _fp8_kernels() or (128,)


def _poison_allocator(numel: int) -> None:
    """Fills freed cache blocks with NaN, so an output element the kernel leaves unwritten fails the test."""
    torch.full((numel,), float("nan"), device="cuda")


def _emulated(q, k, v, causal, window):
    """out of fp64 q, k, v with P quantized as the kernel does (global row max instead of its running one)."""
    b, sq, hq, d = q.shape
    hk = k.shape[2]
    k = k.repeat_interleave(hq // hk, dim=2)
    v = v.repeat_interleave(hq // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / d**0.5
    keep = reference.visible_mask(sq, k.shape[1], causal=causal, window_size=window, device=q.device)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    m = s.amax(-1, keepdim=True).clamp_min(-1e30)
    p = torch.exp2((s - m) * 1.4426950408889634 + 8)
    total = p.sum(-1, keepdim=True)
    pq = p.to(torch.float8_e4m3fn).double()
    out = torch.einsum("bhqk,bkhd->bqhd", pq / total.clamp_min(1e-300), v)
    return out.to(torch.bfloat16).double()


def _case(b, sq, sk, hq, hk, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", generator=g) for s, h in ((sq, hq), (sk, hk), (sk, hk)))
    return [flash_attn4.quantize_fp8(q, nheads_kv=hk), *(flash_attn4.quantize_fp8(t) for t in (k, v))]


def _dequantized(q8, qd, k8, kd, v8, vd):
    """fp64 q, k, v the fp8 tensors and their (batch, nheads_kv) descales stand for."""
    g = q8.shape[2] // k8.shape[2]
    q = fp8.dequantize_fp8(q8, qd.repeat_interleave(g, dim=1))
    return [t.double() for t in (q, fp8.dequantize_fp8(k8, kd), fp8.dequantize_fp8(v8, vd))]


SHAPES = [
    (1, 1, 1, 2, 1),
    (2, 17, 239, 4, 2),
    (1, 113, 1023, 2, 2),
    (2, 1023, 4224, 4, 1),
    (1, 4224, 1023, 2, 2),
]
MASKS = [(False, (-1, -1)), (True, (-1, -1)), (False, (100, 17))]


@pytest.mark.parametrize("d", HDIMS)
@pytest.mark.parametrize("b,sq,sk,hq,hk", SHAPES)
@pytest.mark.parametrize("causal,window", MASKS)
def test_fp8_kernel_matches_the_dequantized_reference(d, b, sq, sk, hq, hk, causal, window):
    (q8, qd), (k8, kd), (v8, vd) = _case(b, sq, sk, hq, hk, d, seed=sq * 7 + sk)
    assert not _ops_fp8.kernel_reason(q8, k8, v8, 0.0)
    _poison_allocator(4 * b * sq * hq * d)
    out, lse = flash_attn4.attn(
        q8,
        k8,
        v8,
        q_descale=qd,
        k_descale=kd,
        v_descale=vd,
        causal=causal,
        window_size=window,
        return_lse=True,
    )
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    deq = _dequantized(q8, qd, k8, kd, v8, vd)
    want, want_lse = reference.attention_ref(*deq, causal=causal, window_size=window)
    emulated = _emulated(*deq, causal, window)
    bound = 2 * (emulated - want).abs().max().item() + 2e-3
    err = (out.double() - want).abs().max().item()
    assert err <= bound, f"max error {err:.4f} > {bound:.4f}"
    seen = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    torch.testing.assert_close(lse.double()[seen], want_lse[seen], atol=2e-3, rtol=0)
    assert torch.all(out[~seen.transpose(1, 2)] == 0)  # rows that see no key


def test_fp8_kernel_reads_v_descale_per_head_and_takes_scalars_as_ones():
    (q8, qd), (k8, kd), (v8, vd) = _case(2, 300, 300, 4, 2, HDIMS[-1], seed=3)
    out = flash_attn4.attn(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
    want, _ = reference.attention_ref(*_dequantized(q8, qd, k8, kd, v8, vd))
    assert (out.double() - want).abs().max() < 0.05
    ones = torch.ones_like(qd)
    out1 = flash_attn4.attn(q8, k8, v8)
    out2 = flash_attn4.attn(q8, k8, v8, q_descale=ones, k_descale=ones, v_descale=ones)
    assert torch.equal(out1, out2)


def test_fp8_kernel_under_torch_compile():
    (q8, qd), (k8, kd), (v8, vd) = _case(1, 256, 256, 2, 2, HDIMS[-1], seed=5)

    def f(q, k, v):
        return flash_attn4.attn(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, causal=True)

    torch.testing.assert_close(torch.compile(f, fullgraph=True)(q8, k8, v8), f(q8, k8, v8), atol=0, rtol=0)
