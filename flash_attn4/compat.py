"""FlashAttention-2's functions on flash_attn4: the same names, arguments, defaults and return values, so
a call site switches with its import alone.

    from flash_attn4.compat import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

Where FlashAttention-2 returns `(out, softmax_lse, S_dmask)` for `return_attn_probs=True`, these return the
same triple with `S_dmask = None`, as FlashAttention-2 itself does without dropout: the attention
probabilities are never materialized, so `return_attn_probs=True` with `dropout_p > 0` raises. Options not
implemented yet (`alibi_slopes` in flash_attn_with_kvcache, the varlen function's `block_table`) raise a
`NotImplementedError` that says so, instead of computing something else. Unlike
FlashAttention-2, CPU tensors work (on the PyTorch reference), as everywhere in flash_attn4.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from flash_attn4.interface import attn, attn_varlen
from flash_attn4.kvcache import attn_with_kvcache

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]


def _unsupported(dropout_p: float, alibi_slopes: Any = None, where: str = "", probs: bool = False) -> None:
    if dropout_p and probs:
        raise NotImplementedError(
            "return_attn_probs=True with dropout_p > 0 asks for the dropped-out attention probabilities, "
            "which flash_attn4 never materializes; the keep mask is flash_attn4.dropout.keep_mask"
        )
    if alibi_slopes is not None and where:
        raise NotImplementedError(f"flash_attn4 takes alibi_slopes in flash_attn_func, not yet in {where}")


def _result(out_lse: tuple[Tensor, Tensor], return_attn_probs: bool):
    out, lse = out_lse
    return (out, lse, None) if return_attn_probs else out


def _window(window_size: Any) -> tuple[int, int]:
    left, right = window_size  # FlashAttention-2 takes any pair (tuple or list)
    return int(left), int(right)


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q (batch, seqlen_q, nheads, d), k / v (batch, seqlen_k, nheads_k, d) -> out like q; with
    return_attn_probs also softmax_lse (batch, nheads, seqlen_q) and None. See `flash_attn4.attn`."""
    _unsupported(dropout_p, probs=return_attn_probs)
    res = attn(
        q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=_window(window_size),
        softcap=softcap, deterministic=deterministic, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
        return_lse=True,
    )  # fmt: skip
    return _result(res, return_attn_probs)


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """qkv (batch, seqlen, 3, nheads, d); otherwise as flash_attn_func."""
    q, k, v = qkv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)  # fmt: skip


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """kv (batch, seqlen_k, 2, nheads_k, d); otherwise as flash_attn_func."""
    k, v = kv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)  # fmt: skip


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """Packed q (total_q, nheads, d), k / v (total_k, nheads_k, d) with int32 cu_seqlens -> out like q; with
    return_attn_probs also softmax_lse (nheads, total_q) and None. See `flash_attn4.attn_varlen`."""
    _unsupported(dropout_p, probs=return_attn_probs)
    if block_table is not None:
        raise NotImplementedError(
            "flash_attn4's varlen attention takes contiguous packed k / v, not a paged cache (block_table); "
            "for paged caches use flash_attn_with_kvcache(..., block_table=...)"
        )
    res = attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                      causal=causal, softmax_scale=softmax_scale, window_size=_window(window_size),
                      softcap=softcap, deterministic=deterministic, dropout_p=dropout_p,
                      alibi_slopes=alibi_slopes, return_lse=True)  # fmt: skip
    return _result(res, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """qkv (total, 3, nheads, d), one cu_seqlens / max_seqlen for q and k; otherwise as
    flash_attn_varlen_func."""
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)  # fmt: skip


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """kv (total_k, 2, nheads_k, d); otherwise as flash_attn_varlen_func."""
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)  # fmt: skip


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """FlashAttention-2's KV-cache function (k / v appended in place at cache_seqlens; block_table = a paged
    cache, any page size here). Its defaults differ from `flash_attn4.attn_with_kvcache`'s: causal=False and
    interleaved rotary. Returns out, or (out, softmax_lse) with return_softmax_lse."""
    _unsupported(0.0, alibi_slopes, "flash_attn_with_kvcache")
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("appending k / v needs cache_seqlens (where each sequence's new rows go)")
        # FlashAttention-2: without lengths every cache row counts as filled.
        cache_seqlens = int(k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1))
    res = attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, page_table=block_table,
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, rotary_cos=rotary_cos,
        rotary_sin=rotary_sin, rotary_interleaved=bool(rotary_interleaved), causal=causal,
        softmax_scale=softmax_scale, window_size=_window(window_size), softcap=softcap,
        num_splits=int(num_splits), return_lse=True,
    )  # fmt: skip
    return res if return_softmax_lse else res[0]
