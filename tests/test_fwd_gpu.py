"""The compiled forward kernel against the reference.

Tolerance (FlashAttention's rule): with `truth` the reference in fp32 and `torch_lp` the same reference
run in the input dtype (upcast=False), the kernel must satisfy

    max|ours - truth| <= 2 * max|torch_lp - truth| + floor,

where floor = max|round_to_dtype(truth) - truth| + 1e-5 for out (a perfectly rounded kernel always passes)
and 1e-5 * max(1, max|lse|) for lse (fp32 rounding). lse must in addition be within
LSE_ATOL * max(1, max|lse|) of the truth: in the kernel it never passes through bf16/fp16 (scores
accumulate in fp32; only P is rounded, for the P V product), whereas torch_lp rounds scores and lse to the
input dtype, so the relative rule alone would let an lse error of about 1e-2 through. lse is compared where
finite; rows that see no key must be -inf in both, with out = 0 there. Outputs are poisoned with NaN before
each call, so an element the kernel never writes fails the test.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from flash_attn4 import _build_info, _ops, attn
from flash_attn4.reference import attention_ref

DEVICE = torch.device("cuda")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# fp32 row sums of up to ~1M exp terms plus exp2/log2 approximations stay far below this; see the docstring.
LSE_ATOL = 1e-3


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    dtype = _DTYPES[_build_info.DTYPES[0]] if _build_info.DTYPES else torch.bfloat16
    hdim = _build_info.HDIMS[0] if _build_info.HDIMS else 128
    ok, why = _build_info.kernel_available(DEVICE, dtype, hdim)
    return None if ok else why


_SKIP = _skip_reason()
requires_kernel = pytest.mark.skipif(
    _SKIP is not None, reason=f"flash_attn4 CUDA kernel unavailable: {_SKIP}"
)
pytestmark = pytest.mark.gpu

# Parametrize over what was built; an unbuilt tree still lists the full set (all skipped, with the reason).
DTYPES = [_DTYPES[n] for n in _build_info.DTYPES] or [torch.bfloat16, torch.float16]
HDIMS = list(_build_info.HDIMS) or [64, 96, 128, 192, 256]
# One dtype / head dim for the sweeps: the production config when it was built.
SWEEP_DTYPE = torch.bfloat16 if torch.bfloat16 in DTYPES else DTYPES[0]
SWEEP_HDIM = 128 if 128 in HDIMS else HDIMS[0]


def _randn(*shape, dtype):
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


def _run_kernel(q, k, v, causal, scale):
    """fwd_into with NaN-poisoned out/lse."""
    b, sq, hq, d = q.shape
    out = torch.full((b, sq, hq, d), math.nan, dtype=q.dtype, device=q.device)
    lse = torch.full((b, hq, sq), math.nan, dtype=torch.float32, device=q.device)
    plan = _ops._kernel_plan(q, q.shape[1], k.shape[1], causal, -1, -1)[0]
    _ops.fwd_into(q, k, v, out, lse, scale, plan)
    return out, lse


def _max_err(a, b):
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def assert_close_to_ref(out, lse, q, k, v, causal, scale, what=""):
    """The tolerance rule of the module docstring, for out and lse."""
    truth_out, truth_lse = attention_ref(q.float(), k.float(), v.float(), causal=causal, softmax_scale=scale)
    lp_out, lp_lse = attention_ref(q, k, v, causal=causal, softmax_scale=scale, upcast=False)
    assert not out.isnan().any(), f"{what}: out has NaN (unwritten or bad) elements"
    assert not lse.isnan().any(), f"{what}: lse has NaN (unwritten or bad) elements"

    floor = _max_err(truth_out.to(out.dtype), truth_out) + 1e-5
    err, err_lp = _max_err(out, truth_out), _max_err(lp_out, truth_out)
    assert err <= 2 * err_lp + floor, f"{what}: out error {err:.3g} > 2 * {err_lp:.3g} + {floor:.3g}"

    empty = torch.isneginf(truth_lse)
    assert torch.equal(torch.isneginf(lse), empty), f"{what}: -inf lse rows differ from the reference"
    assert not torch.isinf(lse[~empty]).any(), f"{what}: lse is inf on a row that sees keys"
    assert (out.transpose(1, 2)[empty] == 0).all(), f"{what}: rows that see no key must be 0"
    finite = ~empty
    if finite.any():
        floor = 1e-5 * max(1.0, truth_lse[finite].abs().max().item())
        err, err_lp = _max_err(lse[finite], truth_lse[finite]), _max_err(lp_lse[finite], truth_lse[finite])
        assert err <= 2 * err_lp + floor, f"{what}: lse error {err:.3g} > 2 * {err_lp:.3g} + {floor:.3g}"
        bound = LSE_ATOL * max(1.0, truth_lse[finite].abs().max().item())
        assert err <= bound, f"{what}: lse error {err:.3g} > {bound:.3g} (lse is fp32 math in the kernel)"


SEQLENS = [
    (1, 1),
    (1, 239),
    (17, 17),
    (113, 203),
    (128, 217),
    (239, 1),
    (203, 113),
    (1023, 1024),
    (4224, 4224),
]


@requires_kernel
@pytest.mark.parametrize("seqlens", SEQLENS, ids=[f"{a}x{b}" for a, b in SEQLENS])
@pytest.mark.parametrize("heads", [(6, 6), (6, 2), (6, 1)], ids=["mha", "gqa3", "mqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hdim", HDIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
def test_fwd_matches_reference(dtype, hdim, causal, heads, seqlens):
    sq, sk = seqlens
    b = 2 if sq * sk <= 1 << 20 else 1
    q, k, v = (
        _randn(b, sq, heads[0], hdim, dtype=dtype),
        *(_randn(b, sk, heads[1], hdim, dtype=dtype) for _ in "kv"),
    )
    scale = 1 / math.sqrt(hdim)
    out, lse = _run_kernel(q, k, v, causal, scale)
    assert_close_to_ref(out, lse, q, k, v, causal, scale)


@requires_kernel
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_seqlen_sweep(causal):
    """Every length 1..300 (tile edges, partial tiles), equal and unequal lengths."""
    for s in range(1, 301):
        for sq, sk in ((s, s), (s, (7 * s) % 300 + 1)):
            q = _randn(1, sq, 4, SWEEP_HDIM, dtype=SWEEP_DTYPE)
            k, v = (_randn(1, sk, 2, SWEEP_HDIM, dtype=SWEEP_DTYPE) for _ in "kv")
            out, lse = _run_kernel(q, k, v, causal, SWEEP_HDIM**-0.5)
            assert_close_to_ref(out, lse, q, k, v, causal, SWEEP_HDIM**-0.5, what=f"sq={sq} sk={sk}")


def _padded_hdims(n: int = 6) -> list[int]:
    """Up to n head dims that are served by zero-padding (multiples of 8, not built), spread out."""
    cands = [d for d in range(8, 257, 8) if d not in HDIMS and _build_info.padded_hdim(d)]
    return sorted(set(cands[:: max(1, len(cands) // (n - 1))][: n - 1] + cands[-1:]))


@requires_kernel
@pytest.mark.parametrize("hdim", _padded_hdims())
def test_padded_head_dims(hdim):
    """Head dims between built ones are zero-padded; the scale must still be 1/sqrt(original hdim)."""
    q = _randn(2, 77, 4, hdim, dtype=SWEEP_DTYPE)
    k, v = (_randn(2, 131, 2, hdim, dtype=SWEEP_DTYPE) for _ in "kv")
    out, lse = _run_kernel(q, k, v, True, hdim**-0.5)
    assert_close_to_ref(out, lse, q, k, v, True, hdim**-0.5)


@requires_kernel
@pytest.mark.parametrize("big", ["q_seqlen", "kv_batch"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_more_than_2_pow_31_elements(big, causal):
    """64-bit offsets: one operand has > 2^31 elements; sampled rows are checked against the reference."""
    dtype, d, h = SWEEP_DTYPE, 128 if 128 in HDIMS else HDIMS[-1], 16
    if big == "q_seqlen":
        b, sq, sk = 1, 2**31 // (h * d) + 64, 256
    else:
        b, sq, sk = 2**31 // (1024 * h * d) + 1, 64, 1024
    q = _randn(b, sq, h, d, dtype=dtype)
    k, v = (
        (_randn(b, sk, 2, d, dtype=dtype) for _ in "kv")
        if big == "q_seqlen"
        else (_randn(b, sk, h, d, dtype=dtype) for _ in "kv")
    )
    assert max(q.numel(), k.numel()) > 2**31
    out, lse = _run_kernel(q, k, v, causal, d**-0.5)
    assert not out.isnan().any() and not lse.isnan().any()
    rows = sorted({0, 1, sq - sk - 1, sq - sk, sq // 2, sq - 2, sq - 1} & set(range(sq)))
    for bi in sorted({0, b // 2, b - 1}):
        for i in rows:
            # Query i alone, with the keys it may see: the bottom-right alignment of a 1-row problem.
            seen = i + sk - sq + 1 if causal else sk
            qi, ki, vi = (
                q[bi : bi + 1, i : i + 1],
                k[bi : bi + 1, : max(seen, 0)],
                v[bi : bi + 1, : max(seen, 0)],
            )
            assert_close_to_ref(
                out[bi : bi + 1, i : i + 1],
                lse[bi : bi + 1, :, i : i + 1],
                qi,
                ki,
                vi,
                causal,
                d**-0.5,
                what=f"batch {bi} row {i}",
            )
    del q, k, v, out, lse
    torch.cuda.empty_cache()


@requires_kernel
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_strided_and_misaligned_inputs_unchanged(causal):
    dtype, d = SWEEP_DTYPE, SWEEP_HDIM
    qkv = _randn(2, 157, 3, 4, d, dtype=dtype)
    q, v = qkv[:, :, 0], qkv[:, :, 2]  # strided views of a packed tensor: read in place
    k = torch.randn(2 * 157 * 4 * d + 1, dtype=dtype, device=DEVICE)[1:].view(2, 157, 4, d)  # misaligned
    q2 = _randn(2, 91, 4 * d + 4, dtype=dtype)[..., : 4 * d].view(2, 91, 4, d)  # row stride not 16-byte
    before = [(t.clone(), t.stride(), t.data_ptr()) for t in (q, k, v, q2, qkv)]
    assert (
        _ops._kernel_plan(q, q.shape[1], k.shape[1], causal, -1, -1)[0] is not None
    )  # the kernel, not a fallback
    for qq in (q, q2):
        out, lse = attn(qq, k, v, causal=causal, return_lse=True)
        assert_close_to_ref(out, lse, qq, k, v, causal, d**-0.5)
    for t, (val, stride, ptr) in zip((q, k, v, q2, qkv), before):
        assert torch.equal(t, val) and t.stride() == stride and t.data_ptr() == ptr


@requires_kernel
def test_op_uses_kernel_deterministically():
    q = _randn(2, 300, 8, SWEEP_HDIM, dtype=SWEEP_DTYPE)
    k, v = (_randn(2, 300, 8, SWEEP_HDIM, dtype=SWEEP_DTYPE) for _ in "kv")
    with warnings.catch_warnings():
        warnings.simplefilter("error", _ops.ReferenceFallbackWarning)  # the kernel, not the reference
        out, lse = attn(q, k, v, causal=True, return_lse=True)
        out2, lse2 = attn(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    k_out, k_lse = _run_kernel(q, k, v, True, SWEEP_HDIM**-0.5)
    assert torch.equal(out, k_out) and torch.equal(lse, k_lse)


@requires_kernel
def test_cuda_graph_capture():
    q = _randn(1, 256, 4, SWEEP_HDIM, dtype=SWEEP_DTYPE)
    k, v = (_randn(1, 256, 4, SWEEP_HDIM, dtype=SWEEP_DTYPE) for _ in "kv")
    attn(q, k, v, causal=True)  # warm up (lazy import, first launch) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn(q, k, v, causal=True)
    q.copy_(_randn(1, 256, 4, SWEEP_HDIM, dtype=SWEEP_DTYPE))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, attn(q, k, v, causal=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.skipif(_SKIP is None, reason="the kernel is available, so nothing falls back")
def test_fallback_warns_once_and_is_correct(monkeypatch):
    monkeypatch.setattr(_ops, "_warned", set())
    q = _randn(1, 33, 4, 64, dtype=torch.bfloat16)
    k, v = (_randn(1, 47, 2, 64, dtype=torch.bfloat16) for _ in "kv")
    with pytest.warns(_ops.ReferenceFallbackWarning, match="flash_attn4") as rec:
        out, lse = attn(q, k, v, causal=True, return_lse=True)
        attn(q, k, v, causal=True)
    assert len(rec) == 1
    ref_out, ref_lse = attention_ref(q, k, v, causal=True)
    torch.testing.assert_close(out, ref_out, atol=0, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=0, rtol=0)
