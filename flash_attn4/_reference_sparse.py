"""Reference block-sparse attention (`attn(..., block_mask=...)`): the executable spec of what the kernels
compute for a BlockMask, in torch ops (differentiable through autograd), one query block at a time so
memory stays at (batch, heads, 128, seqlen_k) scores."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from flash_attn4.block_mask import BlockMask, _builtin


def block_sparse_attention_ref(
    q: Tensor, k: Tensor, v: Tensor, mask: BlockMask, *, causal: bool, softmax_scale: float,
    window_size: tuple[int, int], softcap: float,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """q (b, sq, hq, d), k / v (b, sk, hk, d) -> out (b, sq, hq, d) in q's dtype, lse (b, hq, sq) float32
    (float64 for float64 inputs). Element (i, j) takes part iff mask says so (full block, or partial block
    and the causal / window mask); a row with no key gets out = 0, lse = -inf."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    qt = q.transpose(1, 2).to(cdt)  # (b, hq, sq, d)
    kt = k.transpose(1, 2).to(cdt).repeat_interleave(hq // hk, dim=1)
    vt = v.transpose(1, 2).to(cdt).repeat_interleave(hq // hk, dim=1)
    partial, full = mask.to_dense()  # (B, H, nq, nk), B / H possibly 1
    blk = mask.block_size
    col_block = torch.arange(sk, device=q.device) // blk
    outs, lses = [], []
    for qb in range(math.ceil(sq / blk)):
        r0, r1 = qb * blk, min(sq, (qb + 1) * blk)
        rows = torch.arange(r0, r1, device=q.device)
        elem = _builtin(sq, sk, causal, window_size, q.device, rows=rows)  # (rows, sk)
        seen = full[:, :, qb, col_block][:, :, None, :] | (partial[:, :, qb, col_block][:, :, None, :] & elem)
        s = torch.matmul(qt[:, :, r0:r1], kt.transpose(-1, -2)) * softmax_scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        seen = seen.expand(b, hq, -1, -1)
        s = s.masked_fill(~seen, -math.inf)
        # Rows that see nothing: out 0, lse -inf, and no NaN in the gradient (logsumexp of an all -inf row
        # has a NaN derivative), so their lse is taken over zeros and then replaced.
        empty = ~seen.any(dim=-1)
        lse = torch.logsumexp(torch.where(empty[..., None], torch.zeros_like(s), s), dim=-1)
        p = torch.exp(s - lse[..., None])
        outs.append(torch.matmul(p, vt))
        lses.append(lse.masked_fill(empty, -math.inf))
    if not outs:  # no query rows
        return q.new_zeros(b, sq, hq, v.shape[-1]), torch.full(
            (b, hq, sq), -math.inf, dtype=cdt, device=q.device
        )
    out = torch.cat(outs, dim=2).transpose(1, 2).to(q.dtype)
    lse = torch.cat(lses, dim=2)
    return out, lse.to(torch.float64 if cdt == torch.float64 else torch.float32)
