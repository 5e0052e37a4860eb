"""The ALiBi kernels (`attn` / `attn_varlen` with `alibi_slopes` on sm90, forward and backward) and their
torch.library ops.

GPU: bf16 / fp16 out, lse, dq, dk, dv against fp64 dense attention with the bias written out here, by the GPU
tests' rule (error <= 2 x the error of the same math in low precision + a rounding floor): no mask, causal,
windows, odd lengths, seqlen_q != seqlen_k, GQA, per-head and per-(batch, head) slopes, every built head dim
and dtype, packed batches, deterministic gradients; outputs land in NaN-filled memory, so an unwritten element
fails. CPU: the ops themselves (their reference path) against autograd of the dense form, and opcheck."""

from __future__ import annotations

import option_kernels
import pytest
import torch
from test_block_sparse_kernel import _check  # the GPU tests' rule: error <= 2 x low precision's + floor

import flash_attn4
from flash_attn4 import _build_info


def _gpu_skip() -> str | None:
    return option_kernels.gpu_skip(_build_info.ALIBI_HDIMS, "ALiBi")


def alibi_slopes(heads: int) -> torch.Tensor:
    """The ALiBi paper's geometric slopes 2^(-8 h / heads), h = 1..heads."""
    return 2.0 ** (-8.0 * torch.arange(1, heads + 1) / heads)


def _poison(numel: int) -> None:
    """NaN into freed cache blocks: an output element the kernel leaves unwritten then fails the test."""
    torch.full((numel,), float("nan"), device="cuda")


DTYPES = option_kernels.DTYPES
CASES = [  # sq, sk, causal, window, per_batch, hq, hk
    (1023, 1023, False, (-1, -1), False, 4, 2),
    (1023, 1023, True, (-1, -1), True, 4, 4),
    (517, 2048, True, (-1, -1), False, 8, 2),
    (2048, 517, False, (-1, -1), True, 4, 1),
    (1024, 1024, False, (300, 100), False, 4, 2),
    (113, 239, False, (-1, -1), True, 4, 2),
    (1, 1, False, (-1, -1), False, 2, 1),
]


def _inputs(hdim, sq, sk, per_batch, hq, hk, b=2):
    g = torch.Generator(device="cuda").manual_seed(sq * 7 + sk + hdim)
    q, k, v = (torch.randn(b, n, h, hdim, device="cuda", generator=g, dtype=torch.float64)
               for n, h in ((sq, hq), (sk, hk), (sk, hk)))  # fmt: skip
    if per_batch:
        slopes = torch.rand(b, hq, device="cuda", generator=g, dtype=torch.float64) * 0.5
    else:
        slopes = alibi_slopes(hq).to("cuda", torch.float64)
    return q, k, v, slopes.float().double()  # the kernels read fp32 slopes


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_skip() is not None, reason=f"{_gpu_skip()}")
@pytest.mark.parametrize("dtype", DTYPES or [torch.bfloat16])
@pytest.mark.parametrize("hdim", _build_info.ALIBI_HDIMS or [128])
@pytest.mark.parametrize("sq,sk,causal,window,per_batch,hq,hk", CASES)
def test_alibi_kernel_matches_reference(dtype, hdim, sq, sk, causal, window, per_batch, hq, hk):
    q, k, v, slopes = _inputs(hdim, sq, sk, per_batch, hq, hk)
    g = torch.Generator(device="cuda").manual_seed(sk)
    go = torch.randn(q.shape, device="cuda", dtype=torch.float64, generator=g)
    gl = torch.randn(2, hq, sq, device="cuda", dtype=torch.float64, generator=g)

    def run(fn, dt):
        leaves = [t.to(dt).requires_grad_() for t in (q, k, v)]
        out, lse = fn(*leaves)
        loss = (out.double() * go).sum() + (lse.double().masked_fill(torch.isinf(lse), 0) * gl).sum()
        return out, lse, [x.double() for x in torch.autograd.grad(loss, leaves)]

    _poison(8 * q.numel())

    def ours(*t):
        return flash_attn4.attn(
            *t, causal=causal, window_size=window, alibi_slopes=slopes.float(), return_lse=True
        )

    out, lse, grads = run(ours, dtype)
    ref = lambda *t: option_kernels.dense(*t, causal, window, slopes=slopes)  # noqa: E731
    t_out, t_lse, t_grads = run(ref, torch.float64)
    l_out, l_lse, l_grads = run(ref, dtype)
    assert torch.isfinite(out).all() and all(torch.isfinite(x).all() for x in grads)
    _check("out", out, t_out, l_out, dtype)
    _check("lse", lse, t_lse, l_lse, dtype)
    for name, o, t, lp in zip(("dq", "dk", "dv"), grads, t_grads, l_grads):
        _check(name, o, t, lp, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_skip() is not None, reason=f"{_gpu_skip()}")
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (100, 0))])
def test_alibi_kernel_packed_batches(causal, window):
    """attn_varlen: each sequence's bias uses its own lengths (bottom-right aligned) and its own slopes."""
    hdim, hq, hk = 128 if 128 in _build_info.ALIBI_HDIMS else _build_info.ALIBI_HDIMS[0], 4, 2
    lens_q, lens_k = [300, 1, 517, 128], [400, 77, 517, 1000]
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(sum(lens), h, hdim, device="cuda", generator=g, dtype=torch.float64)
               for lens, h in ((lens_q, hq), (lens_k, hk), (lens_k, hk)))  # fmt: skip
    slopes = (torch.rand(len(lens_q), hq, device="cuda", generator=g) * 0.3).double()
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda",  # noqa: E731
                                   dtype=torch.int32)  # fmt: skip
    go = torch.randn(q.shape, device="cuda", dtype=torch.float64, generator=g)
    dtype = DTYPES[0] if DTYPES else torch.bfloat16

    def ours():
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = flash_attn4.attn_varlen(
            *leaves, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k), causal=causal, window_size=window,
            alibi_slopes=slopes.float(),
        )  # fmt: skip
        return out, torch.autograd.grad((out.double() * go).sum(), leaves)

    def dense(dt):
        outs, grads = [], [torch.zeros_like(t) for t in (q, k, v)]
        q0 = k0 = 0
        for b, (nq, nk) in enumerate(zip(lens_q, lens_k)):
            leaves = [t[None, r0:r0 + n].to(dt).requires_grad_()
                      for t, r0, n in ((q, q0, nq), (k, k0, nk), (v, k0, nk))]  # fmt: skip
            out, _ = option_kernels.dense(*leaves, causal, window, slopes=slopes[b])
            gb = torch.autograd.grad((out.double() * go[None, q0 : q0 + nq]).sum(), leaves)
            grads[0][q0 : q0 + nq] += gb[0][0].double()
            grads[1][k0 : k0 + nk] += gb[1][0].double()
            grads[2][k0 : k0 + nk] += gb[2][0].double()
            outs.append(out[0])
            q0, k0 = q0 + nq, k0 + nk
        return torch.cat(outs), grads

    out, grads = ours()
    t_out, t_grads = dense(torch.float64)
    l_out, l_grads = dense(dtype)
    _check("out", out, t_out, l_out, dtype)
    for name, o, t, lp in zip(("dq", "dk", "dv"), grads, t_grads, l_grads):
        _check(name, o, t, lp, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_skip() is not None, reason=f"{_gpu_skip()}")
