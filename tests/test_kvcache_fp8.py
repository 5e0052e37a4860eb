"""fp8 KV caches in `attn_with_kvcache` (float8_e4m3fn k_cache / v_cache with per-(sequence, kv head)
k_descale / v_descale): the call must equal attention over the dequantized cache, appended rows land as
given, and bad scales or dtypes are clear errors. CPU (the reference path); the CUDA route is in
test_decode_gpu.py."""

from __future__ import annotations

import pytest
import torch

import flash_attn4

FP8 = torch.float8_e4m3fn


def _quantized(b, cap, hk, d, seed=0):
    """Random caches quantized per (sequence, kv head), their descales and the dequantized fp32 caches."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, cap, hk, d, generator=g) * torch.rand(b, 1, hk, 1, generator=g) * 4
    v = torch.randn(b, cap, hk, d, generator=g)
    out = []
    for x in (k, v):
        descale = (x.abs().amax(dim=(1, 3)) / 448.0).float()  # (b, hk)
        q8 = (x / descale[:, None, :, None]).to(FP8)
        out += [q8, descale, q8.float() * descale[:, None, :, None]]
    return out


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_cache_is_attention_over_the_dequantized_cache(q_dtype, causal):
    b, cap, hk, hq, d = 3, 37, 2, 4, 16
    kc, kd, k_deq, vc, vd, v_deq = _quantized(b, cap, hk, d)
    q = torch.randn(b, 2, hq, d).to(q_dtype)
    lens = torch.tensor([37, 5, 20], dtype=torch.int32)
    out, lse = flash_attn4.attn_with_kvcache(
        q, kc, vc, cache_seqlens=lens, causal=causal, k_descale=kd, v_descale=vd, return_lse=True
    )
    want, want_lse = flash_attn4.attn_with_kvcache(
        q.float(), k_deq, v_deq, cache_seqlens=lens, causal=causal, return_lse=True
    )
    assert out.dtype == q_dtype
    torch.testing.assert_close(out, want.to(q_dtype))
    torch.testing.assert_close(lse, want_lse)


def test_fp8_paged_cache_with_append():
    b, page, pages, hk, d = 2, 4, 6, 2, 16
    kc, kd, k_deq, vc, vd, v_deq = _quantized(b, page * pages, hk, d, seed=1)
    perm = torch.randperm(b * pages, generator=torch.Generator().manual_seed(2))
    kp = torch.empty(b * pages, page, hk, d, dtype=FP8)
    vp = torch.empty_like(kp)
    kp[perm] = kc.reshape(b * pages, page, hk, d)
    vp[perm] = vc.reshape(b * pages, page, hk, d)
    pt = perm.view(b, pages).to(torch.int32)
    new_k = (torch.randn(b, 2, hk, d) / kd[:, None, :, None] * 0.5).to(FP8)
    new_v = (torch.randn(b, 2, hk, d) / vd[:, None, :, None] * 0.5).to(FP8)
    q = torch.randn(b, 2, 4, d)
    lens = torch.tensor([9, 21], dtype=torch.int32)
    out = flash_attn4.attn_with_kvcache(
        q, kp, vp, new_k, new_v, cache_seqlens=lens, page_table=pt, k_descale=kd, v_descale=vd
    )
    for i, n in enumerate(lens.tolist()):
        for t in range(2):
            row = n + t
            page_id, slot = pt[i, row // page].item(), row % page
            assert torch.equal(kp[page_id, slot].view(torch.uint8), new_k[i, t].view(torch.uint8))
            assert torch.equal(vp[page_id, slot].view(torch.uint8), new_v[i, t].view(torch.uint8))
        k_deq[i, n : n + 2] = new_k[i].float() * kd[i, None, :, None]
        v_deq[i, n : n + 2] = new_v[i].float() * vd[i, None, :, None]
    want = flash_attn4.attn_with_kvcache(q, k_deq, v_deq, cache_seqlens=lens + 2)
    torch.testing.assert_close(out, want)


def test_fp8_cache_without_descales_reads_the_raw_values():
    kc, _, _, vc, _, _ = _quantized(2, 8, 1, 16)
    q = torch.randn(2, 1, 2, 16)
    got = flash_attn4.attn_with_kvcache(q, kc, vc, cache_seqlens=8)
    torch.testing.assert_close(got, flash_attn4.attn_with_kvcache(q, kc.float(), vc.float(), cache_seqlens=8))


def _bad(kc, vc, q, **kw):
    return lambda: flash_attn4.attn_with_kvcache(q, kc, vc, cache_seqlens=3, **kw)


@pytest.mark.parametrize(
    "case, match",
    [
        ("descale_on_16bit", "scales fp8 caches"),
        ("descale_shape", r"float32 \(batch, nheads_kv\)"),
        ("descale_dtype", r"float32 \(batch, nheads_kv\)"),
        ("mixed_caches", "both be float8_e4m3fn"),
        ("new_k_16bit", "caches' dtype"),
        ("rotary_append", "rotate k before quantizing"),
    ],
)
def test_bad_fp8_cache_input_says_what_to_change(case, match):
    kc, kd, _, vc, vd, _ = _quantized(2, 8, 2, 16)
    q = torch.randn(2, 1, 4, 16)
    new = (torch.randn(2, 1, 2, 16) / 8).to(FP8)
    cos, sin = torch.ones(16, 4), torch.zeros(16, 4)
    call = {
        "descale_on_16bit": _bad(kc.float(), vc.float(), q, k_descale=kd),
        "descale_shape": _bad(kc, vc, q, k_descale=kd[:, :1]),
        "descale_dtype": _bad(kc, vc, q, v_descale=vd.double()),
        "mixed_caches": _bad(kc, vc.float(), q),
        "new_k_16bit": _bad(kc, vc, q, k=new.float(), v=new.float()),
        "rotary_append": _bad(kc, vc, q, k=new, v=new, rotary_cos=cos, rotary_sin=sin),
    }[case]
    with pytest.raises((TypeError, ValueError), match=match):
        call()


def test_fp8_cache_op_passes_opcheck():
    kc, kd, _, vc, vd, _ = _quantized(2, 8, 2, 16)
    q = torch.randn(2, 1, 4, 16)
    lens = torch.tensor([3, 8], dtype=torch.int32)
    mask_args = (False, 0.25, True, -1, 0, 0.0, 0)  # rotary_interleaved .. num_splits
    args = (q, kc, vc, None, None, lens, None, None, None, None, None, *mask_args, kd, vd)
    # opcheck's schema test multiplies the inputs, which torch's CPU kernels do not do in float8: fake
    # tensors and the autograd registration are what the fp8 arguments can change.
    torch.library.opcheck(
        torch.ops.flash_attn4.fwd_kvcache.default,
        args,
        test_utils=("test_faketensor", "test_autograd_registration"),
    )
