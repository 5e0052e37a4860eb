"""The reference (and the CPU path of the custom ops) against a naive float64 attention written here.

The reference computes by one of two routes (reference.py's docstring): torch's fused CPU attention kernel
("fused"), or chunked torch ops ("plain"), which also serves CUDA, softcap, upcast=False in fp16/bf16 and
autograd. Tests that take the `route` fixture run once per route (softcap and autograd stay plain
whatever the fixture says); the tests at the end check which route a call takes and each branch of the
fused route (its mask splits, GQA with and without the kernel's own support, window chunks, dlse).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flash_attn4 import _ops, _reference_fused, attn, reference
from flash_attn4.reference import attention_ref


def naive_attention(q, k, v, *, causal=False, scale=None, window=(-1, -1), softcap=0.0):
    """softmax(scale * q k^T + mask) v in float64 with k/v heads repeated: as plain as it gets.

    q (b, sq, hq, d), k/v (b, sk, hk, d) -> out (b, sq, hq, d) float64, lse (b, hq, sq) float64.
    """
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k = k.double().repeat_interleave(hq // hk, dim=2)
    v = v.double().repeat_interleave(hq // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq)[:, None] + (sk - sq)  # query i's position among the keys (bottom-right aligned)
    j = torch.arange(sk)[None, :]
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    if window[0] >= 0:
        allowed &= j >= i - window[0]
    if window[1] >= 0:
        allowed &= j <= i + window[1]
    s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # all-masked rows give NaN here: those rows are 0
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return out, lse


@contextlib.contextmanager
def _route(name):
    """Run the reference by the "fused" or the "plain" route."""
    old = _reference_fused._USE_FUSED_CPU
    _reference_fused._USE_FUSED_CPU = name == "fused"
    try:
        yield
    finally:
        _reference_fused._USE_FUSED_CPU = old


@pytest.fixture(params=["fused", "plain"])
def route(request):
    with _route(request.param):
        yield request.param


def _qkv(b, sq, sk, hq, hk, d, dtype=torch.float64, requires_grad=False):
    q = torch.randn(b, sq, hq, d, dtype=dtype, requires_grad=requires_grad)
    k = torch.randn(b, sk, hk, d, dtype=dtype, requires_grad=requires_grad)
    v = torch.randn(b, sk, hk, d, dtype=dtype, requires_grad=requires_grad)
    return q, k, v


def _assert_matches_naive(q, k, v, **kw):
    window = kw.pop("window_size", (-1, -1))
    out, lse = attention_ref(q, k, v, window_size=window, **kw)
    ref_out, ref_lse = naive_attention(
        q,
        k,
        v,
        causal=kw.get("causal", False),
        scale=kw.get("softmax_scale"),
        window=window,
        softcap=kw.get("softcap", 0.0),
    )
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float64 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=1e-10)  # -inf rows must match as -inf


@pytest.mark.parametrize("seqlens", [(1, 1), (1, 9), (9, 1), (5, 12), (12, 5), (17, 17), (64, 33)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_matches_naive(seqlens, causal, heads, route):
    sq, sk = seqlens
    _assert_matches_naive(*_qkv(2, sq, sk, heads[0], heads[1], 16), causal=causal)


@pytest.mark.parametrize("window", [(3, -1), (-1, 2), (2, 1), (0, 0), (4, 0), (20, 20)])
@pytest.mark.parametrize("seqlens", [(7, 7), (5, 13), (13, 5)])
@pytest.mark.parametrize("causal", [False, True])
def test_window(window, seqlens, causal, route):
    if causal and window[1] > 0:
        window = (window[0], 0)  # what interface.attn passes: causal=True means right = 0
    _assert_matches_naive(*_qkv(1, *seqlens, 4, 2, 8), causal=causal, window_size=window)


@pytest.mark.parametrize("softcap", [0.5, 3.0])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap_and_scale(softcap, causal):
    q, k, v = _qkv(2, 11, 6, 3, 1, 16)
    q = q * 4  # large scores, so the cap actually bends them
    _assert_matches_naive(q, k, v, causal=causal, softcap=softcap, softmax_scale=0.3)


def test_default_scale_is_one_over_sqrt_headdim():
    q, k, v = _qkv(1, 5, 5, 2, 2, 24)
    a, _ = attention_ref(q, k, v)
    b, _ = attention_ref(q, k, v, softmax_scale=1 / math.sqrt(24))
    torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize(
    "sq, sk, kw",
    [
        (9, 4, {"causal": True}),  # rows 0..4 sit before the first key
        (8, 3, {"causal": True, "window_size": (1, 0)}),
        (6, 6, {"window_size": (-1, -1), "causal": False}),  # control: no empty row
        (5, 0, {}),  # no keys at all
    ],
)
def test_rows_that_see_no_key(sq, sk, kw, route):
    q, k, v = _qkv(1, sq, sk, 2, 1, 8, requires_grad=True)
    out, lse = attn(q, k, v, return_lse=True, **kw)
    window = kw.get("window_size", (-1, -1))
    _, ref_lse = naive_attention(
        q.detach(), k.detach(), v.detach(), causal=kw.get("causal", False), window=window
    )
    empty = torch.isneginf(ref_lse)  # (b, h, sq)
    assert torch.equal(torch.isneginf(lse), empty)
    assert (out.permute(0, 2, 1, 3)[empty] == 0).all()
    assert not out.isnan().any() and not lse.isnan().any()
    (out.sum() + lse[~empty].sum()).backward()
    for t in (q, k, v):
        assert not t.grad.isnan().any()
    # An empty row contributes nothing: its query gets no gradient.
    assert (q.grad.permute(0, 2, 1, 3)[empty] == 0).all()


@pytest.mark.parametrize("window", [(7, -1), (-1, -1), (-1, 3), (4, 2)])
def test_chunking_is_invisible(monkeypatch, route, window):
    q, k, v = _qkv(2, 37, 29, 4, 2, 8)
    whole = attention_ref(q, k, v, causal=True, window_size=window)
    monkeypatch.setattr(reference, "_CHUNK_ELEMS", 2 * 4 * 29 * 3)  # <= 3 full rows a chunk, ragged last
    chunked = attention_ref(q, k, v, causal=True, window_size=window)
    # Up to float64 rounding: BLAS may block a smaller batch of rows differently (seen with torch 2.14).
    torch.testing.assert_close(chunked, whole, atol=1e-13, rtol=1e-12)


def test_long_sequence_fits(route):
    # 4224 x 4224 scores: the reference must chunk rather than hold everything at once.
    q, k, v = _qkv(1, 4224, 4224, 1, 1, 8, dtype=torch.float32)
    out, lse = attention_ref(q, k, v, causal=True)
    ref_out, ref_lse = naive_attention(q, k, v, causal=True)
    torch.testing.assert_close(out, ref_out.float(), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("upcast", [True, False])
def test_dtypes(dtype, upcast, route):
    q, k, v = _qkv(2, 19, 23, 4, 2, 16, dtype=dtype)
    out, lse = attention_ref(q, k, v, causal=True, upcast=upcast)
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref_out, ref_lse = naive_attention(q, k, v, causal=True)
    tol = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 6e-2}[dtype]
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "kw",
    [
        {"causal": False},
        {"causal": True},
        {"window_size": (2, 1)},
        {"softcap": 1.5, "causal": True},
        {"softmax_scale": 0.7, "window_size": (1, -1)},
    ],
    ids=["full", "causal", "window", "softcap", "scale"],
)
@pytest.mark.parametrize("seqlens", [(4, 6), (6, 4)])
def test_gradcheck_custom_op(kw, seqlens, route):
    """float64 gradcheck of the whole public path (custom op fwd + bwd), out and lse both."""
    sq, sk = seqlens
    q, k, v = _qkv(1, sq, sk, 4, 2, 8, requires_grad=True)
    mask = reference.visible_mask(
        sq, sk, causal=kw.get("causal", False), window_size=kw.get("window_size", (-1, -1))
    )
    return_lse = mask is None or bool(mask.any(dim=1).all())  # lse of an empty row is a constant -inf
    torch.autograd.gradcheck(lambda q, k, v: attn(q, k, v, return_lse=return_lse, **kw), (q, k, v))


def test_gradients_match_naive_autograd(route):
    q, k, v = _qkv(2, 7, 9, 6, 2, 8, requires_grad=True)
    out, lse = attn(q, k, v, causal=True, softcap=2.0, return_lse=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    ref_out, ref_lse = naive_attention(q, k, v, causal=True, softcap=2.0)
    ref_grads = torch.autograd.grad((ref_out, ref_lse), (q, k, v), (dout, dlse))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_fwd(dtype, requires_grad):
    q, k, v = _qkv(2, 5, 7, 4, 2, 8, dtype=dtype, requires_grad=requires_grad)
    for args in [(0.3, True, -1, 0, 0.0, False), (0.3, False, 2, 1, 1.5, True)]:
        torch.library.opcheck(torch.ops.flash_attn4.fwd.default, (q, k, v, *args))


def test_opcheck_bwd():
    q, k, v = _qkv(2, 5, 7, 4, 2, 8)
    out, lse = torch.ops.flash_attn4.fwd(q, k, v, 0.3, True, -1, 0, 0.0, False)
    for dlse in (torch.randn_like(lse), None):
        args = (torch.randn_like(out), dlse, q, k, v, out, lse, 0.3, True, -1, 0, 0.0, False)
        torch.library.opcheck(torch.ops.flash_attn4.bwd.default, args)


def test_gradients_keep_a_transposed_inputs_layout():
    # (batch, heads, seqlen, d) tensors handed over as .transpose(1, 2), as HuggingFace does: the gradients
    # come back in that layout (no copy for whatever runs next), and the fake kernel says the same strides.
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in _qkv(2, 5, 7, 4, 2, 8))
    out, lse = torch.ops.flash_attn4.fwd(q, k, v, 0.3, True, -1, 0, 0.0, False)
    args = (torch.randn_like(out), None, q, k, v, out, lse, 0.3, True, -1, 0, 0.0, False)
    grads = torch.ops.flash_attn4.bwd(*args)
    for g, t in zip(grads, (q, k, v)):
        assert g.stride() == t.stride()
    torch.library.opcheck(torch.ops.flash_attn4.bwd.default, args)


@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, 2),
    sq=st.integers(1, 40),
    sk=st.integers(1, 40),
    hk=st.integers(1, 3),
    group=st.integers(1, 3),
    d=st.integers(1, 20),
    causal=st.booleans(),
    left=st.integers(-1, 45),
    right=st.integers(-1, 45),
    softcap=st.sampled_from([0.0, 0.0, 0.7, 5.0]),
    fused=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_hypothesis_shapes(b, sq, sk, hk, group, d, causal, left, right, softcap, fused, seed):
    torch.manual_seed(seed)
    if causal:
        right = min(right, 0)
    with _route("fused" if fused else "plain"):
        _assert_matches_naive(
            *_qkv(b, sq, sk, hk * group, hk, d), causal=causal, window_size=(left, right), softcap=softcap
        )


@pytest.mark.parametrize(
    "sq, sk, causal, window, expected",
    [
        (8, 8, False, (-1, -1), (-1, -1)),
        (8, 8, True, (-1, -1), (-1, 0)),
        (8, 8, False, (-1, 0), (-1, 0)),
        (8, 8, False, (7, 7), (-1, -1)),  # windows as wide as the problem mask nothing
        (8, 8, False, (6, 6), (6, 6)),
        (1, 100, True, (-1, -1), (-1, -1)),  # one query row at the end sees every key
        (5, 100, False, (-1, 3), (-1, 3)),
        (5, 100, False, (-1, 4), (-1, -1)),
        (100, 5, False, (4, -1), (-1, -1)),
    ],
)
def test_effective_mask(sq, sk, causal, window, expected):
    assert _ops._effective_mask(sq, sk, causal, *window) == expected
    # And the claim behind it: the effective mask is the same mask.
    a = reference.visible_mask(sq, sk, causal=causal, window_size=window)
    e = reference.visible_mask(sq, sk, window_size=expected)
    full = torch.ones(sq, sk, dtype=torch.bool)
    assert torch.equal(full if a is None else a, full if e is None else e)


@pytest.mark.parametrize(
    "sq, sk, kw",
    [
        (7, 9, {"causal": True}),
        (9, 4, {"causal": True}),  # rows that see no key
        (8, 8, {"window_size": (2, 1), "softcap": 1.5}),
        (6, 11, {"window_size": (-1, 3), "softmax_scale": 0.5}),
    ],
)
@pytest.mark.parametrize("chunk_rows", [None, 2])
def test_bwd_ref_matches_autograd_of_ref(sq, sk, kw, chunk_rows, monkeypatch, route):
    """attention_bwd_ref (the written-out backward, by either route) is the derivative of attention_ref
    (autograd through the plain route), chunked or not."""
    if chunk_rows is not None:
        monkeypatch.setattr(reference, "_CHUNK_ELEMS", 6 * sk * chunk_rows)
    q, k, v = _qkv(2, sq, sk, 6, 2, 8, requires_grad=True)
    out, lse = attention_ref(q, k, v, **kw)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    finite = torch.isfinite(lse)
    want = torch.autograd.grad((out, lse[finite]), (q, k, v), (dout, dlse[finite]))
    got = reference.attention_bwd_ref(dout, q, k, v, dlse=dlse.masked_fill(~finite, 0), **kw)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-10)


# The routes themselves.


def _count_fused_calls(monkeypatch):
    """Counts calls into torch's fused CPU kernel (forward and backward) made by the reference."""
    calls = {"fwd": 0, "bwd": 0}
    fwd, bwd = _reference_fused._sdpa_fwd, _reference_fused._sdpa_bwd

    def counted_fwd(*a, **kw):
        calls["fwd"] += 1
        return fwd(*a, **kw)

    def counted_bwd(*a, **kw):
        calls["bwd"] += 1
        return bwd(*a, **kw)

    monkeypatch.setattr(_reference_fused, "_sdpa_fwd", counted_fwd)
    monkeypatch.setattr(_reference_fused, "_sdpa_bwd", counted_bwd)
    return calls


