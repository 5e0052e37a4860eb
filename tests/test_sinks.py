"""Attention sinks (`sinks=`, GPT-OSS): one learnable logit per query head in every row's softmax
denominator. Checked against a dense fp64 reference that appends the sink as an extra score column (as
transformers' eager GPT-OSS attention does): out, lse and the gradients of q, k, v and the sinks, for
attn, attn_varlen and attn_with_kvcache, with masks, softcap and GQA."""

from __future__ import annotations

import math

import pytest
import torch

import flash_attn4


def dense_with_sinks(q, k, v, sinks, *, causal=False, window=(-1, -1), softcap=0.0, scale=None):
    """(b, sq, hq, d) -> out, lse (b, hq, sq): softmax over [scores, sink], the sink column dropped."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    kk = k.repeat_interleave(hq // hk, dim=2)
    vv = v.repeat_interleave(hq // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)  # bottom-right aligned key of each row
    j = torch.arange(sk, device=q.device)[None, :]
    left, right = window
    seen = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal or right >= 0:
        seen &= j <= i + (0 if causal else right)
    if left >= 0:
        seen &= j >= i - left
    s = s.masked_fill(~seen, -math.inf)
    col = sinks.to(s.dtype).view(1, hq, 1, 1).expand(b, hq, sq, 1)
    full = torch.cat([s, col], dim=-1)
    lse = torch.logsumexp(full, dim=-1)
    p = torch.softmax(full, dim=-1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", p, vv), lse


def _inputs(b=2, sq=19, sk=33, hq=4, hk=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    return mk(b, sq, hq, d), mk(b, sk, hk, d), mk(b, sk, hk, d), (2 * mk(hq)).detach().requires_grad_()


def _grads(outs, inputs, g_out, g_lse):
    loss = (outs[0] * g_out).sum() + (outs[1] * g_lse).sum()
    return torch.autograd.grad(loss, inputs)


def _assert_matches(ours, want, inputs):
    """(out, lse) and their gradients into `inputs` for random output gradients, which it returns."""
    torch.testing.assert_close(ours, want, atol=1e-10, rtol=1e-10)
    g_out, g_lse = torch.randn_like(want[0]), torch.randn_like(want[1])
    for a, b in zip(_grads(ours, inputs, g_out, g_lse), _grads(want, inputs, g_out, g_lse)):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)
    return g_out, g_lse


@pytest.mark.parametrize(
    "causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (5, 3)), (True, (7, 0))]
)
@pytest.mark.parametrize("softcap", [0.0, 3.0])
def test_attn_sinks_match_dense_reference(causal, window, softcap):
    q, k, v, sinks = _inputs()
    ours = flash_attn4.attn(q, k, v, causal=causal, window_size=window, softcap=softcap, sinks=sinks,
                            return_lse=True)  # fmt: skip
    want = dense_with_sinks(q, k, v, sinks, causal=causal, window=window, softcap=softcap)
    _assert_matches(ours, want, (q, k, v, sinks))


def test_a_row_that_sees_no_key_gets_zero_and_the_sink():
    q, k, v, sinks = _inputs(sq=40, sk=8)  # causal, bottom-right: the first 32 rows see no key
    out, lse = flash_attn4.attn(q, k, v, causal=True, sinks=sinks, return_lse=True)
    assert torch.equal(out[:, :32], torch.zeros_like(out[:, :32]))
    torch.testing.assert_close(lse[:, :, :32], sinks.detach().view(1, -1, 1).expand(2, -1, 32))
    out.sum().backward()
    assert torch.isfinite(sinks.grad).all() and torch.isfinite(q.grad).all()


def test_varlen_sinks_equal_each_sequence_alone():
    lens_q, lens_k = [5, 0, 11], [9, 4, 11]
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sum(lens_q), 4, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(sum(lens_k), 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(4, generator=g, dtype=torch.float64)
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    out, lse = flash_attn4.attn_varlen(q, k, v, cu(lens_q), cu(lens_k), 11, 11, causal=True, sinks=sinks,
                                       return_lse=True)  # fmt: skip
    oq = ok = 0
    for lq, lk in zip(lens_q, lens_k):
        if lq:
            o, l_ = dense_with_sinks(q[None, oq:oq + lq], k[None, ok:ok + lk], v[None, ok:ok + lk], sinks,
                                     causal=True)  # fmt: skip
            torch.testing.assert_close(out[oq : oq + lq], o[0], atol=1e-10, rtol=1e-10)
            torch.testing.assert_close(lse[:, oq : oq + lq], l_[0], atol=1e-10, rtol=1e-10)
        oq, ok = oq + lq, ok + lk


def test_kvcache_sinks_equal_attn_over_the_filled_rows():
    g = torch.Generator().manual_seed(4)
    b, cap, hq, hk, d = 2, 32, 4, 2, 16
    q = torch.randn(b, 1, hq, d, generator=g)
    kc, vc = (torch.randn(b, cap, hk, d, generator=g) for _ in range(2))
    sinks = torch.randn(hq, generator=g)
    lens = torch.tensor([7, 32], dtype=torch.int32)
    out, lse = flash_attn4.attn_with_kvcache(q, kc, vc, cache_seqlens=lens, sinks=sinks, return_lse=True)
    for i, n in enumerate(lens.tolist()):
        o, l_ = flash_attn4.attn(q[i:i + 1], kc[i:i + 1, :n], vc[i:i + 1, :n], causal=True, sinks=sinks,
                                 return_lse=True)  # fmt: skip
        torch.testing.assert_close((out[i : i + 1], lse[i : i + 1]), (o, l_), atol=1e-6, rtol=1e-6)


def test_bad_sinks_are_clear_errors():
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="one logit per query head"):
        flash_attn4.attn(q, k, v, sinks=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="floating-point"):
        flash_attn4.attn(q, k, v, sinks=torch.zeros(4, dtype=torch.int64))


def _gpu_skip() -> str | None:
    from flash_attn4 import _build_info

    if not torch.cuda.is_available():
        return "no CUDA device"
    arch, why = _build_info.kernel_available(torch.device("cuda"), torch.bfloat16, 128)
    return None if arch is not None else why


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_skip() is not None, reason=f"no kernels: {_gpu_skip()}")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,use_lse", [(1, True), (300, True), (300, False)])
def test_sinks_on_the_kernels(causal, sq, use_lse):
    """bf16 on the CUDA kernels (sq = 1: the decode kernel) against the fp64 dense reference, by the GPU
    tests' rule: error <= 2 x the error of the same math in bf16 + a rounding floor; out, lse, gradients."""
    g = torch.Generator(device="cuda").manual_seed(5)
    b, sk, hq, hk, d = 2, 517, 8, 2, 128
    q, k, v = (torch.randn(b, n, h, d, device="cuda", generator=g) for n, h in ((sq, hq), (sk, hk), (sk, hk)))
    sinks = 3 * torch.randn(hq, device="cuda", generator=g)
    g_out = torch.randn(b, sq, hq, d, device="cuda", generator=g)
    g_lse = torch.randn(b, hq, sq, device="cuda", generator=g)

    def run(fn, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)] + [sinks.clone().requires_grad_()]
        out, lse = fn(*leaves)
        loss = (out.float() * g_out).sum()
        (loss + (lse.float() * g_lse).sum() if use_lse else loss).backward()  # else lse gets no gradient
        return [out, lse] + [t.grad for t in leaves]

    def ours_fn(q, k, v, s):
        return flash_attn4.attn(q, k, v, causal=causal, sinks=s, return_lse=True)

    ours = run(ours_fn, torch.bfloat16)
    truth = run(lambda *a: dense_with_sinks(*a, causal=causal), torch.float64)
    lp = run(lambda *a: dense_with_sinks(*a, causal=causal), torch.bfloat16)
    for name, o, t, low in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), ours, truth, lp):
        assert torch.isfinite(o).all(), name
        floor = (t.to(o.dtype).double() - t).abs().max().item() + 1e-4
        err, err_lp = (o.double() - t).abs().max().item(), (low.double() - t).abs().max().item()
        assert err <= 2 * err_lp + floor, f"{name}: {err:.3g} > 2 * {err_lp:.3g} + {floor:.3g}"


