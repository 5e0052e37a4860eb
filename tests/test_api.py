"""Public API, every validation error, dispatch decisions, and the kernel-call plumbing (with a fake `_C`)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import flash_attn4
from flash_attn4 import _build_info, _ops, attn, interface
from flash_attn4._reference_kvcache import attention_kvcache_ref
from flash_attn4.reference import (
    attention_bwd_ref,
    attention_ref,
    attention_varlen_bwd_ref,
    attention_varlen_ref,
)

_VARLEN_KEYS = ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "max_seqlen_q", "max_seqlen_k")


def _qkv(b=2, sq=5, sk=7, hq=4, hk=2, d=16, dtype=torch.float32, **kw):
    return (
        torch.randn(b, sq, hq, d, dtype=dtype, **kw),
        torch.randn(b, sk, hk, d, dtype=dtype, **kw),
        torch.randn(b, sk, hk, d, dtype=dtype, **kw),
    )


def test_exports():
    assert flash_attn4.__version__ == "0.1.0"
    assert flash_attn4.attn is attn
    assert flash_attn4.reference.attention_ref is attention_ref
    assert isinstance(flash_attn4.is_built(), bool)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_shapes_and_dtypes(dtype):
    q, k, v = _qkv(dtype=dtype)
    out = attn(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape and out.dtype == dtype
    out2, lse = attn(q, k, v, return_lse=True)
    assert torch.equal(out, out2)
    assert lse.shape == (2, 4, 5)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)


def test_matches_reference_and_defaults():
    q, k, v = _qkv()
    out, lse = attn(q, k, v, causal=True, return_lse=True)
    ref_out, ref_lse = attention_ref(q, k, v, causal=True, softmax_scale=1 / math.sqrt(16))
    torch.testing.assert_close(out, ref_out, atol=0, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=0, rtol=0)


def test_causal_equals_right_window_zero():
    q, k, v = _qkv(sq=6, sk=9)
    a = attn(q, k, v, causal=True)
    torch.testing.assert_close(attn(q, k, v, window_size=(-1, 0)), a, atol=0, rtol=0)
    torch.testing.assert_close(attn(q, k, v, causal=True, window_size=(-1, 0)), a, atol=0, rtol=0)
    # causal combines with a left window; right -1 then means "causal decides".
    b = attn(q, k, v, causal=True, window_size=(2, -1))
    torch.testing.assert_close(attn(q, k, v, window_size=(2, 0)), b, atol=0, rtol=0)


def test_inputs_unchanged_and_any_strides():
    base = torch.randn(2, 7, 3, 4, 16)  # packed (b, s, 3, h, d)
    q, k, v = base.unbind(dim=2)
    qt = torch.randn(2, 7, 4, 16).transpose(-1, -2).contiguous().transpose(-1, -2)  # last dim not contiguous
    assert qt.stride(-1) != 1
    before = [(t.clone(), t.stride(), t.data_ptr()) for t in (q, k, v, qt)]
    out = attn(q, k, v, causal=True)
    out_t = attn(qt, k, v)
    for t, (val, stride, ptr) in zip((q, k, v, qt), before):
        assert torch.equal(t, val) and t.stride() == stride and t.data_ptr() == ptr
    torch.testing.assert_close(out, attn(q.contiguous(), k.contiguous(), v.contiguous(), causal=True))
    torch.testing.assert_close(out_t, attn(qt.contiguous(), k, v))


def test_empty_sequences():
    q, k, v = _qkv()
    out, lse = attn(q[:, :0], k, v, return_lse=True)
    assert out.shape == (2, 0, 4, 16) and lse.shape == (2, 4, 0)
    out, lse = attn(q, k[:, :0], v[:, :0], return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()
    out = attn(q[:0], k[:0], v[:0])
    assert out.shape == (0, 5, 4, 16)


def test_backward_on_cpu():
    q, k, v = _qkv(requires_grad=True)
    out, lse = attn(q, k, v, causal=True, return_lse=True)
    (out.square().sum() + lse.sum()).backward()
    assert all(t.grad is not None and t.grad.shape == t.shape for t in (q, k, v))


def test_torch_compile_fullgraph():
    q, k, v = _qkv(requires_grad=True)
    f = torch.compile(lambda q, k, v: attn(q, k, v, causal=True), backend="aot_eager", fullgraph=True)
    out = f(q, k, v)
    torch.testing.assert_close(out, attn(q, k, v, causal=True))
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    want = torch.autograd.grad(attn(q, k, v, causal=True).sum(), (q, k, v))
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w)


# --- validation: every error says what to change ---------------------------------------------------

_OK = _qkv()


def _with(i, t):
    args = list(_OK)
    args[i] = t
    return args


@pytest.mark.parametrize(
    "args, kwargs, exc, match",
    [
        (_with(0, [1.0]), {}, TypeError, "q must be a torch.Tensor"),
        (_with(1, torch.randn(2, 7, 16)), {}, ValueError, "k must be 4-D"),
        (_with(0, torch.randn(2, 5, 4, 16, 1)), {}, ValueError, "q must be 4-D"),
        (_with(1, torch.randn(2, 7, 2, 16, device="meta")), {}, ValueError, "one device"),
        (_with(2, torch.randn(2, 7, 2, 16, dtype=torch.float64)), {}, TypeError, "one dtype"),
        ([t.to(torch.int32) for t in _OK], {}, TypeError, "on CPU q, k, v must be"),
        (_with(2, torch.randn(2, 8, 2, 16)), {}, ValueError, "k and v must agree but in the last dim"),
        ([_OK[0], torch.randn(3, 7, 2, 16), torch.randn(3, 7, 2, 16)], {}, ValueError, "same batch size"),
        ([_OK[0], torch.randn(2, 7, 2, 8), torch.randn(2, 7, 2, 8)], {}, ValueError, "same headdim"),
        ([_OK[0], torch.randn(2, 7, 3, 16), torch.randn(2, 7, 3, 16)], {}, ValueError, "multiple of nheads"),
        ([_OK[0], torch.randn(2, 7, 0, 16), torch.randn(2, 7, 0, 16)], {}, ValueError, "multiple of nheads"),
        (
            [torch.randn(2, 5, 4, 0), torch.randn(2, 7, 2, 0), torch.randn(2, 7, 2, 0)],
            {},
            ValueError,
            "headdim",
        ),
        (_OK, {"causal": 1}, TypeError, "causal must be a bool"),
        (_OK, {"return_lse": None}, TypeError, "return_lse must be a bool"),
        (_OK, {"deterministic": "yes"}, TypeError, "deterministic must be a bool"),
        (_OK, {"window_size": 4}, ValueError, r"\(left, right\) pair"),
        (_OK, {"window_size": (1, 2, 3)}, ValueError, r"\(left, right\) pair"),
        (_OK, {"window_size": (1.5, 2)}, TypeError, "left must be an int"),
        (_OK, {"window_size": (1, True)}, TypeError, "right must be an int"),
        (_OK, {"window_size": (-2, 0)}, ValueError, "-1 for unbounded"),
        (_OK, {"causal": True, "window_size": (-1, 3)}, ValueError, "conflicts"),
        (_OK, {"softcap": -1.0}, ValueError, "softcap must be >= 0"),
        (_OK, {"softcap": math.inf}, ValueError, "finite"),
        (_OK, {"softcap": "1"}, TypeError, "softcap must be a real number"),
        (_OK, {"softmax_scale": 0.0}, ValueError, "softmax_scale must be > 0"),
        (_OK, {"softmax_scale": -0.1}, ValueError, "softmax_scale must be > 0"),
        (_OK, {"softmax_scale": math.nan}, ValueError, "finite"),
        (_OK, {"softmax_scale": True}, TypeError, "softmax_scale must be a real number"),
    ],
)
def test_validation_errors(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        attn(*args, **kwargs)


@pytest.mark.parametrize(
    "device, dtype, hdim, exc, match",
    [
        ("cuda", torch.float32, 64, TypeError, "float16 or bfloat16"),
        ("cuda", torch.bfloat16, 60, ValueError, "multiple of 8"),
        ("cuda", torch.float16, 264, ValueError, "multiple of 8 in"),
        ("xpu", torch.float16, 64, ValueError, "CUDA and CPU"),
        ("cpu", torch.int64, 64, TypeError, "on CPU"),
    ],
)
def test_device_rules(device, dtype, hdim, exc, match):
    with pytest.raises(exc, match=match):
        interface._validate_device_rules(device, dtype, hdim)


@pytest.mark.parametrize(
    "device, dtype, hdim",
    [("cuda", torch.bfloat16, 8), ("cuda", torch.float16, 256), ("cpu", torch.float64, 3)],
)
def test_device_rules_accept(device, dtype, hdim):
    interface._validate_device_rules(device, dtype, hdim)


# --- build info and dispatch ------------------------------------------------------------------------


def test_padded_hdim(monkeypatch):
    monkeypatch.setattr(_build_info, "HDIMS", (64, 96, 128, 256))
    assert [_build_info.padded_hdim(d) for d in (8, 64, 72, 96, 136, 256, 264, 60, 0)] == [
        64,
        64,
        96,
        96,
        256,
        256,
        None,
        None,
        None,
    ]


def test_cpu_never_uses_the_kernel():
    ok, why = _build_info.kernel_available(torch.device("cpu"), torch.bfloat16, 128)
    assert not ok and "reference" in why
    q, k, _ = _qkv(dtype=torch.bfloat16)
    assert _ops._kernel_plan(q, q.shape[1], k.shape[1], True, -1, 0) == (None, why)


def test_not_built_reason_says_how_to_build(monkeypatch):
    monkeypatch.setattr(_build_info, "BUILT", False)
    monkeypatch.setattr(_build_info, "REASON", "torch has no CUDA")
    _build_info.load_extension.cache_clear()
    try:
        ext, why = _build_info.load_extension()
        assert ext is None and "torch has no CUDA" in why and "--no-build-isolation" in why
        assert not _build_info.is_built()
    finally:
        _build_info.load_extension.cache_clear()


def test_warn_once_per_reason(monkeypatch):
    monkeypatch.setattr(_ops, "_warned", set())
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _ops._warn_once("reason A")
        _ops._warn_once("reason A")
        _ops._warn_once("reason B")
    assert [str(x.message) for x in w] == [
        "flash_attn4: using the slow PyTorch reference on CUDA: reason A",
        "flash_attn4: using the slow PyTorch reference on CUDA: reason B",
    ]
    assert all(issubclass(x.category, _ops.ReferenceFallbackWarning) for x in w)


# --- the kernel call, with a fake extension that checks the binding contract -------------------------


class FakeExt:
    """Stands in for flash_attn4._C: asserts the contract of `_C.fwd` and writes the reference result."""

    def __init__(self):
        self.calls = []

    @staticmethod
    def _options(causal, kw):
        assert set(kw) <= {"window_left", "window_right", "softcap", "kernel_arch", *_VARLEN_KEYS}
        assert kw.get("kernel_arch") in (80, 90)  # _build_info.kernel_arch decides; the binding only checks
        window = (kw.get("window_left", -1), kw.get("window_right", -1))
        assert not (causal and window != (-1, -1))  # the binding takes causal or a window, never both
        assert all(isinstance(w, int) for w in window) and isinstance(kw.get("softcap", 0.0), float)
        opts = {"causal": causal, "window_size": window, "softcap": kw.get("softcap", 0.0)}
        varlen = {n: kw[n] for n in ("seqused_q", "seqused_k") if kw.get(n) is not None}
        return opts, varlen, kw.get("cu_seqlens_q") is not None

    def fwd(self, q, k, v, out, lse, softmax_scale, causal, **kw):
        assert isinstance(softmax_scale, float) and isinstance(causal, bool)
        for t in (q, k, v):
            assert t.stride(-1) == 1 and all(s % 8 == 0 for s in t.stride()[:-1]) and t.data_ptr() % 16 == 0
            assert t.shape[-1] in _build_info.HDIMS
        opts, used, packed = self._options(causal, kw)
        assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
        if packed:
            assert lse.shape == (q.shape[1], q.shape[0]) and lse.is_contiguous()
            cu = (kw["cu_seqlens_q"], kw["cu_seqlens_k"])
            ref_out, ref_lse = attention_varlen_ref(q, k, v, *cu, softmax_scale=softmax_scale, **opts, **used)
        else:
            b, sq, hq, d = q.shape
            assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32 and lse.is_contiguous()
            ref_out, ref_lse = attention_ref(q, k, v, softmax_scale=softmax_scale, **opts)
        out.copy_(ref_out)
        lse.copy_(ref_lse)
        self.calls.append({"q": q, "k": k, "v": v, "scale": softmax_scale, **opts, "packed": packed})

    def bwd(self, dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal, deterministic, dlse, **kw):
        assert isinstance(softmax_scale, float) and isinstance(causal, bool)
        assert isinstance(deterministic, bool)
        for t in (dout, q, k, v, out):
            assert t.stride(-1) == 1 and all(s % 8 == 0 for s in t.stride()[:-1]) and t.data_ptr() % 16 == 0
            assert t.shape[-1] in _build_info.HDIMS
        for g, like in ((dq, q), (dk, k), (dv, v)):
            assert g.shape == like.shape and g.dtype == like.dtype and g.is_contiguous()
        assert lse.dtype == torch.float32 and lse.is_contiguous()
        assert dlse is None or (dlse.shape == lse.shape and dlse.dtype == torch.float32)
        opts, used, packed = self._options(causal, kw)
        if packed:
            cu = (kw["cu_seqlens_q"], kw["cu_seqlens_k"])
            dl = torch.zeros_like(lse) if dlse is None else dlse
            grads = attention_varlen_bwd_ref(
                dout, q, k, v, *cu, dlse=dl, softmax_scale=softmax_scale, **opts, **used
            )
        else:
            grads = attention_bwd_ref(dout, q, k, v, dlse=dlse, softmax_scale=softmax_scale, **opts)
        for g, r in zip((dq, dk, dv), grads):
            g.copy_(r)
        self.calls.append({"bwd": True, "q": q, "deterministic": deterministic, "dlse": dlse, **opts})

    def decode(self, q, k_cache, v_cache, out, lse, k_new, v_new, cache_seqlens, page_table, cache_batch_idx,
               cache_leftpad, rotary_cos, rotary_sin, rotary_interleaved, softmax_scale, causal, window_left,
               window_right, softcap, num_splits, k_descale=None, v_descale=None):  # fmt: skip
        """Short query blocks: `attn`'s (k / v a full contiguous cache) and `attn_varlen`'s (one packed cache
        row, sequences located by cache_seqlens / cache_leftpad / cache_batch_idx); nothing appended or
        rotated."""
        assert isinstance(softmax_scale, float) and isinstance(causal, bool) and isinstance(num_splits, int)
        assert not (causal and (window_left, window_right) != (-1, -1))
        assert (
            k_new is None
            and v_new is None
            and page_table is None
            and rotary_cos is None
            and rotary_sin is None
            and k_descale is None
            and v_descale is None
        )
        assert q.shape[-1] in _build_info.HDIMS and out.shape == q.shape and out.is_contiguous()
        b, sq, hq, d = q.shape
        assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32 and lse.is_contiguous()
        opts = {"causal": causal, "window_size": (window_left, window_right), "softcap": softcap}
        if cache_seqlens is None:
            assert cache_batch_idx is None and cache_leftpad is None
            ref_out, ref_lse = attention_ref(q, k_cache, v_cache, softmax_scale=softmax_scale, **opts)
        else:
            ref_out, ref_lse = attention_kvcache_ref(
                q, k_cache, v_cache, cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
                cache_leftpad=cache_leftpad, softmax_scale=softmax_scale, **opts,
            )  # fmt: skip
        out.copy_(ref_out)
        lse.copy_(ref_lse)
        self.calls.append(
            {
                "decode": True,
                "q": q,
                "k": k_cache,
                "v": v_cache,
                "scale": softmax_scale,
                "splits": num_splits,
                "varlen": cache_seqlens is not None,
                **opts,
            }
        )
        return max(num_splits, 1)


@pytest.fixture
def fake_ext(monkeypatch):
    ext = FakeExt()
    monkeypatch.setattr(_build_info, "load_extension", lambda: (ext, ""))
    monkeypatch.setattr(_build_info, "HDIMS", (64, 96, 128))
    monkeypatch.setattr(_build_info, "DECODE_HDIMS", (64, 128))
    monkeypatch.setattr(_build_info, "kernel_available", lambda device, dtype, hdim: (90, ""))
    return ext


def _poisoned(q):
    b, sq, hq, d = q.shape
    return torch.full_like(q, math.nan), torch.full((b, hq, sq), math.nan)


@pytest.mark.parametrize("hdim", [64, 80, 8])
def test_fwd_into_pads_head_dim(fake_ext, hdim):
    q, k, v = _qkv(d=hdim, dtype=torch.bfloat16)
    out, lse = _poisoned(q)
    _ops.fwd_into(q, k, v, out, lse, 0.25, _ops._Plan(90, True))
    (call,) = fake_ext.calls
    assert call["q"].shape[-1] == _build_info.padded_hdim(hdim) and call["scale"] == 0.25
    ref_out, ref_lse = attention_ref(q, k, v, causal=True, softmax_scale=0.25)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)


def _misaligned(shape, how):
    b, s, h, d = shape
    if how == "offset":  # base address 2 bytes past a 16-byte boundary
        return torch.randn(b * s * h * d + 1, dtype=torch.bfloat16)[1:].view(b, s, h, d)
    if how == "row_stride":  # rows h * d + 4 elements apart: not a multiple of 8
        return torch.randn(b, s, h * d + 4, dtype=torch.bfloat16)[..., : h * d].view(b, s, h, d)
    if how == "expanded":
        return torch.randn(1, s, h, d, dtype=torch.bfloat16).expand(b, s, h, d)
    if how == "last_dim":
        return torch.randn(b, s, h, d, dtype=torch.bfloat16).transpose(-1, -2).contiguous().transpose(-1, -2)
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["offset", "row_stride", "expanded", "last_dim"])
def test_fwd_into_copies_only_what_violates_tma_rules(fake_ext, how):
    qkv = torch.randn(2, 9, 3, 4, 64, dtype=torch.bfloat16)
    q = qkv[:, :, 0]  # strided but TMA-legal: must be passed through without a copy
    k = _misaligned((2, 9, 4, 64), how)
    v = qkv[:, :, 2]
    k_before = k.clone()
    out, lse = _poisoned(q)
    _ops.fwd_into(q, k, v, out, lse, 0.125, _ops._Plan(90, False))
    (call,) = fake_ext.calls
    assert call["q"].data_ptr() == q.data_ptr() and call["v"].data_ptr() == v.data_ptr()
    assert call["k"].data_ptr() != k.data_ptr()
    assert torch.equal(k, k_before)
    torch.testing.assert_close(out, attention_ref(q, k, v, softmax_scale=0.125)[0])


def test_fwd_into_rejects_bad_outputs(fake_ext):
    q, k, v = _qkv(d=64, dtype=torch.bfloat16)
    out, lse = _poisoned(q)
    with pytest.raises(ValueError, match="out must be"):
        _ops.fwd_into(q, k, v, out.float(), lse, 0.1, _ops._Plan(90, False))
    with pytest.raises(ValueError, match="lse must be"):
        _ops.fwd_into(q, k, v, out, lse.transpose(1, 2).contiguous(), 0.1, _ops._Plan(90, False))


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("hdim", [64, 40])
def test_kernel_path_backward_goes_to_bwd_kernel(fake_ext, deterministic, hdim):
    q, k, v = _qkv(sq=6, sk=9, d=hdim, dtype=torch.bfloat16, requires_grad=True)
    out, lse = attn(q, k, v, causal=True, return_lse=True, deterministic=deterministic)
    assert fake_ext.calls and fake_ext.calls[-1]["causal"] is True
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    dq, dk, dv = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    call = fake_ext.calls[-1]
    assert call.get("bwd") and call["deterministic"] is deterministic and call["dlse"] is not None
    assert call["q"].shape[-1] == 64  # hdim 40 padded to the backward's 64
    ref = attention_bwd_ref(dout, q.detach(), k.detach(), v.detach(), dlse=dlse, causal=True)
    for g, r in zip((dq, dk, dv), ref):
        torch.testing.assert_close(g, r.to(g.dtype), atol=2e-2, rtol=2e-2)


def test_kernel_path_backward_without_lse_grad_passes_none(fake_ext):
    q, k, v = _qkv(sq=5, sk=5, d=128, dtype=torch.bfloat16, requires_grad=True)
    attn(q, k, v).sum().backward()
    assert fake_ext.calls[-1].get("bwd") and fake_ext.calls[-1]["dlse"] is None


@pytest.mark.parametrize(
    "kw, kernel_causal, kernel_window",
    [
        ({}, False, (-1, -1)),
        ({"causal": True}, True, (-1, -1)),
        ({"window_size": (-1, 0)}, True, (-1, -1)),
        ({"window_size": (8, -1)}, False, (-1, -1)),  # as wide as the keys: no window at all
        ({"window_size": (2, -1)}, False, (2, -1)),
        ({"window_size": (2, -1), "causal": True}, False, (2, 0)),
        ({"softcap": 2.0}, False, (-1, -1)),
    ],
)
def test_kernel_plan_features(fake_ext, kw, kernel_causal, kernel_window):
    q, k, v = _qkv(sq=6, sk=9, d=64, dtype=torch.bfloat16)
    out = attn(q, k, v, **kw)
    call = fake_ext.calls[-1]
    assert call["causal"] is kernel_causal and call["window_size"] == kernel_window
    assert call["softcap"] == kw.get("softcap", 0.0)
    ref = attention_ref(
        q,
        k,
        v,
        causal=kw.get("causal", False),
        window_size=kw.get("window_size", (-1, -1)),
        softcap=kw.get("softcap", 0.0),
    )[0]
    torch.testing.assert_close(out, ref)


# --- which kernel family serves a device (flash_attn4._build_info.kernel_arch) ------------------------


@pytest.mark.parametrize(
    "capability, archs, force, want",
    [
        ((9, 0), ("sm90",), False, 90),
        ((9, 0), ("sm90", "sm80"), True, 80),  # FLASH_ATTN4_FORCE_SM80=1 runs the Ampere path on Hopper
        ((9, 0), ("sm90",), True, None),  # forced, but this build has no sm80 kernels
        ((8, 0), ("sm90", "sm80"), False, 80),
        ((8, 9), ("sm90", "sm80"), False, 80),
        ((8, 6), ("sm90",), False, None),
        ((7, 5), ("sm90", "sm80"), False, None),
    ],
)
def test_kernel_arch_dispatch(monkeypatch, capability, archs, force, want):
    monkeypatch.setattr(_build_info, "_capability", lambda index: capability)
    monkeypatch.setattr(_build_info, "ARCHS", archs)
    monkeypatch.setattr(_build_info, "TARGETS", (80, 90) if "sm80" in archs else (90,))
    monkeypatch.setenv("FLASH_ATTN4_FORCE_SM80", "1" if force else "0")
    arch, why = _build_info.kernel_arch(torch.device("cuda", 0))
    assert arch == want
    assert (why == "") == (want is not None)
    if want is None and capability[0] >= 8:
        assert "rebuild" in why or "pip install" in why


@pytest.mark.parametrize(
    "capability, targets, want, binary",
    [
        ((8, 6), (86, 120), 80, "sm_86 SASS"),
        ((8, 9), (86,), 80, "sm_86 SASS"),  # SASS of an earlier minor version of the same major
        ((12, 0), (80, 120), 80, "sm_120 SASS"),
        ((12, 1), (80,), 80, "compute_80 PTX"),  # no SASS for its major: the PTX, compiled at load time
        ((8, 0), (86,), None, ""),  # below every target: a rebuild is needed
    ],
)
def test_consumer_gpus_run_the_ampere_path(monkeypatch, capability, targets, want, binary):
    monkeypatch.setattr(_build_info, "_capability", lambda index: capability)
    monkeypatch.setattr(_build_info, "ARCHS", ("sm80",))
    monkeypatch.setattr(_build_info, "TARGETS", targets)
    arch, why = _build_info.kernel_arch(torch.device("cuda", 0))
    assert arch == want
    if want is None:
        assert "FLASH_ATTN4_ARCHS including 80" in why
    else:
        assert _build_info.binary_for(*capability).startswith(binary)


@pytest.mark.parametrize("num_splits", [0, 3])
def test_varlen_short_queries_go_to_the_decode_kernel(fake_ext, num_splits):
    """max_seqlen_q x group <= 64 (decoding a packed batch): the decode kernel over the packed k / v as one
    cache row, with no offset read on the host; the result scattered back equals the packed reference, and
    the gradient comes from the packed backward."""
    lens_q, lens_k = [1, 3, 0, 2], [10, 40, 5, 1]
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    q = torch.randn(sum(lens_q), 8, 64, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(sum(lens_k), 2, 64, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(sum(lens_k), 2, 64, dtype=torch.bfloat16, requires_grad=True)
    for kw in ({"causal": True}, {"window_size": (4, 1), "softcap": 3.0}):
        out, lse = flash_attn4.attn_varlen(q, k, v, cu(lens_q), cu(lens_k), 3, 40, num_splits=num_splits,
                                           return_lse=True, **kw)  # fmt: skip
        call = fake_ext.calls[-1]
        assert call["decode"] and call["varlen"] and call["q"].shape == (4, 3, 8, 64)
        ref_out, ref_lse = attention_varlen_ref(
            q.detach(), k.detach(), v.detach(), cu(lens_q), cu(lens_k), **kw
        )
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(lse, ref_lse.float())
    out.float().sum().backward()
    assert fake_ext.calls[-1].get("bwd") and q.grad is not None


def test_varlen_goes_to_the_kernel_forward_and_backward(fake_ext):
    """Packed batches reach `_C.fwd`/`_C.bwd` with the offsets (not read on the host), as the reference."""
    lens_q, lens_k = [5, 0, 9], [7, 3, 2]
    cu_q = torch.tensor([0, 5, 5, 14], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 10, 12], dtype=torch.int32)
    q = torch.randn(sum(lens_q), 4, 64, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(sum(lens_k), 2, 64, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(sum(lens_k), 2, 64, dtype=torch.bfloat16, requires_grad=True)
    kw = {"causal": True, "window_size": (3, -1), "softcap": 5.0}
    # max_seqlen_q 40 x GQA group 2 = 80 rows: past the decode kernel's 64, so the packed forward kernel.
    out = flash_attn4.attn_varlen(q, k, v, cu_q, cu_k, 40, 7, **kw)
    assert fake_ext.calls[-1]["packed"] and fake_ext.calls[-1]["window_size"] == (3, 0)
    dq, dk, dv = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    assert fake_ext.calls[-1].get("bwd")
    ref = attention_varlen_ref(q.detach(), k.detach(), v.detach(), cu_q, cu_k, **kw)[0]
    torch.testing.assert_close(out, ref)
