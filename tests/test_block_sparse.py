"""Block-sparse attention (`BlockMask`, `attn(..., block_mask=...)`) and the estimator: against a dense fp64
reference with the equivalent element mask, written out here (blocks expanded to elements, AND the causal /
window mask on partial blocks), forward and gradients; densities 0, one block, 10%, 50%, 100%; the
FlexAttention converter; the estimator on a planted pattern and on random inputs."""

from __future__ import annotations

import math

import pytest
import torch

import flash_attn4
from flash_attn4 import BlockMask, estimate_block_mask

BLK = 128


def _elem(sq, sk, causal, window):
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    left, right = window
    right = 0 if causal else right
    m = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        m &= j <= i + right
    if left >= 0:
        m &= j >= i - left
    return m


def dense_masked(q, k, v, allowed, scale=None):
    """allowed (B|1, H|1, sq, sk) -> out, lse with masked softmax in fp64; empty rows: 0 and -inf."""
    b, sq, hq, d = q.shape
    g = hq // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(g, 2)) * (scale or 1 / math.sqrt(d))
    s = s.masked_fill(~allowed, -math.inf)
    empty = ~allowed.expand_as(s).any(-1)
    lse = torch.logsumexp(torch.where(empty[..., None], torch.zeros_like(s), s), -1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse[..., None]), v.repeat_interleave(g, 2))
    return out, lse.masked_fill(empty, -math.inf)


def _expand(blocks, sq, sk):
    return blocks.repeat_interleave(BLK, -2).repeat_interleave(BLK, -1)[..., :sq, :sk]


def _random_blocks(shape, density, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g) < density


