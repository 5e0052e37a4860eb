"""The decode kernels (split-KV, contiguous and paged caches, append + rotary) against the reference.

Tolerance as in test_fwd_gpu.py: max|ours - truth| <= 2 * max|torch_lp - truth| + floor, with truth the
fp32 reference (`_reference_kvcache`) and torch_lp the same attention in the input dtype. Outputs come from
fresh allocations the kernels must fully write (a NaN-poisoned cache past the valid rows checks that no
unattended row leaks in).
"""

from __future__ import annotations

import pytest
import torch

import flash_attn4
from flash_attn4 import _build_info, _ops_kvcache
from flash_attn4._reference_kvcache import attention_kvcache_ref

DEVICE = torch.device("cuda")


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not _build_info.DECODE_HDIMS:
        return f"no decode kernel built (head dims {_build_info.HDIMS})"
    q = torch.empty(1, 1, 1, _build_info.DECODE_HDIMS[0], dtype=torch.bfloat16, device=DEVICE)
    ok, why = _ops_kvcache.decode_available(q)
    return None if ok else why


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))
_BUILT = _build_info.DECODE_HDIMS
HDIM = 128 if 128 in _BUILT or not _BUILT else _BUILT[0]


def _check(out, lse, ref_out, ref_lse, lp_out):
    out, ref_out, lp_out = out.float(), ref_out.float(), lp_out.float()
    assert not torch.isnan(out).any()
    floor = (ref_out.bfloat16().float() - ref_out).abs().max().item() + 1e-5
    tol = 2 * (lp_out - ref_out).abs().max().item() + floor
    err = (out - ref_out).abs().max().item()
    assert err <= tol, f"out error {err} > {tol}"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    assert (lse[fin] - ref_lse[fin].float()).abs().max().item() <= 1e-3 * max(
        1.0, ref_lse[fin].abs().max().item()
    )


def _make_cache(b, cap, hk, d, paged_size, dtype=torch.bfloat16):
    """Cache tensors (poisoned with NaN past what the test fills) and a page table (shuffled pages)."""
    if paged_size:
        max_pages = (cap + paged_size - 1) // paged_size
        num_pages = b * max_pages + 3
        kc = torch.randn(num_pages, paged_size, hk, d, device=DEVICE, dtype=dtype)
        vc = torch.randn_like(kc)
        pt = torch.randperm(num_pages, device=DEVICE)[: b * max_pages].view(b, max_pages).to(torch.int32)
        return kc, vc, pt
    kc = torch.randn(b, cap, hk, d, device=DEVICE, dtype=dtype)
    return kc, torch.randn_like(kc), None


CASES = [
    # b, sq, hq, hk, cap, page, causal, window, softcap, splits
    (1, 1, 32, 8, 4099, 0, True, (-1, -1), 0.0, 0),
    (4, 1, 8, 8, 1000, 0, True, (-1, -1), 0.0, 0),
    (3, 4, 16, 2, 777, 0, True, (-1, -1), 0.0, 3),
    (2, 1, 8, 1, 513, 0, False, (-1, -1), 30.0, 0),
    (2, 5, 8, 4, 300, 0, True, (64, 0), 0.0, 2),
    (2, 1, 32, 8, 2048, 16, True, (-1, -1), 0.0, 0),
    (3, 2, 8, 2, 999, 1, True, (-1, -1), 0.0, 4),
    (2, 1, 8, 8, 1024, 64, True, (-1, -1), 0.0, 0),
    (2, 128, 8, 2, 700, 256, True, (-1, -1), 0.0, 0),
    (64, 1, 8, 8, 65, 0, True, (-1, -1), 0.0, 0),
    # One CTA over thousands of pages: the shared-memory page-id ring refills many times.
    (2, 1, 8, 2, 5000, 1, True, (-1, -1), 0.0, 1),
    (1, 1, 8, 8, 20000, 3, True, (-1, -1), 0.0, 1),
]


