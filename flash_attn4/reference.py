"""The executable spec: exact attention in plain PyTorch.

CPU tensors (and CUDA tensors when no kernel can serve them) run this code, and every test compares the
kernels against it. It favours obviousness over speed; the only concessions are GQA without repeating
k/v and chunking over query rows so that long sequences fit in memory.

Semantics (DESIGN.md):
- scores s = scale * q.k, scale defaulting to 1/sqrt(headdim); with softcap c > 0, s = c * tanh(s / c).
- Masks are aligned to the bottom-right corner: query i sits at key position p = i + seqlen_k - seqlen_q.
  causal: key j visible iff j <= p. window (left, right), -1 = unbounded: p - left <= j <= p + right.
  causal=True is the same as right = 0 (and combines with a left window).
- A query row that sees no key gets out = 0 and lse = -inf, with no NaN in values or gradients.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# Scores held at once per chunk (elements of batch * heads * rows * keys). 2^25 fp32 = 128 MiB, and the
# softmax keeps a few such temporaries: small enough for a laptop, large enough that a 4224 x 4224
# problem is only a handful of chunks.
_CHUNK_ELEMS = 1 << 25


def visible_mask(
    seqlen_q: int,
    seqlen_k: int,
    *,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    row_start: int = 0,
    row_end: int | None = None,
    device: torch.device | str | None = None,
) -> Tensor | None:
    """Bool mask (row_end - row_start, seqlen_k): True where query row i may attend to key j.

    Rows are absolute query indices in [row_start, row_end). Returns None when nothing is masked.
    """
    row_end = seqlen_q if row_end is None else row_end
    left, right = window_size
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if left < 0 and right < 0:
        return None
    rows = torch.arange(row_start, row_end, device=device)[:, None]
    pos = rows + (seqlen_k - seqlen_q)  # bottom-right alignment
    cols = torch.arange(seqlen_k, device=device)[None, :]
    mask = torch.ones(row_end - row_start, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        mask &= cols <= pos + right
    if left >= 0:
        mask &= cols >= pos - left
    return mask


def _compute_dtype(dtype: torch.dtype, upcast: bool) -> torch.dtype:
    if dtype == torch.float64:
        return torch.float64
    return torch.float32 if upcast else dtype


def attention_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    upcast: bool = True,
) -> tuple[Tensor, Tensor]:
    """Reference attention.

    Args:
        q: (batch, seqlen_q, nheads_q, headdim).
        k, v: (batch, seqlen_k, nheads_kv, headdim), nheads_q % nheads_kv == 0; query head h reads kv
            head h // (nheads_q // nheads_kv).
        upcast: compute in float32 (float64 inputs always compute in float64). With upcast=False the
            math runs in the input dtype: that is "torch's own low-precision error" the tests measure
            the kernels against.

    Returns:
        out: (batch, seqlen_q, nheads_q, headdim) in q's dtype.
        lse: (batch, nheads_q, seqlen_q), natural log of the softmax denominator, float32 (float64 for
            float64 inputs); -inf for rows that see no key.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be 4-D (batch, seqlen, nheads, headdim); got {q.shape}, {k.shape}, {v.shape}"
        )
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"nheads_q ({hq}) must be a multiple of nheads_kv ({hk})")
    g = hq // hk
    dv = v.shape[-1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    cdt = _compute_dtype(q.dtype, upcast)
    lse_dtype = torch.float64 if cdt == torch.float64 else torch.float32

    if b * sq * hq == 0 or sk == 0:
        # No keys at all: every row is a row that sees no key.
        out = q.new_zeros(b, sq, hq, dv)
        lse = torch.full((b, hq, sq), -math.inf, dtype=lse_dtype, device=q.device)
        return out, lse

    qg, kt, vh = _grouped(q, k, v, cdt)
    outs, lses = [], []
    for r0, r1 in _row_chunks(b * hq * sk, sq):
        p, lse, _ = _probs(qg, kt, r0, r1, sq, scale, causal, window_size, softcap)
        outs.append(torch.matmul(p, vh).view(b, hk, g, r1 - r0, -1))
        lses.append(lse.to(lse_dtype))
    out = _ungroup(torch.cat(outs, dim=3)).to(q.dtype)
    lse = torch.cat(lses, dim=3).reshape(b, hq, sq)
    return out, lse


def attention_bwd_ref(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    dlse: Tensor | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of `attention_ref` (the math the backward kernel implements, in float32/float64).

    P is recomputed from q, k and the log-sum-exp; D = rowsum(dO * O); dS = P * (dO V^T - D + dlse);
    with softcap, dS is multiplied by tanh' = 1 - tanh^2; dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO.

    Args:
        dout: (batch, seqlen_q, nheads_q, headdim), gradient of out.
        q, k, v: as for `attention_ref`.
        dlse: (batch, nheads_q, seqlen_q) gradient of lse, or None for zero.

    Returns:
        dq, dk, dv in the dtypes and shapes of q, k, v; zero for rows that see no key.
    """
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = hq // hk
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    cdt = _compute_dtype(q.dtype, upcast=True)
    if b * sq * hq == 0 or sk == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    qg, kt, vh = _grouped(q, k, v, cdt)
    do = dout.to(cdt).reshape(b, sq, hk, g, -1).permute(0, 2, 3, 1, 4)  # (b, hk, g, sq, dv)
    dl = None if dlse is None else dlse.to(cdt).reshape(b, hk, g, sq)
    dqs = []
    dk = torch.zeros(b, hk, sk, d, dtype=cdt, device=q.device)
    dv = torch.zeros(b, hk, sk, v.shape[-1], dtype=cdt, device=q.device)
    for r0, r1 in _row_chunks(b * hq * sk, sq):
        p, _, tanh = _probs(qg, kt, r0, r1, sq, scale, causal, window_size, softcap)
        qc = qg[:, :, :, r0:r1].reshape(b, hk, -1, d)
        doc = do[:, :, :, r0:r1].reshape(b, hk, g * (r1 - r0), -1)
        o = torch.matmul(p, vh)
        delta = (doc * o).sum(dim=-1, keepdim=True)
        if dl is not None:
            delta = delta - dl[:, :, :, r0:r1].reshape(b, hk, -1, 1)
        ds = p * (torch.matmul(doc, vh.transpose(-1, -2)) - delta)
        if tanh is not None:
            ds = ds * (1 - tanh * tanh)
        dqs.append((torch.matmul(ds, kt.transpose(-1, -2)) * scale).view(b, hk, g, r1 - r0, d))
        dk += torch.matmul(ds.transpose(-1, -2), qc) * scale
        dv += torch.matmul(p.transpose(-1, -2), doc)
    dq = _ungroup(torch.cat(dqs, dim=3))
    return dq.to(q.dtype), dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype)


def _grouped(q: Tensor, k: Tensor, v: Tensor, cdt: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """q -> (b, hk, g, sq, d): query heads grouped under their kv head, so k/v are never repeated;
    k -> (b, hk, d, sk); v -> (b, hk, sk, dv)."""
    b, sq, hq, d = q.shape
    hk = k.shape[2]
    qg = q.to(cdt).reshape(b, sq, hk, hq // hk, d).permute(0, 2, 3, 1, 4)
    return qg, k.to(cdt).permute(0, 2, 3, 1), v.to(cdt).permute(0, 2, 1, 3)


def _ungroup(x: Tensor) -> Tensor:
    """(b, hk, g, sq, d) -> (b, sq, hq = hk * g, d)."""
    b, hk, g, sq, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(b, sq, hk * g, d)


def _row_chunks(elems_per_row: int, sq: int) -> list[tuple[int, int]]:
    rows = max(1, _CHUNK_ELEMS // max(1, elems_per_row))
    return [(r0, min(sq, r0 + rows)) for r0 in range(0, sq, rows)]


def _probs(
    qg: Tensor,
    kt: Tensor,
    r0: int,
    r1: int,
    sq: int,
    scale: float,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Softmax probabilities of query rows [r0, r1).

    Returns P (b, hk, g * rows, sk), lse (b, hk, g, rows) and tanh(x / softcap) (or None) for the backward.
    """
    b, hk, g, _, d = qg.shape
    sk = kt.shape[-1]
    rows = r1 - r0
    s = torch.matmul(qg[:, :, :, r0:r1].reshape(b, hk, g * rows, d), kt).view(b, hk, g, rows, sk) * scale
    tanh = None
    if softcap > 0:
        tanh = torch.tanh(s / softcap)
        s = softcap * tanh
    mask = visible_mask(
        sq, sk, causal=causal, window_size=window_size, row_start=r0, row_end=r1, device=qg.device
    )
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    # The max only stabilises exp; detaching it changes neither values nor gradients, and keeps the -inf
    # of rows that see no key out of the graph.
    m = s.amax(dim=-1, keepdim=True).detach()
    empty = torch.isneginf(m)
    m = torch.where(empty, torch.zeros_like(m), m)
    p = torch.exp(s - m)  # exactly 0 where masked
    denom = p.sum(dim=-1, keepdim=True)
    denom = torch.where(empty, torch.ones_like(denom), denom)
    lse = torch.where(empty, torch.full_like(m, -math.inf), m + torch.log(denom)).squeeze(-1)
    p = (p / denom).view(b, hk, g * rows, sk)
    return p, lse, None if tanh is None else tanh.view(b, hk, g * rows, sk)


def _varlen_segments(
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, seqused_q: Tensor | None, seqused_k: Tensor | None
) -> list[tuple[int, int, int, int]]:
    """(q start, q rows used, k start, k rows used) per sequence, read on the host."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if len(cq) != len(ck) or len(cq) < 1:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must both have batch + 1 >= 1 entries")
    lens_q = [b - a for a, b in zip(cq, cq[1:])]
    lens_k = [b - a for a, b in zip(ck, ck[1:])]
    if cq[0] != 0 or ck[0] != 0 or min(lens_q + lens_k, default=0) < 0:
        raise ValueError("cu_seqlens must start at 0 and be non-decreasing")
    used_q = lens_q if seqused_q is None else [min(u, n) for u, n in zip(seqused_q.tolist(), lens_q)]
    used_k = lens_k if seqused_k is None else [min(u, n) for u, n in zip(seqused_k.tolist(), lens_k)]
    return [(cq[i], max(0, used_q[i]), ck[i], max(0, used_k[i])) for i in range(len(lens_q))]


def attention_varlen_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    seqused_q: Tensor | None = None,
    seqused_k: Tensor | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    upcast: bool = True,
) -> tuple[Tensor, Tensor]:
    """Reference attention over a packed batch of variable-length sequences.

    Sequence i owns query rows [cu_seqlens_q[i], cu_seqlens_q[i+1]) of q and key rows
    [cu_seqlens_k[i], cu_seqlens_k[i+1]) of k and v, and is attention_ref of those rows on their own (masks
    aligned to the bottom-right corner of each sequence). With seqused_q / seqused_k (batch,) only the first
    seqused rows of a sequence take part; the other query rows get out = 0 and lse = -inf.

    Args:
        q: (total_q, nheads_q, headdim); k, v: (total_k, nheads_kv, headdim).
        cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32 offsets, starting at 0, non-decreasing.

    Returns:
        out (total_q, nheads_q, headdim) in q's dtype; lse (nheads_q, total_q) float32 (float64 for
        float64 inputs), natural log.
    """
    total_q, hq, _ = q.shape
    cdt = _compute_dtype(q.dtype, upcast)
    lse_dtype = torch.float64 if cdt == torch.float64 else torch.float32
    out = q.new_zeros(total_q, hq, v.shape[-1])
    lse = torch.full((hq, total_q), -math.inf, dtype=lse_dtype, device=q.device)
    for q0, nq, k0, nk in _varlen_segments(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
        if nq == 0:
            continue
        o, l_ = attention_ref(
            q[None, q0 : q0 + nq],
            k[None, k0 : k0 + nk],
            v[None, k0 : k0 + nk],
            causal=causal,
            softmax_scale=softmax_scale,
            window_size=window_size,
            softcap=softcap,
            upcast=upcast,
        )
        out[q0 : q0 + nq] = o[0]
        lse[:, q0 : q0 + nq] = l_[0]
    return out, lse


def attention_varlen_bwd_ref(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    dlse: Tensor | None = None,
    seqused_q: Tensor | None = None,
    seqused_k: Tensor | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of `attention_varlen_ref` (dlse: (nheads_q, total_q) or None); rows not used get 0."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for q0, nq, k0, nk in _varlen_segments(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
        if nq == 0 or nk == 0:
            continue
        g = attention_bwd_ref(
            dout[None, q0 : q0 + nq],
            q[None, q0 : q0 + nq],
            k[None, k0 : k0 + nk],
            v[None, k0 : k0 + nk],
            dlse=None if dlse is None else dlse[None, :, q0 : q0 + nq],
            causal=causal,
            softmax_scale=softmax_scale,
            window_size=window_size,
            softcap=softcap,
        )
        dq[q0 : q0 + nq] = g[0][0]
        dk[k0 : k0 + nk] = g[1][0]
        dv[k0 : k0 + nk] = g[2][0]
    return dq, dk, dv
