"""CPU tests of the decode API (`attn_with_kvcache`, `merge_attn_states`): semantics against the plain
attention reference, appends, paged caches, lying device values, validation messages, the torch.library op.
The CUDA kernels are compared with the same reference in test_decode_gpu.py."""

from __future__ import annotations

import math

import pytest
import torch

import flash_attn4
from flash_attn4.reference import attention_ref


def _cache(b=3, cap=40, hk=2, d=16, dtype=torch.float32):
    torch.manual_seed(0)
    return torch.randn(b, cap, hk, d, dtype=dtype), torch.randn(b, cap, hk, d, dtype=dtype)


def test_contiguous_cache_is_attention_over_the_filled_rows():
    kc, vc = _cache()
    q = torch.randn(3, 2, 4, 16)
    lens = torch.tensor([40, 7, 19], dtype=torch.int32)
    out, lse = flash_attn4.attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True, return_lse=True)
    for i, n in enumerate(lens.tolist()):
        ref, ref_lse = attention_ref(q[i : i + 1], kc[i : i + 1, :n], vc[i : i + 1, :n], causal=True)
        torch.testing.assert_close(out[i : i + 1], ref)
        torch.testing.assert_close(lse[i : i + 1], ref_lse)


def test_append_writes_the_cache_then_attends():
    kc, vc = _cache()
    q, k, v = torch.randn(3, 1, 4, 16), torch.randn(3, 1, 2, 16), torch.randn(3, 1, 2, 16)
    lens = torch.tensor([0, 5, 39], dtype=torch.int32)
    before = kc.clone()
    out = flash_attn4.attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens)
    for i, n in enumerate(lens.tolist()):
        assert torch.equal(kc[i, n], k[i, 0]) and torch.equal(vc[i, n], v[i, 0])
        assert torch.equal(kc[i, :n], before[i, :n]) and torch.equal(kc[i, n + 1 :], before[i, n + 1 :])
        ref, _ = attention_ref(q[i : i + 1], kc[i : i + 1, : n + 1], vc[i : i + 1, : n + 1], causal=True)
        torch.testing.assert_close(out[i : i + 1], ref)


@pytest.mark.parametrize("page", [1, 3, 16])
def test_paged_cache_equals_contiguous(page):
    b, cap, hk, d = 2, 48, 2, 16
    kc, vc = _cache(b, cap, hk, d)
    pages = cap // page
    perm = torch.randperm(b * pages)
    kp = torch.empty(b * pages, page, hk, d)
    vp = torch.empty_like(kp)
    kp[perm] = kc.reshape(b * pages, page, hk, d)
    vp[perm] = vc.reshape(b * pages, page, hk, d)
    pt = perm.view(b, pages).to(torch.int32)
    q = torch.randn(b, 1, 4, d)
    lens = torch.tensor([48, 29], dtype=torch.int32)
    want = flash_attn4.attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
    got = flash_attn4.attn_with_kvcache(q, kp, vp, cache_seqlens=lens, page_table=pt)
    torch.testing.assert_close(got, want)


def test_lying_lengths_are_clamped_and_bad_pages_read_zeros():
    kc, vc = _cache(b=2, cap=8)
    q = torch.randn(2, 1, 4, 16)
    out = flash_attn4.attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([10**9, -3], dtype=torch.int32))
    ref, _ = attention_ref(q[:1], kc[:1], vc[:1])
    torch.testing.assert_close(out[:1], ref)
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # no key: out = 0
    kp, vp = kc.view(4, 4, 2, 16), vc.view(4, 4, 2, 16)
    pt = torch.tensor([[0, 99], [-1, 2]], dtype=torch.int32)
    lens = torch.tensor([8, 8], dtype=torch.int32)
    paged = flash_attn4.attn_with_kvcache(q, kp, vp, cache_seqlens=lens, page_table=pt)
    zk = torch.cat([kp[0], torch.zeros_like(kp[0])])[None]  # page 99 is outside the pool: zeros
    zv = torch.cat([vp[0], torch.zeros_like(vp[0])])[None]
    torch.testing.assert_close(paged[:1], attention_ref(q[:1], zk, zv)[0])