@pytest.mark.parametrize("b,sq,hq,hk,cap,page,causal,window,softcap,splits", CASES)
@pytest.mark.parametrize("append", [False, True])
@pytest.mark.parametrize("rotary", [None, "halves", "interleaved"])
def test_kvcache_matches_reference(b, sq, hq, hk, cap, page, causal, window, softcap, splits, append, rotary):
    if rotary and not append:
        pytest.skip("rotary applies with appended k / v")
    d = HDIM
    kc, vc, pt = _make_cache(b, cap, hk, d, page)
    q = torch.randn(b, sq, hq, d, device=DEVICE, dtype=torch.bfloat16)
    sn = sq if append else 0
    k = torch.randn(b, sn, hk, d, device=DEVICE, dtype=torch.bfloat16) if append else None
    v = torch.randn_like(k) if append else None
    seqlens = torch.randint(0, cap - sn + 1, (b,), device=DEVICE, dtype=torch.int32)
    seqlens[0] = cap - sn  # one full sequence
    cos = sin = None
    if rotary:
        ang = torch.rand(cap + 8, d // 4, device=DEVICE) * 6.28
        cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    kw = dict(
        cache_seqlens=seqlens,
        page_table=pt,
        rotary_cos=cos,
        rotary_sin=sin,
        rotary_interleaved=rotary == "interleaved",
        causal=causal,
        window_size=window,
        softcap=softcap,
    )
    kc_ref, vc_ref = kc.clone(), vc.clone()
    kc0, vc0 = kc.clone(), vc.clone()
    out, lse = flash_attn4.attn_with_kvcache(q, kc, vc, k, v, num_splits=splits, return_lse=True, **kw)
    kw.pop("window_size")
    ref_out, ref_lse = attention_kvcache_ref(q, kc_ref, vc_ref, k, v, window_size=window, **kw)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref), "appended cache differs from the reference"
    lp_out, _ = _lp(q, kc0, vc0, k, v, kw, window)  # torch's own bf16 error, which the rule scales
    _check(out, lse, ref_out, ref_lse, lp_out)


def _lp(q, kc, vc, k, v, kw, window):
    """The same call with the attention in bf16 (reference.attention_ref with upcast=False)."""
    from flash_attn4 import reference

    orig = reference.attention_ref
    reference.attention_ref = lambda *a, **kk: orig(*a, **{**kk, "upcast": False})
    try:
        return attention_kvcache_ref(q, kc.clone(), vc.clone(), k, v, window_size=window, **kw)
    finally:
        reference.attention_ref = orig


