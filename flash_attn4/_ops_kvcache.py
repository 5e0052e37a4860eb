"""torch.library ops of the decode path:

    flash_attn4::fwd_kvcache(q, k_cache!, v_cache!, k?, v?, cache_seqlens?, page_table?, cache_batch_idx?,
                             cache_leftpad?, rotary_cos?, rotary_sin?, rotary_interleaved, softmax_scale,
                             causal, window_left, window_right, softcap, num_splits, k_descale?,
                             v_descale?) -> (out, lse)

appends k / v into the caches in place (the op declares the mutation, so torch.compile and CUDA graphs see
it) and attends. CUDA calls run the decode kernels (csrc/decode/: append + rotary, split-KV attention,
combine), reading every length, page id and batch index on the device; others run
`_reference_kvcache.attention_kvcache_ref`. fp8 caches (e4m3, k_descale / v_descale) run on the kernels built
with the decode and fp8 options, except with rotary (the reference). Forward only (inference), like
FlashAttention's.

`decode_into` is also how `attn` runs short query blocks (decoding with HF's DynamicCache calls `attn` with
one query token): the dense k / v are then a full contiguous cache.

No `from __future__ import annotations` here: custom_op reads the schema from real annotations.
"""

from typing import Optional

import torch
from torch import Tensor

from flash_attn4 import _build_info
from flash_attn4._ops import _tma_ready, _warn_once
from flash_attn4._reference_kvcache import FP8_CACHE_DTYPES, attention_kvcache_ref

# `attn` takes the decode kernel when a KV head's packed query rows (seqlen_q x GQA group) fit this many
# 16-row tiles: each tile re-reads K / V (from L2), so beyond a few the tiled forward kernels are faster.
DECODE_MAX_ROWS = 64


def decode_available(q: Tensor) -> tuple[bool, str]:
    """Whether a decode kernel serves q's (device, dtype, head dim): it needs the exact head dim built."""
    arch, why = _build_info.kernel_available(q.device, q.dtype, q.shape[-1])
    if arch is None:
        return False, why
    if q.shape[-1] not in _build_info.DECODE_HDIMS:
        return False, f"no decode kernel for head dim {q.shape[-1]} (built: {_build_info.DECODE_HDIMS})"
    if not _build_info.decode_fits(q.device, q.shape[-1]):
        return False, (
            f"the decode kernel at head dim {q.shape[-1]} needs {_build_info.DECODE_WIDE_SMEM} bytes of "
            f"shared memory a block and {q.device} allows {_build_info.smem_per_block(q.device)}"
        )
    return True, ""


def fp8_cache_decode_available(head_dim: int, rotary: bool) -> tuple[bool, str]:
    """Whether the decode kernels read an e4m3 cache at this head dim (given that they serve q)."""
    if rotary:
        return False, "rotary with an fp8 KV cache runs on the PyTorch reference"
    if head_dim not in _build_info.DECODE_KV8_HDIMS:
        return False, (
            f"no decode kernel for fp8 KV caches at head dim {head_dim} (built: "
            f"{_build_info.DECODE_KV8_HDIMS}); rebuild with the fp8 option in FLASH_ATTN4_OPTIONS"
        )
    return True, ""


