"""The block-sparse forward kernel (sm90, `attn(..., block_mask=...)` on CUDA) and its torch.library op.

GPU: bf16 / fp16 against the fp64 dense reference with the equivalent element mask, by the GPU tests' rule
(error <= 2 x the error of the same math in low precision + a rounding floor), densities 0, one block, 10%,
50%, 100%, causal / window / softcap, odd lengths, broadcast mask batch / heads, every built head dim; lists
that lie (counts past the end, negative or too large indices) run without a fault. CPU: the op itself
(reference inside) against `attn`'s reference path, gradients, and torch.library.opcheck."""

from __future__ import annotations

import math

import pytest
import torch
from test_block_sparse import _elem, _expand, _random_blocks, dense_masked

import flash_attn4
from flash_attn4 import BlockMask, _build_info

BLK = 128


def _gpu_skip() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not _build_info.BLOCK_SPARSE_HDIMS:
        return "no block-sparse kernels in this build"
    arch, why = _build_info.kernel_arch(torch.device("cuda"))
    return None if arch == 90 else (why or f"the block-sparse kernels need sm90, this is sm{arch}")


def _mask(mshape, sq, sk, density, seed, full_share=0.5):
    nq, nk = math.ceil(sq / BLK), math.ceil(sk / BLK)
    blocks = _random_blocks((*mshape, nq, nk), density, seed)
    full = blocks & _random_blocks((*mshape, nq, nk), full_share, seed + 1)
    return blocks, full


def _allowed(blocks, full, sq, sk, causal, window):
    """The element mask equivalent to the block mask: full blocks, and partial ones AND the element mask."""
    return _expand(full, sq, sk) | (_expand(blocks & ~full, sq, sk) & _elem(sq, sk, causal, window))


