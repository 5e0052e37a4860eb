"""Packed batches with short query blocks (decoding many sequences at once) on the split-KV decode kernel.

The decode kernel reads a query block of fixed height per sequence and keys from cache rows. A packed batch
maps onto it without reading an offset on the host: the packed k / v are one cache row (batch index 0 for
every sequence) whose sequence b holds rows [cu_k[b], cu_k[b] + len_k(b)) (cache_leftpad, cache_seqlens);
its queries are gathered into a (batch, max_seqlen_q) block aligned to the block's last row (the decode
kernel's bottom-right alignment), and the outputs scattered back. Rows of the block before a sequence's
first query are padding: computed on a clamped row, never written back.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _lengths(cu: Tensor, used: Tensor | None) -> Tensor:
    n = (cu[1:] - cu[:-1]).clamp(min=0)
    return n if used is None else torch.minimum(n, used.clamp(min=0))


def as_cache(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, used_q: Tensor | None,
             used_k: Tensor | None, max_q: int) -> dict:  # fmt: skip
    """The decode kernel's view of a packed call: q_block (batch, max_q, hq, d), caches (1, total_k, hk, d),
    cache_seqlens / cache_leftpad / cache_batch_idx (batch,) int32, and rows / valid (batch, max_q): the
    packed query row behind each block row, and whether it is a real query of that sequence."""
    batch = cu_q.numel() - 1
    len_q = torch.minimum(_lengths(cu_q, used_q), torch.full_like(cu_q[1:], max_q))
    t = torch.arange(max_q, device=q.device, dtype=torch.int32)
    first = max_q - len_q  # block rows before this are padding
    raw = cu_q[:-1, None] + t[None, :] - first[:, None]
    valid = (t[None, :] >= first[:, None]) & (raw >= 0) & (raw < q.shape[0])
    rows = raw.clamp(0, max(q.shape[0] - 1, 0))
    start_k = cu_k[:-1].clamp(0, k.shape[0])
    return dict(
        q_block=q[rows.reshape(-1).long()].view(batch, max_q, *q.shape[1:]),
        k_cache=k.unsqueeze(0),
        v_cache=v.unsqueeze(0),
        cache_seqlens=(start_k + _lengths(cu_k, used_k)).to(torch.int32),
        cache_leftpad=start_k.to(torch.int32),
        cache_batch_idx=torch.zeros(batch, dtype=torch.int32, device=q.device),
        rows=rows,
        valid=valid,
    )


def scatter_back(out_block: Tensor, lse_block: Tensor, rows: Tensor, valid: Tensor,
                 total_q: int) -> tuple[Tensor, Tensor]:  # fmt: skip
    """out_block (batch, max_q, hq, d), lse_block (batch, hq, max_q) -> packed out (total_q, hq, d) and lse
    (hq, total_q); rows outside every sequence get out = 0 and lse = -inf."""
    hq, d = out_block.shape[2], out_block.shape[3]
    keep = valid.reshape(-1)
    # Padding rows go to a spare row past the end, dropped after the scatter (no host-side compaction).
    dest = torch.where(keep, rows.reshape(-1).long(), torch.full_like(keep, total_q, dtype=torch.long))
    out = out_block.new_zeros(total_q + 1, hq, d).index_copy_(0, dest, out_block.reshape(-1, hq, d))
    lse = lse_block.new_full((total_q + 1, hq), float("-inf"))
    lse.index_copy_(0, dest, lse_block.transpose(1, 2).reshape(-1, hq))
    return out[:total_q], lse[:total_q].t().contiguous()
