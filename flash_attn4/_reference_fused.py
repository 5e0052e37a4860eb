"""The fused CPU route of the reference: a faster way, for CPU tensors, to the same semantics as the plain
route in reference.py (whose docstring states them), held to the same tests.

It calls torch's own fused CPU attention (`aten::_scaled_dot_product_flash_attention_for_cpu` and its
backward, what F.scaled_dot_product_attention runs on CPU), in float32 (bf16/fp16 inputs are upcast first:
in its reduced-precision mode that kernel rounds P to the input dtype before P @ V) or float64. It returns
out and the natural-log lse. It only knows top-left causal and additive masks, so: no mask is one call;
causal-like masks (right bounded, left not) are at most two calls, a non-causal call over the keys every
row sees plus a top-left causal call over the rest, merged by their lse (a bottom-right causal mask with
seqlen_q > seqlen_k starts at the first row that sees a key instead); a bounded left window goes by chunks
of query rows over their key band with an explicit additive mask. Rows that see no key are always a prefix
of the rows (only a bounded right side can hide every key from a row); they never reach the kernel, which
would give them lse = 0.

The key-band geometry both routes chunk by (`_key_band`, `_hidden`, `_row_chunks`) lives here too, so that
reference.py imports this module and not the other way round. Score budgets (`chunk_elems`) are passed in
by reference.py, which owns the chunk sizes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

# The fused route's switch; tests switch it off to hold the plain route to the same checks.
_USE_FUSED_CPU = True
# Query rows per fused call when a bounded left window needs an explicit mask (fewer when the score
# budget, reference._CHUNK_ELEMS, says so): a chunk computes rows x (rows + window) scores, of which the
# window's share is needed.
_FUSED_WINDOW_ROWS = 64
# torch's fused CPU kernel learnt GQA (nheads_kv < nheads_q) in pytorch#157893 (July 2025), taken here to
# be torch 2.9 on (checked on 2.11 and 2.13); before, it would read k/v heads by the query head index, so
# GQA goes through one call per query head of each group (strided views, no copies).
_FUSED_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 9)


def _key_band(r0: int, r1: int, sq: int, sk: int, left: int, right: int) -> tuple[int, int]:
    """The keys [lo, hi) that some query row in [r0, r1) may see."""
    off = sk - sq
    lo = 0 if left < 0 else max(0, r0 + off - left)
    hi = sk if right < 0 else min(sk, r1 + off + right)
    return lo, hi


def _hidden(
    r0: int, r1: int, lo: int, hi: int, sq: int, sk: int, left: int, right: int, device: torch.device
) -> Tensor | None:
    """Bool (r1 - r0, hi - lo): True where query row r0 + i may not see key lo + j; None if none is hidden."""
    off = sk - sq
    cut_right = right >= 0 and hi > r0 + off + right + 1  # the first row sees less than the band
    cut_left = left >= 0 and lo < r1 - 1 + off - left  # the last row sees less than the band
    if not (cut_right or cut_left):
        return None
    pos = torch.arange(r0 + off, r1 + off, device=device)[:, None]
    cols = torch.arange(lo, hi, device=device)[None, :]
    hidden = cols > pos + right if cut_right else None
    if cut_left:
        below = cols < pos - left
        hidden = below if hidden is None else hidden | below
    return hidden


def _row_chunks(
    r_start: int,
    r_end: int,
    sq: int,
    sk: int,
    left: int,
    right: int,
    budget: int,
    max_rows: int | None = None,
) -> list[tuple[int, int, int, int]]:
    """(r0, r1, lo, hi): chunks of the query rows [r_start, r_end) and their key bands, each chunk's
    rows x band within `budget` elements (or a single row), at most `max_rows` rows."""
    chunks = []
    r0 = r_start
    while r0 < r_end:
        rows = r_end - r0 if max_rows is None else min(max_rows, r_end - r0)
        while True:
            lo, hi = _key_band(r0, r0 + rows, sq, sk, left, right)
            fit = max(1, budget // max(1, hi - lo))
            if fit >= rows:
                break
            rows = fit
        chunks.append((r0, r0 + rows, lo, hi))
        r0 += rows
    return chunks


_HAS_FUSED_CPU = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu") and hasattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"
)


def _fused_ok(q: Tensor, v: Tensor, cdt: torch.dtype, softcap: float) -> bool:
    """Whether the fused CPU route computes this call (reference.py's docstring says when it does)."""
    return (
        _USE_FUSED_CPU
        and _HAS_FUSED_CPU
        and q.device.type == "cpu"
        and cdt in (torch.float32, torch.float64)
        and not softcap > 0
        and v.shape[-1] == q.shape[-1]
    )


def _bhsd(x: Tensor, cdt: torch.dtype) -> Tensor:
    """(b, s, h, d) -> a (b, h, s, d) view in `cdt` with unit last stride: what the fused kernel reads."""
    x = x.to(cdt)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.transpose(1, 2)


def _sdpa_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, mask: Tensor | None = None):
    """torch's fused CPU attention on (b, h, s, d) views (causal = top-left): out (b, hq, sq, d) with
    (b, s, h, d) memory, lse (b, hq, sq) natural log, in q's dtype."""
    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    hq, hk = q.shape[1], k.shape[1]
    if hq == hk or _FUSED_GQA:
        return fwd(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    g = hq // hk  # query head h reads kv head h // g: heads i, g + i, 2g + i, ... read kv heads 0, 1, 2, ...
    b, _, n, _ = q.shape
    out = q.new_empty(b, n, hq, v.shape[-1]).transpose(1, 2)
    lse = q.new_empty(b, hq, n)
    for i in range(g):
        out[:, i::g], lse[:, i::g] = fwd(q[:, i::g], k, v, 0.0, causal, attn_mask=mask, scale=scale)
    return out, lse


def _sdpa_bwd(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    causal: bool,
    mask: Tensor | None = None,
):
    """The fused CPU kernel's backward (P from the given lse, D = rowsum(do * out)): dq, dk, dv."""
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    hq, hk = q.shape[1], k.shape[1]
    if hq == hk or _FUSED_GQA:
        return bwd(do, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)
    g = hq // hk
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for i in range(g):
        dq_i, dk_i, dv_i = bwd(
            do[:, i::g],
            q[:, i::g],
            k,
            v,
            out[:, i::g],
            lse[:, i::g],
            0.0,
            causal,
            attn_mask=mask,
            scale=scale,
        )
        dq[:, i::g] = dq_i
        dk += dk_i
        dv += dv_i
    return dq, dk, dv


def _fused_window_chunks(
    b: int, hq: int, sq: int, sk: int, left: int, right: int, first: int, q: Tensor, chunk_elems: int
):
    """(rows, lo, hi, additive mask or None) per chunk of the rows [first, sq) under a bounded left window,
    at most `chunk_elems` scores (b * hq * rows * band) a chunk; `rows` indexes the tensors that start at
    row `first`."""
    budget = max(1, chunk_elems // (b * hq))
    masks: dict[tuple[int, int, int], Tensor | None] = {}  # interior chunks share one mask
    for r0, r1, lo, hi in _row_chunks(first, sq, sq, sk, left, right, budget, _FUSED_WINDOW_ROWS):
        key = (r1 - r0, lo - r0, hi - r0)  # the mask depends on the band relative to the rows only
        if key not in masks:
            hidden = _hidden(r0, r1, lo, hi, sq, sk, left, right, q.device)
            masks[key] = None
            if hidden is not None:
                masks[key] = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device).masked_fill_(
                    hidden, -math.inf
                )
        yield slice(r0 - first, r1 - first), lo, hi, masks[key]


def _fused_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    sq: int,
    left: int,
    right: int,
    first: int,
    chunk_elems: int,
) -> tuple[Tensor, Tensor]:
    """Rows [first, sq) (those that see a key) by the fused CPU kernel, `left`/`right`/`first` from
    `reference._mask_bounds`, `chunk_elems` (`reference._CHUNK_ELEMS`) the score budget of a window chunk.
    q: those rows (b, hq, sq - first, d); k, v (b, hk, sk, d); (b, h, s, d) views in the compute dtype.
    Returns out (b, hq, sq - first, d) and lse (b, hq, sq - first)."""
    sk = k.shape[2]
    if left < 0 and right < 0:
        return _sdpa_fwd(q, k, v, scale, False)
    if left < 0:
        # Row first + t sees keys j <= t + e: keys [0, e) in full, then a top-left causal edge.
        e = max(0, sk - sq + right)
        if e == 0:
            return _sdpa_fwd(q, k, v, scale, True)
        out_a, lse_a = _sdpa_fwd(q, k[:, :, :e], v[:, :, :e], scale, False)
        out_b, lse_b = _sdpa_fwd(q, k[:, :, e:], v[:, :, e:], scale, True)
        lse = torch.logaddexp(lse_a, lse_b)  # both finite: every row sees key 0 of each part
        out = out_a.mul_(torch.exp(lse_a - lse).unsqueeze(-1))
        return out.addcmul_(out_b, torch.exp(lse_b - lse).unsqueeze(-1)), lse
    b, hq, n, _ = q.shape
    out = q.new_empty(b, n, hq, v.shape[-1]).transpose(1, 2)
    lse = q.new_empty(b, hq, n)
    for rows, lo, hi, mask in _fused_window_chunks(b, hq, sq, sk, left, right, first, q, chunk_elems):
        out[:, :, rows], lse[:, :, rows] = _sdpa_fwd(
            q[:, :, rows], k[:, :, lo:hi], v[:, :, lo:hi], scale, False, mask
        )
    return out, lse


