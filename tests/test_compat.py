"""flash_attn4.compat: FlashAttention-2's call sites run unchanged. The signatures are FlashAttention-2's
(names, order, defaults, from flash_attn/flash_attn_interface.py); each function returns what the native API
returns for the same call; the packed forms pass gradients; what is not implemented raises."""

from __future__ import annotations

import inspect

import pytest
import torch

import flash_attn4
from flash_attn4 import compat, reference

_OPTS = (
    "dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, "
    "deterministic=False, return_attn_probs=False"
)
FA2_SIGNATURES = {  # flash_attn/flash_attn_interface.py (FlashAttention 2.x)
    "flash_attn_func": f"(q, k, v, {_OPTS})",
    "flash_attn_qkvpacked_func": f"(qkv, {_OPTS})",
    "flash_attn_kvpacked_func": f"(q, kv, {_OPTS})",
    "flash_attn_varlen_func": (
        f"(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, {_OPTS}, block_table=None)"
    ),
    "flash_attn_varlen_qkvpacked_func": f"(qkv, cu_seqlens, max_seqlen, {_OPTS})",
    "flash_attn_varlen_kvpacked_func": (
        f"(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, {_OPTS})"
    ),
    "flash_attn_with_kvcache": (
        "(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None, "
        "cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False, "
        "window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0, "
        "return_softmax_lse=False)"
    ),
}


@pytest.mark.parametrize("name", sorted(FA2_SIGNATURES))
def test_signature_is_flash_attention_2s(name):
    assert str(inspect.signature(getattr(compat, name))) == FA2_SIGNATURES[name]
    assert name in compat.__all__


def _qkv(b=2, sq=37, sk=53, hq=4, hk=2, d=32, grad=False):
    torch.manual_seed(0)
    q = torch.randn(b, sq, hq, d, requires_grad=grad)
    k, v = (torch.randn(b, sk, hk, d, requires_grad=grad) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(-1, -1), [8, 0]])
def test_flash_attn_func_positional_call_site(causal, window):
    q, k, v = _qkv()
    # A FlashAttention-2 call site: dropout_p, softmax_scale, causal positionally, window as a list.
    out = compat.flash_attn_func(q, k, v, 0.0, 0.2, causal, window, 0.0, None, False)
    want = flash_attn4.attn(q, k, v, softmax_scale=0.2, causal=causal, window_size=tuple(window))
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    ref, _ = reference.attention_ref(q, k, v, causal=causal, softmax_scale=0.2, window_size=tuple(window))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_return_attn_probs_gives_out_lse_and_none():
    q, k, v = _qkv()
    out, lse, s_dmask = compat.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    want_out, want_lse = flash_attn4.attn(q, k, v, causal=True, return_lse=True)
    assert s_dmask is None and lse.shape == (2, 4, 37)
    torch.testing.assert_close((out, lse), (want_out, want_lse), atol=0, rtol=0)


def test_packed_forms_equal_the_split_form_with_gradients():
    q, _, _ = _qkv(sk=37, hk=4, grad=True)
    qkv = torch.randn(2, 37, 3, 4, 32, requires_grad=True)
    out = compat.flash_attn_qkvpacked_func(qkv, causal=True)
    q2, k2, v2 = (t.detach().requires_grad_() for t in qkv.unbind(2))
    want = flash_attn4.attn(q2, k2, v2, causal=True)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    g = torch.randn_like(out)
    out.backward(g)
    want.backward(g)
    torch.testing.assert_close(qkv.grad, torch.stack([q2.grad, k2.grad, v2.grad], dim=2), atol=1e-6, rtol=0)

    kv = torch.randn(2, 53, 2, 2, 32, requires_grad=True)
    out = compat.flash_attn_kvpacked_func(q, kv, softmax_scale=0.3)
    torch.testing.assert_close(out, flash_attn4.attn(q, kv[:, :, 0], kv[:, :, 1], softmax_scale=0.3))
    out.sum().backward()
    assert kv.grad is not None and q.grad is not None