def test_alibi_kernel_deterministic_and_routes_to_the_kernel():
    """deterministic=True gives bitwise-equal gradients; the call takes the kernel (no reference warning)."""
    hdim = _build_info.ALIBI_HDIMS[0]
    q, k, v, slopes = _inputs(hdim, 700, 900, False, 4, 2)

    def grads():
        leaves = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
        out = flash_attn4.attn(*leaves, causal=True, alibi_slopes=slopes.float(), deterministic=True)
        return torch.autograd.grad(out.float().square().sum(), leaves)

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", flash_attn4.ReferenceFallbackWarning)
        a, b = grads(), grads()
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def _cpu_inputs(packed: bool):
    g = torch.Generator().manual_seed(1)
    if packed:
        shapes = ((70, 4), (90, 2), (90, 2))
        q, k, v = (torch.randn(n, h, 16, generator=g, dtype=torch.float64) for n, h in shapes)
        cu_q = torch.tensor([0, 30, 70], dtype=torch.int32)
        cu_k = torch.tensor([0, 50, 90], dtype=torch.int32)
        slopes = torch.rand(2, 4, generator=g, dtype=torch.float64)
        return q, k, v, slopes, (cu_q, cu_k, None, None, 40, 50)
    shapes = ((30, 4), (50, 2), (50, 2))
    q, k, v = (torch.randn(2, n, h, 16, generator=g, dtype=torch.float64) for n, h in shapes)
    return q, k, v, alibi_slopes(4).double(), (None, None, None, None, 30, 50)


@pytest.mark.parametrize("packed", [False, True])
def test_alibi_op_reference_path_gradients(packed):
    """The op's written-out backward (CPU: the reference path) against autograd of the dense form."""
    q, k, v, slopes, seqs = _cpu_inputs(packed)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = torch.ops.flash_attn4.fwd_alibi(*leaves, slopes, *seqs, 0.25, True, -1, -1, False)
    go, gl = torch.randn_like(out), torch.randn_like(lse)
    ours = torch.autograd.grad((out * go).sum() + (lse.masked_fill(torch.isinf(lse), 0) * gl).sum(), leaves)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    if packed:
        cu_q, cu_k = seqs[0].tolist(), seqs[1].tolist()
        outs, lses = [], []
        for b in range(2):
            qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            sub = [t[None, s] for t, s in zip(ref_leaves, (qs, ks, ks))]
            o, l_ = option_kernels.dense(*sub, causal=True, slopes=slopes[b])
            outs.append(o[0])
            lses.append(l_[0])
        ref_out, ref_lse = torch.cat(outs), torch.cat(lses, dim=-1)
    else:
        ref_out, ref_lse = option_kernels.dense(*ref_leaves, causal=True, slopes=slopes)
    torch.testing.assert_close((out, lse), (ref_out, ref_lse), atol=1e-10, rtol=1e-10)
    ref_loss = (ref_out * go).sum() + (ref_lse.masked_fill(torch.isinf(ref_lse), 0) * gl).sum()
    ref = torch.autograd.grad(ref_loss, ref_leaves)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("packed", [False, True])
def test_alibi_op_opcheck(packed):
    q, k, v, slopes, seqs = _cpu_inputs(packed)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.library.opcheck(torch.ops.flash_attn4.fwd_alibi.default,
                          (*leaves, slopes, *seqs, 0.25, False, 10, 3, False))  # fmt: skip