@pytest.mark.parametrize(
    "dtype, kw, requires_grad, fused",
    [
        (torch.float64, {"causal": True}, False, True),
        (torch.float32, {"window_size": (3, 1)}, False, True),
        (torch.bfloat16, {"causal": True}, False, True),  # upcast to float32, then fused
        (torch.bfloat16, {"causal": True, "upcast": False}, False, False),  # math in bf16: plain
        (torch.float16, {"upcast": False}, False, False),
        (torch.float32, {"upcast": False}, False, True),  # float32 math either way
        (torch.float64, {"softcap": 2.0}, False, False),  # no softcap in the fused kernel
        (torch.float64, {"causal": True}, True, False),  # autograd records: plain, differentiable
    ],
)
def test_route_taken(dtype, kw, requires_grad, fused, monkeypatch):
    calls = _count_fused_calls(monkeypatch)
    q, k, v = _qkv(1, 6, 9, 4, 2, 8, dtype=dtype, requires_grad=requires_grad)
    out, lse = attention_ref(q, k, v, **kw)
    assert (calls["fwd"] > 0) == fused
    assert out.requires_grad == requires_grad
    if requires_grad:
        with torch.no_grad():  # the same call without autograd recording takes the fused route
            attention_ref(q, k, v, **kw)
        assert calls["fwd"] > 0 or "softcap" in kw
    if "upcast" not in kw:
        calls["fwd"] = 0
        reference.attention_bwd_ref(torch.randn_like(out), q, k, v, **kw)
        assert (calls["bwd"] > 0) == (calls["fwd"] > 0) == ("softcap" not in kw)


