"""ALiBi (`alibi_slopes`): the logit of query i and key j gets -slope_h * |i + seqlen_k - seqlen_q - j| after
softcap (FlashAttention-2's definition). Against a dense fp64 reference written out here, forward and
gradients, with masks, softcap, GQA, per-head and per-(batch, head) slopes; and through compat."""

from __future__ import annotations

import math

import pytest
import torch

import flash_attn4
from flash_attn4 import compat


def dense_alibi(q, k, v, slopes, *, causal=False, window=(-1, -1), softcap=0.0):
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    kk, vv = (t.repeat_interleave(hq // hk, dim=2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) / math.sqrt(d)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    s = s - slopes.reshape(-1, hq, 1, 1) * (i - j).abs()
    left, right = window
    right = 0 if causal else right
    seen = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        seen &= j <= i + right
    if left >= 0:
        seen &= j >= i - left
    s = s.masked_fill(~seen, -math.inf)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), vv), torch.logsumexp(s, -1)


@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (False, (20, 5), 0.0), (True, (-1, -1), 4.0)])  # fmt: skip
@pytest.mark.parametrize("per_batch", [False, True])
def test_alibi_matches_dense_reference(causal, window, softcap, per_batch):
    g = torch.Generator().manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    q, k, v = mk(2, 150, 4, 16), mk(2, 170, 2, 16), mk(2, 170, 2, 16)
    slopes = (
        torch.rand(2, 4, generator=g, dtype=torch.float64) if per_batch else 2.0 ** -torch.arange(1.0, 5.0)
    )
    slopes = slopes.to(torch.float64)
    out, lse = flash_attn4.attn(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                alibi_slopes=slopes, return_lse=True)  # fmt: skip
    want = dense_alibi(q, k, v, slopes, causal=causal, window=window, softcap=softcap)
    torch.testing.assert_close((out, lse), want, atol=1e-10, rtol=1e-10)
    go = torch.randn_like(out)
    got = torch.autograd.grad((out * go).sum(), (q, k, v))
    ref = torch.autograd.grad((want[0] * go).sum(), (q, k, v))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


def test_alibi_through_compat_and_bad_slopes():
    q, k, v = torch.randn(1, 20, 4, 8), torch.randn(1, 20, 4, 8), torch.randn(1, 20, 4, 8)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    out = compat.flash_attn_func(q, k, v, 0.0, None, True, alibi_slopes=slopes)
    torch.testing.assert_close(out, flash_attn4.attn(q, k, v, causal=True, alibi_slopes=slopes))
    torch.testing.assert_close(out, dense_alibi(q, k, v, slopes, causal=True)[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="alibi_slopes must be"):
        flash_attn4.attn(q, k, v, alibi_slopes=torch.ones(3))
    with pytest.raises(TypeError, match="floating-point"):
        flash_attn4.attn(q, k, v, alibi_slopes=torch.ones(4, dtype=torch.int64))
