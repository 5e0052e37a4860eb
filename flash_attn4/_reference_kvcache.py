"""The executable spec of `attn_with_kvcache` and `merge_attn_states`, in plain PyTorch.

Used for CPU tensors, for CUDA calls no kernel serves, and by the tests. Semantics (FlashAttention's, with
every device-side value clamped the way the kernels clamp it, so a lying value computes the same thing on
both paths):

- Sequence b's keys are cache rows [leftpad_b, end_b) with end_b = min(clamp(cache_seqlens_b, 0, capacity) +
  seqlen_new, capacity) and leftpad_b clamped into [0, end_b]; masks are aligned to end_b (its last query
  token sees the last key).
- New k / v rows go to cache rows cache_seqlens_b + t, in place; nothing is written when cache_seqlens_b is
  negative or >= capacity, for rows past the capacity, or into a page id outside [0, num_pages).
- Paged caches: key row t of sequence b is row t % page_size of page page_table[b, t // page_size]; a page id
  outside the pool reads as zeros.
- Rotary: the new k at positions cache_seqlens_b - leftpad_b + t; q at the same positions with a causal or
  window mask, else all of q at cache_seqlens_b - leftpad_b; positions past rotary_cos's rows use its last.
- fp8 caches: sequence b's keys and values are the cache's values times k_descale[b, h] / v_descale[b, h]
  (1 where None) for kv head h, in fp32; the attention then runs in fp32 and out takes q's dtype.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from flash_attn4 import reference

# Cache dtypes read through k_descale / v_descale.
FP8_CACHE_DTYPES = (torch.float8_e4m3fn,)


def apply_rotary_ref(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool) -> Tensor:
    """x (b, s, h, d) rotated on its first 2 * cos.shape[1] channels at positions (b, s); fp32 math, x's dtype
    out. interleaved: pairs (2i, 2i + 1) (GPT-J); else halves (i, i + rotary_dim / 2) (GPT-NeoX)."""
    half = cos.shape[1]
    rd = 2 * half
    pos = positions.long().clamp(0, cos.shape[0] - 1)
    c = cos.float()[pos].unsqueeze(2)  # (b, s, 1, half)
    s = sin.float()[pos].unsqueeze(2)
    xr = x[..., :rd].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        rot = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., rd:]), dim=-1)


def _per_seq(t: Tensor | None, batch: int, default: int) -> list[int]:
    return [default] * batch if t is None else [int(x) for x in t.tolist()]


def attention_kvcache_ref(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None = None,
    v: Tensor | None = None,
    *,
    cache_seqlens: Tensor | None = None,
    page_table: Tensor | None = None,
    cache_batch_idx: Tensor | None = None,
    cache_leftpad: Tensor | None = None,
    rotary_cos: Tensor | None = None,
    rotary_sin: Tensor | None = None,
    rotary_interleaved: bool = False,
    causal: bool = True,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    k_descale: Tensor | None = None,
    v_descale: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(out, lse) of attention over the cache after appending k / v in place (see the module docstring).
    out: like q; lse: (batch, nheads_q, seqlen_q) float32 (float64 for float64 inputs)."""
    fp8 = k_cache.dtype in FP8_CACHE_DTYPES
    b, sq, hq, d = q.shape
    paged = page_table is not None
    num_slabs = k_cache.shape[0]
    page_size = k_cache.shape[1] if paged else 0
    capacity = page_table.shape[1] * page_size if paged else k_cache.shape[1]
    sn = 0 if k is None else k.shape[1]
    used = _per_seq(cache_seqlens, b, capacity - sn)
    leftpad = _per_seq(cache_leftpad, b, 0)
    slabs = [min(max(s, 0), num_slabs - 1) for s in _per_seq(cache_batch_idx, b, 0)] if not paged else None
    if slabs is not None and cache_batch_idx is None:
        slabs = list(range(b))
    pt = page_table.tolist() if paged else None

    def locate(bi: int, row: int) -> tuple[int, int] | None:
        """(slab, row in slab) of cache row `row` of sequence bi, or None (zeros / no write)."""
        if row < 0 or row >= capacity:
            return None
        if not paged:
            return slabs[bi], row
        page = pt[bi][row // page_size]
        return (page, row % page_size) if 0 <= page < num_slabs else None

    rotary = rotary_cos is not None
    if rotary:
        per_token = causal or window_size != (-1, -1)
        base = torch.tensor([u - lp for u, lp in zip(used, leftpad)], device=q.device)
        steps = (
            torch.arange(sq, device=q.device)
            if per_token
            else torch.zeros(sq, dtype=torch.long, device=q.device)
        )
        q = apply_rotary_ref(q, rotary_cos, rotary_sin, base[:, None] + steps[None, :], rotary_interleaved)
        if k is not None:
            k = apply_rotary_ref(
                k,
                rotary_cos,
                rotary_sin,
                base[:, None] + torch.arange(sn, device=q.device)[None],
                rotary_interleaved,
            )
    if k is not None:
        for bi in range(b):
            if not 0 <= used[bi] < capacity:
                continue
            for t in range(sn):
                loc = locate(bi, used[bi] + t)
                if loc is not None:
                    k_cache[loc[0], loc[1]] = k[bi, t]
                    v_cache[loc[0], loc[1]] = v[bi, t]

    outs, lses = [], []
    for bi in range(b):
        end = min(min(max(used[bi], 0), capacity) + sn, capacity)
        begin = min(max(leftpad[bi], 0), end)
        rows = range(begin, end)
        kb = k_cache.new_zeros(len(rows), k_cache.shape[2], d)
        vb = v_cache.new_zeros(len(rows), v_cache.shape[2], d)
        for i, row in enumerate(rows):
            loc = locate(bi, row)
            if loc is not None:
                kb[i], vb[i] = k_cache[loc[0], loc[1]], v_cache[loc[0], loc[1]]
        qb = q[bi : bi + 1]
        if fp8:
            acc = torch.float64 if q.dtype == torch.float64 else torch.float32
            qb, kb, vb = qb.to(acc), kb.to(acc), vb.to(acc)
            if k_descale is not None:
                kb = kb * k_descale[bi, :, None].to(acc)
            if v_descale is not None:
                vb = vb * v_descale[bi, :, None].to(acc)
        o, lse = reference.attention_ref(
            qb,
            kb[None],
            vb[None],
            causal=causal,
            softmax_scale=softmax_scale,
            window_size=window_size,
            softcap=softcap,
        )
        outs.append(o.to(q.dtype))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def merge_attn_states_ref(
    out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor
) -> tuple[Tensor, Tensor]:
    """The lse-weighted merge of two attentions over disjoint key sets: out (batch, seqlen, heads, d),
    lse (batch, heads, seqlen). Rows where both lse are -inf give out = 0, lse = -inf. Differentiable."""
    acc = torch.float64 if out_a.dtype == torch.float64 else torch.float32  # fp64 stays fp64 (gradcheck)
    la, lb = lse_a.to(acc), lse_b.to(acc)
    lse = torch.logaddexp(la, lb)
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, torch.zeros_like(lse))
    wa = torch.where(finite, torch.exp(la - safe), torch.zeros_like(la)).transpose(1, 2).unsqueeze(-1)
    wb = torch.where(finite, torch.exp(lb - safe), torch.zeros_like(lb)).transpose(1, 2).unsqueeze(-1)
    out = wa * out_a.to(acc) + wb * out_b.to(acc)
    lse = torch.where(finite, lse, torch.full_like(lse, -math.inf))
    return out.to(out_a.dtype), lse.to(lse_a.dtype)
