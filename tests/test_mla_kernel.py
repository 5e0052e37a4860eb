"""The MLA kernels (q / k head dim 192, v head dim 128; sm90, both directions): `attn` and `attn_varlen` with
a v smaller than q and k, against fp64 dense attention by the GPU tests' rule (error <= 2 x the same math's
error in low precision + a rounding floor), outputs landing in NaN-filled memory so an unwritten element
fails. Out, lse, dq, dk, dv; no mask, causal, windows, odd lengths, seqlen_q != seqlen_k, GQA, both dtypes,
packed batches, head dims padded up to the kernel's (184 / 120), deterministic dq."""

from __future__ import annotations

import warnings

import option_kernels
import pytest
import torch
from option_kernels import DTYPES, dense, gpu_skip
from test_alibi_kernel import _poison
from test_block_sparse_kernel import _check  # the GPU tests' rule

import flash_attn4
from flash_attn4 import _build_info


def _gpu_skip() -> str | None:
    return gpu_skip(_build_info.MLA_HDIMS, "MLA", "FLASH_ATTN4_HDIMS without 192")


CASES = [*option_kernels.CASES, (1, 1, False, (-1, -1), 2, 1)]  # sq, sk, causal, window, hq, hk


def _inputs(d, dv, sq, sk, hq, hk, b=2):
    g = torch.Generator(device="cuda").manual_seed(sq * 7 + sk + d + dv)
    return (torch.randn(b, n, h, e, device="cuda", generator=g, dtype=torch.float64)
            for n, h, e in ((sq, hq, d), (sk, hk, d), (sk, hk, dv)))  # fmt: skip


def _dims():
    return _build_info.MLA_HDIMS or [(192, 128)]


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_skip() is not None, reason=f"{_gpu_skip()}")
@pytest.mark.parametrize("dtype", DTYPES or [torch.bfloat16])
@pytest.mark.parametrize("dims", _dims())
@pytest.mark.parametrize("sq,sk,causal,window,hq,hk", CASES)
def test_mla_kernel_matches_reference(dtype, dims, sq, sk, causal, window, hq, hk):
    q, k, v = _inputs(*dims, sq, sk, hq, hk)
    g = torch.Generator(device="cuda").manual_seed(sk)
    go = torch.randn(*q.shape[:3], dims[1], device="cuda", dtype=torch.float64, generator=g)
    gl = torch.randn(q.shape[0], hq, sq, device="cuda", dtype=torch.float64, generator=g)

    def run(fn, dt):
        leaves = [t.to(dt).requires_grad_() for t in (q, k, v)]
        out, lse = fn(*leaves)
        grads = torch.autograd.grad((out * go.to(dt)).sum() + (lse * gl.to(lse.dtype)).sum(), leaves)
        return (out, lse, *grads)

    _poison(q.shape[0] * sq * hq * dims[0] * 8)
    got = run(lambda *t: flash_attn4.attn(*t, causal=causal, window_size=window, return_lse=True), dtype)
    assert got[0].shape == (*q.shape[:3], dims[1]) and got[0].dtype == dtype
    truth = run(lambda *t: dense(*t, causal, window), torch.float64)
    low = run(lambda *t: dense(*t, causal, window), dtype)
    for name, a, t, lp in zip(("out", "lse", "dq", "dk", "dv"), got, truth, low):
        assert torch.isfinite(a).all(), name
        _check(name, a, t, lp, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_skip() is not None, reason=f"{_gpu_skip()}")
def test_mla_takes_the_kernels_in_both_directions(monkeypatch):
    """No reference-fallback warning from the forward or the backward, and a deterministic dq is bitwise
    reproducible."""
    d, dv = _dims()[0]
    q, k, v = (t.to(torch.bfloat16) for t in _inputs(d, dv, 517, 700, 4, 2))
    monkeypatch.setattr(flash_attn4._ops, "_warned", set())
    go = torch.randn(*q.shape[:3], dv, device="cuda", dtype=torch.bfloat16)
    grads = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = flash_attn4.attn(*leaves, causal=True, deterministic=True)
            grads.append(torch.autograd.grad(out, leaves, go))
    assert not caught, [str(w.message) for w in caught]
    assert torch.equal(grads[0][0], grads[1][0])


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_skip() is not None, reason=f"{_gpu_skip()}")
@pytest.mark.parametrize("causal", [False, True])
def test_mla_kernel_gradients_and_padded_head_dims(causal):
    """Head dims below the kernel's (184 / 120: zero-padded in, sliced out), forward and gradients."""
    d, dv = _dims()[0]
    q, k, v = _inputs(d - 8, dv - 8, 300, 333, 4, 2)
    g = torch.Generator(device="cuda").manual_seed(5)
    go = torch.randn(*q.shape[:3], dv - 8, device="cuda", dtype=torch.float64, generator=g)

    def run(fn, dt):
        leaves = [t.to(dt).requires_grad_() for t in (q, k, v)]
        out, _ = fn(*leaves)
        return (out, *torch.autograd.grad(out, leaves, go.to(dt)))

    got = run(lambda *t: (flash_attn4.attn(*t, causal=causal), None), torch.bfloat16)
    truth = run(lambda *t: dense(*t, causal), torch.float64)
    low = run(lambda *t: dense(*t, causal), torch.bfloat16)
    for name, a, t, lp in zip(("out", "dq", "dk", "dv"), got, truth, low):
        _check(name, a, t, lp, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_skip() is not None, reason=f"{_gpu_skip()}")
@pytest.mark.parametrize("causal", [False, True])
def test_mla_kernel_packed_batch(causal):
    d, dv = _dims()[0]
    lens_q, lens_k = [1, 130, 517, 64], [7, 130, 300, 1000]
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(sum(lens_q), 4, d, device="cuda", generator=g, dtype=torch.float64)
    k = torch.randn(sum(lens_k), 2, d, device="cuda", generator=g, dtype=torch.float64)
    v = torch.randn(sum(lens_k), 2, dv, device="cuda", generator=g, dtype=torch.float64)
    cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
          for n in (lens_q, lens_k)]  # fmt: skip
    _poison(q.shape[0] * 4 * dv * 4)
    out, lse = flash_attn4.attn_varlen(*(t.bfloat16() for t in (q, k, v)), *cu, max(lens_q), max(lens_k),
                                       causal=causal, return_lse=True)  # fmt: skip
    assert out.shape == (q.shape[0], 4, dv)
    for b in range(len(lens_q)):
        (q0, q1), (k0, k1) = (c[b : b + 2].tolist() for c in cu)
        seg = [t[None, a:e] for t, (a, e) in zip((q, k, v), ((q0, q1), (k0, k1), (k0, k1)))]
        truth, low = (
            dense(*seg, causal),
            dense(*(t.bfloat16() for t in seg), causal),
        )
        _check(f"out[{b}]", out[None, q0:q1], truth[0], low[0], torch.bfloat16)
        _check(f"lse[{b}]", lse[:, q0:q1][None], truth[1], low[1], torch.bfloat16)
