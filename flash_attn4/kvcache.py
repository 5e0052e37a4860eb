"""Public API of the decode path: `attn_with_kvcache` and `merge_attn_states` (FlashAttention semantics;
`_reference_kvcache` is the executable spec)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flash_attn4 import _ops, _ops_kvcache, checks  # (importing the _ops modules registers the ops)
from flash_attn4._reference_kvcache import FP8_CACHE_DTYPES, merge_attn_states_ref
from flash_attn4._sinks import _validate_sinks, _with_sinks
from flash_attn4.interface import _validate_device_rules, _validate_options


def _check_int_vector(name: str, t: Any, batch: int, device: torch.device) -> None:
    if t is None:
        return
    if not isinstance(t, Tensor) or t.dim() != 1 or t.dtype != torch.int32 or t.numel() != batch:
        raise TypeError(f"{name} must be None or a 1-D int32 tensor of {batch} values (one per sequence)")
    if t.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {t.device}")


def _validate_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, page_table, cache_batch_idx, cache_leftpad,
                      rotary_cos, rotary_sin) -> None:  # fmt: skip
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
        if t.device != q.device:
            raise TypeError(f"{name} must be on q's device ({q.device})")
    cache_dtype = k_cache.dtype
    if v_cache.dtype != cache_dtype or (cache_dtype != q.dtype and cache_dtype not in FP8_CACHE_DTYPES):
        raise TypeError(
            f"k_cache and v_cache must both have q's dtype ({q.dtype}) or both be float8_e4m3fn (with "
            f"k_descale / v_descale), got {k_cache.dtype} and {v_cache.dtype}"
        )
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    b, _, hq, d = q.shape
    hk = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise ValueError(f"the caches' headdim ({k_cache.shape[3]}) must be q's ({d})")
    if hk < 1 or hq % hk != 0:
        raise ValueError(f"nheads of q ({hq}) must be a multiple of the caches' nheads ({hk})")
    _validate_device_rules(q.device.type, q.dtype, d)
    if page_table is not None:
        if not isinstance(page_table, Tensor) or page_table.dim() != 2 or page_table.dtype != torch.int32:
            raise TypeError("page_table must be an int32 (batch, max_pages) tensor")
        if page_table.shape[0] != b or page_table.device != q.device:
            raise ValueError(f"page_table must have {b} rows and live on q's device")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx is for contiguous caches; with a page_table, map pages instead")
    elif cache_batch_idx is None and k_cache.shape[0] < b:
        raise ValueError(
            f"the cache has {k_cache.shape[0]} rows but q has {b} sequences; pass cache_batch_idx or a "
            "larger cache"
        )
    if not isinstance(cache_seqlens, Tensor):
        raise TypeError("cache_seqlens must be an int32 (batch,) tensor (or an int, for one length for all)")
    for name, t in (("cache_seqlens", cache_seqlens), ("cache_batch_idx", cache_batch_idx),
                    ("cache_leftpad", cache_leftpad)):  # fmt: skip
        _check_int_vector(name, t, b, q.device)
    if (k is None) != (v is None):
        raise ValueError("pass both k and v to append, or neither")
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            if (
                not isinstance(t, Tensor)
                or t.dim() != 4
                or t.shape[0] != b
                or t.shape[2:] != k_cache.shape[2:]
            ):
                raise ValueError(
                    f"{name} must be (batch, seqlen_new, nheads_kv, headdim) = ({b}, *, {hk}, {d})"
                )
            if t.dtype != cache_dtype or t.device != q.device:
                raise TypeError(f"{name} must have the caches' dtype ({cache_dtype}) and q's device")
        if k.shape != v.shape:
            raise ValueError("k and v must have one shape")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("pass both rotary_cos and rotary_sin, or neither")
    if rotary_cos is not None:
        if cache_dtype != q.dtype and k is not None:
            raise ValueError(
                "rotary on the new k needs a 16-bit cache: rotate k before quantizing it for an fp8 one"
            )
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if not isinstance(t, Tensor) or t.dim() != 2 or t.shape != rotary_cos.shape:
                raise ValueError(f"{name} must be (seqlen_ro, rotary_dim / 2), shaped like rotary_cos")
            if t.dtype != q.dtype or t.device != q.device:
                raise TypeError(f"{name} must have q's dtype and device")
        if not 0 < 2 * rotary_cos.shape[1] <= d:
            raise ValueError(f"rotary_dim (2 x {rotary_cos.shape[1]}) must be in (0, headdim = {d}]")


def attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None = None,
    v: Tensor | None = None,
    *,
    cache_seqlens: Tensor | int,
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
    num_splits: int = 0,
    return_lse: bool = False,
    sinks: Tensor | None = None,
    k_descale: Tensor | None = None,
    v_descale: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of q over a KV cache, appending k / v into it first (in place), FlashAttention's semantics.

    Args:
        q: (batch, seqlen_q, nheads_q, headdim): the new tokens' queries (1 for decoding; more for
            speculative decoding or chunked prefill).
        k_cache, v_cache: contiguous (batch_cache, seqlen_cache, nheads_kv, headdim), or paged (num_pages,
            page_size, nheads_kv, headdim) with `page_table`. Any page size from 1 up.
        k, v: optional (batch, seqlen_new, nheads_kv, headdim), written into the caches at rows
            cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 (in place) before attending.
        cache_seqlens: (batch,) int32 (or an int): tokens already in each sequence's cache. Read, not
            advanced (the caller adds seqlen_new after the call).
        page_table: (batch, max_pages) int32: sequence b's token t lives in page
            page_table[b, t // page_size].
        cache_batch_idx: (batch,) int32: the cache row of each sequence (contiguous caches).
        cache_leftpad: (batch,) int32: sequence b's keys start at cache row cache_leftpad[b].
        rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2), q's dtype: rotary embedding applied to q and the
            new k at positions cache_seqlens - cache_leftpad + t (q all at cache_seqlens - cache_leftpad
            without a causal or window mask); interleaved (GPT-J) or halves (GPT-NeoX).
        causal, softmax_scale, window_size, softcap: as for `attn`, aligned to each sequence's last key.
        num_splits: 0 = choose, 1 = no split, N = split the keys N ways.
        return_lse: also return lse (batch, nheads_q, seqlen_q) float32.
        sinks: optional (nheads_q,) attention-sink logits, as for `attn`.
        k_descale, v_descale: fp8 caches (`torch.float8_e4m3fn` k_cache and v_cache, q 16-bit): fp32
            (batch, nheads_kv) scales, sequence b's key (value) of kv head h being k_cache's value times
            k_descale[b, h]; None means 1. New k / v are appended as they are, so they come quantized with the
            same scales (`flash_attn4.quantize_fp8`), in the caches' dtype. The decode kernels read such
            caches where built (the decode and fp8 options); with rotary they run on the PyTorch reference.

    Lengths, page ids and batch indices are read on the device (no host synchronisation: the call can be
    captured in a CUDA graph and replayed with new values). Values that lie never fault: lengths are clamped
    to the cache, pages outside the pool read as zeros and are never written (`_reference_kvcache` has the
    exact rules). Inference only: no gradients.
    """
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    _validate_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, page_table, cache_batch_idx, cache_leftpad,
                      rotary_cos, rotary_sin)  # fmt: skip
    softmax_scale, left, right, softcap = _validate_options(
        q.shape[-1], causal, softmax_scale, window_size, softcap, return_lse, False
    )
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise TypeError(f"num_splits must be an int >= 0 (0 = choose, 1 = no split), got {num_splits!r}")
    if not isinstance(rotary_interleaved, bool):
        raise TypeError("rotary_interleaved must be a bool")
    _validate_sinks(sinks, q.shape[2], q.device)
    _validate_descales(q, k_cache, k_descale, v_descale)
    if checks.checks_enabled():
        checks.check_kvcache(k_cache, 0 if k is None else k.shape[1], cache_seqlens, page_table,
                             cache_batch_idx, cache_leftpad)  # fmt: skip
    direct = _ops.eager_direct(q, k_cache, v_cache, k, v, cache_seqlens, page_table, cache_batch_idx,
                               cache_leftpad, rotary_cos, rotary_sin)  # fmt: skip
    op = _ops_kvcache.fwd_kvcache_impl if direct else torch.ops.flash_attn4.fwd_kvcache
    out, lse = op(
        q, k_cache, v_cache, k, v, cache_seqlens, page_table, cache_batch_idx, cache_leftpad, rotary_cos,
        rotary_sin, rotary_interleaved, softmax_scale, *_kernel_mask(causal, left, right), softcap,
        num_splits, k_descale, v_descale,
    )  # fmt: skip
    if sinks is not None:
        out, lse = _with_sinks(out, lse, sinks, head_dim=1)
    return (out, lse) if return_lse else out


