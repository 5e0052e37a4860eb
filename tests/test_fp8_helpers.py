"""flash_attn4.quantize_fp8 / dequantize_fp8 / hadamard_rotate: the descale shapes of each granularity, the
e4m3 rounding bound, zero groups, odd lengths, inputs left untouched; H orthonormal, q k^T unchanged by the
rotation, and the rotation shrinking the quantization error of inputs with outlier channels."""

from __future__ import annotations

import pytest
import torch

import flash_attn4
from flash_attn4 import fp8


def _x(b=2, s=300, h=3, d=64, seed=0, outliers=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, h, d, generator=g)
    if outliers:
        x[..., :3] *= torch.tensor([20.0, 50.0, 100.0])  # a few channels far larger, as in LLM activations
    return x


@pytest.mark.parametrize("granularity,shape", [("tensor", ()), ("head", (2, 3)), ("block", (2, 3, 3))])
def test_round_trip_within_e4m3_rounding(granularity, shape):
    x = _x(outliers=True)
    before = x.clone()
    x8, descale = flash_attn4.quantize_fp8(x, granularity=granularity, block_size=128)
    assert x8.dtype == torch.float8_e4m3fn and x8.shape == x.shape
    assert descale.dtype == torch.float32 and tuple(descale.shape) == shape
    assert torch.equal(x, before)
    back = fp8.dequantize_fp8(x8, descale, block_size=128)
    if granularity == "tensor":
        unit = descale
    elif granularity == "head":
        unit = descale[:, None, :, None]
    else:
        unit = descale.transpose(1, 2).repeat_interleave(128, dim=1)[:, :300, :, None]
    # 3 mantissa bits: half an ulp is 2^-4 of the value; subnormals (below 2^-6) step by 2^-9.
    assert ((back - x).abs() <= x.abs() * 2**-4 + unit * 2**-10 + 1e-12).all()
    assert (x8.float().abs().amax() <= 448).item()


def test_zero_groups_and_bad_arguments():
    x = torch.zeros(1, 5, 2, 8)
    x8, descale = flash_attn4.quantize_fp8(x)
    assert torch.equal(descale, torch.ones(1, 2)) and not x8.float().any()
    with pytest.raises(ValueError, match="granularity"):
        flash_attn4.quantize_fp8(x, granularity="row")
    with pytest.raises(ValueError, match="4-D|batch, seqlen"):
        flash_attn4.quantize_fp8(torch.zeros(5, 2, 8))
    with pytest.raises(ValueError, match="does not fit"):
        fp8.dequantize_fp8(x8, torch.ones(3))


@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_hadamard_keeps_qk_and_is_orthonormal(d):
    h = fp8._rotation(d, "cpu", torch.float64)
    torch.testing.assert_close(h @ h.T, torch.eye(d, dtype=torch.float64), atol=1e-12, rtol=0)
    q, k = _x(d=d, seed=1).double(), _x(d=d, seed=2).double()
    qr, kr = flash_attn4.hadamard_rotate(q, k)
    want = torch.einsum("bqhd,bkhd->bhqk", q, k)
    torch.testing.assert_close(torch.einsum("bqhd,bkhd->bhqk", qr, kr), want, atol=1e-10, rtol=1e-10)


def _score_error(q, k, rotate):
    if rotate:
        q, k = flash_attn4.hadamard_rotate(q, k)
    deq = [fp8.dequantize_fp8(*flash_attn4.quantize_fp8(t)) for t in (q, k)]
    exact = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double())
    got = torch.einsum("bqhd,bkhd->bhqk", deq[0].double(), deq[1].double())
    return ((got - exact).norm() / exact.norm()).item()


def test_rotation_shrinks_the_error_of_outlier_channels():
    q, k = _x(seed=3, outliers=True), _x(seed=4, outliers=True)
    plain, rotated = _score_error(q, k, False), _score_error(q, k, True)
    assert rotated < 0.5 * plain, (plain, rotated)


def test_quantize_q_per_kv_head_group():
    """GQA: q's descale is per (batch, kv head), the shape the kernels read; each group of query heads shares
    the scale of its largest value."""
    x = _x(h=6, outliers=True)
    x8, descale = flash_attn4.quantize_fp8(x, nheads_kv=2)
    assert x8.shape == x.shape and tuple(descale.shape) == (2, 2)
    want = x.abs().reshape(2, 300, 2, 3 * 64).amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max
    torch.testing.assert_close(descale, want)
    back = fp8.dequantize_fp8(x8, descale.repeat_interleave(3, dim=1))
    assert ((back - x).abs() <= x.abs() / 16 + descale.max() * 2**-9).all()
    with pytest.raises(ValueError, match="multiple of nheads_kv"):
        flash_attn4.quantize_fp8(x, nheads_kv=4)
    with pytest.raises(ValueError, match="granularity='head'"):
        flash_attn4.quantize_fp8(x, granularity="block", nheads_kv=2)
