"""The block-sparse kernels (sm90 and the sm80 path, `attn(..., block_mask=...)` on CUDA, forward and
backward) and their torch.library ops.

GPU: bf16 / fp16 out, lse, dq, dk, dv against fp64 dense attention with the equivalent element mask, by the
GPU tests' rule (error <= 2 x the error of the same math in low precision + a rounding floor), densities 0,
one block, 10%, 50%, 100%, causal / window / softcap, odd lengths, GQA, broadcast mask batch / heads, every
built head dim; lists that lie (counts past the end, negative or too large indices) run without a fault;
deterministic gradients. CPU: the op itself (reference inside) against `attn`'s reference path, gradients,
and torch.library.opcheck."""

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
    return None if arch in (80, 90) else why


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


def _dense(q, k, v, allowed, softcap):
    """The fp64-or-low-precision dense attention with the equivalent element mask (softcap folded into the
    scores by hand), differentiable: (out, lse); empty rows 0 and -inf."""
    if not softcap:
        return dense_masked(q, k, v, allowed)
    hq, hk, d = q.shape[2], k.shape[2], q.shape[-1]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(hq // hk, 2)) / math.sqrt(d)
    s = (softcap * torch.tanh(s / softcap)).masked_fill(~allowed, -math.inf)
    empty = ~allowed.expand_as(s).any(-1)
    lse = torch.logsumexp(torch.where(empty[..., None], torch.zeros_like(s), s), -1)
    p = torch.exp(s - lse[..., None]).to(q.dtype)
    return torch.einsum("bhqk,bkhd->bqhd", p, v.repeat_interleave(hq // hk, 2)), lse.masked_fill(
        empty, -math.inf
    )


def _check(name, ours, truth, low, dtype):
    """FlashAttention's rule: error <= 2 x the same math's error in low precision + a rounding floor."""
    live = ~torch.isinf(truth)
    o, t, lp = ours.double()[live], truth[live], low.double()[live]
    if not t.numel():
        return
    floor = (t.to(dtype).double() - t).abs().max().item() + 1e-4
    err, err_lp = (o - t).abs().max().item(), (lp - t).abs().max().item()
    assert err <= 2 * err_lp + floor, f"{name}: {err:.3g} > 2 * {err_lp:.3g} + {floor:.3g}"


def _case(hdim, sq, sk, density, mshape, hq=4, hk=2):
    g = torch.Generator(device="cuda").manual_seed(sq * 7 + sk + hdim)
    shapes = ((sq, hq), (sk, hk), (sk, hk))
    q, k, v = (torch.randn(2, n, h, hdim, device="cuda", generator=g, dtype=torch.float64) for n, h in shapes)
    blocks, full = _mask(mshape, sq, sk, density, seed=sq + sk)
    return q, k, v, blocks, full, BlockMask.from_dense(blocks, sq, sk, full=full).to("cuda")


DTYPE = torch.bfloat16 if "bf16" in _build_info.DTYPES else torch.float16


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_skip() is not None, reason=f"{_gpu_skip()}")
@pytest.mark.parametrize("hdim", _build_info.BLOCK_SPARSE_HDIMS or [128])
@pytest.mark.parametrize("sq,sk,causal,window,softcap,density,mshape", GPU_CASES)
def test_block_sparse_kernel_matches_reference(hdim, sq, sk, causal, window, softcap, density, mshape):
    q, k, v, blocks, full, mask = _case(hdim, sq, sk, density, mshape)
    out, lse = flash_attn4.attn(*(t.to(DTYPE) for t in (q, k, v)), causal=causal, window_size=window,
                                softcap=softcap, block_mask=mask, return_lse=True)  # fmt: skip
    allowed = _allowed(blocks, full, sq, sk, causal, window).cuda()
    truth = _dense(q, k, v, allowed, softcap)
    low = _dense(*(t.to(DTYPE) for t in (q, k, v)), allowed, softcap)
    assert torch.isfinite(out).all()
    empty = ~allowed.expand(*lse.shape, sk).any(-1)
    assert torch.isinf(lse[empty]).all() and (lse[empty] < 0).all()
    assert not out.transpose(1, 2)[empty].any(), "rows with no key must be 0"
    _check("out", out, truth[0], low[0], DTYPE)
    _check("lse", lse, truth[1], low[1], DTYPE)


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_skip() is not None, reason=f"{_gpu_skip()}")
@pytest.mark.parametrize("hdim", _build_info.BLOCK_SPARSE_HDIMS or [128])
@pytest.mark.parametrize("sq,sk,causal,window,softcap,density,mshape", GPU_CASES)
def test_block_sparse_kernel_gradients_match_reference(
    hdim, sq, sk, causal, window, softcap, density, mshape
):
    """The backward kernel (the transposed lists) against fp64 autograd of the dense masked attention, with
    a gradient through lse too; NaN-poisoned is not possible for autograd outputs, so rows and key blocks no
    block reaches must come back exactly 0."""
    q, k, v, blocks, full, mask = _case(hdim, sq, sk, density, mshape)
    allowed = _allowed(blocks, full, sq, sk, causal, window).cuda()
    g = torch.Generator(device="cuda").manual_seed(sk)
    go = torch.randn(q.shape, device="cuda", dtype=torch.float64, generator=g)
    gl = torch.randn(2, q.shape[2], sq, device="cuda", dtype=torch.float64, generator=g)

    def grads(fn, dt):
        leaves = [t.to(dt).requires_grad_() for t in (q, k, v)]
        out, lse = fn(*leaves)
        loss = (out.double() * go).sum() + (lse.double().masked_fill(torch.isinf(lse), 0) * gl).sum()
        return [x.double() for x in torch.autograd.grad(loss, leaves)]

    ours = grads(lambda *t: flash_attn4.attn(*t, causal=causal, window_size=window, softcap=softcap,
                                             block_mask=mask, return_lse=True), DTYPE)  # fmt: skip
    truth = grads(lambda *t: _dense(*t, allowed, softcap), torch.float64)
    low = grads(lambda *t: _dense(*t, allowed, softcap), DTYPE)
    for name, o, t, lp in zip(("dq", "dk", "dv"), ours, truth, low):
        assert torch.isfinite(o).all(), name
        _check(name, o, t, lp, DTYPE)
    # Keys that no query sees get exactly zero gradients (their CTAs take no step but still store).
    unseen = ~allowed.expand(2, q.shape[2], sq, sk).any(-2).any(1)  # (b, sk)
    assert not ours[1][unseen].any() and not ours[2][unseen].any()


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_skip() is not None, reason=f"{_gpu_skip()}")
def test_block_sparse_kernel_lists_that_lie_do_not_fault():
    """Counts past the lists' length or negative, indices negative or too large: clamped in both kernels
    (some in-bounds attention), never a fault; the CUDA context still works afterwards."""
    b, sq, sk, h, d = 2, 500, 700, 4, _build_info.BLOCK_SPARSE_HDIMS[0]
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for n in (sq, sk, sk))
    nq, nk = math.ceil(sq / BLK), math.ceil(sk / BLK)

    def lists(rows, length):
        count = torch.randint(-3, length + 5, (b, h, rows), device="cuda", dtype=torch.int32)
        index = torch.randint(-1000, 1000, (b, h, rows, length), device="cuda", dtype=torch.int32)
        return count, index, count.flip(-1), index.flip(-1)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = torch.ops.flash_attn4.fwd_block_sparse(*leaves, *lists(nq, nk), *lists(nk, nq), d**-0.5, False,
                                                      -1, -1, 0.0, False)  # fmt: skip
    grads = torch.autograd.grad(out.float().sum(), leaves)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    assert flash_attn4.attn(q, k, v).isfinite().all()


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_skip() is not None, reason=f"{_gpu_skip()}")
def test_block_sparse_deterministic_gradients_come_from_the_reference():
    """deterministic=True: the backward kernel has no such mode, so the reference runs (with a warning);
    two runs give bitwise-equal gradients."""
    q, k, v, blocks, full, mask = _case(_build_info.BLOCK_SPARSE_HDIMS[0], 300, 400, 0.6, (1, 1))

    def grads():
        leaves = [t.to(DTYPE).requires_grad_() for t in (q, k, v)]
        out = flash_attn4.attn(*leaves, causal=True, block_mask=mask, deterministic=True)
        return torch.autograd.grad(out.float().square().sum(), leaves)

    a, b = grads(), grads()
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def _op_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    b, sq, sk, hq, hk, d = 2, 200, 300, 4, 2, 16
    shapes = ((sq, hq), (sk, hk), (sk, hk))
    q, k, v = (torch.randn(b, n, h, d, generator=g, dtype=torch.float64) for n, h in shapes)
    blocks, full = _mask((2, 1), sq, sk, 0.6, seed)
    mask = BlockMask.from_dense(blocks, sq, sk, full=full)
    lists = (mask.kv_count, mask.kv_index, mask.full_count, mask.full_index, mask.q_count, mask.q_index,
             mask.full_q_count, mask.full_q_index)  # fmt: skip
    return q, k, v, mask, lists


def test_block_sparse_op_equals_the_reference_path_with_gradients():
    q, k, v, mask, lists = _op_inputs()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = torch.ops.flash_attn4.fwd_block_sparse(*leaves, *lists, 0.25, True, -1, -1, 0.0, False)
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
                          (q, k, v, *lists, 0.25, False, 100, 20, 0.0, False))  # fmt: skip