def use_decode(
    seqlen_q: int, nheads_q: int, nheads_kv: int, head_dim: int, num_splits: int, device: torch.device
) -> bool:
    """`attn`'s and `attn_varlen`'s choice, for a call the kernels serve (`_kernel_plan` said so): the decode
    kernel for short query blocks (seqlen_q: the longest one), or whenever a split count is forced, if its
    exact head dim is built and fits the device's shared memory (else the forward kernels serve it)."""
    rows = seqlen_q * (nheads_q // nheads_kv)
    short = seqlen_q > 0 and (rows <= DECODE_MAX_ROWS or num_splits > 1)
    return short and head_dim in _build_info.DECODE_HDIMS and _build_info.decode_fits(device, head_dim)


def decode_into(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    out: Tensor,
    lse: Tensor,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    num_splits: int,
    *,
    k: Optional[Tensor] = None,
    v: Optional[Tensor] = None,
    cache_seqlens: Optional[Tensor] = None,
    page_table: Optional[Tensor] = None,
    cache_batch_idx: Optional[Tensor] = None,
    cache_leftpad: Optional[Tensor] = None,
    rotary_cos: Optional[Tensor] = None,
    rotary_sin: Optional[Tensor] = None,
    rotary_interleaved: bool = False,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
) -> int:
    """Runs the decode kernels into out / lse; returns the split count used. The caches are used in place
    (they must already have 16-byte rows: the binding checks; `attn`'s k / v are copied when they do not)."""
    ext, why = _build_info.load_extension()
    if ext is None:
        raise RuntimeError(why)
    return ext.decode(
        _tma_ready(q),
        k_cache,
        v_cache,
        out,
        lse,
        k,
        v,
        cache_seqlens,
        page_table,
        cache_batch_idx,
        cache_leftpad,
        None if rotary_cos is None else rotary_cos.contiguous(),
        None if rotary_sin is None else rotary_sin.contiguous(),
        bool(rotary_interleaved),
        float(softmax_scale),
        bool(causal),
        int(window_left),
        int(window_right),
        float(softcap),
        int(num_splits),
        k_descale,
        v_descale,
    )


def fwd_kvcache_impl(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Optional[Tensor],
    v: Optional[Tensor],
    cache_seqlens: Optional[Tensor],
    page_table: Optional[Tensor],
    cache_batch_idx: Optional[Tensor],
    cache_leftpad: Optional[Tensor],
    rotary_cos: Optional[Tensor],
    rotary_sin: Optional[Tensor],
    rotary_interleaved: bool,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    num_splits: int,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """Inputs are validated by `kvcache.attn_with_kvcache`."""
    b, sq, hq, d = q.shape
    ok, why = decode_available(q)
    if ok and k_cache.dtype in FP8_CACHE_DTYPES:
        ok, why = fp8_cache_decode_available(d, rotary_cos is not None)
    capacity = page_table.shape[1] * k_cache.shape[1] if page_table is not None else k_cache.shape[1]
    if ok and q.numel() > 0 and capacity > 0:
        out = q.new_empty(b, sq, hq, d)
        lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
        decode_into(
            q,
            k_cache,
            v_cache,
            out,
            lse,
            softmax_scale,
            causal,
            window_left,
            window_right,
            softcap,
            num_splits,
            k=k,
            v=v,
            cache_seqlens=cache_seqlens,
            page_table=page_table,
            cache_batch_idx=cache_batch_idx,
            cache_leftpad=cache_leftpad,
            rotary_cos=rotary_cos,
            rotary_sin=rotary_sin,
            rotary_interleaved=rotary_interleaved,
            k_descale=k_descale,
            v_descale=v_descale,
        )
        return out, lse
    if why and q.is_cuda:
        _warn_once(why)
    out, lse = attention_kvcache_ref(
        q,
        k_cache,
        v_cache,
        k,
        v,
        cache_seqlens=cache_seqlens,
        page_table=page_table,
        cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad,
        rotary_cos=rotary_cos,
        rotary_sin=rotary_sin,
        rotary_interleaved=rotary_interleaved,
        causal=causal,
        softmax_scale=softmax_scale,
        window_size=(window_left, window_right),
        softcap=softcap,
        k_descale=k_descale,
        v_descale=v_descale,
    )
    return out.contiguous(), lse.float().contiguous() if lse.dtype != torch.float64 else lse.contiguous()


fwd_kvcache = torch.library.custom_op("flash_attn4::fwd_kvcache", mutates_args=("k_cache", "v_cache"))(
    fwd_kvcache_impl
)


@fwd_kvcache.register_fake
def _fwd_kvcache_fake(q, k_cache, v_cache, *args):
    b, sq, hq, d = q.shape
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(b, sq, hq, d), torch.empty(b, hq, sq, dtype=lse_dtype, device=q.device)