def test_route_plain_for_other_v_headdim(monkeypatch):
    calls = _count_fused_calls(monkeypatch)
    q, k, _ = _qkv(2, 5, 7, 4, 2, 8)
    v = torch.randn(2, 7, 2, 6, dtype=torch.float64)
    out, lse = attention_ref(q, k, v, causal=True)
    assert calls["fwd"] == 0 and out.shape == (2, 5, 4, 6)
    ref_out, ref_lse = naive_attention(q, k, v, causal=True)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=1e-10)


# Every branch of the fused route, forward and backward (with and without dlse), against the naive float64
# attention and its autograd: no mask; bottom-right causal with sq == sk, sq < sk (a non-causal part and a
# top-left causal part merged by lse), sq > sk (rows before the first key never reach the kernel); right
# windows (causal-like, shifted: merged or starting late); bounded left windows (row chunks over their key
# band with an additive mask; ragged chunks, interior chunks sharing one mask); rows that see no key.
_FUSED_CASES = [
    (9, 9, False, (-1, -1)),
    (9, 9, True, (-1, -1)),
    (5, 13, True, (-1, -1)),
    (13, 5, True, (-1, -1)),
    (1, 13, True, (-1, -1)),
    (13, 5, False, (-1, 2)),  # rows 0..5 see no key, the rest a shifted causal edge
    (5, 13, False, (-1, 2)),
    (11, 11, False, (-1, 3)),
    (11, 11, True, (3, -1)),  # causal sliding window
    (13, 5, True, (1, -1)),  # sliding window and rows that see no key
    (5, 13, False, (2, 1)),
    (13, 5, False, (0, 0)),
    (12, 12, False, (4, -1)),  # left bound only: every key after p - left
]