def _varlen(lens_q=(5, 0, 17), lens_k=(9, 3, 17), hq=4, hk=2, d=32):
    torch.manual_seed(1)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), hq, d)
    k, v = (torch.randn(int(cu_k[-1]), hk, d) for _ in range(2))
    return q, k, v, cu_q, cu_k, max(lens_q), max(lens_k)


def test_varlen_forms():
    q, k, v, cu_q, cu_k, mq, mk = _varlen()
    out, lse, none = compat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, 0.0, None, True,
                                                   return_attn_probs=True)  # fmt: skip
    want = flash_attn4.attn_varlen(q, k, v, cu_q, cu_k, mq, mk, causal=True, return_lse=True)
    assert none is None and lse.shape == (4, q.shape[0])
    torch.testing.assert_close((out, lse), want, atol=0, rtol=0)

    kv = torch.stack([k, v], dim=1)
    out = compat.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, mq, mk, causal=True)
    torch.testing.assert_close(out, want[0], atol=0, rtol=0)

    qkv = torch.randn(20, 3, 4, 32)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    out = compat.flash_attn_varlen_qkvpacked_func(qkv, cu, 13, softcap=5.0)
    torch.testing.assert_close(out, flash_attn4.attn_varlen(*qkv.unbind(1), cu, cu, 13, 13, softcap=5.0))


def test_with_kvcache_uses_flash_attention_2s_defaults():
    """causal=False and interleaved rotary by default (flash_attn4's own function defaults to causal and
    halves); k / v are appended in place; return_softmax_lse gives (out, lse)."""
    torch.manual_seed(2)
    b, cap, hq, hk, d = 2, 64, 4, 2, 32
    q = torch.randn(b, 3, hq, d)
    caches = [torch.randn(b, cap, hk, d) for _ in range(2)]
    k_new, v_new = (torch.randn(b, 3, hk, d) for _ in range(2))
    lens = torch.tensor([10, 40], dtype=torch.int32)
    cos, sin = torch.rand(cap, d // 4), torch.rand(cap, d // 4)
    ours_k, ours_v = (c.clone() for c in caches)
    out, lse = compat.flash_attn_with_kvcache(q, ours_k, ours_v, k_new, v_new, cos, sin, lens,
                                              return_softmax_lse=True)  # fmt: skip
    want_k, want_v = (c.clone() for c in caches)
    want = flash_attn4.attn_with_kvcache(q, want_k, want_v, k_new, v_new, cache_seqlens=lens, rotary_cos=cos,
                                         rotary_sin=sin, rotary_interleaved=True, causal=False,
                                         return_lse=True)  # fmt: skip
    torch.testing.assert_close((out, lse), want, atol=0, rtol=0)
    torch.testing.assert_close((ours_k, ours_v), (want_k, want_v), atol=0, rtol=0)
    assert not torch.equal(ours_k, caches[0])  # appended in place

    # No cache_seqlens: every row counts as filled (and appending then needs them).
    full = compat.flash_attn_with_kvcache(q, *caches, causal=True)
    torch.testing.assert_close(full, flash_attn4.attn(q, *caches, causal=True), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="cache_seqlens"):
        compat.flash_attn_with_kvcache(q, *caches, k_new, v_new)


def test_what_is_not_implemented_says_so():
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match="return_attn_probs"):
        compat.flash_attn_func(q, k, v, 0.1, return_attn_probs=True)
    qp, kp, vp, cu_q, cu_k, mq, mk = _varlen()
    with pytest.raises(NotImplementedError, match="block_table"):
        compat.flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, mq, mk, block_table=torch.zeros(3, 1))
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        compat.flash_attn_with_kvcache(q, k, v, cache_seqlens=10, alibi_slopes=torch.ones(4))
    slopes = torch.rand(4)
    torch.testing.assert_close(
        compat.flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, mq, mk, causal=True, alibi_slopes=slopes),
        flash_attn4.attn_varlen(qp, kp, vp, cu_q, cu_k, mq, mk, causal=True, alibi_slopes=slopes),
    )