def _validate_descales(q: Tensor, k_cache: Tensor, k_descale: Any, v_descale: Any) -> None:
    fp8 = k_cache.dtype in FP8_CACHE_DTYPES
    for name, t in (("k_descale", k_descale), ("v_descale", v_descale)):
        if t is None:
            continue
        if not fp8:
            raise TypeError(f"{name} scales fp8 caches; these caches are {k_cache.dtype} (pass None)")
        shape = (q.shape[0], k_cache.shape[2])
        if not isinstance(t, Tensor) or t.dtype != torch.float32 or tuple(t.shape) != shape:
            raise TypeError(f"{name} must be a float32 (batch, nheads_kv) = {shape} tensor")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")


def _kernel_mask(causal: bool, left: int, right: int) -> tuple[bool, int, int]:
    """(causal, window_left, window_right) as the op takes them: a causal window is a window with right 0."""
    return causal and left == -1, left, right if not causal else 0


def decode_step(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cache_seqlens: Tensor,
    cache_leftpad: Tensor | None,
    *,
    causal: bool,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    **options: Any,
) -> Tensor:
    """`attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=..., cache_leftpad=..., ...)` for callers whose
    tensors are consistent by construction (the HF integration's decoding steps, once per layer and token).

    Where the op's implementation may be called directly (plain CUDA tensors, no tracing: `_ops.eager_direct`)
    it is, without the Python checks, about a third of the call's host time: the decode kernel's binding
    checks every shape, dtype, device and layout itself (and raises). Anything else (other options, CPU
    tensors, torch.compile) takes `attn_with_kvcache`, checks and all.
    """
    if (
        not options
        and isinstance(window_size, tuple)
        and _ops.eager_direct(q, k_cache, v_cache, cache_seqlens, cache_leftpad)
    ):
        scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
        out, _ = _ops_kvcache.fwd_kvcache_impl(
            q, k_cache, v_cache, None, None, cache_seqlens, None, None, cache_leftpad, None, None, False,
            scale, *_kernel_mask(causal, *window_size), float(softcap), 0, None, None,
        )  # fmt: skip
        return out
    return attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad, causal=causal,
        softmax_scale=softmax_scale, window_size=window_size, softcap=softcap, **options,
    )  # fmt: skip


def merge_attn_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Merge two attentions of the same queries over disjoint key sets (split-KV, cascades, ring attention).

    out_*: (batch, seqlen, nheads, headdim); lse_*: (batch, nheads, seqlen) natural log (as `attn(...,
    return_lse=True)` returns). Returns (out, lse) of the attention over the union: weights exp(lse_x - lse),
    lse = logaddexp(lse_a, lse_b); rows where both are -inf give out = 0, lse = -inf. Differentiable.
    """
    for name, t in (("out_a", out_a), ("out_b", out_b)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D (batch, seqlen, nheads, headdim) tensor")
    if out_a.shape != out_b.shape:
        raise ValueError(
            f"out_a and out_b must have one shape, got {tuple(out_a.shape)}, {tuple(out_b.shape)}"
        )
    b, s, h, _ = out_a.shape
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if not isinstance(t, Tensor) or tuple(t.shape) != (b, h, s):
            raise ValueError(f"{name} must be (batch, nheads, seqlen) = {(b, h, s)}")
    return merge_attn_states_ref(out_a, lse_a, out_b, lse_b)
