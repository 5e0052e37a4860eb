"""FLASH_ATTN4_FP16_ACCUM=1: the Ampere path's float16 forward accumulates each key block's P V in fp16
(AccumPVF16, csrc/sm80/kernel_traits_fwd_sm80.hpp) at head dims up to 128. Against the float64 reference
its error stays within 4x the larger of the fp32-accumulate kernel's and torch's float16 attention's (+ a
rounding floor), and it does change the result there (the option is live); head dims above 128, windows
and bfloat16 inputs ignore it; a bad value is a clear error.
"""

from __future__ import annotations

import pytest
import torch

import flash_attn4
from flash_attn4 import _build_info
from flash_attn4.reference import attention_ref


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    if "fp16" not in _build_info.DTYPES or not _build_info.HDIMS:
        return "no float16 kernels built"
    arch, why = _build_info.kernel_available(torch.device("cuda"), torch.float16, _build_info.HDIMS[0])
    if arch != 80:
        return why or "the sm90 kernels serve this GPU (FLASH_ATTN4_FORCE_SM80=1 tests the Ampere path)"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]


def _err(a, b):
    return (a.double() - b).abs().max().item()


@pytest.mark.parametrize("hdim", list(_build_info.HDIMS) or [128])
@pytest.mark.parametrize("causal,sq,sk", [(False, 1000, 1000), (True, 301, 4099), (False, 77, 3001)])
def test_fp16_accumulation_error_is_bounded_and_live(monkeypatch, hdim, causal, sq, sk):
    g = torch.Generator(device="cuda").manual_seed(hdim + sk)
    q = torch.randn(2, sq, 4, hdim, device="cuda", generator=g)
    k, v = (torch.randn(2, sk, 2, hdim, device="cuda", generator=g) for _ in range(2))
    truth = attention_ref(q.double(), k.double(), v.double(), causal=causal)[0]
    h = [t.half() for t in (q, k, v)]
    monkeypatch.setenv("FLASH_ATTN4_FP16_ACCUM", "0")
    out32 = flash_attn4.attn(*h, causal=causal)
    monkeypatch.setenv("FLASH_ATTN4_FP16_ACCUM", "1")
    out16 = flash_attn4.attn(*h, causal=causal)
    lp = attention_ref(*h, causal=causal, upcast=False)[0]
    floor = _err(truth.half(), truth) + 1e-4
    err16, err32, err_lp = _err(out16, truth), _err(out32, truth), _err(lp, truth)
    assert torch.isfinite(out16).all()
    assert err16 <= 4 * max(err32, err_lp) + floor, f"{err16:.3g} vs fp32-acc {err32:.3g}, torch {err_lp:.3g}"
    if hdim <= 128:
        assert not torch.equal(out16, out32), "FLASH_ATTN4_FP16_ACCUM=1 changed nothing"
    else:
        assert torch.equal(out16, out32), "above head dim 128 the option is ignored"


def test_windows_keep_fp32_accumulation(monkeypatch):
    hdim = min(_build_info.HDIMS)
    q, k, v = (torch.randn(2, 300, 2, hdim, device="cuda", dtype=torch.float16) for _ in range(3))
    monkeypatch.setenv("FLASH_ATTN4_FP16_ACCUM", "0")
    plain = flash_attn4.attn(q, k, v, window_size=(64, 0))
    monkeypatch.setenv("FLASH_ATTN4_FP16_ACCUM", "1")
    assert torch.equal(flash_attn4.attn(q, k, v, window_size=(64, 0)), plain)


def test_bfloat16_ignores_it_and_a_bad_value_is_an_error(monkeypatch):
    hdim = _build_info.HDIMS[0]
    q, k, v = (torch.randn(1, 200, 2, hdim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    monkeypatch.setenv("FLASH_ATTN4_FP16_ACCUM", "0")
    plain = flash_attn4.attn(q, k, v)
    monkeypatch.setenv("FLASH_ATTN4_FP16_ACCUM", "1")
    assert torch.equal(flash_attn4.attn(q, k, v), plain)
    monkeypatch.setenv("FLASH_ATTN4_FP16_ACCUM", "yes")
    with pytest.raises(RuntimeError, match="FLASH_ATTN4_FP16_ACCUM must be 0 or 1"):
        flash_attn4.attn(q.half(), k.half(), v.half())