@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 3.0),
                                                   (False, (5, 3), 0.0)])  # fmt: skip
def test_fwd_sinks_op_matches_dense_reference_and_opcheck(causal, window, softcap):
    """flash_attn4::fwd_sinks, the op attn takes where the sm90 kernels fold the sinks in: on the CPU its
    reference path, and its backward (flash_attn4::bwd_sinks: the backward on the sinked out and lse, plus
    d sinks from D), the same on every path, against the dense fp64 reference; and torch.library.opcheck."""
    q, k, v, sinks = _inputs()
    left, right = window
    ours = torch.ops.flash_attn4.fwd_sinks(q, k, v, sinks, 0.25, causal, left, right, softcap, False)
    want = dense_with_sinks(q, k, v, sinks, causal=causal, window=window, softcap=softcap)
    g_out, g_lse = _assert_matches(ours, want, (q, k, v, sinks))
    torch.library.opcheck(torch.ops.flash_attn4.fwd_sinks.default,
                          (q, k, v, sinks, 0.25, causal, left, right, softcap, False))  # fmt: skip
    # The backward op itself is not differentiated: plain tensors.
    q, k, v, sinks, out, lse = (t.detach() for t in (q, k, v, sinks, *ours))
    for dlse in (None, g_lse):
        args = (g_out, dlse, q, k, v, out, lse, sinks, 0.25, causal, left, right, softcap, False)
        torch.library.opcheck(torch.ops.flash_attn4.bwd_sinks.default, args)