def _fused_bwd(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    sq: int,
    left: int,
    right: int,
    first: int,
    chunk_elems: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of `_fused_fwd`, split the same way; each part's backward takes the whole row's out and
    lse, so its P and D are the whole row's and the parts' gradients add up."""
    sk = k.shape[2]
    if left < 0 and right < 0:
        return _sdpa_bwd(do, q, k, v, out, lse, scale, False)
    if left < 0:
        e = max(0, sk - sq + right)
        if e == 0:
            return _sdpa_bwd(do, q, k, v, out, lse, scale, True)
        dq, dk_a, dv_a = _sdpa_bwd(do, q, k[:, :, :e], v[:, :, :e], out, lse, scale, False)
        dq_b, dk_b, dv_b = _sdpa_bwd(do, q, k[:, :, e:], v[:, :, e:], out, lse, scale, True)
        return dq.add_(dq_b), torch.cat([dk_a, dk_b], dim=2), torch.cat([dv_a, dv_b], dim=2)
    b, hq = q.shape[:2]
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rows, lo, hi, mask in _fused_window_chunks(b, hq, sq, sk, left, right, first, q, chunk_elems):
        dq_c, dk_c, dv_c = _sdpa_bwd(
            do[:, :, rows],
            q[:, :, rows],
            k[:, :, lo:hi],
            v[:, :, lo:hi],
            out[:, :, rows],
            lse[:, :, rows],
            scale,
            False,
            mask,
        )
        dq[:, :, rows] = dq_c
        dk[:, :, lo:hi] += dk_c
        dv[:, :, lo:hi] += dv_c
    return dq, dk, dv


def _fused_grads(dout, q, k, v, dlse, scale, left, right, first, cdt, chunk_elems, saved=None):
    """dq of rows [first, sq) (b, sq - first, hq, d), dk, dv (b, sk, hk, d) in `cdt` by the fused route
    (`reference.attention_bwd_ref`'s docstring says how dlse rides along); `saved`: the forward's (out, lse)
    of those rows as (b, h, s, d) / (b, h, s), or None to recompute."""
    sq, d = q.shape[1], q.shape[-1]
    qt, kt, vt = _bhsd(q[:, first:], cdt), _bhsd(k, cdt), _bhsd(v, cdt)
    out, lse = (
        saved if saved is not None else _fused_fwd(qt, kt, vt, scale, sq, left, right, first, chunk_elems)
    )
    dot = _bhsd(dout[:, first:], cdt)
    if dlse is not None:
        qt, kt, out = F.pad(qt, (0, 1)), F.pad(kt, (0, 1)), F.pad(out, (0, 1))
        vt = F.pad(vt, (0, 1), value=1.0)
        dot = torch.cat([dot, dlse[:, :, first:].to(cdt).unsqueeze(-1)], dim=-1)
    dq, dk, dv = _fused_bwd(dot, qt, kt, vt, out, lse, scale, sq, left, right, first, chunk_elems)
    return (t[..., :d].transpose(1, 2) for t in (dq, dk, dv))
