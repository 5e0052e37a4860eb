"""Reference attention for the options the kernels do not run yet: block masks (`block_mask`), ALiBi
(`alibi_slopes`) and dropout (`dropout_p`, with flash_attn4.dropout's keep mask). The executable spec of
what the kernels will compute, in torch ops (differentiable through autograd), one block of 128 query rows
at a time so memory stays at (batch, heads, 128, seqlen_k) scores."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from flash_attn4.block_mask import BLOCK, BlockMask, _builtin
from flash_attn4.dropout import keep_mask, keep_scale


def general_attention_ref(
    q: Tensor, k: Tensor, v: Tensor, *, block_mask: BlockMask | None = None,
    alibi_slopes: Tensor | None = None, causal: bool, softmax_scale: float, window_size: tuple[int, int],
    softcap: float, dropout_p: float = 0.0, dropout_seed: tuple = (0, 0), dropout_batch: int = 0,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """q (b, sq, hq, d), k / v (b, sk, hk, d) -> out (b, sq, hq, d) in q's dtype, lse (b, hq, sq) float32
    (float64 for float64 inputs). The logit of (i, j) is softcap(scale q_i . k_j) - slope_h |i + sk - sq - j|
    (ALiBi, slopes (hq,) or (b, hq)); element (i, j) takes part iff the causal / window mask lets it and,
    with a block mask, its block is full (no element mask) or partial (with it). A row with no key gets
    out = 0, lse = -inf. dropout_p > 0 drops probabilities by `keep_mask(*dropout_seed, ...)` (batch index
    counted from dropout_batch, for a packed batch's sequences) and scales the kept ones by keep_scale(p);
    lse is that of the probabilities before dropout."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    qt = q.transpose(1, 2).to(cdt)  # (b, hq, sq, d)
    kt = k.transpose(1, 2).to(cdt).repeat_interleave(hq // hk, dim=1)
    vt = v.transpose(1, 2).to(cdt).repeat_interleave(hq // hk, dim=1)
    blk = BLOCK if block_mask is None else block_mask.block_size
    if block_mask is not None:
        partial, full = block_mask.to_dense()  # (B, H, nq, nk), B / H possibly 1
    col_block = torch.arange(sk, device=q.device) // blk
    slopes = None
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(cdt).reshape(-1 if alibi_slopes.dim() == 2 else 1, hq)[..., None, None]
    outs, lses = [], []
    for qb in range(math.ceil(sq / blk)):
        r0, r1 = qb * blk, min(sq, (qb + 1) * blk)
        rows = torch.arange(r0, r1, device=q.device)
        elem = _builtin(sq, sk, causal, window_size, q.device, rows=rows)  # (rows, sk)
        if block_mask is None:
            seen = elem[None, None]
        else:
            seen = full[:, :, qb, col_block][:, :, None, :] | (
                partial[:, :, qb, col_block][:, :, None, :] & elem
            )
        s = torch.matmul(qt[:, :, r0:r1], kt.transpose(-1, -2)) * softmax_scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if slopes is not None:
            dist = (rows[:, None] + (sk - sq) - torch.arange(sk, device=q.device)[None, :]).abs().to(cdt)
            s = s - slopes * dist
        seen = seen.expand(b, hq, -1, -1)
        s = s.masked_fill(~seen, -math.inf)
        # Rows that see nothing: out 0, lse -inf, and no NaN in the gradient (logsumexp of an all -inf row
        # has a NaN derivative), so their lse is taken over zeros and then replaced.
        empty = ~seen.any(dim=-1)
        lse = torch.logsumexp(torch.where(empty[..., None], torch.zeros_like(s), s), dim=-1)
        p = torch.exp(s - lse[..., None])
        if dropout_p > 0:
            keep = keep_mask(*dropout_seed, dropout_p, b, hq, rows, torch.arange(sk, device=q.device),
                             batch_start=dropout_batch)  # fmt: skip
            p = p * keep * keep_scale(dropout_p)
        outs.append(torch.matmul(p, vt))
        lses.append(lse.masked_fill(empty, -math.inf))
    if not outs:  # no query rows
        return q.new_zeros(b, sq, hq, v.shape[-1]), torch.full(
            (b, hq, sq), -math.inf, dtype=cdt, device=q.device
        )
    out = torch.cat(outs, dim=2).transpose(1, 2).to(q.dtype)
    lse = torch.cat(lses, dim=2)
    return out, lse.to(torch.float64 if cdt == torch.float64 else torch.float32)


def general_varlen_ref(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, *, seqused_q=None,
    seqused_k=None, causal: bool, softmax_scale: float, window_size: tuple[int, int], softcap: float,
    block_mask: BlockMask | None = None, alibi_slopes: Tensor | None = None, dropout_p: float = 0.0,
    dropout_seed: tuple = (0, 0),
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The packed form: sequence b is `general_attention_ref` of its rows, with dropout batch index b, ALiBi
    slopes alibi_slopes[b] when they are per sequence, and the top-left corner of block_mask's batch entry
    b (or its only one) as its block mask; the offsets are read on the host. out (total_q, hq, d), lse
    (hq, total_q); rows outside every sequence get out = 0, lse = -inf."""
    from flash_attn4.reference import _varlen_segments

    total_q, hq, _ = q.shape
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = q.new_zeros(total_q, hq, v.shape[-1])
    lse = torch.full((hq, total_q), -math.inf, dtype=cdt, device=q.device)
    if block_mask is not None:
        partial, full = block_mask.to_dense()
    for b, (q0, nq, k0, nk) in enumerate(_varlen_segments(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)):
        if nq == 0 or nk == 0:
            continue  # out 0, lse -inf: no key to see
        seq_mask = None
        if block_mask is not None:
            blk, i = block_mask.block_size, min(b, partial.shape[0] - 1)
            rows_b, cols_b = math.ceil(nq / blk), math.ceil(nk / blk)
            p_b, f_b = partial[i : i + 1, :, :rows_b, :cols_b], full[i : i + 1, :, :rows_b, :cols_b]
            seq_mask = BlockMask.from_dense(p_b | f_b, nq, nk, full=f_b, block_size=blk)
        slopes = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        o, l_ = general_attention_ref(
            q[None, q0:q0 + nq], k[None, k0:k0 + nk], v[None, k0:k0 + nk], causal=causal,
            softmax_scale=softmax_scale, window_size=window_size, softcap=softcap, block_mask=seq_mask,
            alibi_slopes=slopes, dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_batch=b,
        )  # fmt: skip
        rows = torch.arange(q0, q0 + nq, device=q.device)
        out = out.index_copy(0, rows, o[0])
        lse = lse.index_copy(1, rows, l_[0].to(cdt))
    return out, lse


def general_bwd_ref(
    dout: Tensor, dlse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, *, block_mask=None,
    alibi_slopes: Tensor | None = None, causal: bool, softmax_scale: float, window_size: tuple[int, int],
    softcap: float, dropout_p: float = 0.0, dropout_seed: tuple = (0, 0), dropout_batch: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Gradients of general_attention_ref (a block mask, ALiBi, dropout), written out rather than taken
    through autograd (a custom op's implementation runs below autograd): per block of query rows, P from the
    recomputed scores, Pd = P o M / (1 - p) with dropout's keep mask M (else P), dV += Pd^T dO,
    dS = P (dO V^T o M / (1 - p) - (rowsum(dO O) - dlse)) (times 1 - tanh^2 under softcap), dQ = scale dS K,
    dK += scale dS^T Q; GQA heads summed into their kv head. Returns dq, dk, dv in the inputs' dtypes (float32
    math, float64 for float64 inputs)."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = hq // hk
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    qt = q.transpose(1, 2).to(cdt)
    kt = k.transpose(1, 2).to(cdt).repeat_interleave(g, dim=1)
    vt = v.transpose(1, 2).to(cdt).repeat_interleave(g, dim=1)
    dot = dout.transpose(1, 2).to(cdt)
    blk = BLOCK if block_mask is None else block_mask.block_size
    if block_mask is not None:
        partial, full = block_mask.to_dense()
    col_block = torch.arange(sk, device=q.device) // blk
    slopes = None
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(cdt).reshape(-1 if alibi_slopes.dim() == 2 else 1, hq)[..., None, None]
    dq = torch.zeros_like(qt)
    dk = torch.zeros(b, hq, sk, d, dtype=cdt, device=q.device)
    dv = torch.zeros(b, hq, sk, v.shape[-1], dtype=cdt, device=q.device)
    for qb in range(math.ceil(sq / blk)):
        r0, r1 = qb * blk, min(sq, (qb + 1) * blk)
        rows = torch.arange(r0, r1, device=q.device)
        elem = _builtin(sq, sk, causal, window_size, q.device, rows=rows)
        if block_mask is None:
            seen = elem[None, None]
        else:
            partial_b = partial[:, :, qb, col_block][:, :, None, :]
            seen = full[:, :, qb, col_block][:, :, None, :] | (partial_b & elem)
        seen = seen.expand(b, hq, -1, -1)
        s = torch.matmul(qt[:, :, r0:r1], kt.transpose(-1, -2)) * softmax_scale
        th = torch.tanh(s / softcap) if softcap else None
        t = softcap * th if softcap else s
        if slopes is not None:  # a constant in the scores: only P sees it
            dist = rows[:, None] + (sk - sq) - torch.arange(sk, device=q.device)[None, :]
            t = t - slopes * dist.abs().to(cdt)
        t = t.masked_fill(~seen, -math.inf)
        empty = ~seen.any(dim=-1)
        lse = torch.logsumexp(torch.where(empty[..., None], torch.zeros_like(t), t), dim=-1)
        p = torch.exp(t - lse[..., None])  # 0 where masked (and on empty rows)
        do = dot[:, :, r0:r1]
        kept = 1.0
        if dropout_p > 0:
            kept = keep_mask(*dropout_seed, dropout_p, b, hq, rows, torch.arange(sk, device=q.device),
                             batch_start=dropout_batch).to(cdt) * keep_scale(dropout_p)  # fmt: skip
        pd = p * kept
        dv += torch.matmul(pd.transpose(-1, -2), do)
        delta = (do * torch.matmul(pd, vt)).sum(-1)
        if dlse is not None:
            delta = delta - dlse[:, :, r0:r1].to(cdt).masked_fill(empty, 0)
        ds = p * (torch.matmul(do, vt.transpose(-1, -2)) * kept - delta[..., None])
        if softcap:
            ds = ds * (1 - th * th)
        ds = ds * softmax_scale
        dq[:, :, r0:r1] = torch.matmul(ds, kt)
        dk += torch.matmul(ds.transpose(-1, -2), qt[:, :, r0:r1])
    dk = dk.view(b, hk, g, sk, d).sum(2)
    dv = dv.view(b, hk, g, sk, -1).sum(2)
    return (dq.transpose(1, 2).to(q.dtype), dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype))


def general_varlen_bwd_ref(
    dout: Tensor, dlse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor, seqused_q=None, seqused_k=None, *, per_sequence=None, **opts,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """general_bwd_ref of a packed batch, sequence by sequence (offsets read on the host): q / dout
    (total_q, hq, d), k / v (total_k, hk, d), dlse (hq, total_q) or None. per_sequence(b) gives sequence b's
    own keyword arguments (its ALiBi slopes, its dropout batch index); `opts` are everyone's."""
    from flash_attn4.reference import _varlen_segments

    dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
    for b, (q0, nq, k0, nk) in enumerate(_varlen_segments(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)):
        if nq == 0 or nk == 0:
            continue
        dl_b = None if dlse is None else dlse[None, :, q0 : q0 + nq]
        own = per_sequence(b) if per_sequence else {}
        g = general_bwd_ref(dout[None, q0:q0 + nq], dl_b, q[None, q0:q0 + nq], k[None, k0:k0 + nk],
                            v[None, k0:k0 + nk], **opts, **own)  # fmt: skip
        dq[q0 : q0 + nq] = g[0][0]
        dk[k0 : k0 + nk] += g[1][0]
        dv[k0 : k0 + nk] += g[2][0]
    return dq, dk, dv
