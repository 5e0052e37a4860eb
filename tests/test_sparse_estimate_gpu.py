"""estimate_block_mask's GPU path (csrc/sparse_estimate.cu) against its PyTorch version on the same CUDA
inputs: the same kept blocks, partial / full split, counts, increasing indices with zeros after each count,
and transposed lists that are the transpose. Odd lengths, GQA, causal / window, threshold and density, keep
options, fp32 / fp16 / bf16, a non-contiguous k; a planted pattern found at 32k tokens."""

from __future__ import annotations

import pytest
import torch

from flash_attn4 import _build_info, sparsity
from flash_attn4.block_mask import _dense, _lists


def _skip() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    ext, why = _build_info.load_extension()
    if ext is None:
        return why
    return None if hasattr(ext, "estimate_blocks") else "this build has no estimate_blocks"


pytestmark = pytest.mark.skipif(_skip() is not None, reason=str(_skip()))

CASES = [  # b, sq, sk, hq, hk, d, causal, window, option, keep_first, keep_local, dtype
    (2, 1000, 1000, 4, 2, 64, False, (-1, -1), dict(threshold=0.9), 1, 1, torch.bfloat16),
    (1, 1000, 1000, 4, 4, 128, True, (-1, -1), dict(threshold=0.7), 1, 1, torch.float16),
    (1, 300, 2100, 6, 2, 96, True, (-1, -1), dict(density=0.3), 0, 0, torch.bfloat16),
    (2, 2100, 300, 2, 1, 64, True, (-1, -1), dict(density=0.5), 2, 2, torch.float32),
    (1, 4096, 4096, 2, 1, 128, False, (700, 200), dict(threshold=0.95), 1, 1, torch.bfloat16),
    (1, 4096, 4096, 2, 2, 256, False, (-1, -1), dict(density=0.1), 1, 1, torch.bfloat16),
    (3, 129, 257, 3, 3, 72, False, (-1, -1), dict(threshold=1.0), 0, 0, torch.float16),
    (1, 8192, 8192, 1, 1, 64, True, (-1, -1), dict(density=0.25), 1, 2, torch.bfloat16),
]


def _both(q, k, **kw):
    gpu = sparsity.estimate_block_mask(q, k, **kw)
    kernel, sparsity._kernel = sparsity._kernel, lambda *a: None
    try:
        ref = sparsity.estimate_block_mask(q, k, **kw)
    finally:
        sparsity._kernel = kernel
    return gpu, ref


def _check_lists(count, index, dense):
    """count / index are `dense`'s row lists: increasing set columns, then zeros."""
    want_count, want_index = _lists(dense)
    assert torch.equal(count, want_count)
    slots = torch.arange(index.shape[-1], device=index.device)
    live = slots < count[..., None]
    assert torch.equal(torch.where(live, index, 0), torch.where(live, want_index, 0))
    assert (index[~live] == 0).all()


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_estimator_kernel_equals_the_pytorch_version(case):
    b, sq, sk, hq, hk, d, causal, window, option, keep_first, keep_local, dtype = case
    g = torch.Generator(device="cuda").manual_seed(sq * 7 + sk)
    q = torch.randn(b, sq, hq, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(b, sk, hk, 2 * d, device="cuda", generator=g).to(dtype)[..., ::2]  # non-contiguous
    # Structure, so that masses are far from uniform: a shared direction in some query / key blocks.
    n = min(sk, sq // 2)
    q[:, :n] += 0.5 * k[:, :n].mean(2, keepdim=True).expand(b, n, hq, d)
    kw = dict(causal=causal, window_size=window, keep_first=keep_first, keep_local=keep_local, **option)
    gpu, ref = _both(q, k, **kw)
    gp, gf = gpu.to_dense()
    rp, rf = ref.to_dense()
    assert torch.equal(gp, rp) and torch.equal(gf, rf), (
        f"{int((gp != rp).sum())} partial / {int((gf != rf).sum())} full blocks differ of {gp.numel()}"
    )
    _check_lists(gpu.kv_count, gpu.kv_index, gp)
    _check_lists(gpu.full_count, gpu.full_index, gf)
    _check_lists(gpu.q_count, gpu.q_index, gp.mT)
    _check_lists(gpu.full_q_count, gpu.full_q_index, gf.mT)
    nk = gp.shape[-1]
    assert torch.equal(_dense(gpu.q_count, gpu.q_index, gp.shape[-2]), gp.mT)
    assert gpu.kv_index.is_contiguous() and gpu.q_index.is_contiguous() and gpu.kv_index.shape[-1] == nk


def test_estimator_kernel_finds_a_planted_pattern_at_32k():
    torch.manual_seed(0)
    b, s, h, d, blk = 1, 32768, 4, 128, 128
    nb = s // blk
    perm = torch.randperm(nb, device="cuda")
    u = torch.randn(nb, d, device="cuda") * 3
    q = 0.3 * torch.randn(b, s, h, d, device="cuda")
    k = 0.3 * torch.randn(b, s, h, d, device="cuda")
    q += u.repeat_interleave(blk, 0)[None, :, None]
    k += u[torch.argsort(perm)].repeat_interleave(blk, 0)[None, :, None]
    mask = sparsity.estimate_block_mask(q.bfloat16(), k.bfloat16(), threshold=0.9, keep_first=0, keep_local=0)
    partial, full = mask.to_dense()
    kept = partial | full
    assert not partial.any()
    rows = torch.arange(nb, device="cuda")
    assert kept[0, :, rows, perm].all()  # query block i's partner, key block perm[i]
    assert kept.float().mean() < 0.02