GPU_CASES = [  # sq, sk, causal, window, softcap, density, mask (batch, heads)
    (1023, 1023, False, (-1, -1), 0.0, 0.5, (2, 4)),
    (1023, 1023, True, (-1, -1), 0.0, 0.5, (1, 4)),
    (517, 2048, True, (-1, -1), 0.0, 0.1, (2, 1)),
    (2048, 517, False, (-1, -1), 0.0, 0.1, (1, 1)),
    (1024, 1024, False, (300, 100), 0.0, 0.5, (2, 4)),
    (1024, 1024, False, (-1, -1), 30.0, 0.5, (2, 4)),
    (640, 640, True, (-1, -1), 0.0, 1.0, (1, 1)),
    (640, 640, False, (-1, -1), 0.0, 0.0, (2, 4)),
    (113, 239, False, (-1, -1), 0.0, 1.0, (2, 4)),
]


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_skip() is not None, reason=f"{_gpu_skip()}")
@pytest.mark.parametrize("hdim", _build_info.BLOCK_SPARSE_HDIMS or [128])
@pytest.mark.parametrize("sq,sk,causal,window,softcap,density,mshape", GPU_CASES)
def test_block_sparse_kernel_matches_reference(hdim, sq, sk, causal, window, softcap, density, mshape):
    dtype = torch.bfloat16 if "bf16" in _build_info.DTYPES else torch.float16
    g = torch.Generator(device="cuda").manual_seed(sq * 7 + sk)
    b, hq, hk = 2, 4, 2
    shapes = ((sq, hq), (sk, hk), (sk, hk))
    q, k, v = (torch.randn(b, n, h, hdim, device="cuda", generator=g) for n, h in shapes)
    blocks, full = _mask(mshape, sq, sk, density, seed=sq + sk)
    mask = BlockMask.from_dense(blocks, sq, sk, full=full).to("cuda")
    out, lse = flash_attn4.attn(q.to(dtype), k.to(dtype), v.to(dtype), causal=causal, window_size=window,
                                softcap=softcap, block_mask=mask, return_lse=True)  # fmt: skip
    allowed = _allowed(blocks, full, sq, sk, causal, window).cuda()

    def dense(dt):
        qq, kk, vv = (t.to(dt) for t in (q, k, v))
        if softcap:  # softcap(s) = c tanh(s / c): fold it into the scores by hand
            scale = 1 / math.sqrt(hdim)
            s = torch.einsum("bqhd,bkhd->bhqk", qq, kk.repeat_interleave(hq // hk, 2)).double() * scale
            s = (softcap * torch.tanh(s / softcap)).masked_fill(~allowed, -math.inf)
            empty = ~allowed.expand_as(s).any(-1)
            lse_ = torch.logsumexp(torch.where(empty[..., None], torch.zeros_like(s), s), -1)
            p = torch.exp(s - lse_[..., None]).to(dt)
            o = torch.einsum("bhqk,bkhd->bqhd", p, vv.repeat_interleave(hq // hk, 2))
            return o, lse_.masked_fill(empty, -math.inf)
        return dense_masked(qq, kk, vv, allowed)

    truth, low = dense(torch.float64), dense(dtype)
    assert torch.isfinite(out).all()
    empty = ~allowed.expand(b, hq, sq, sk).any(-1)
    assert torch.isinf(lse[empty]).all() and (lse[empty] < 0).all()
    assert not out.transpose(1, 2)[empty].any(), "rows with no key must be 0"
    for name, o, t, lp in (("out", out, truth[0], low[0]), ("lse", lse, truth[1], low[1])):
        live = ~torch.isinf(t)
        o, t, lp = o.double()[live], t[live], lp.double()[live]
        floor = (t.to(dtype).double() - t).abs().max().item() + 1e-4 if t.numel() else 0.0
        err, err_lp = ((o - t).abs().max().item(), (lp - t).abs().max().item()) if t.numel() else (0.0, 0.0)
        assert err <= 2 * err_lp + floor, f"{name}: {err:.3g} > 2 * {err_lp:.3g} + {floor:.3g}"


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_skip() is not None, reason=f"{_gpu_skip()}")
def test_block_sparse_kernel_lists_that_lie_do_not_fault():
    """Counts past nk or negative, indices negative or past nk: clamped in the kernel (some in-bounds
    attention), never a fault; the CUDA context still works afterwards."""
    b, sq, sk, h, d = 2, 500, 700, 4, _build_info.BLOCK_SPARSE_HDIMS[0]
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for n in (sq, sk, sk))
    nq, nk = math.ceil(sq / BLK), math.ceil(sk / BLK)
    count = torch.randint(-3, nk + 5, (b, h, nq), device="cuda", dtype=torch.int32)
    index = torch.randint(-1000, 1000, (b, h, nq, nk), device="cuda", dtype=torch.int32)
    out, lse = torch.ops.flash_attn4.fwd_block_sparse(q, k, v, count, index, count.flip(-1), index.flip(-1),
                                                      d**-0.5, False, -1, -1, 0.0)  # fmt: skip
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert flash_attn4.attn(q, k, v).isfinite().all()


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_skip() is not None, reason=f"{_gpu_skip()}")
def test_block_sparse_gradients_on_cuda_match_the_reference():
    """Forward on the kernel, backward through the reference: gradients close to the fp64 ones."""
    b, sq, sk, h, d = 1, 300, 400, 2, _build_info.BLOCK_SPARSE_HDIMS[0]
    qf, kf, vf = (torch.randn(b, n, h, d, device="cuda", dtype=torch.float64) for n in (sq, sk, sk))
    blocks, full = _mask((1, 1), sq, sk, 0.6, seed=3)
    mask = BlockMask.from_dense(blocks, sq, sk, full=full).to("cuda")
    allowed = _allowed(blocks, full, sq, sk, True, (-1, -1)).cuda()
    go = torch.randn(b, sq, h, d, device="cuda", dtype=torch.float64)

    def grads(fn, dt):
        leaves = [t.detach().to(dt).clone().requires_grad_() for t in (qf, kf, vf)]
        return [g.double() for g in torch.autograd.grad((fn(*leaves).double() * go).sum(), leaves)]

    ours = grads(lambda q, k, v: flash_attn4.attn(q, k, v, causal=True, block_mask=mask), torch.bfloat16)
    truth = grads(lambda q, k, v: dense_masked(q, k, v, allowed)[0], torch.float64)
    low = grads(lambda q, k, v: dense_masked(q, k, v, allowed)[0], torch.bfloat16)
    for name, o, t, lp in zip(("dq", "dk", "dv"), ours, truth, low):
        floor = (t.to(torch.bfloat16).double() - t).abs().max().item() + 1e-4
        err, err_lp = (o - t).abs().max().item(), (lp - t).abs().max().item()
        assert err <= 2 * err_lp + floor, f"{name}: {err:.3g} > 2 * {err_lp:.3g} + {floor:.3g}"


def _op_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    b, sq, sk, hq, hk, d = 2, 200, 300, 4, 2, 16
    shapes = ((sq, hq), (sk, hk), (sk, hk))
    q, k, v = (torch.randn(b, n, h, d, generator=g, dtype=torch.float64) for n, h in shapes)
    blocks, full = _mask((2, 1), sq, sk, 0.6, seed)
    mask = BlockMask.from_dense(blocks, sq, sk, full=full)
    lists = (mask.kv_count, mask.kv_index, mask.full_count, mask.full_index)
    return q, k, v, mask, lists


def test_block_sparse_op_equals_the_reference_path_with_gradients():
    q, k, v, mask, lists = _op_inputs()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = torch.ops.flash_attn4.fwd_block_sparse(*leaves, *lists, 0.25, True, -1, -1, 0.0)
    leaves_ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = flash_attn4.attn(*leaves_ref, causal=True, softmax_scale=0.25, block_mask=mask, return_lse=True)
    torch.testing.assert_close((out, lse), want)
    go, gl = torch.randn_like(out), torch.randn_like(lse).masked_fill(torch.isinf(lse), 0)
    loss = lambda o, lse_: (o * go).sum() + (lse_.masked_fill(torch.isinf(lse_), 0) * gl).sum()  # noqa: E731
    got = torch.autograd.grad(loss(out, lse), leaves)
    ref = torch.autograd.grad(loss(*want), leaves_ref)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


def test_block_sparse_op_passes_opcheck():
    q, k, v, _, lists = _op_inputs(1)
    q, k, v = (t.float().requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.flash_attn4.fwd_block_sparse.default,
                          (q, k, v, *lists, 0.25, False, 100, 20, 0.0))  # fmt: skip
