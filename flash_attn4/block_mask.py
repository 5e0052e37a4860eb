"""Block-sparse attention masks: which (query block, key block) tiles a call computes.

    mask = flash_attn4.BlockMask.from_dense(blocks, seqlen_q, seqlen_k)   # blocks: bool (B, H, nq, nk)
    out = flash_attn4.attn(q, k, v, block_mask=mask)

Per (batch, head, query block) two index lists, as in FlashAttention-4 and FlexAttention: *partial*
blocks, computed with the call's element mask (causal or window), and *full* blocks, computed without it.
Every other block is skipped. Element (i, j) is therefore seen iff its block is full, or its block is
partial and the element mask lets i see j. The batch and head dims may be 1 (broadcast). The backward's
transpose (per key block, the query blocks that read it) is built with torch ops on the mask's device.
Blocks are 128 x 128 (the sm90 kernels' tiles); the last block of a sequence may be short.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

BLOCK = 128


def _lists(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """bool (..., n, m) -> (count (..., n) int32, index (..., n, m) int32): each row's set columns in
    increasing order in its first count slots (the other slots are never read). Fresh row-major tensors: the
    kernels read the lists row by row, whatever the strides of `blocks` (a transpose, say). A cumsum and a
    scatter, not a sort: few and cheap launches (estimate_block_mask builds one per call)."""
    m = blocks.shape[-1]
    count = blocks.sum(-1, dtype=torch.int32)
    # Set column j goes to slot (set columns before it); the others all land in slot m - 1, which is past
    # count whenever one of them exists.
    slot = torch.where(blocks, blocks.cumsum(-1) - 1, m - 1)
    cols = torch.arange(m, device=blocks.device, dtype=torch.int32).expand(blocks.shape)
    index = torch.zeros(blocks.shape, dtype=torch.int32, device=blocks.device).scatter_(-1, slot, cols)
    return count.contiguous(), index  # a reduction keeps a permuted input's order; the kernels want row-major


def _dense(count: Tensor, index: Tensor, m: int) -> Tensor:
    """The inverse of _lists: bool (B, H, n, m). Slots past count may hold anything (padding repeats)."""
    slots = torch.arange(index.shape[-1], device=index.device)
    live = (slots < count[..., None].long()).to(torch.int32)
    hits = torch.zeros(*index.shape[:-1], m, dtype=torch.int32, device=index.device)
    return hits.scatter_add_(-1, index.long().clamp(0, m - 1), live) > 0


@dataclass(frozen=True)
class BlockMask:
    """Block lists of one block-sparse attention pattern (see the module doc). Build it with
    `from_dense`, `from_indices` or `from_flex`; `estimate_block_mask` builds one from q and k."""

    seqlen_q: int
    seqlen_k: int
    kv_count: Tensor  # (B, H, nq) int32: partial key blocks of each query block
    kv_index: Tensor  # (B, H, nq, nk) int32
    full_count: Tensor  # (B, H, nq) int32: full key blocks
    full_index: Tensor  # (B, H, nq, nk) int32
    q_count: Tensor  # (B, H, nk) int32: the transpose of the partial lists (for the backward)
    q_index: Tensor  # (B, H, nk, nq) int32
    full_q_count: Tensor  # (B, H, nk) int32
    full_q_index: Tensor  # (B, H, nk, nq) int32
    block_size: int = BLOCK

    @property
    def num_blocks(self) -> tuple[int, int]:
        return self.kv_count.shape[-1], self.q_count.shape[-1]

    @property
    def shape(self) -> tuple[int, int]:
        """(batch or 1, heads or 1)."""
        return tuple(self.kv_count.shape[:2])

    @classmethod
    def from_dense(
        cls, blocks: Tensor, seqlen_q: int, seqlen_k: int, *, full: Tensor | None = None,
        block_size: int = BLOCK,
    ) -> BlockMask:  # fmt: skip
        """blocks: bool (B or 1, H or 1, ceil(seqlen_q / block), ceil(seqlen_k / block)), True = compute;
        full: optional bool of the same shape, True where a computed block needs no element mask (a subset
        of blocks; without it every computed block is partial)."""
        nq, nk = math.ceil(seqlen_q / block_size), math.ceil(seqlen_k / block_size)
        for name, t in (("blocks", blocks), ("full", full)):
            if t is None:
                continue
            if not isinstance(t, Tensor) or t.dim() != 4 or t.shape[-2:] != (nq, nk):
                raise ValueError(
                    f"{name} must be a 4-D (batch or 1, heads or 1, {nq}, {nk}) tensor for seqlen_q "
                    f"{seqlen_q}, seqlen_k {seqlen_k} and {block_size}-token blocks, got "
                    f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}"
                )
        blocks = blocks.bool()
        full = torch.zeros_like(blocks) if full is None else full.bool() & blocks
        partial = blocks & ~full
        return cls._build(partial, full, seqlen_q, seqlen_k, block_size)

    @classmethod
    def from_indices(
        cls, kv_count: Tensor, kv_index: Tensor, seqlen_q: int, seqlen_k: int, *,
        full_count: Tensor | None = None, full_index: Tensor | None = None, block_size: int = BLOCK,
    ) -> BlockMask:  # fmt: skip
        """FlexAttention / FlashAttention-4 style lists: kv_count (B, H, nq), kv_index (B, H, nq, >= max
        count) of partial key blocks, optionally full_count / full_index of full ones."""
        nk = math.ceil(seqlen_k / block_size)
        partial = _dense(kv_count, kv_index, nk)
        full = _dense(full_count, full_index, nk) if full_count is not None else torch.zeros_like(partial)
        return cls.from_dense(partial | full, seqlen_q, seqlen_k, full=full, block_size=block_size)

    @classmethod
    def from_flex(cls, flex_mask, *, causal: bool = False, window_size: tuple[int, int] = (-1, -1)):
        """From torch.nn.attention.flex_attention.BlockMask (its block structure). Its partial blocks are
        computed with our built-in element mask, so the call must pass the same `causal` / `window_size`
        as given here; this checks on the partial blocks that flex_mask's mask_mod agrees with that mask
        and raises a ValueError that says so when it does not."""
        bq, bk = flex_mask.BLOCK_SIZE
        if bq != bk:
            raise ValueError(f"flash_attn4 block masks have square blocks, got {flex_mask.BLOCK_SIZE}")
        seqlen_q, seqlen_k = flex_mask.seq_lengths
        mask = cls.from_indices(flex_mask.kv_num_blocks, flex_mask.kv_indices, seqlen_q, seqlen_k,
                                full_count=flex_mask.full_kv_num_blocks, full_index=flex_mask.full_kv_indices,
                                block_size=bq)  # fmt: skip
        _check_mask_mod(mask, flex_mask.mask_mod, causal, window_size)
        return mask

    @classmethod
    def _build(cls, partial: Tensor, full: Tensor, seqlen_q: int, seqlen_k: int, block: int) -> BlockMask:
        # One set of launches for both kinds and, on a square grid, for both orientations: the estimator
        # builds a mask every call, and each launch costs about as much host time as its GPU work.
        partial, full = torch.broadcast_tensors(partial, full)
        kinds = (partial, full, partial.mT, full.mT)
        counts, indexes = [], []
        for group in [kinds] if partial.shape[-1] == partial.shape[-2] else [kinds[:2], kinds[2:]]:
            count, index = _lists(torch.stack(group))
            counts += count.unbind(0)
            indexes += index.unbind(0)
        kv_count, full_count, q_count, full_q_count = counts
        kv_index, full_index, q_index, full_q_index = indexes
        return cls(int(seqlen_q), int(seqlen_k), kv_count, kv_index, full_count, full_index, q_count, q_index,
                   full_q_count, full_q_index, block)  # fmt: skip

    def to_dense(self) -> tuple[Tensor, Tensor]:
        """(partial, full) bool (B, H, nq, nk)."""
        nk = self.q_count.shape[-1]
        return _dense(self.kv_count, self.kv_index, nk), _dense(self.full_count, self.full_index, nk)

    def element_mask(self, causal: bool = False, window_size: tuple[int, int] = (-1, -1)) -> Tensor:
        """bool (B, H, seqlen_q, seqlen_k): True where query i sees key j under this mask and the call's
        element mask (bottom-right aligned, as everywhere). Dense: for tests and the reference."""
        partial, full = self.to_dense()
        blk = self.block_size
        rows = torch.arange(self.seqlen_q, device=partial.device) // blk
        cols = torch.arange(self.seqlen_k, device=partial.device) // blk
        p = partial[:, :, rows][:, :, :, cols]
        f = full[:, :, rows][:, :, :, cols]
        return f | (p & _builtin(self.seqlen_q, self.seqlen_k, causal, window_size, partial.device))

    def to(self, device) -> BlockMask:
        fields = {k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in self.__dict__.items()}
        return BlockMask(**fields)


def _builtin(sq: int, sk: int, causal: bool, window_size, device, rows=None, cols=None) -> Tensor:
    """The element mask of causal / window_size, bottom-right aligned: (sq, sk), or at given rows / cols."""
    i = (torch.arange(sq, device=device) if rows is None else rows) + (sk - sq)
    j = torch.arange(sk, device=device) if cols is None else cols
    i, j = i[..., :, None], j[..., None, :]
    left, right = window_size
    right = 0 if causal else right
    seen = torch.ones(torch.broadcast_shapes(i.shape, j.shape), dtype=torch.bool, device=device)
    if right >= 0:
        seen = seen & (j <= i + right)
    if left >= 0:
        seen = seen & (j >= i - left)
    return seen


def _check_mask_mod(mask: BlockMask, mask_mod, causal: bool, window_size) -> None:
    """mask_mod on every partial block (in range) against the built-in mask; ValueError on a mismatch."""
    if mask_mod is None:
        return
    partial, _ = mask.to_dense()
    b, h, qb, kb = torch.nonzero(partial, as_tuple=True)
    if b.numel() == 0:
        return
    blk = mask.block_size
    offs = torch.arange(blk, device=partial.device)
    rows = (qb[:, None] * blk + offs).clamp(max=mask.seqlen_q - 1)  # (P, blk); clamped rows repeat a real one
    cols = (kb[:, None] * blk + offs).clamp(max=mask.seqlen_k - 1)
    theirs = mask_mod(b[:, None, None], h[:, None, None], rows[:, :, None], cols[:, None, :])
    ours = _builtin(mask.seqlen_q, mask.seqlen_k, causal, window_size, partial.device, rows, cols)
    if not torch.equal(theirs.bool(), ours):
        what = "causal=True" if causal else f"window_size={tuple(window_size)}"
        raise ValueError(
            "the FlexAttention mask_mod differs from flash_attn4's built-in element mask "
            f"({what}) on its partial blocks; flash_attn4 computes partial blocks with causal / window masks "
            "only: pass the matching causal / window_size, or make those blocks full or empty"
        )
