"""The executable spec: exact attention in plain PyTorch.

CPU tensors (and CUDA tensors when no kernel can serve them) run this code, and every test compares the
kernels against it.

Semantics (README, "API and semantics"):
- scores s = scale * q.k, scale defaulting to 1/sqrt(headdim); with softcap c > 0, s = c * tanh(s / c).
- Masks are aligned to the bottom-right corner: query i sits at key position p = i + seqlen_k - seqlen_q.
  causal: key j visible iff j <= p. window (left, right), -1 = unbounded: p - left <= j <= p + right.
  causal=True is the same as right = 0 (and combines with a left window).
- A query row that sees no key gets out = 0 and lse = -inf, with no NaN in values or gradients.

How it is computed. Two routes give the same values (up to float rounding; tests hold both to a naive
float64 attention):
- The plain route: softmax(scale q k^T + mask) v with torch ops, over chunks of query rows (at most
  _CHUNK_ELEMS scores at once) and, per chunk, only the band of keys the mask lets it see; GQA groups the
  query heads under their kv head instead of repeating k/v. It runs whenever the fused route does not:
  CUDA tensors, softcap, upcast=False with fp16/bf16 inputs (that mode is "the math in the input dtype"),
  a v head dim other than q's, and whenever autograd must record the forward (tests take gradients of
  attention_ref; the plain route is differentiable op by op).
- The fused route, CPU only (flash_attn4/_reference_fused.py, whose docstring has the details): torch's
  own fused CPU attention (`aten::_scaled_dot_product_flash_attention_for_cpu` and its backward), in
  float32 (bf16/fp16 inputs upcast first) or float64, the bottom-right masks split into the top-left
  causal and additive masks that kernel knows; rows that see no key never reach it.
  `_reference_fused._USE_FUSED_CPU = False` switches it off.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from flash_attn4._reference_fused import _bhsd, _fused_fwd, _fused_grads, _fused_ok, _hidden, _row_chunks

# Scores held at once per chunk (elements of batch * heads * rows * keys). 2^25 fp32 = 128 MiB, and the
# softmax keeps a few such temporaries: small enough for a laptop, large enough that a 4224 x 4224
# problem is only a handful of chunks. On CPU the plain route uses at most _CPU_CHUNK_ELEMS (8 MiB of fp32
# scores): the fastest of 2^18..2^23 measured on 2 cores (large enough for efficient matmuls, small enough
# that the softmax temporaries are not fresh pages faulted in for every op).
_CHUNK_ELEMS = 1 << 25
_CPU_CHUNK_ELEMS = 1 << 21


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


def _mask_bounds(sq: int, sk: int, causal: bool, window_size: tuple[int, int]) -> tuple[int, int, int]:
    """(left, right, first) for sk >= 1: the window with causal folded in and a side that hides no key
    dropped (-1 = unbounded, as `_ops._effective_mask`), and the first query row that sees a key.

    Row i sees keys [max(0, p - left), min(sk - 1, p + right)], p = i + sk - sq <= sk - 1. That range is
    empty only when p + right < 0, so the rows that see no key are exactly the rows before `first`.
    """
    left, right = window_size
    if causal:
        right = 0 if right < 0 else min(right, 0)
    left = -1 if left < 0 or left >= sk - 1 else left
    right = -1 if right < 0 or right >= sq - 1 else right
    first = 0 if right < 0 else min(sq, max(0, sq - sk - right))
    return left, right, first


def _records_graph(*ts: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def _with_empty_prefix(
    out: Tensor, lse: Tensor, first: int, dtype: torch.dtype, lse_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """out (b, sq, hq, dv) in `dtype` and lse (b, hq, sq) in `lse_dtype` from the rows [first, sq), the rows
    before `first` (which see no key) being 0 and -inf."""
    if first == 0:
        return out.to(dtype), lse.to(lse_dtype).contiguous()
    b, n, hq, dv = out.shape
    full = torch.zeros(b, first + n, hq, dv, dtype=dtype, device=out.device)
    full[:, first:] = out
    full_lse = torch.full((b, hq, first + n), -math.inf, dtype=lse_dtype, device=out.device)
    full_lse[:, :, first:] = lse
    return full, full_lse


def _plain_budget(b: int, hq: int, device: torch.device) -> int:
    """Scores per (batch, head) in one chunk of the plain route."""
    elems = min(_CHUNK_ELEMS, _CPU_CHUNK_ELEMS) if device.type == "cpu" else _CHUNK_ELEMS
    return max(1, elems // (b * hq))


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

    Differentiable (autograd through torch ops, the plain route) when autograd records the call.
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

    left, right, first = _mask_bounds(sq, sk, causal, window_size) if sk > 0 else (-1, -1, sq)
    if b * sq * hq == 0 or first == sq:
        # No keys at all, or no row sees one.
        out = q.new_zeros(b, sq, hq, dv)
        lse = torch.full((b, hq, sq), -math.inf, dtype=lse_dtype, device=q.device)
        return out, lse

    if _fused_ok(q, v, cdt, softcap) and not _records_graph(q, k, v):
        qt, kt, vt = _bhsd(q[:, first:], cdt), _bhsd(k, cdt), _bhsd(v, cdt)
        o, l_ = _fused_fwd(qt, kt, vt, scale, sq, left, right, first, _CHUNK_ELEMS)
        return _with_empty_prefix(o.transpose(1, 2), l_, first, q.dtype, lse_dtype)

    inplace = not _records_graph(q, k, v)
    qg, kh, vh = _grouped(q, k, v, cdt)
    outs, lses = [], []
    for r0, r1, lo, hi in _row_chunks(first, sq, sq, sk, left, right, _plain_budget(b, hq, q.device)):
        p, lse, _ = _probs(qg, kh, r0, r1, lo, hi, sq, scale, left, right, softcap, inplace)
        outs.append(torch.matmul(p, vh[:, :, lo:hi]).view(b, hk, g, r1 - r0, -1))
        lses.append(lse)
    out = _ungroup(torch.cat(outs, dim=3))
    lse = torch.cat(lses, dim=3).reshape(b, hq, sq - first)
    return _with_empty_prefix(out, lse, first, q.dtype, lse_dtype)


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
    out: Tensor | None = None,
    lse: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of `attention_ref` (the math the backward kernel implements, in float32/float64).

    P is recomputed from q, k and the log-sum-exp; D = rowsum(dO * O); dS = P * (dO V^T - D + dlse);
    with softcap, dS is multiplied by tanh' = 1 - tanh^2; dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO.

    The fused CPU route recomputes out and lse with the fused forward and runs the fused backward kernel,
    which knows no dlse: the dlse term rides on one more head-dim column, zero in q and k (scores unchanged),
    one in v and dlse in dO (so dO V^T gains + dlse), zero in out (so D does not).

    Args:
        dout: (batch, seqlen_q, nheads_q, headdim), gradient of out.
        q, k, v: as for `attention_ref`.
        dlse: (batch, nheads_q, seqlen_q) gradient of lse, or None for zero.
        out, lse: optionally, what `attention_ref` returned for these inputs. The fused route then skips
            its forward recompute, but only for float32/float64 inputs, whose out carries the full
            precision D needs (a bf16/fp16 out was rounded, so it is recomputed in float32 instead).

    Returns:
        dq, dk, dv in the dtypes and shapes of q, k, v; zero for rows that see no key. Not differentiable.
    """
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    cdt = _compute_dtype(q.dtype, upcast=True)
    left, right, first = _mask_bounds(sq, sk, causal, window_size) if sk > 0 else (-1, -1, sq)
    if b * sq * hq == 0 or first == sq:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    with torch.no_grad():
        saved = None
        if out is not None and lse is not None and out.dtype == cdt and lse.dtype == cdt:
            saved = (_bhsd(out[:, first:], cdt), lse[:, :, first:])
        if _fused_ok(q, v, cdt, softcap):
            dq_rows, dk, dv = _fused_grads(
                dout, q, k, v, dlse, scale, left, right, first, cdt, _CHUNK_ELEMS, saved
            )
        else:
            # Exact (compute-dtype) out and lse are used as the kernels use them: P from that lse, D from
            # that out, so the block of a larger attention (ring attention) gets its share of the gradients.
            given = {} if saved is None else {"out": out, "lse": lse}
            dq_rows, dk, dv = _plain_grads(
                dout, q, k, v, dlse, scale, left, right, first, softcap, cdt, **given
            )
        if first == 0:
            dq = dq_rows.to(q.dtype)
        else:
            dq = torch.zeros_like(q, memory_format=torch.contiguous_format)
            dq[:, first:] = dq_rows
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def _plain_grads(dout, q, k, v, dlse, scale, left, right, first, softcap, cdt, out=None, lse=None):
    """As `_reference_fused._fused_grads`, by chunks of rows and their key bands (written out, in place).
    With lse, P is exp(S - lse) for that lse (the kernels' recompute) rather than this call's own softmax;
    with out, D = rowsum(dO * out) from that out."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = hq // hk
    qg, kh, vh = _grouped(q, k, v, cdt)
    do = dout.to(cdt).reshape(b, sq, hk, g, -1).permute(0, 2, 3, 1, 4)  # (b, hk, g, sq, dv)
    dl = None if dlse is None else dlse.to(cdt).reshape(b, hk, g, sq)
    dq = torch.empty(b, hk, g, sq - first, d, dtype=cdt, device=q.device)
    dk = torch.zeros(b, hk, sk, d, dtype=cdt, device=q.device)
    dv = torch.zeros(b, hk, sk, v.shape[-1], dtype=cdt, device=q.device)
    for r0, r1, lo, hi in _row_chunks(first, sq, sq, sk, left, right, _plain_budget(b, hq, q.device)):
        p, own_lse, tanh = _probs(
            qg, kh, r0, r1, lo, hi, sq, scale, left, right, softcap, True, want_tanh=True
        )
        qc = qg[:, :, :, r0:r1].reshape(b, hk, -1, d)
        doc = do[:, :, :, r0:r1].reshape(b, hk, g * (r1 - r0), -1)
        kb, vb = kh[:, :, lo:hi], vh[:, :, lo:hi]
        if lse is not None:  # P of the given lse: this call's P times exp(own lse - given lse)
            given = lse.to(cdt).reshape(b, hk, g, sq)[:, :, :, r0:r1]
            ratio = torch.exp(own_lse - given).masked_fill(torch.isneginf(own_lse), 0.0)
            p.mul_(ratio.reshape(b, hk, g * (r1 - r0), 1))
        if out is not None:
            o = out.to(cdt).reshape(b, sq, hk, g, -1).permute(0, 2, 3, 1, 4)[:, :, :, r0:r1]
            o = o.reshape(b, hk, g * (r1 - r0), -1)
        else:
            o = torch.matmul(p, vb)
        delta = (doc * o).sum(dim=-1, keepdim=True)
        if dl is not None:
            delta = delta - dl[:, :, :, r0:r1].reshape(b, hk, -1, 1)
        ds = torch.matmul(doc, vb.transpose(-1, -2)).sub_(delta).mul_(p)
        if tanh is not None:
            ds.mul_(tanh.mul_(tanh).neg_().add_(1))
        dq[:, :, :, r0 - first : r1 - first] = torch.matmul(ds, kb).mul_(scale).view(b, hk, g, r1 - r0, d)
        dk[:, :, lo:hi] += torch.matmul(ds.transpose(-1, -2), qc).mul_(scale)
        dv[:, :, lo:hi] += torch.matmul(p.transpose(-1, -2), doc)
    return _ungroup(dq), dk.transpose(1, 2), dv.transpose(1, 2)


def _grouped(q: Tensor, k: Tensor, v: Tensor, cdt: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """q -> (b, hk, g, sq, d): query heads grouped under their kv head, so k/v are never repeated;
    k -> (b, hk, sk, d), v -> (b, hk, sk, dv), contiguous, so that a band of keys is a plain matrix
    that matmul reads in place (a strided band would be copied for every chunk)."""
    b, sq, hq, d = q.shape
    hk = k.shape[2]
    qg = q.to(cdt).reshape(b, sq, hk, hq // hk, d).permute(0, 2, 3, 1, 4)
    kh, vh = (t.transpose(1, 2).to(cdt, memory_format=torch.contiguous_format) for t in (k, v))
    return qg, kh, vh


def _ungroup(x: Tensor) -> Tensor:
    """(b, hk, g, sq, d) -> (b, sq, hq = hk * g, d)."""
    b, hk, g, sq, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(b, sq, hk * g, d)


def _probs(
    qg: Tensor,
    kh: Tensor,
    r0: int,
    r1: int,
    lo: int,
    hi: int,
    sq: int,
    scale: float,
    left: int,
    right: int,
    softcap: float,
    inplace: bool,
    want_tanh: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Softmax probabilities of query rows [r0, r1) over their key band [lo, hi) (the keys outside it are
    hidden from every row of the chunk, so they would only add exact zeros).

    Returns P (b, hk, g * rows, hi - lo), lse (b, hk, g, rows) and, with want_tanh and softcap,
    tanh(x / softcap) for the backward. `inplace` (when autograd does not record) reuses the score buffer.
    """
    b, hk, g, _, d = qg.shape
    sk = kh.shape[2]
    rows, width = r1 - r0, hi - lo
    s = torch.matmul(qg[:, :, :, r0:r1].reshape(b, hk, g * rows, d), kh[:, :, lo:hi].transpose(-1, -2))
    s = s.view(b, hk, g, rows, width)
    s = s.mul_(scale) if inplace else s * scale
    tanh = None
    if softcap > 0:
        if inplace:
            s.div_(softcap).tanh_()
            tanh = s.clone() if want_tanh else None
            s.mul_(softcap)
        else:
            tanh = torch.tanh(s / softcap)
            s = softcap * tanh
    hidden = _hidden(r0, r1, lo, hi, sq, sk, left, right, qg.device)
    if hidden is not None:
        s = s.masked_fill_(hidden, -math.inf) if inplace else s.masked_fill(hidden, -math.inf)
    # The max only stabilises exp; detaching it changes neither values nor gradients, and keeps the -inf
    # of rows that see no key out of the graph.
    m = s.amax(dim=-1, keepdim=True).detach()
    empty = torch.isneginf(m)
    m = torch.where(empty, torch.zeros_like(m), m)
    p = s.sub_(m).exp_() if inplace else torch.exp(s - m)  # exactly 0 where masked
    denom = p.sum(dim=-1, keepdim=True)
    denom = torch.where(empty, torch.ones_like(denom), denom)
    lse = torch.where(empty, torch.full_like(m, -math.inf), m + torch.log(denom)).squeeze(-1)
    p = p.div_(denom) if inplace else p / denom
    p = p.view(b, hk, g * rows, width)
    return p, lse, None if tanh is None else tanh.view(b, hk, g * rows, width)


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
    out: Tensor | None = None,
    lse: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of `attention_varlen_ref` (dlse: (nheads_q, total_q) or None); rows not used get 0. out
    (total_q, nheads_q, d) and lse (nheads_q, total_q), optionally, as for `attention_bwd_ref`: P from that
    lse and D from that out (a block of a larger attention, ring_attn_varlen's, gets its share)."""
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
            out=None if out is None else out[None, q0 : q0 + nq],
            lse=None if lse is None else lse[None, :, q0 : q0 + nq],
        )
        dq[q0 : q0 + nq] = g[0][0]
        dk[k0 : k0 + nk] = g[1][0]
        dv[k0 : k0 + nk] = g[2][0]
    return dq, dk, dv