@pytest.mark.parametrize("sq, sk, causal, window", _FUSED_CASES)
@pytest.mark.parametrize("gqa_in_kernel", [True, False], ids=["kernel_gqa", "gqa_by_group"])
@pytest.mark.parametrize("window_rows", [None, 3])
def test_fused_branches(sq, sk, causal, window, gqa_in_kernel, window_rows, monkeypatch):
    if gqa_in_kernel and not _reference_fused._FUSED_GQA:
        pytest.skip("this torch's fused CPU kernel has no GQA")
    monkeypatch.setattr(_reference_fused, "_FUSED_GQA", gqa_in_kernel)
    if window_rows is not None:
        monkeypatch.setattr(_reference_fused, "_FUSED_WINDOW_ROWS", window_rows)
    calls = _count_fused_calls(monkeypatch)
    q, k, v = _qkv(2, sq, sk, 6, 2, 8, requires_grad=True)
    kw = {"causal": causal, "window_size": window, "softmax_scale": 0.4}
    with torch.no_grad():
        out, lse = attention_ref(q, k, v, **kw)
    assert calls["fwd"] > 0
    ref_out, ref_lse = naive_attention(q, k, v, causal=causal, window=window, scale=0.4)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=1e-10)
    assert not out.isnan().any() and not lse.isnan().any()

    finite = torch.isfinite(ref_lse)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    for with_dlse in (False, True):
        want = torch.autograd.grad(
            (ref_out, ref_lse[finite]) if with_dlse else (ref_out,),
            (q, k, v),
            (dout, dlse[finite]) if with_dlse else (dout,),
            retain_graph=True,
        )
        got = reference.attention_bwd_ref(
            dout, q, k, v, dlse=dlse.masked_fill(~finite, 0) if with_dlse else None, **kw
        )
        for g, w in zip(got, want):
            assert not g.isnan().any()
            torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-10)
    assert calls["bwd"] > 0


