"""The reference (and the CPU path of the custom ops) against a naive float64 attention written here."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flash_attn4 import _ops, attn, reference
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
def test_matches_naive(seqlens, causal, heads):
    sq, sk = seqlens
    _assert_matches_naive(*_qkv(2, sq, sk, heads[0], heads[1], 16), causal=causal)


@pytest.mark.parametrize("window", [(3, -1), (-1, 2), (2, 1), (0, 0), (4, 0), (20, 20)])
@pytest.mark.parametrize("seqlens", [(7, 7), (5, 13), (13, 5)])
@pytest.mark.parametrize("causal", [False, True])
def test_window(window, seqlens, causal):
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
def test_rows_that_see_no_key(sq, sk, kw):
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


def test_chunking_is_invisible(monkeypatch):
    q, k, v = _qkv(2, 37, 29, 4, 2, 8)
    whole = attention_ref(q, k, v, causal=True, window_size=(7, -1))
    monkeypatch.setattr(reference, "_CHUNK_ELEMS", 2 * 4 * 29 * 3)  # 3 rows per chunk, ragged last chunk
    chunked = attention_ref(q, k, v, causal=True, window_size=(7, -1))
    # Up to float64 rounding: BLAS may block a smaller batch of rows differently (seen with torch 2.14).
    torch.testing.assert_close(chunked, whole, atol=1e-13, rtol=1e-12)


def test_long_sequence_fits():
    # 4224 x 4224 scores: the reference must chunk rather than hold everything at once.
    q, k, v = _qkv(1, 4224, 4224, 1, 1, 8, dtype=torch.float32)
    out, lse = attention_ref(q, k, v, causal=True)
    ref_out, ref_lse = naive_attention(q, k, v, causal=True)
    torch.testing.assert_close(out, ref_out.float(), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("upcast", [True, False])
def test_dtypes(dtype, upcast):
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
def test_gradcheck_custom_op(kw, seqlens):
    """float64 gradcheck of the whole public path (custom op fwd + bwd), out and lse both."""
    sq, sk = seqlens
    q, k, v = _qkv(1, sq, sk, 4, 2, 8, requires_grad=True)
    mask = reference.visible_mask(
        sq, sk, causal=kw.get("causal", False), window_size=kw.get("window_size", (-1, -1))
    )
    return_lse = mask is None or bool(mask.any(dim=1).all())  # lse of an empty row is a constant -inf
    torch.autograd.gradcheck(lambda q, k, v: attn(q, k, v, return_lse=return_lse, **kw), (q, k, v))


def test_gradients_match_naive_autograd():
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
    softcap=st.sampled_from([0.0, 0.7, 5.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_hypothesis_shapes(b, sq, sk, hk, group, d, causal, left, right, softcap, seed):
    torch.manual_seed(seed)
    if causal:
        right = min(right, 0)
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
def test_bwd_ref_matches_autograd_of_ref(sq, sk, kw, chunk_rows, monkeypatch):
    """attention_bwd_ref (the written-out backward) is the derivative of attention_ref, chunked or not."""
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