def test_merge_attn_states_equals_attention_over_the_union():
    q, k, v = torch.randn(2, 3, 4, 16), torch.randn(2, 20, 4, 16), torch.randn(2, 20, 4, 16)
    a, la = attention_ref(q, k[:, :7], v[:, :7])
    b, lb = attention_ref(q, k[:, 7:], v[:, 7:])
    out, lse = flash_attn4.merge_attn_states(a, la, b, lb)
    ref, ref_lse = attention_ref(q, k, v)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)


def test_merge_attn_states_gradients():
    a, b = torch.randn(2, 1, 3, 2, 4, dtype=torch.float64, requires_grad=True)
    la, lb = torch.randn(2, 1, 2, 3, dtype=torch.float64, requires_grad=True)
    la = la.detach().index_fill(2, torch.tensor([0]), -math.inf).requires_grad_()  # one side sees no key
    assert torch.autograd.gradcheck(flash_attn4.merge_attn_states, (a, la, b, lb))


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(cache_seqlens=torch.zeros(2, dtype=torch.int64)), "int32"),
        (dict(cache_seqlens=torch.zeros(3, dtype=torch.int32)), "one per sequence"),
        (dict(cache_seqlens=0, page_table=torch.zeros(2, 4)), "page_table"),
        (dict(cache_seqlens=0, num_splits=-1), "num_splits"),
    ],
)
def test_bad_input_says_what_to_change(kw, match):
    kc, vc = _cache(b=2)
    q = torch.randn(2, 1, 4, 16)
    with pytest.raises((TypeError, ValueError), match=match):
        flash_attn4.attn_with_kvcache(q, kc, vc, **kw)


def test_op_passes_opcheck():
    kc, vc = _cache(b=2)
    q, k = torch.randn(2, 1, 4, 16), torch.randn(2, 1, 2, 16)
    lens = torch.tensor([3, 9], dtype=torch.int32)
    args = (q, kc, vc, k, k.clone(), lens, None, None, None, None, None, False, 0.25, True, -1, 0, 0.0, 0)
    torch.library.opcheck(torch.ops.flash_attn4.fwd_kvcache.default, args)


@pytest.fixture
def checks_on():
    flash_attn4.enable_checks()
    yield
    flash_attn4.enable_checks(False)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(cache_seqlens=torch.tensor([40, 41], dtype=torch.int32)), r"cache_seqlens\[1\] = 41"),
        (dict(cache_seqlens=torch.tensor([-1, 0], dtype=torch.int32)), r"cache_seqlens\[0\] = -1"),
        (
            dict(cache_seqlens=0, cache_batch_idx=torch.tensor([0, 5], dtype=torch.int32)),
            r"cache_batch_idx\[1\]",
        ),
        (dict(cache_seqlens=4, cache_leftpad=torch.tensor([0, 9], dtype=torch.int32)), r"cache_leftpad\[1\]"),
    ],
)
def test_opt_in_checks_name_the_lying_value(checks_on, kw, match):
    kc, vc = _cache(b=2)
    with pytest.raises(ValueError, match=match):
        flash_attn4.attn_with_kvcache(torch.randn(2, 1, 4, 16), kc, vc, **kw)