@pytest.mark.parametrize("route_name", ["fused", "plain"])
def test_strided_inputs(route_name):
    """(b, h, s, d) tensors handed over transposed, k/v expanded over the batch, a non-unit last stride."""
    q, k, v = _qkv(1, 7, 9, 4, 2, 8)
    qt = q.expand(2, -1, -1, -1).transpose(1, 2).contiguous().transpose(1, 2)
    kx, vx = k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1)
    vs = torch.randn(2, 9, 2, 16, dtype=torch.float64)[..., ::2]  # last stride 2
    with _route(route_name):
        for qq, kk, vv in [(qt, kx, vx), (qt, kx, vs)]:
            out, lse = attention_ref(qq, kk, vv, causal=True, window_size=(3, -1))
            ref_out, ref_lse = naive_attention(qq, kk, vv, causal=True, window=(3, -1))
            torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
            torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=1e-10)
            dout = torch.randn_like(out)
            got = reference.attention_bwd_ref(dout, qq, kk, vv, causal=True, window_size=(3, -1))
            leaves = [t.detach().clone().requires_grad_() for t in (qq, kk, vv)]
            ref = naive_attention(*leaves, causal=True, window=(3, -1))[0]
            want = torch.autograd.grad(ref, leaves, dout)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "kw", [{"causal": True}, {"window_size": (5, 0)}, {}], ids=["causal", "window", "full"]
)
def test_upcast_is_float32_math(dtype, kw):
    """upcast=True: float32 math, so out is the exact attention rounded once to the input dtype and lse is
    float32-accurate (torch's fused kernel run in bf16 rounds P before P @ V and misses this by far);
    upcast=False: the math in the input dtype, visibly less accurate (lse rounded to it)."""
    torch.manual_seed(0)
    q, k, v = _qkv(2, 300, 300, 4, 2, 64, dtype=dtype)
    ref_out, ref_lse = naive_attention(
        q, k, v, causal=kw.get("causal", False), window=kw.get("window_size", (-1, -1))
    )
    eps = torch.finfo(dtype).eps  # 2^-7 (bf16), 2^-10 (fp16): round to nearest is within eps / 2 relative
    for upcast in (True, False):
        out, lse = attention_ref(q, k, v, upcast=upcast, **kw)
        out_err = ((out.double() - ref_out).abs() - ref_out.abs() * eps / 2).max().item()
        lse_err = (lse.double() - ref_lse).abs().max().item()
        if upcast:
            assert out_err <= 1e-5 and lse_err <= 1e-5, (out_err, lse_err)
        else:
            assert lse_err > 1e-4, lse_err


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "kw", [{"causal": True}, {"window_size": (2, 1)}, {}], ids=["causal", "window", "full"]
)
def test_bwd_ref_with_saved_out_and_lse(dtype, kw, monkeypatch):
    """Handing attention_bwd_ref the forward's out and lse skips the forward recompute for float32/float64
    (same gradients: the forward is deterministic) and is ignored for bf16 (its out is rounded)."""
    calls = _count_fused_calls(monkeypatch)
    q, k, v = _qkv(2, 9, 6, 4, 2, 8, dtype=dtype)
    out, lse = attention_ref(q, k, v, **kw)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse).masked_fill(torch.isinf(lse), 0)
    for dl in (None, dlse):
        want = reference.attention_bwd_ref(dout, q, k, v, dlse=dl, **kw)
        calls["fwd"] = 0
        saved = out if dtype != torch.bfloat16 else torch.full_like(out, float("nan"))
        got = reference.attention_bwd_ref(dout, q, k, v, dlse=dl, out=saved, lse=lse, **kw)
        assert (calls["fwd"] == 0) == (dtype != torch.bfloat16)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=0, rtol=0)