@pytest.mark.parametrize("sq,hq,hk,sk", [(1, 32, 8, 4096), (3, 8, 8, 1000), (16, 16, 4, 257)])
@pytest.mark.parametrize("splits", [0, 1, 5])
def test_attn_short_queries_run_decode(sq, hq, hk, sk, splits):
    q = torch.randn(2, sq, hq, HDIM, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(2, sk, hk, HDIM, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out, lse = flash_attn4.attn(q, k, v, causal=True, num_splits=splits, return_lse=True)
    from flash_attn4.reference import attention_ref

    ref, ref_lse = attention_ref(q, k, v, causal=True)
    lp, _ = attention_ref(q, k, v, causal=True, upcast=False)
    _check(out, lse, ref, ref_lse, lp)


@pytest.mark.parametrize("lens_q,lens_k,hq,hk", [([1] * 9, [700, 1, 0, 33, 4096, 5, 64, 65, 999], 32, 8),
                                                  ([2, 0, 3, 1], [17, 300, 3, 1000], 8, 2)])  # fmt: skip
@pytest.mark.parametrize("splits", [0, 1, 4])
def test_attn_varlen_short_queries_run_decode(lens_q, lens_k, hq, hk, splits):
    """A packed decode batch on the decode kernel (one cache row, sequences by leftpad / seqlens), scattered
    back; forward against the packed reference, and the packed backward runs on its out / lse."""
    from flash_attn4.reference import attention_varlen_ref

    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,  # noqa: E731
                                   device=DEVICE)  # fmt: skip
    q = torch.randn(sum(lens_q), hq, HDIM, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(sum(lens_k), hk, HDIM, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cq, ck = cu(lens_q), cu(lens_k)
    mq, mk = max(lens_q), max(lens_k)
    kw = {"causal": True, "num_splits": splits, "return_lse": True}
    out, lse = flash_attn4.attn_varlen(q, k, v, cq, ck, mq, mk, **kw)
    ref, ref_lse = attention_varlen_ref(q.detach(), k, v, cq, ck, causal=True)
    lp, _ = attention_varlen_ref(q.detach(), k, v, cq, ck, causal=True, upcast=False)
    _check(out, lse, ref, ref_lse, lp)
    out.float().sum().backward()
    assert torch.isfinite(q.grad).all()


def test_eager_shortcut_equals_the_dispatched_op():
    """The public functions skip the dispatcher when nothing needs it; the op gives the same bits."""
    from flash_attn4 import _ops

    q = torch.randn(2, 1, 8, HDIM, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(2, 300, 2, HDIM, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    assert _ops.eager_direct(q, k, v)
    assert not _ops.eager_direct(q.requires_grad_(), k, v)
    q = q.detach()
    with torch.no_grad():
        assert _ops.eager_direct(q.requires_grad_(), k, v)
    q = q.detach()
    lens = torch.tensor([300, 17], device=DEVICE, dtype=torch.int32)
    direct = flash_attn4.attn_with_kvcache(q, k, v, cache_seqlens=lens)
    op, _ = torch.ops.flash_attn4.fwd_kvcache(
        q, k, v, None, None, lens, None, None, None, None, None, False, HDIM**-0.5, True, -1, 0, 0.0, 0
    )
    assert torch.equal(direct, op)
    out_direct = flash_attn4.attn(q, k, v, causal=True)
    out_op, _ = torch.ops.flash_attn4.fwd(q, k, v, HDIM**-0.5, True, -1, 0, 0.0, False, 0)
    assert torch.equal(out_direct, out_op)


@pytest.mark.parametrize(
    "causal, window, softcap", [(True, (-1, -1), 0.0), (True, (37, 0), 30.0), (False, (5, 9), 0.0)]
)
def test_decode_step_equals_attn_with_kvcache(causal, window, softcap):
    """The HF integration's shortcut (no Python checks) computes what the public function does, on the
    transposed (batch, heads, seqlen, dim) views HF hands over; a call it cannot take falls back."""
    from flash_attn4.kvcache import decode_step

    b, hq, hk, cap = 3, 8, 2, 300
    q = torch.randn(b, hq, 1, HDIM, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(b, hk, cap, HDIM, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn_like(k)
    lens = torch.tensor([300, 17, 250], device=DEVICE, dtype=torch.int32)
    leftpad = torch.tensor([0, 3, 100], device=DEVICE, dtype=torch.int32)
    kw = dict(causal=causal, window_size=window, softcap=softcap, softmax_scale=0.1)
    want = flash_attn4.attn_with_kvcache(q, k, v, cache_seqlens=lens, cache_leftpad=leftpad, **kw)
    assert torch.equal(decode_step(q, k, v, lens, leftpad, **kw), want)
    ref, _ = attention_kvcache_ref(q, k, v, cache_seqlens=lens, cache_leftpad=leftpad, causal=causal,
                                   window_size=window, softcap=softcap, softmax_scale=0.1)  # fmt: skip
    assert (want.float() - ref.float()).abs().max().item() < 2e-2
    sinks = torch.randn(hq, device=DEVICE)  # an option it leaves to the public function
    assert torch.equal(
        decode_step(q, k, v, lens, leftpad, sinks=sinks, **kw),
        flash_attn4.attn_with_kvcache(q, k, v, cache_seqlens=lens, cache_leftpad=leftpad, sinks=sinks, **kw),
    )


def test_lying_values_do_not_fault():
    b, hk, d = 3, 2, HDIM
    kc, vc, pt = _make_cache(b, 256, hk, d, 16)
    q = torch.randn(b, 1, 4, d, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(b, 1, hk, d, device=DEVICE, dtype=torch.bfloat16)
    pt[0, 3] = -5
    pt[1, 0] = 10**6
    seqlens = torch.tensor([100, 10**9, -7], device=DEVICE, dtype=torch.int32)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    out, lse = flash_attn4.attn_with_kvcache(
        q, kc, vc, k, k, cache_seqlens=seqlens, page_table=pt, return_lse=True
    )
    ref_out, ref_lse = attention_kvcache_ref(q, kc_ref, vc_ref, k, k, cache_seqlens=seqlens, page_table=pt)
    torch.cuda.synchronize()
    assert torch.equal(kc, kc_ref)
    assert (out.float() - ref_out.float()).abs().max().item() < 2e-2


def test_cuda_graph_replay_with_new_lengths():
    b, cap, hk, d = 4, 1024, 2, HDIM
    kc, vc, _ = _make_cache(b, cap, hk, d, 0)
    q = torch.randn(b, 1, 8, d, device=DEVICE, dtype=torch.bfloat16)
    seqlens = torch.full((b,), 10, device=DEVICE, dtype=torch.int32)
    flash_attn4.attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = flash_attn4.attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)
    for lens in ([5, 900, 1, 1024], [1000, 3, 77, 512]):
        seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        g.replay()
        ref, _ = attention_kvcache_ref(q, kc, vc, cache_seqlens=seqlens)
        assert (out.float() - ref.float()).abs().max().item() < 2e-2


def test_merge_attn_states_matches_whole():
    q = torch.randn(2, 3, 4, HDIM, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(2, 300, 4, HDIM, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    oa, la = flash_attn4.attn(q, k[:, :100], v[:, :100], return_lse=True)
    ob, lb = flash_attn4.attn(q, k[:, 100:], v[:, 100:], return_lse=True)
    o, l_ = flash_attn4.merge_attn_states(oa, la, ob, lb)
    ref, ref_l = flash_attn4.attn(q, k, v, return_lse=True)
    assert (o.float() - ref.float()).abs().max().item() < 2e-2
    assert (l_ - ref_l).abs().max().item() < 1e-3


FP8_CASES = [
    # b, sq, hq, hk, cap, page, causal, softcap, splits
    (1, 1, 32, 8, 4099, 0, True, 0.0, 0),
    (3, 4, 16, 2, 777, 0, True, 0.0, 3),
    (2, 1, 8, 1, 513, 0, False, 30.0, 0),
    (2, 1, 32, 8, 2048, 16, True, 0.0, 0),
    (3, 2, 8, 2, 999, 1, True, 0.0, 4),
]


@pytest.mark.skipif(HDIM not in _build_info.DECODE_KV8_HDIMS, reason="no fp8-cache decode kernel built")
@pytest.mark.parametrize("b,sq,hq,hk,cap,page,causal,softcap,splits", FP8_CASES)
@pytest.mark.parametrize("append", [False, True])
def test_fp8_cache_matches_reference(b, sq, hq, hk, cap, page, causal, softcap, splits, append):
    """e4m3 caches with per-(sequence, kv head) scales: the kernel against the reference over the dequantized
    cache (fp32), appended rows byte for byte."""
    fp8, d = torch.float8_e4m3fn, HDIM
    kc, vc, pt = _make_cache(b, cap, hk, d, page, dtype=torch.float32)
    # Scales large enough that every quantized value stays inside e4m3's range (|x| <= 448; past it the cast
    # gives NaN): |randn| < 6 over the smallest scale 0.02 is at most 300.
    kd = torch.rand(b, hk, device=DEVICE) * 0.02 + 0.02
    vd = torch.rand(b, hk, device=DEVICE) * 0.02 + 0.02
    rows = pt if pt is not None else torch.arange(b, device=DEVICE)[:, None]
    # Quantize with sequence b's scales (each page belongs to one sequence; spare pages take sequence 0's).
    owner = torch.zeros(kc.shape[0], dtype=torch.long, device=DEVICE)
    owner[rows.long().flatten()] = torch.arange(b, device=DEVICE).repeat_interleave(rows.shape[1])
    kc8 = (kc / kd[owner][:, None, :, None]).to(fp8)
    vc8 = (vc / vd[owner][:, None, :, None]).to(fp8)
    q = torch.randn(b, sq, hq, d, device=DEVICE, dtype=torch.bfloat16)
    sn = sq if append else 0
    k = (torch.randn(b, sn, hk, d, device=DEVICE) / kd[:, None, :, None]).to(fp8) if append else None
    v = (torch.randn(b, sn, hk, d, device=DEVICE) / vd[:, None, :, None]).to(fp8) if append else None
    seqlens = torch.randint(0, cap - sn + 1, (b,), device=DEVICE, dtype=torch.int32)
    seqlens[0] = cap - sn
    kw = dict(
        cache_seqlens=seqlens, page_table=pt, causal=causal, softcap=softcap, k_descale=kd, v_descale=vd
    )
    kc_ref, vc_ref = kc8.clone(), vc8.clone()
    out, lse = flash_attn4.attn_with_kvcache(q, kc8, vc8, k, v, num_splits=splits, return_lse=True, **kw)
    ref_out, ref_lse = attention_kvcache_ref(q, kc_ref, vc_ref, k, v, **kw)
    assert torch.equal(kc8.view(torch.uint8), kc_ref.view(torch.uint8)), "appended cache differs"
    assert torch.equal(vc8.view(torch.uint8), vc_ref.view(torch.uint8)), "appended cache differs"
    # torch's own bf16 error: the same call over the dequantized caches rounded to bf16, attention in bf16.
    deq = [(c.float() * s[owner][:, None, :, None]).bfloat16() for c, s in ((kc_ref, kd), (vc_ref, vd))]
    lp_out, _ = _lp(q, *deq, None, None, dict(cache_seqlens=seqlens + sn, page_table=pt, causal=causal,
                                              softcap=softcap), (-1, -1))  # fmt: skip
    _check(out, lse, ref_out, ref_lse, lp_out)