def test_opt_in_checks_paged_and_varlen(checks_on):
    kp, vp = torch.randn(4, 8, 2, 16), torch.randn(4, 8, 2, 16)
    pt = torch.tensor([[0, 1], [2, 7]], dtype=torch.int32)
    q = torch.randn(2, 1, 4, 16)
    flash_attn4.attn_with_kvcache(
        q, kp, vp, cache_seqlens=torch.tensor([16, 8], dtype=torch.int32), page_table=pt
    )
    with pytest.raises(ValueError, match=r"page_table\[1, 1\] = 7"):
        flash_attn4.attn_with_kvcache(
            q, kp, vp, cache_seqlens=torch.tensor([16, 9], dtype=torch.int32), page_table=pt
        )
    qv, kv = torch.randn(10, 2, 16), torch.randn(10, 2, 16)
    for cu, match in (([0, 6, 4], "decreases"), ([-2, 3, 10], "must be >= 0"), ([0, 3, 11], "past the 10")):
        c = torch.tensor(cu, dtype=torch.int32)
        with pytest.raises(ValueError, match=match):
            flash_attn4.attn_varlen(qv, kv, kv, c, c, 10, 10)
    ok = torch.tensor([0, 3, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="more than max_seqlen_q"):
        flash_attn4.attn_varlen(qv, kv, kv, ok, ok, 5, 10)
    flash_attn4.attn_varlen(qv, kv, kv, ok, ok, 7, 7)


def test_decode_step_falls_back_to_the_public_function():
    """Off the decode kernel (here: CPU tensors) `decode_step` is `attn_with_kvcache`, checks included."""
    from flash_attn4.kvcache import decode_step

    torch.manual_seed(3)
    q = torch.randn(2, 1, 4, 16)
    kc, vc = torch.randn(2, 9, 2, 16), torch.randn(2, 9, 2, 16)
    lens, leftpad = torch.tensor([9, 6], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
    kw = dict(causal=True, window_size=(4, 0), softcap=5.0)
    want = flash_attn4.attn_with_kvcache(q, kc, vc, cache_seqlens=lens, cache_leftpad=leftpad, **kw)
    torch.testing.assert_close(decode_step(q, kc, vc, lens, leftpad, **kw), want, atol=0, rtol=0)
    with pytest.raises(ValueError, match="nheads"):
        decode_step(q[:, :, :3], kc, vc, lens, leftpad, causal=True)


@pytest.mark.parametrize(
    "kw",
    [
        dict(causal=True),
        dict(causal=True, window_size=(37, 0), softcap=30.0, softmax_scale=0.1),
        dict(causal=False, window_size=(5, 9)),
    ],
)
def test_decode_step_shortcut_passes_what_the_public_function_passes(monkeypatch, kw):
    """Where the decode kernel takes the call, `decode_step` skips the Python checks and calls the kernels
    directly: the arguments must be those `attn_with_kvcache` hands them (checked here without a GPU by
    recording the kernel call)."""
    import inspect

    from flash_attn4 import _ops, _ops_kvcache
    from flash_attn4.kvcache import decode_step

    calls = []
    params = inspect.signature(_ops_kvcache.decode_into).parameters

    def record(*args, **kwargs):
        bound = dict(zip(params, args), **kwargs)
        calls.append({n: bound.get(n, p.default) for n, p in params.items() if n not in ("out", "lse")})
        return 1

    monkeypatch.setattr(_ops, "eager_direct", lambda *t: True)
    monkeypatch.setattr(_ops_kvcache, "decode_available", lambda q: (True, ""))
    monkeypatch.setattr(_ops_kvcache, "decode_into", record)
    q = torch.randn(2, 1, 4, 16, dtype=torch.bfloat16)
    kc, vc = torch.randn(2, 9, 2, 16, dtype=torch.bfloat16), torch.randn(2, 9, 2, 16, dtype=torch.bfloat16)
    lens, leftpad = torch.tensor([9, 6], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
    flash_attn4.attn_with_kvcache(q, kc, vc, cache_seqlens=lens, cache_leftpad=leftpad, **kw)
    decode_step(q, kc, vc, lens, leftpad, **kw)
    assert len(calls) == 2
    public, shortcut = calls
    assert public.keys() == shortcut.keys()
    for name in public:
        a, b = public[name], shortcut[name]
        assert (a is b) if isinstance(a, torch.Tensor) or a is None else (a == b and type(a) is type(b)), name