def _qkv(b, sq, sk, hq, hk, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    return mk(b, sq, hq, d), mk(b, sk, hk, d), mk(b, sk, hk, d)


CASES = [  # sq, sk, causal, window, density, mask (batch, heads)
    (300, 300, False, (-1, -1), 0.5, (2, 4)),
    (300, 517, True, (-1, -1), 0.5, (1, 4)),
    (517, 300, False, (100, 50), 0.5, (2, 1)),
    (256, 640, False, (-1, -1), 0.1, (2, 4)),
    (384, 384, True, (-1, -1), 1.0, (1, 1)),
    (384, 384, False, (-1, -1), 0.0, (2, 4)),
]


@pytest.mark.parametrize("sq,sk,causal,window,density,mshape", CASES)
def test_attn_block_mask_matches_dense_reference(sq, sk, causal, window, density, mshape):
    q, k, v = _qkv(2, sq, sk, 4, 2)
    nq, nk = math.ceil(sq / BLK), math.ceil(sk / BLK)
    blocks = _random_blocks((*mshape, nq, nk), density, seed=sq + sk)
    full = blocks & _random_blocks((*mshape, nq, nk), 0.5, seed=1)
    mask = BlockMask.from_dense(blocks, sq, sk, full=full)
    out, lse = flash_attn4.attn(q, k, v, causal=causal, window_size=window, block_mask=mask, return_lse=True)
    allowed = _expand(full, sq, sk) | (_expand(blocks & ~full, sq, sk) & _elem(sq, sk, causal, window))
    want = dense_masked(q, k, v, allowed)
    torch.testing.assert_close((out, lse), want, atol=1e-10, rtol=1e-10)
    go, gl = torch.randn_like(out), torch.randn_like(lse).masked_fill(torch.isinf(lse), 0)
    got = torch.autograd.grad((out * go).sum() + (lse.masked_fill(torch.isinf(lse), 0) * gl).sum(), (q, k, v))
    w_out, w_lse = want
    ref = torch.autograd.grad(
        (w_out * go).sum() + (w_lse.masked_fill(torch.isinf(w_lse), 0) * gl).sum(), (q, k, v)
    )
    for a, b in zip(got, ref):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


def test_all_full_blocks_equal_dense_attention_and_one_block_is_one_block():
    q, k, v = _qkv(1, 300, 300, 2, 2)
    everything = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    mask = BlockMask.from_dense(everything, 300, 300, full=everything)
    torch.testing.assert_close(flash_attn4.attn(q, k, v, block_mask=mask), flash_attn4.attn(q, k, v))
    one = torch.zeros(1, 1, 3, 3, dtype=torch.bool)
    one[..., 1, 2] = True
    out, lse = flash_attn4.attn(q, k, v, block_mask=BlockMask.from_dense(one, 300, 300), return_lse=True)
    rows = slice(128, 256)
    want = flash_attn4.attn(q[:, rows], k[:, 256:], v[:, 256:])
    torch.testing.assert_close(out[:, rows], want)
    assert not out[:, :128].any() and torch.isinf(lse[:, :, :128]).all()


def test_lists_and_transpose():
    blocks = _random_blocks((2, 3, 5, 7), 0.4, seed=7)
    mask = BlockMask.from_dense(blocks, 5 * BLK - 3, 7 * BLK - 100)
    partial, full = mask.to_dense()
    assert torch.equal(partial, blocks) and not full.any()
    assert torch.equal(mask.kv_count, blocks.sum(-1, dtype=torch.int32))
    assert torch.equal(mask.q_count, blocks.sum(-2, dtype=torch.int32))
    for b, h, r in [(0, 0, 0), (1, 2, 4)]:
        n = int(mask.kv_count[b, h, r])
        assert mask.kv_index[b, h, r, :n].tolist() == torch.nonzero(blocks[b, h, r]).flatten().tolist()
    again = BlockMask.from_indices(mask.kv_count, mask.kv_index, mask.seqlen_q, mask.seqlen_k)
    assert torch.equal(again.to_dense()[0], blocks)


def test_bad_block_masks_are_clear_errors():
    q, k, v = _qkv(2, 300, 300, 4, 2)
    with pytest.raises(ValueError, match="seqlen_q 256"):
        flash_attn4.attn(
            q, k, v, block_mask=BlockMask.from_dense(torch.ones(1, 1, 2, 3, dtype=torch.bool), 256, 300)
        )
    with pytest.raises(ValueError, match=r"\(batch, heads\)"):
        flash_attn4.attn(
            q, k, v, block_mask=BlockMask.from_dense(torch.ones(3, 1, 3, 3, dtype=torch.bool), 300, 300)
        )
    with pytest.raises(ValueError, match="4-D"):
        BlockMask.from_dense(torch.ones(3, 3, dtype=torch.bool), 300, 300)
    with pytest.raises(TypeError, match="BlockMask"):
        flash_attn4.attn(q, k, v, block_mask=torch.ones(1))


def test_flex_block_mask_converter():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v = _qkv(2, 300, 300, 4, 2)
    causal = flex.create_block_mask(lambda b, h, i, j: i >= j, 2, 1, 300, 300, device="cpu", BLOCK_SIZE=BLK)
    mask = BlockMask.from_flex(causal, causal=True)
    torch.testing.assert_close(flash_attn4.attn(q, k, v, causal=True, block_mask=mask),
                               flash_attn4.attn(q, k, v, causal=True))  # fmt: skip
    with pytest.raises(ValueError, match="mask_mod differs"):
        BlockMask.from_flex(causal)  # its partial blocks are causal, not unmasked
    local = flex.create_block_mask(lambda b, h, i, j: (i - j).abs() <= 40, 1, 1, 300, 300, device="cpu")
    with pytest.raises(ValueError, match="mask_mod differs"):
        BlockMask.from_flex(local, window_size=(30, 30))
    mask = BlockMask.from_flex(local, window_size=(40, 40))
    torch.testing.assert_close(flash_attn4.attn(q, k, v, window_size=(40, 40), block_mask=mask),
                               flash_attn4.attn(q, k, v, window_size=(40, 40)))  # fmt: skip


def _true_mass_kept(q, k, mask, causal):
    """Mean over query rows of the exact attention mass inside the mask's blocks."""
    allowed_all = _elem(q.shape[1], k.shape[1], causal, (-1, -1))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(q.shape[2] // k.shape[2], 2)) / math.sqrt(
        q.shape[-1]
    )
    p = torch.softmax(s.masked_fill(~allowed_all, -math.inf), -1)
    partial, full = mask.to_dense()
    inside = _expand(partial | full, q.shape[1], k.shape[1])
    return (p * inside).sum(-1).mean().item()


def test_estimator_finds_a_planted_pattern():
    torch.manual_seed(0)
    b, s, h, d, nb = 1, 8 * BLK, 2, 64, 8
    perm = torch.randperm(nb)
    u = torch.randn(nb, d) * 3
    q = 0.3 * torch.randn(b, s, h, d)
    k = 0.3 * torch.randn(b, s, h, d)
    for i in range(nb):
        q[:, i * BLK : (i + 1) * BLK] += u[i]
        k[:, perm[i] * BLK : (perm[i] + 1) * BLK] += u[i]
    mask = estimate_block_mask(q, k, threshold=0.9, keep_first=0, keep_local=0)
    partial, full = mask.to_dense()
    kept = partial | full
    assert all(kept[0, 0, i, perm[i]] for i in range(nb))
    assert kept.float().mean() < 0.3  # it found a sparse pattern, not everything
    assert _true_mass_kept(q.double(), k.double(), mask, causal=False) >= 0.95


@pytest.mark.parametrize("causal", [False, True])
def test_estimator_keeps_the_threshold_on_random_inputs(causal):
    torch.manual_seed(1)
    q, k = torch.randn(1, 6 * BLK, 2, 64), torch.randn(1, 6 * BLK, 2, 64)
    mask = estimate_block_mask(q, k, threshold=0.9, causal=causal)
    assert _true_mass_kept(q.double(), k.double(), mask, causal) >= 0.9 - 0.02
    dens = estimate_block_mask(q, k, density=0.5, causal=causal, keep_first=0, keep_local=0)
    partial, full = dens.to_dense()
    assert ((partial | full).sum(-1) <= 3).all()  # half of 6 visible blocks at most, rounded up
    out = flash_attn4.attn(q, k, k, causal=causal, block_mask=mask)
    assert torch.isfinite(out).all()


def test_varlen_block_mask_and_alibi_equal_each_sequence_alone():
    """attn_varlen with a per-sequence block mask (built for the max lengths) and per-sequence ALiBi slopes:
    sequence b equals attn on its rows with the top-left corner of its mask entry."""
    lens_q, lens_k = [130, 0, 300], [200, 40, 300]
    g = torch.Generator().manual_seed(9)
    q = torch.randn(sum(lens_q), 4, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(sum(lens_k), 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    blocks = _random_blocks((3, 4, 3, 3), 0.6, seed=2)
    mask = BlockMask.from_dense(blocks, 300, 300)
    slopes = torch.rand(3, 4, generator=g, dtype=torch.float64)
    out = flash_attn4.attn_varlen(q, k, v, cu(lens_q), cu(lens_k), 300, 300, causal=True, block_mask=mask,
                                  alibi_slopes=slopes)  # fmt: skip
    oq = ok = 0
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        if lq:
            nq, nk = math.ceil(lq / BLK), math.ceil(lk / BLK)
            own = BlockMask.from_dense(blocks[b : b + 1, :, :nq, :nk], lq, lk)
            qb, kb, vb = q[None, oq : oq + lq], k[None, ok : ok + lk], v[None, ok : ok + lk]
            want = flash_attn4.attn(qb, kb, vb, causal=True, block_mask=own, alibi_slopes=slopes[b])
            torch.testing.assert_close(out[oq : oq + lq], want[0], atol=1e-12, rtol=1e-12)
        oq, ok = oq + lq, ok + lk
    with pytest.raises(ValueError, match="max_seqlen_q, max_seqlen_k"):
        flash_attn4.attn_varlen(q, k, v, cu(lens_q), cu(lens_k), 256, 300, block_mask=mask)
