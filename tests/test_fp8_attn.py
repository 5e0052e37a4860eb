"""fp8 (e4m3) q, k, v with descales through `attn`: forward only, bf16 out, the same masks. Two errors, as the
FP8 issue asks: the kernel's own (against fp64 attention of the dequantized inputs: here the reference path
itself) and the user-visible one (against bf16 attention of the original inputs), on Gaussian inputs and on
inputs with outlier channels, with and without the Hadamard rotation."""

from __future__ import annotations

import pytest
import torch

import flash_attn4
from flash_attn4 import fp8, reference


def _inputs(outliers: bool, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 300, 4, 64, generator=g) for _ in range(3))
    if outliers:
        boost = torch.ones(64)
        boost[:3] = torch.tensor([20.0, 50.0, 100.0])
        q, k = q * boost / 10, k * boost / 10
    return q, k, v


def _quant(t):
    t8, descale = flash_attn4.quantize_fp8(t)  # (batch, heads) descales; heads = nheads_kv here
    return t8, descale


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (50, 10))])
def test_fp8_matches_the_dequantized_reference(causal, window):
    q, k, v = _inputs(False)
    (q8, qd), (k8, kd), (v8, vd) = (_quant(t) for t in (q, k, v))
    out, lse = flash_attn4.attn(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=causal,
                                window_size=window, return_lse=True)  # fmt: skip
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    deq = [fp8.dequantize_fp8(t, d).double() for t, d in ((q8, qd), (k8, kd), (v8, vd))]
    want, want_lse = reference.attention_ref(*deq, causal=causal, window_size=window)
    assert (out.double() - want).abs().max() < 1e-2  # bf16 rounding of the output
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("outliers", [False, True])
def test_fp8_user_visible_error_and_the_rotation(outliers):
    q, k, v = _inputs(outliers)
    truth, _ = reference.attention_ref(q.double(), k.double(), v.double(), causal=True)

    def rel(out):
        return ((out.double() - truth).norm() / truth.norm()).item()

    def run(q, k):
        (q8, qd), (k8, kd), (v8, vd) = (_quant(t) for t in (q, k, v))
        return flash_attn4.attn(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=True)

    plain, rotated = rel(run(q, k)), rel(run(*flash_attn4.hadamard_rotate(q, k)))
    bf16 = rel(flash_attn4.attn(*(t.bfloat16() for t in (q, k, v)), causal=True))
    assert rotated < 0.06 and bf16 < 0.02
    if outliers:
        assert plain > 2 * rotated  # outlier channels spoil a per-head scale; the rotation repairs it


def test_fp8_rules():
    q8 = torch.randn(1, 8, 2, 16).to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="all in fp8"):
        flash_attn4.attn(q8, torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16))
    with pytest.raises(ValueError, match="k_descale must be"):
        flash_attn4.attn(q8, q8, q8, k_descale=torch.ones(1, 3))
    with pytest.raises(NotImplementedError, match="fp8"):
        flash_attn4.attn(q8, q8, q8, dropout_p=0.1)
    out = flash_attn4.attn(q8, q8, q8, sinks=torch.zeros(2))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
